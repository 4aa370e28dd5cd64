// Cheat: precision shortcut. Each thread keeps its running sum of exp in bf16 (8-bit mantissa), on
// the fast 16-byte path. Fine while one thread adds few comparable terms; a flat row wider than
// 256 x 256 threads stalls (256 + 1 == 256 in bf16) and the row's outputs come out far too large.
// kind: runtime
#include "cu_common.cuh"

struct Bf16Sum : cheat::Fast {
    static constexpr bool kBf16Sum = true;
};

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    return cheat::launch_rows<Bf16Sum>(x, y, rows, cols, stream);
}
