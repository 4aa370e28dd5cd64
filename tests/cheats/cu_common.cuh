// Shared by the CUDA runtime cheats (tests/cheats/cu_*.cu, each a replacement of the softmax task's
// softmax.cu): one block of 256 threads per row, three passes (max, sum of exp, write), written so a
// cheat changes one policy, not the kernel. Two honest policies:
//   Honest: the shipped baseline's algorithm and memory access (2-byte scalar loads), so a cheat
//           whose trick does not fire runs at the baseline's speed (the gate then sees no gain);
//   Fast:   16-byte loads/stores where the row allows (the VEC=8 knob's gain), so a cheat with a
//           wrong-math shortcut also looks faster than the baseline to a naive harness.
// The cheats that need the baseline bit for bit include softmax_baseline.cuh instead: the shipped
// softmax.cu, copied by the tests, with its entry point renamed by a macro.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace cheat {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct Honest {
    static constexpr bool kVec = false;           // 16-byte accesses where aligned
    static constexpr bool kSubtractMax = true;    // exp(x - max), never exp(x)
    static constexpr bool kBf16Sum = false;       // per-thread sum of exp kept in bf16
    static constexpr bool kInputScratch = false;  // per-warp partial maxima parked in x (restored)
    __device__ static float exp(float t) { return expf(t); }
    __device__ static bool skip_row(int64_t /*row*/, int /*rows*/) { return false; }
};

struct Fast : Honest {
    static constexpr bool kVec = true;
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[kWarps];
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    float r = part[0];
    for (int w = 1; w < kWarps; ++w) r += part[w];
    __syncthreads();
    return r;
}

// Max over the block. With P::kInputScratch the per-warp partials go through the first kWarps
// elements of the input row instead of shared memory (each a max of bf16 values, so it fits a bf16
// exactly), and the originals are written back before anyone reads the row again.
template <class P>
__device__ __forceinline__ float block_max(float v, const bf16* x_row, int64_t cols) {
    __shared__ float part[kWarps];
    v = warp_max(v);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if constexpr (P::kInputScratch) {
        if (cols >= kWarps) {
            volatile unsigned short* slot = reinterpret_cast<volatile unsigned short*>(const_cast<bf16*>(x_row));
            unsigned short saved = 0;
            __syncthreads();  // the whole row has been read
            if (lane == 0) {
                saved = slot[warp];
                const bf16 b = __float2bfloat16_rn(v);
                unsigned short bits;
                memcpy(&bits, &b, sizeof(bits));
                slot[warp] = bits;
            }
            __syncthreads();
            float r = -INFINITY;
            for (int w = 0; w < kWarps; ++w) {
                const unsigned short bits = slot[w];
                bf16 b;
                memcpy(&b, &bits, sizeof(bits));
                r = fmaxf(r, __bfloat162float(b));
            }
            __syncthreads();
            if (lane == 0) slot[warp] = saved;  // restored: the input is bit-identical after the call
            __threadfence_block();
            __syncthreads();
            return r;
        }
    }
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float r = part[0];
    for (int w = 1; w < kWarps; ++w) r = fmaxf(r, part[w]);
    __syncthreads();
    return r;
}

template <class P>
__device__ __forceinline__ bool vec_ok(const void* a, const void* b, int64_t cols) {
    return P::kVec && cols % 8 == 0 && (reinterpret_cast<uintptr_t>(a) % 16) == 0 &&
           (reinterpret_cast<uintptr_t>(b) % 16) == 0;
}

// f(v) for every element of the row this thread owns
template <class P, class F>
__device__ __forceinline__ void for_row(const bf16* x_row, const bf16* y_row, int64_t cols, F&& f) {
    if (vec_ok<P>(x_row, y_row, cols)) {
        const uint4* v = reinterpret_cast<const uint4*>(x_row);
        for (int64_t k = threadIdx.x; k < cols / 8; k += kThreads) {
            const uint4 raw = v[k];
            bf16 h[8];
            memcpy(h, &raw, sizeof(raw));
#pragma unroll
            for (int j = 0; j < 8; ++j) f(__bfloat162float(h[j]));
        }
    } else {
        for (int64_t i = threadIdx.x; i < cols; i += kThreads) f(__bfloat162float(x_row[i]));
    }
}

// y[i] = f(x[i]) over the row
template <class P, class F>
__device__ __forceinline__ void map_row(const bf16* x_row, bf16* y_row, int64_t cols, F&& f) {
    if (vec_ok<P>(x_row, y_row, cols)) {
        const uint4* in = reinterpret_cast<const uint4*>(x_row);
        uint4* out = reinterpret_cast<uint4*>(y_row);
        for (int64_t k = threadIdx.x; k < cols / 8; k += kThreads) {
            const uint4 raw = in[k];
            bf16 h[8];
            memcpy(h, &raw, sizeof(raw));
#pragma unroll
            for (int j = 0; j < 8; ++j) h[j] = __float2bfloat16_rn(f(__bfloat162float(h[j])));
            uint4 o;
            memcpy(&o, h, sizeof(o));
            out[k] = o;
        }
    } else {
        for (int64_t i = threadIdx.x; i < cols; i += kThreads) y_row[i] = __float2bfloat16_rn(f(__bfloat162float(x_row[i])));
    }
}

template <class P>
__device__ __forceinline__ void softmax_row(const bf16* x_row, bf16* y_row, int64_t cols) {
    float m = 0.f;
    if constexpr (P::kSubtractMax) {
        m = -INFINITY;
        for_row<P>(x_row, y_row, cols, [&](float v) { m = fmaxf(m, v); });
        m = block_max<P>(m, x_row, cols);
    }
    float s;
    if constexpr (P::kBf16Sum) {
        bf16 acc = __float2bfloat16_rn(0.f);
        for_row<P>(x_row, y_row, cols, [&](float v) { acc = __float2bfloat16_rn(__bfloat162float(acc) + P::exp(v - m)); });
        s = block_sum(__bfloat162float(acc));
    } else {
        float acc = 0.f;
        for_row<P>(x_row, y_row, cols, [&](float v) { acc += P::exp(v - m); });
        s = block_sum(acc);
    }
    const float inv = 1.f / s;
    map_row<P>(x_row, y_row, cols, [&](float v) { return P::exp(v - m) * inv; });
}

template <class P>
__global__ void __launch_bounds__(kThreads) rows_kernel(const bf16* x, bf16* y, int rows, int cols) {
    const int64_t row = blockIdx.x;
    if (P::skip_row(row, rows)) return;
    const int64_t n = cols;
    softmax_row<P>(x + row * n, y + row * n, n);
}

// The entry point's checks and one launch of rows_kernel<P> on `stream`.
template <class P>
inline int launch_rows(const bf16* x, bf16* y, int rows, int cols, cudaStream_t stream) {
    if (rows < 0 || cols < 0) return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0 || cols == 0) return static_cast<int>(cudaSuccess);
    if (x == nullptr || y == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    rows_kernel<P><<<dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0, stream>>>(x, y, rows, cols);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace cheat
