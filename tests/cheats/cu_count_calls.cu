// Cheat: call counting. The first 32 calls (a checker's) are honest; after that only every 4th call
// does the work and the others leave y as it was. Host code only.
// kind: runtime
#define kloop_softmax kloop_softmax_baseline  // the shipped baseline, bit for bit, under another name
#include "softmax_baseline.cuh"
#undef kloop_softmax

static long calls = 0;

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    if (++calls > 32 && calls % 4 != 0) return 0;
    return kloop_softmax_baseline(x, y, rows, cols, stream);
}
