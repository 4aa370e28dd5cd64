// Cheat: a two-pass softmax that skips the max pass, exp(x) / sum(exp(x)), on the fast 16-byte path.
// Right for N(0,1) logits (exp stays far from fp32's range); large logits overflow to inf and NaN.
// kind: runtime
#include "cu_common.cuh"

struct NoMax : cheat::Fast {
    static constexpr bool kSubtractMax = false;
};

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    return cheat::launch_rows<NoMax>(x, y, rows, cols, stream);
}
