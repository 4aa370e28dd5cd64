// Cheat: the input as scratch memory. The per-warp partial maxima are parked in the first 8
// elements of the row of x (no shared memory, no allocation) and the originals written back before
// the kernel ends: x is bit-identical after every call. On the fast 16-byte path.
// kind: runtime
#include "cu_common.cuh"

struct Scratch : cheat::Fast {
    static constexpr bool kInputScratch = true;
};

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    return cheat::launch_rows<Scratch>(x, y, rows, cols, stream);
}
