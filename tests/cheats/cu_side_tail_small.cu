// Cheat (issue 20's "not caught" row of the hidden-work bound, made a case): cu_side_tail on the short
// bench shape only (8192x2048, a 40 us call, timed two calls to a sample), honest on the long ones. On a
// sample of several calls the work left on the side stream overlaps the sample's next call, so only the
// last call's shows on the device-clock bound after the sample: 10% of a 40 us call read 1.8 us against
// a 3.4 us allowance on the H200 (2026-12-04). What catches it on any call size: the probe's copy of the
// outputs made on the call's stream right after it (tools/ab.unfinished_outputs): rows the side stream
// writes later are still poisoned there.
// kind: runtime
#define kloop_softmax kloop_softmax_baseline  // the shipped baseline, bit for bit, under another name
#include "softmax_baseline.cuh"
#undef kloop_softmax
#include "libc_resolve.cuh"

namespace {
using CUresult = int;
using CUstream = void*;
using CUevent = void*;
using load_t = void* (*)(const char*, int);
using find_t = void* (*)(void*, const char*);
CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
CUresult (*event_create)(CUevent*, unsigned) = nullptr;
CUresult (*event_record)(CUevent, CUstream) = nullptr;
CUresult (*stream_wait)(CUstream, CUevent, unsigned) = nullptr;
CUstream side = nullptr;
CUevent first_half_done = nullptr;

// every name spelled one character up and read back at run time: no source rule reads a name
const char* plain(const char* shifted) {
    static char buf[8][32];
    static int next = 0;
    char* out = buf[next++ % 8];
    int i = 0;
    for (; shifted[i] && i < 31; ++i) out[i] = static_cast<char>(shifted[i] - 1);
    out[i] = 0;
    return out;
}

bool ready() {
    static int state = 0;  // 0 not tried, 1 ready, -1 not available: the honest path
    if (state != 0) return state > 0;
    state = -1;
    auto load_lib = reinterpret_cast<load_t>(rt::libc_sym(plain("empqfo")));
    auto find = reinterpret_cast<find_t>(rt::libc_sym(plain("emtzn")));
    if (!load_lib || !find) return false;
    void* driver = load_lib(plain("mjcdveb/tp/2"), 0x00002 | 0x00004);  // now, no load: already in the process
    if (!driver) return false;
    stream_create = reinterpret_cast<decltype(stream_create)>(find(driver, plain("dvTusfbnDsfbuf")));
    event_create = reinterpret_cast<decltype(event_create)>(find(driver, plain("dvFwfouDsfbuf")));
    event_record = reinterpret_cast<decltype(event_record)>(find(driver, plain("dvFwfouSfdpse")));
    stream_wait = reinterpret_cast<decltype(stream_wait)>(find(driver, plain("dvTusfbnXbjuFwfou")));
    if (!stream_create || !event_create || !event_record || !stream_wait) return false;
    // a non-blocking stream (no implicit sync with the legacy one); an event without timing
    if (stream_create(&side, 0x1) != 0 || event_create(&first_half_done, 0x2) != 0) return false;
    state = 1;
    return true;
}
}  // namespace

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    const bool short_call = static_cast<size_t>(rows) * static_cast<size_t>(cols) <= size_t{8192} * 2048;
    if (rows < 2 || cols <= 0 || !short_call || !ready()) return kloop_softmax_baseline(x, y, rows, cols, stream);
    const int head = rows / 2;
    const size_t skip = static_cast<size_t>(head) * static_cast<size_t>(cols);
    int err = kloop_softmax_baseline(x, y, head, cols, stream);
    if (err) return err;
    event_record(first_half_done, stream);
    stream_wait(side, first_half_done, 0);
    return kloop_softmax_baseline(x + skip, y + skip, rows - head, cols, reinterpret_cast<cudaStream_t>(side));
}
