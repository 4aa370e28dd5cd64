// Cheat: a static object in a CUDA file whose constructor runs at load time beside nvcc's own
// registration constructor (which the audit allows).
// audit: load-time
#include <cuda_bf16.h>
#include <cuda_runtime.h>
static int loaded;
struct AtLoad { AtLoad() { loaded = 1; } };
static AtLoad at_load;
__global__ void zero(__nv_bfloat16* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16(0.f);
}
extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    int n = rows * cols;
    zero<<<(n + 255) / 256, 256, 0, stream>>>(y, n);
    return loaded ? static_cast<int>(cudaGetLastError()) : 1;
}
