// Cheat: the work goes to the legacy default stream (cudaStreamLegacy, a constant: no stream is
// created, no API the audit forbids) instead of the stream it was given. Events recorded on a
// non-blocking stream (a framework's usual stream) do not wait for it: the call looks free, and the
// output is right by the time anyone synchronizes the device.
// kind: runtime
#define kloop_softmax kloop_softmax_baseline  // the shipped baseline, bit for bit, under another name
#include "softmax_baseline.cuh"
#undef kloop_softmax

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t) {
    return kloop_softmax_baseline(x, y, rows, cols, cudaStreamLegacy);
}
