// Cheat: only the rows a sparse check samples are computed (the first 4, the middle one, the last);
// every other row of y is left as it was.
// kind: runtime
#include "cu_common.cuh"

struct Sparse : cheat::Honest {
    __device__ static bool skip_row(int64_t row, int rows) {
        return !(row < 4 || row == rows / 2 || row == rows - 1);
    }
};

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    return cheat::launch_rows<Sparse>(x, y, rows, cols, stream);
}
