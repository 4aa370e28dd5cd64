// Cheat: the work as a CUDA graph (built node by node, no stream capture) launched on the legacy
// stream, not on the stream the harness passes: events on the harness's stream do not wait for it.
// audit: symbols
#include <cuda_bf16.h>
#include <cuda_runtime.h>
__global__ void copy_rows(const __nv_bfloat16* x, __nv_bfloat16* y, long long n) {
    long long i = blockIdx.x * 256ll + threadIdx.x;
    if (i < n) y[i] = x[i];
}
extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t) {
    long long n = static_cast<long long>(rows) * cols;
    void* args[] = {&x, &y, &n};
    cudaKernelNodeParams p = {};
    p.func = reinterpret_cast<void*>(copy_rows);
    p.gridDim = dim3(static_cast<unsigned>((n + 255) / 256));
    p.blockDim = dim3(256);
    p.kernelParams = args;
    cudaGraph_t graph;
    cudaGraphNode_t node;
    cudaGraphExec_t exec;
    cudaGraphCreate(&graph, 0);
    cudaGraphAddKernelNode(&node, graph, nullptr, 0, &p);
    cudaGraphInstantiate(&exec, graph, 0);
    return static_cast<int>(cudaGraphLaunch(exec, cudaStreamLegacy));
}
