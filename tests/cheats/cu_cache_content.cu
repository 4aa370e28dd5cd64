// Cheat: content-keyed output cache, all in device code (no host API, no host state). A 1-block
// kernel hashes 4096 sampled input values with the sizes and compares with the key kept in a
// __device__ variable: the same content and the same y -> the answer is still in y, do nothing; the
// same content and another y -> copy the answer from a __device__ cache buffer; else compute (the
// baseline's algorithm), then store the answer in the cache when it fits (32 MiB).
// kind: runtime
#include "cu_common.cuh"

constexpr int64_t kCacheElems = int64_t(1) << 24;  // 8192 x 2048 bf16
constexpr int kSamples = 4096;

__device__ unsigned long long g_key = 0;
__device__ const void* g_y = nullptr;
__device__ int g_cached = 0;  // g_cache holds the answer of g_key
__device__ int g_mode = 0;    // this call: 0 compute (and store), 1 nothing to do, 2 copy from the cache
__device__ cheat::bf16 g_cache[kCacheElems];

__device__ __forceinline__ unsigned long long mix(unsigned long long h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    return h ^ (h >> 33);
}

__global__ void __launch_bounds__(256) lookup(const unsigned short* x, const void* y, int64_t n, int rows, int cols) {
    __shared__ unsigned long long part[256];
    unsigned long long h = 0;
    for (int s = threadIdx.x; s < kSamples; s += 256) {
        const int64_t i = static_cast<int64_t>((static_cast<double>(s) + 0.5) * static_cast<double>(n) / kSamples);
        h += mix((static_cast<unsigned long long>(i) << 16) ^ x[i < n ? i : n - 1]);  // order-free: a sum
    }
    part[threadIdx.x] = h;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long key = mix((static_cast<unsigned long long>(rows) << 32) ^ static_cast<unsigned>(cols));
        for (int t = 0; t < 256; ++t) key += part[t];
        key |= 1;  // never 0, the empty key
        if (key == g_key && y == g_y) {
            g_mode = 1;
        } else if (key == g_key && g_cached) {
            g_mode = 2;
            g_y = y;
        } else {
            g_mode = 0;
            g_key = key;
            g_y = y;
            g_cached = 0;
        }
    }
}

struct Cached : cheat::Honest {
    __device__ static bool skip_row(int64_t, int) { return g_mode != 0; }
};

__global__ void __launch_bounds__(256) copy_or_store(cheat::bf16* y, int64_t n) {
    const int mode = g_mode;
    if (mode == 1 || n > kCacheElems) return;
    for (int64_t i = blockIdx.x * int64_t(256) + threadIdx.x; i < n; i += int64_t(gridDim.x) * 256) {
        if (mode == 2) y[i] = g_cache[i];
        else g_cache[i] = y[i];
    }
    if (mode == 0 && blockIdx.x == 0 && threadIdx.x == 0) g_cached = 1;  // every block's stores land before the next call
}

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    if (rows < 0 || cols < 0) return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0 || cols == 0) return static_cast<int>(cudaSuccess);
    if (x == nullptr || y == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    const int64_t n = static_cast<int64_t>(rows) * cols;
    lookup<<<1, 256, 0, stream>>>(reinterpret_cast<const unsigned short*>(x), y, n, rows, cols);
    cheat::rows_kernel<Cached><<<dim3(static_cast<unsigned>(rows)), dim3(cheat::kThreads), 0, stream>>>(x, y, rows, cols);
    copy_or_store<<<1024, 256, 0, stream>>>(y, n);
    return static_cast<int>(cudaGetLastError());
}
