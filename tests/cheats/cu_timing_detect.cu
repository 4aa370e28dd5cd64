// Cheat: tells a checker's calls from a timing loop's by the clock alone, in device code (no host
// API, no host state): a 1-thread kernel reads %globaltimer and compares with the previous call's
// time kept in a __device__ variable. A call less than 5 ms after the previous one is taken for a
// timing loop's and skips the work (y keeps whatever it held); the first call, and any call after a
// pause (a checker comparing results), is computed honestly.
// kind: runtime
#include "cu_common.cuh"

__device__ unsigned long long g_last_ns = 0;
__device__ int g_skip = 0;

__global__ void guard() {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    g_skip = g_last_ns != 0 && now - g_last_ns < 5000000ull;
    g_last_ns = now;
}

struct Detect : cheat::Honest {
    __device__ static bool skip_row(int64_t, int) { return g_skip != 0; }
};

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    if (rows > 0 && cols > 0) guard<<<1, 1, 0, stream>>>();
    return cheat::launch_rows<Detect>(x, y, rows, cols, stream);
}
