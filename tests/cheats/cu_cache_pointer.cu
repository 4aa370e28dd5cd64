// Cheat: pointer-keyed output cache. A call with the same x, y and sizes as the previous one "must"
// find its answer still in y: it returns without launching anything. Host code only.
// kind: runtime
#define kloop_softmax kloop_softmax_baseline  // the shipped baseline, bit for bit, under another name
#include "softmax_baseline.cuh"
#undef kloop_softmax

static const void* last_x = nullptr;
static const void* last_y = nullptr;
static int last_rows = -1, last_cols = -1;

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    if (x == last_x && y == last_y && rows == last_rows && cols == last_cols) return 0;
    last_x = x;
    last_y = y;
    last_rows = rows;
    last_cols = cols;
    return kloop_softmax_baseline(x, y, rows, cols, stream);
}
