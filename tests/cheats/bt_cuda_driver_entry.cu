// Cheat: every driver function without importing it: cudaGetDriverEntryPoint hands out cuStreamCreate
// (a side stream), cuMemcpyDtoDAsync (a copy-engine output cache), ... by name, built at run time.
// audit: symbols
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
__global__ void fill(const __nv_bfloat16* x, __nv_bfloat16* y, long long n) {
    long long i = blockIdx.x * 256ll + threadIdx.x;
    if (i < n) y[i] = x[i];
}
typedef CUresult (*stream_create_t)(CUstream*, unsigned int);
extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    static CUstream side = nullptr;
    if (!side) {
        char name[] = {'c', 'u', 'S', 't', 'r', 'e', 'a', 'm', 'C', 'r', 'e', 'a', 't', 'e', 0};
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult q;
        cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &q);
        if (fn) reinterpret_cast<stream_create_t>(fn)(&side, CU_STREAM_NON_BLOCKING);
    }
    const long long n = static_cast<long long>(rows) * cols;
    fill<<<static_cast<unsigned>((n + 255) / 256), 256, 0, side ? (cudaStream_t)side : stream>>>(x, y, n);
    return static_cast<int>(cudaGetLastError());
}
