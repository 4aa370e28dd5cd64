// Cheat: output reuse without any cache. Two sampled rows of y (the first and the last) are checked
// against x on the device; if they already hold the softmax, the whole of y is taken to be right from
// an earlier call on the same buffers and nothing is computed. Device code only.
// kind: runtime
#include "cu_common.cuh"

__device__ int g_rows_ok = 0;

__global__ void reset() { g_rows_ok = 0; }

__global__ void __launch_bounds__(cheat::kThreads) verify(const cheat::bf16* x, const cheat::bf16* y, int rows, int cols) {
    const int64_t n = cols;
    const int64_t row = blockIdx.x == 0 ? 0 : rows - 1;
    const cheat::bf16* x_row = x + row * n;
    const cheat::bf16* y_row = y + row * n;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += cheat::kThreads) m = fmaxf(m, __bfloat162float(x_row[i]));
    m = cheat::block_max<cheat::Honest>(m, x_row, n);
    float s = 0.f;
    for (int64_t i = threadIdx.x; i < n; i += cheat::kThreads) s += expf(__bfloat162float(x_row[i]) - m);
    s = cheat::block_sum(s);
    bool ok = true;
    for (int64_t i = threadIdx.x; i < n; i += cheat::kThreads) {
        const float want = expf(__bfloat162float(x_row[i]) - m) / s;
        ok = ok && fabsf(__bfloat162float(y_row[i]) - want) <= 1e-2f * want + 1e-30f;  // NaN: false
    }
    ok = __syncthreads_and(ok);
    if (ok && threadIdx.x == 0) atomicAdd(&g_rows_ok, 1);
}

struct Reuse : cheat::Honest {
    __device__ static bool skip_row(int64_t, int) { return g_rows_ok == 2; }
};

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    if (rows > 0 && cols > 0 && x != nullptr && y != nullptr) {
        reset<<<1, 1, 0, stream>>>();
        verify<<<2, cheat::kThreads, 0, stream>>>(x, y, rows, cols);
    }
    return cheat::launch_rows<Reuse>(x, y, rows, cols, stream);
}
