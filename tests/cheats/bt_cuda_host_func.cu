// Cheat: cudaLaunchHostFunc (spelled by a macro) runs host code on the stream: work the device
// events do not see, on a driver thread.
// audit: symbols
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#define CAT(a, b) a##b
static void CUDART_CB on_host(void*) {}
extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    CAT(cudaLaunch, HostFunc)(stream, on_host, nullptr);
    return 0;
}
