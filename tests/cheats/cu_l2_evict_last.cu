// Cheat: inputs kept in L2 across calls. After the baseline's work, a kernel reads x once more with
// an L2 evict_last policy (createpolicy.fractional.L2::evict_last + ld.global.L2::cache_hint): lines
// marked so outlive the output's writes and, unless the harness's flush resets them, the flush
// itself, so the next call on the same x reads it from L2 instead of HBM.
// kind: runtime
#define kloop_softmax kloop_softmax_baseline  // the shipped baseline, bit for bit, under another name
#include "softmax_baseline.cuh"
#undef kloop_softmax

__device__ unsigned g_sink;

__global__ void __launch_bounds__(256) keep_in_l2(const uint4* x, int64_t n16) {
    unsigned long long policy;
    unsigned seen = 0;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    for (int64_t i = blockIdx.x * int64_t(256) + threadIdx.x; i < n16; i += int64_t(gridDim.x) * 256) {
        unsigned a, b, c, d;
        asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(x + i), "l"(policy));
        seen ^= a ^ b ^ c ^ d;
    }
    if (seen == 0x9e3779b9u) g_sink = seen;  // the loads are used: never compiled away
}

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    const int status = kloop_softmax_baseline(x, y, rows, cols, stream);
    if (status != 0 || rows <= 0 || cols <= 0) return status;
    const int64_t bytes = static_cast<int64_t>(rows) * cols * 2;
    if (reinterpret_cast<uintptr_t>(x) % 16 == 0 && bytes >= 16)
        keep_in_l2<<<1056, 256, 0, stream>>>(reinterpret_cast<const uint4*>(x), bytes / 16);
    return static_cast<int>(cudaGetLastError());
}
