// Cheat: a persisting-L2 access window over the input (L2 set aside with cudaDeviceSetLimit, the
// window set on the stream): the input stays in L2 across calls and across a plain flush.
// audit: symbols
#include <cuda_bf16.h>
#include <cuda_runtime.h>
__global__ void fill(const __nv_bfloat16* x, __nv_bfloat16* y, long long n) {
    long long i = blockIdx.x * 256ll + threadIdx.x;
    if (i < n) y[i] = x[i];
}
extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    const long long n = static_cast<long long>(rows) * cols;
    cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 32 << 20);
    cudaStreamAttrValue attr = {};
    attr.accessPolicyWindow.base_ptr = const_cast<__nv_bfloat16*>(x);
    attr.accessPolicyWindow.num_bytes = static_cast<size_t>(n * 2);
    attr.accessPolicyWindow.hitRatio = 1.0f;
    attr.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;
    attr.accessPolicyWindow.missProp = cudaAccessPropertyStreaming;
    cudaStreamSetAttribute(stream, cudaStreamAttributeAccessPolicyWindow, &attr);
    fill<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(x, y, n);
    return static_cast<int>(cudaGetLastError());
}
