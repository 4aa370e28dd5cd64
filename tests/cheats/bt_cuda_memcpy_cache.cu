// Cheat: an output cache in a __device__ buffer replayed with cudaMemcpyAsync when the input pointer
// repeats (the copy engine does the work; no kernel of the task's runs).
// audit: symbols
#include <cuda_bf16.h>
#include <cuda_runtime.h>
__device__ __nv_bfloat16 g_cache[1 << 20];
__global__ void fill(const __nv_bfloat16* x, __nv_bfloat16* y, long long n) {
    long long i = blockIdx.x * 256ll + threadIdx.x;
    if (i < n) y[i] = x[i];
}
extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    static const void* last = nullptr;
    const long long n = static_cast<long long>(rows) * cols;
    void* cache = nullptr;
    cudaGetSymbolAddress(&cache, g_cache);
    if (x == last && n <= (1 << 20))
        return static_cast<int>(cudaMemcpyAsync(y, cache, n * 2, cudaMemcpyDeviceToDevice, stream));
    last = x;
    fill<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(x, y, n);
    if (n <= (1 << 20)) cudaMemcpyAsync(cache, y, n * 2, cudaMemcpyDeviceToDevice, stream);
    return static_cast<int>(cudaGetLastError());
}
