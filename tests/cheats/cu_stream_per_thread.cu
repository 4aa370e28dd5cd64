// Cheat: the work goes to the per-thread default stream, spelled as its handle value so that no
// source rule (cudaStreamPerThread) sees it, instead of the stream it was given. Like the legacy
// stream it needs no API call, and events on a non-blocking stream do not wait for it.
// kind: runtime
#define kloop_softmax kloop_softmax_baseline  // the shipped baseline, bit for bit, under another name
#include "softmax_baseline.cuh"
#undef kloop_softmax

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t) {
    return kloop_softmax_baseline(x, y, rows, cols, reinterpret_cast<cudaStream_t>(0x2));
}
