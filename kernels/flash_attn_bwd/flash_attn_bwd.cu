// FlashAttention backward, bf16 in / bf16 out, fp32 accumulation, for Hopper (sm_90a).
//
// Given Q, K, V, O, dO (bf16) and the forward's LSE (fp32, natural log of the scaled scores) it
// computes, with P = exp(Q K^T * scale - LSE) (masked), dP = dO V^T and dS = P * (dP - Delta),
// Delta = rowsum(dO * O):
//
//   dV = P^T dO      dK = scale * dS^T Q      dQ = scale * dS K
//
// GQA: K/V have kv_heads heads, each shared by heads/kv_heads query heads; dK, dV sum over the group.
//
// A plain baseline in the forward's style (WMMA 16x16x16, bf16 operands, fp32 accumulate, tiles in
// shared memory through cp.async). Kernels, in stream order:
//
//   bwd_preprocess      Delta = rowsum(dO * O), one warp per row (into the `delta` workspace),
//                       and zeroes the fp32 workspaces the atomics below accumulate into
//   KV_OUTER = 1:       bwd_dkdv: one block per (kv head, BLOCK_N keys), dK/dV in registers, looping
//                       over the group's query heads and their query tiles; dQ either
//                         DQ_ATOMIC = 0: a second pass, bwd_dq (one block per query tile, dQ in
//                                        registers, looping over the key tiles; S/P/dS recomputed)
//                         DQ_ATOMIC = 1: fp32 atomicAdd of each tile's dS K into the dq workspace,
//                                        then bf16 conversion (one pass over the scores, not two)
//   KV_OUTER = 0:       bwd_dq with dQ in registers and dK/dV by fp32 atomics into their workspaces,
//                       then conversion (DQ_ATOMIC is not used)
//
// Knobs (-D defines; allowed values in task.toml): BLOCK_M, BLOCK_N, NUM_WARPS, KV_OUTER, DQ_ATOMIC.
// A combination whose shared memory does not fit makes the entry point return an error, no launch.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <climits>
#include <cstdint>

#ifndef BLOCK_M
#define BLOCK_M 64
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef NUM_WARPS
#define NUM_WARPS 8
#endif
#ifndef KV_OUTER
#define KV_OUTER 1
#endif
#ifndef DQ_ATOMIC
#define DQ_ATOMIC 0
#endif

static_assert(BLOCK_M % 16 == 0 && BLOCK_M >= 16, "BLOCK_M must be a multiple of 16");
static_assert(BLOCK_N % 16 == 0 && BLOCK_N >= 16, "BLOCK_N must be a multiple of 16");
static_assert(NUM_WARPS >= 1 && NUM_WARPS <= 32, "NUM_WARPS out of range");
static_assert(KV_OUTER == 0 || KV_OUTER == 1, "KV_OUTER must be 0 or 1");
static_assert(DQ_ATOMIC == 0 || DQ_ATOMIC == 1, "DQ_ATOMIC must be 0 or 1");

namespace {

using namespace nvcuda;

constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr float LOG2E = 1.4426950408889634f;

using bf16 = __nv_bfloat16;
using AccFrag = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <int D> struct Layout {
    static constexpr int LDQ = D + 8;        // bf16 rows of Q, dO, K, V
    static constexpr int LDS = BLOCK_N + 4;  // fp32 rows of S, dP
    static constexpr int LDP = BLOCK_N + 8;  // bf16 rows of P, dS
    static constexpr int LDO = D + 4;        // fp32 rows of the atomics' staging tile
    static constexpr int ROWS = BLOCK_M > BLOCK_N ? BLOCK_M : BLOCK_N;

    static constexpr size_t align(size_t n) { return (n + 127) / 128 * 128; }

    static constexpr size_t STATS = 0;                                         // lse (log2 units), delta: BLOCK_M fp32 each
    static constexpr size_t Q = STATS + align(2 * BLOCK_M * sizeof(float));
    static constexpr size_t DO = Q + align(size_t(BLOCK_M) * LDQ * 2);
    static constexpr size_t K = DO + align(size_t(BLOCK_M) * LDQ * 2);
    static constexpr size_t V = K + align(size_t(BLOCK_N) * LDQ * 2);
    static constexpr size_t S = V + align(size_t(BLOCK_N) * LDQ * 2);
    static constexpr size_t DP = S + align(size_t(BLOCK_M) * LDS * 4);
    static constexpr size_t P = DP + align(size_t(BLOCK_M) * LDS * 4);
    static constexpr size_t DS = P + align(size_t(BLOCK_M) * LDP * 2);
    static constexpr size_t STAGE = DS + align(size_t(BLOCK_M) * LDP * 2);   // only with atomics
    static constexpr size_t BYTES_PLAIN = STAGE;
    static constexpr size_t BYTES_ATOMIC = STAGE + align(size_t(ROWS) * LDO * 4);

    // accumulator tiles a warp owns: dK/dV (BLOCK_N x D) or dQ (BLOCK_M x D)
    static constexpr int KV_TILES = (BLOCK_N / 16) * (D / 16);
    static constexpr int Q_TILES = (BLOCK_M / 16) * (D / 16);
    static_assert(KV_TILES % NUM_WARPS == 0 && Q_TILES % NUM_WARPS == 0, "output tiles must split evenly over the warps");
    static constexpr int KV_PER_WARP = KV_TILES / NUM_WARPS;
    static constexpr int Q_PER_WARP = Q_TILES / NUM_WARPS;
};

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// `rows` rows of D bf16 from global row `row0` into smem (stride LDQ); rows past seqlen zero-filled.
template <int D>
__device__ __forceinline__ void load_tile(bf16* smem, const bf16* gmem_bh, int row0, int rows, int seqlen) {
    constexpr int CHUNKS_PER_ROW = D / 8;
    for (int i = threadIdx.x; i < rows * CHUNKS_PER_ROW; i += NUM_THREADS) {
        const int r = i / CHUNKS_PER_ROW;
        const int c = (i % CHUNKS_PER_ROW) * 8;
        const bool valid = row0 + r < seqlen;
        const bf16* src = valid ? gmem_bh + (size_t)(row0 + r) * D + c : gmem_bh;
        cp_async_16(smem + r * Layout<D>::LDQ + c, src, valid);
    }
}

// LSE (in log2 units; +inf for padding rows, so P = 0 there) and Delta of BLOCK_M rows into smem.
__device__ __forceinline__ void load_row_stats(float* s_lse2, float* s_delta, const float* lse_bh,
                                               const float* delta_bh, int m0, int seqlen) {
    for (int r = threadIdx.x; r < BLOCK_M; r += NUM_THREADS) {
        const int qi = m0 + r;
        const float l = qi < seqlen ? lse_bh[qi] : INFINITY;
        s_lse2[r] = l == -INFINITY ? INFINITY : l * LOG2E;  // a row that saw no key has P = 0
        s_delta[r] = qi < seqlen ? delta_bh[qi] : 0.f;
    }
}

// S = Q K^T and dP = dO V^T for one (query tile, key tile), then P and dS (bf16) in shared memory.
template <int D>
__device__ __forceinline__ void scores_and_grads(unsigned char* smem, int m0, int n0, int seqlen, int causal,
                                                 float scale_log2) {
    using L = Layout<D>;
    const float* s_lse2 = reinterpret_cast<const float*>(smem + L::STATS);
    const float* s_delta = s_lse2 + BLOCK_M;
    const bf16* sQ = reinterpret_cast<const bf16*>(smem + L::Q);
    const bf16* sdO = reinterpret_cast<const bf16*>(smem + L::DO);
    const bf16* sK = reinterpret_cast<const bf16*>(smem + L::K);
    const bf16* sV = reinterpret_cast<const bf16*>(smem + L::V);
    float* sS = reinterpret_cast<float*>(smem + L::S);
    float* sdP = reinterpret_cast<float*>(smem + L::DP);
    bf16* sP = reinterpret_cast<bf16*>(smem + L::P);
    bf16* sdS = reinterpret_cast<bf16*>(smem + L::DS);
    const int warp = threadIdx.x / 32;

    constexpr int TN = BLOCK_N / 16;
    for (int t = warp; t < 2 * (BLOCK_M / 16) * TN; t += NUM_WARPS) {
        const bool grad = t >= (BLOCK_M / 16) * TN;  // first the S tiles, then the dP tiles
        const int u = grad ? t - (BLOCK_M / 16) * TN : t;
        const int mi = u / TN, ni = u % TN;
        const bf16* a_src = grad ? sdO : sQ;
        const bf16* b_src = grad ? sV : sK;
        AccFrag acc;
        wmma::fill_fragment(acc, 0.f);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b;  // K^T / V^T
            wmma::load_matrix_sync(a, a_src + mi * 16 * L::LDQ + kk * 16, L::LDQ);
            wmma::load_matrix_sync(b, b_src + ni * 16 * L::LDQ + kk * 16, L::LDQ);
            wmma::mma_sync(acc, a, b, acc);
        }
        wmma::store_matrix_sync((grad ? sdP : sS) + mi * 16 * L::LDS + ni * 16, acc, L::LDS, wmma::mem_row_major);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < BLOCK_M * BLOCK_N; i += NUM_THREADS) {
        const int r = i / BLOCK_N, c = i % BLOCK_N;
        const int qi = m0 + r, kj = n0 + c;
        const bool masked = qi >= seqlen || kj >= seqlen || (causal && kj > qi);
        const float p = masked ? 0.f : exp2f(sS[r * L::LDS + c] * scale_log2 - s_lse2[r]);
        const float ds = p * (sdP[r * L::LDS + c] - s_delta[r]);
        sP[r * L::LDP + c] = __float2bfloat16_rn(p);
        sdS[r * L::LDP + c] = __float2bfloat16_rn(ds);
    }
    __syncthreads();
}

// acc[i] += A^T B for the warp's tiles of a (BLOCK_N x D) result: A = P or dS (BLOCK_M x BLOCK_N, bf16),
// B = dO or Q (BLOCK_M x D).
template <int D>
__device__ __forceinline__ void acc_transposed(AccFrag* acc, const bf16* a, const bf16* b) {
    using L = Layout<D>;
    const int warp = threadIdx.x / 32;
    constexpr int TD = D / 16;
#pragma unroll
    for (int i = 0; i < L::KV_PER_WARP; ++i) {
        const int t = warp * L::KV_PER_WARP + i;
        const int ni = t / TD, di = t % TD;
#pragma unroll 1  // rolled: unrolled, ptxas hoists every fragment load and spills at head_dim 128
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> fa;  // (A^T)[n, m] = A[m, n]
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
            wmma::load_matrix_sync(fa, a + kk * 16 * L::LDP + ni * 16, L::LDP);
            wmma::load_matrix_sync(fb, b + kk * 16 * L::LDQ + di * 16, L::LDQ);
            wmma::mma_sync(acc[i], fa, fb, acc[i]);
        }
    }
}

// acc[i] += dS K for the warp's tiles of a (BLOCK_M x D) result.
template <int D>
__device__ __forceinline__ void acc_dq(AccFrag* acc, const bf16* sdS, const bf16* sK) {
    using L = Layout<D>;
    const int warp = threadIdx.x / 32;
    constexpr int TD = D / 16;
#pragma unroll
    for (int i = 0; i < L::Q_PER_WARP; ++i) {
        const int t = warp * L::Q_PER_WARP + i;
        const int mi = t / TD, di = t % TD;
#pragma unroll 1  // rolled: unrolled, ptxas hoists every fragment load and spills at head_dim 128
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
            wmma::load_matrix_sync(fa, sdS + mi * 16 * L::LDP + kk * 16, L::LDP);
            wmma::load_matrix_sync(fb, sK + kk * 16 * L::LDQ + di * 16, L::LDQ);
            wmma::mma_sync(acc[i], fa, fb, acc[i]);
        }
    }
}

// Store PER_WARP per-warp fragments of a (rows x D) tile to the staging area, then atomically add
// factor * tile into gmem rows [row0, row0 + rows) (those below seqlen).
template <int D, int PER_WARP>
__device__ __forceinline__ void atomic_tile(unsigned char* smem, const AccFrag* acc, int rows,
                                            float* gmem_bh, int row0, int seqlen, float factor) {
    using L = Layout<D>;
    float* st = reinterpret_cast<float*>(smem + L::STAGE);
    const int warp = threadIdx.x / 32;
    constexpr int TD = D / 16;
#pragma unroll  // a compile-time index into the fragments: a runtime one puts them in local memory
    for (int i = 0; i < PER_WARP; ++i) {
        const int t = warp * PER_WARP + i;
        wmma::store_matrix_sync(st + (t / TD) * 16 * L::LDO + (t % TD) * 16, acc[i], L::LDO, wmma::mem_row_major);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * D; i += NUM_THREADS) {
        const int r = i / D, c = i % D;
        if (row0 + r < seqlen) atomicAdd(gmem_bh + (size_t)(row0 + r) * D + c, factor * st[r * L::LDO + c]);
    }
    __syncthreads();
}

// Write PER_WARP fragments of a (rows x D) result as bf16 (factor * value), rows below seqlen.
template <int D, int PER_WARP>
__device__ __forceinline__ void store_bf16(unsigned char* smem, const AccFrag* acc, int rows,
                                           bf16* gmem_bh, int row0, int seqlen, float factor) {
    using L = Layout<D>;
    float* st = reinterpret_cast<float*>(smem + L::Q);  // every tile is free by now (fits: see launch)
    const int warp = threadIdx.x / 32;
    constexpr int TD = D / 16;
    __syncthreads();
#pragma unroll  // a compile-time index into the fragments: a runtime one puts them in local memory
    for (int i = 0; i < PER_WARP; ++i) {
        const int t = warp * PER_WARP + i;
        wmma::store_matrix_sync(st + (t / TD) * 16 * L::LDO + (t % TD) * 16, acc[i], L::LDO, wmma::mem_row_major);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * (D / 2); i += NUM_THREADS) {
        const int r = i / (D / 2), c = (i % (D / 2)) * 2;
        if (row0 + r < seqlen)
            *reinterpret_cast<__nv_bfloat162*>(gmem_bh + (size_t)(row0 + r) * D + c) =
                __floats2bfloat162_rn(factor * st[r * L::LDO + c], factor * st[r * L::LDO + c + 1]);
    }
    __syncthreads();
}

// ---- kernels ------------------------------------------------------------------------------------

// delta[row] = sum_c dO[row, c] * O[row, c] (one warp per row); zeroes n1 floats of z1, n2 of z2.
template <int D>
__global__ void __launch_bounds__(NUM_THREADS)
bwd_preprocess(const bf16* __restrict__ o, const bf16* __restrict__ dout, float* __restrict__ delta, long long rows,
               float* __restrict__ z1, long long n1, float* __restrict__ z2, long long n2) {
    const int lane = threadIdx.x % 32;
    const long long warps = (long long)gridDim.x * NUM_WARPS;
    for (long long row = (long long)blockIdx.x * NUM_WARPS + threadIdx.x / 32; row < rows; row += warps) {
        float acc = 0.f;
        for (int c = 2 * lane; c < D; c += 64) {
            const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o + row * D + c));
            const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + row * D + c));
            acc += a.x * b.x + a.y * b.y;
        }
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) delta[row] = acc;
    }
    const long long threads = (long long)gridDim.x * NUM_THREADS;
    for (long long i = (long long)blockIdx.x * NUM_THREADS + threadIdx.x; i < n1; i += threads) z1[i] = 0.f;
    for (long long i = (long long)blockIdx.x * NUM_THREADS + threadIdx.x; i < n2; i += threads) z2[i] = 0.f;
}

// One block per (batch * kv head, key tile): dK, dV of BLOCK_N keys over the group's query heads.
// one block per SM is enough to fill it with this many warps: let ptxas use up to 255 registers
// (without the hint it caps the default at 128 and spills the dK/dV accumulators)
template <int D, bool DQ_ATOMICS>
__global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_dkdv(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
         const bf16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
         bf16* __restrict__ dk, bf16* __restrict__ dv, float* __restrict__ dq_accum, int heads, int kv_heads,
         int seqlen, int causal, float scale, float scale_log2) {
    using L = Layout<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    float* s_lse2 = reinterpret_cast<float*>(smem + L::STATS);
    float* s_delta = s_lse2 + BLOCK_M;
    bf16* sQ = reinterpret_cast<bf16*>(smem + L::Q);
    bf16* sdO = reinterpret_cast<bf16*>(smem + L::DO);
    bf16* sK = reinterpret_cast<bf16*>(smem + L::K);
    bf16* sV = reinterpret_cast<bf16*>(smem + L::V);
    const bf16* sP = reinterpret_cast<const bf16*>(smem + L::P);
    const bf16* sdS = reinterpret_cast<const bf16*>(smem + L::DS);

    const int n_blocks = (seqlen + BLOCK_N - 1) / BLOCK_N;
    const int n_block = n_blocks - 1 - static_cast<int>(blockIdx.x % n_blocks);  // causal: the busiest first
    const size_t bkv = blockIdx.x / n_blocks;
    const size_t batch = bkv / kv_heads;
    const int group = heads / kv_heads;
    const size_t kv_head = bkv % kv_heads;
    const int n0 = n_block * BLOCK_N;
    const size_t row_stride = (size_t)seqlen * D;

    load_tile<D>(sK, k + bkv * row_stride, n0, BLOCK_N, seqlen);
    load_tile<D>(sV, v + bkv * row_stride, n0, BLOCK_N, seqlen);
    cp_async_commit();

    AccFrag acc_dk[L::KV_PER_WARP], acc_dv[L::KV_PER_WARP];
#pragma unroll
    for (int i = 0; i < L::KV_PER_WARP; ++i) {
        wmma::fill_fragment(acc_dk[i], 0.f);
        wmma::fill_fragment(acc_dv[i], 0.f);
    }
    const int m_first = causal ? n0 / BLOCK_M : 0;  // causal: query tiles above the keys see none of them
    const int m_tiles = (seqlen + BLOCK_M - 1) / BLOCK_M;
    for (int hh = 0; hh < group; ++hh) {
        const size_t bh = batch * heads + kv_head * group + hh;
        for (int mt = m_first; mt < m_tiles; ++mt) {
            const int m0 = mt * BLOCK_M;
            load_tile<D>(sQ, q + bh * row_stride, m0, BLOCK_M, seqlen);
            load_tile<D>(sdO, dout + bh * row_stride, m0, BLOCK_M, seqlen);
            cp_async_commit();
            load_row_stats(s_lse2, s_delta, lse + bh * seqlen, delta + bh * seqlen, m0, seqlen);
            cp_async_wait_all();
            __syncthreads();
            scores_and_grads<D>(smem, m0, n0, seqlen, causal, scale_log2);
            acc_transposed<D>(acc_dv, sP, sdO);
            acc_transposed<D>(acc_dk, sdS, sQ);
            if constexpr (DQ_ATOMICS) {
                AccFrag part[L::Q_PER_WARP];
#pragma unroll
                for (int i = 0; i < L::Q_PER_WARP; ++i) wmma::fill_fragment(part[i], 0.f);
                acc_dq<D>(part, sdS, sK);
                atomic_tile<D, L::Q_PER_WARP>(smem, part, BLOCK_M, dq_accum + bh * row_stride, m0, seqlen, scale);
            }
            __syncthreads();  // Q, dO, P, dS are rewritten by the next tile
        }
    }
    store_bf16<D, L::KV_PER_WARP>(smem, acc_dv, BLOCK_N, dv + bkv * row_stride, n0, seqlen, 1.f);
    store_bf16<D, L::KV_PER_WARP>(smem, acc_dk, BLOCK_N, dk + bkv * row_stride, n0, seqlen, scale);
}

// One block per (batch * head, query tile): dQ of BLOCK_M rows over the key tiles; with DKV_ATOMICS
// also each tile's dK, dV contributions by fp32 atomics into their workspaces (kv heads).
template <int D, bool DKV_ATOMICS>
__global__ void __launch_bounds__(NUM_THREADS)
bwd_dq(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
       const bf16* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
       bf16* __restrict__ dq, float* __restrict__ dk_accum, float* __restrict__ dv_accum, int heads, int kv_heads,
       int seqlen, int causal, float scale, float scale_log2) {
    using L = Layout<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    float* s_lse2 = reinterpret_cast<float*>(smem + L::STATS);
    float* s_delta = s_lse2 + BLOCK_M;
    bf16* sQ = reinterpret_cast<bf16*>(smem + L::Q);
    bf16* sdO = reinterpret_cast<bf16*>(smem + L::DO);
    bf16* sK = reinterpret_cast<bf16*>(smem + L::K);
    bf16* sV = reinterpret_cast<bf16*>(smem + L::V);
    const bf16* sP = reinterpret_cast<const bf16*>(smem + L::P);
    const bf16* sdS = reinterpret_cast<const bf16*>(smem + L::DS);

    const int m_blocks = (seqlen + BLOCK_M - 1) / BLOCK_M;
    const int m_block = m_blocks - 1 - static_cast<int>(blockIdx.x % m_blocks);  // causal: the busiest first
    const size_t bh = blockIdx.x / m_blocks;
    const size_t bkv = (bh / heads) * kv_heads + (bh % heads) / (heads / kv_heads);
    const int m0 = m_block * BLOCK_M;
    const size_t row_stride = (size_t)seqlen * D;

    load_tile<D>(sQ, q + bh * row_stride, m0, BLOCK_M, seqlen);
    load_tile<D>(sdO, dout + bh * row_stride, m0, BLOCK_M, seqlen);
    cp_async_commit();
    load_row_stats(s_lse2, s_delta, lse + bh * seqlen, delta + bh * seqlen, m0, seqlen);

    AccFrag acc[L::Q_PER_WARP];
#pragma unroll
    for (int i = 0; i < L::Q_PER_WARP; ++i) wmma::fill_fragment(acc[i], 0.f);
    const int kv_end = causal ? min(seqlen, m0 + BLOCK_M) : seqlen;
    const int n_tiles = (kv_end + BLOCK_N - 1) / BLOCK_N;
    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BLOCK_N;
        load_tile<D>(sK, k + bkv * row_stride, n0, BLOCK_N, seqlen);
        load_tile<D>(sV, v + bkv * row_stride, n0, BLOCK_N, seqlen);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        scores_and_grads<D>(smem, m0, n0, seqlen, causal, scale_log2);
        acc_dq<D>(acc, sdS, sK);
        if constexpr (DKV_ATOMICS) {
            AccFrag part[L::KV_PER_WARP];
#pragma unroll
            for (int i = 0; i < L::KV_PER_WARP; ++i) wmma::fill_fragment(part[i], 0.f);
            acc_transposed<D>(part, sP, sdO);
            atomic_tile<D, L::KV_PER_WARP>(smem, part, BLOCK_N, dv_accum + bkv * row_stride, n0, seqlen, 1.f);
#pragma unroll
            for (int i = 0; i < L::KV_PER_WARP; ++i) wmma::fill_fragment(part[i], 0.f);
            acc_transposed<D>(part, sdS, sQ);
            atomic_tile<D, L::KV_PER_WARP>(smem, part, BLOCK_N, dk_accum + bkv * row_stride, n0, seqlen, scale);
        }
        __syncthreads();  // K, V, P, dS are rewritten by the next tile
    }
    store_bf16<D, L::Q_PER_WARP>(smem, acc, BLOCK_M, dq + bh * row_stride, m0, seqlen, scale);
}

__global__ void __launch_bounds__(NUM_THREADS) to_bf16(const float* __restrict__ src, bf16* __restrict__ dst, long long n) {
    const long long threads = (long long)gridDim.x * NUM_THREADS;
    for (long long i = (long long)blockIdx.x * NUM_THREADS + threadIdx.x; i < n; i += threads) dst[i] = __float2bfloat16_rn(src[i]);
}

int grid_for(long long work) {
    const long long blocks = (work + NUM_THREADS - 1) / NUM_THREADS;
    return static_cast<int>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

template <typename K>
cudaError_t allow_smem(K kernel, size_t bytes, int smem_max) {
    if (bytes > static_cast<size_t>(smem_max)) return cudaErrorInvalidConfiguration;  // knobs too big: no launch
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <int D>
int launch(const bf16* q, const bf16* k, const bf16* v, const bf16* o, const bf16* dout, const float* lse, bf16* dq,
           bf16* dk, bf16* dv, float* ws_delta, float* ws_dq, float* ws_dk, float* ws_dv, int batch, int heads,
           int kv_heads, int seqlen, int causal, float scale, cudaStream_t stream) {
    using L = Layout<D>;
    // store_bf16 stages a (ROWS x D) fp32 tile over the tiles from Q on, once the loop is done
    static_assert(L::Q + size_t(L::ROWS) * L::LDO * 4 <= L::BYTES_PLAIN, "epilogue staging does not fit");
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    int smem_max = 0;
    err = cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err != cudaSuccess) return err;

    const long long q_rows = (long long)batch * heads * seqlen;
    const long long kv_elems = (long long)batch * kv_heads * seqlen * D;
    const long long m_blocks = (long long)batch * heads * ((seqlen + BLOCK_M - 1) / BLOCK_M);
    const long long n_blocks = (long long)batch * kv_heads * ((seqlen + BLOCK_N - 1) / BLOCK_N);
    if (m_blocks > INT_MAX || n_blocks > INT_MAX) return cudaErrorInvalidConfiguration;
    const float scale_log2 = scale * LOG2E;

    // check every kernel's shared memory before launching any
    constexpr bool dq_atomic = KV_OUTER == 1 && DQ_ATOMIC == 1;
    if constexpr (KV_OUTER == 1) {
        auto dkdv = bwd_dkdv<D, dq_atomic>;
        err = allow_smem(dkdv, dq_atomic ? L::BYTES_ATOMIC : L::BYTES_PLAIN, smem_max);
        if (err != cudaSuccess) return err;
        if constexpr (!dq_atomic) {
            err = allow_smem(bwd_dq<D, false>, L::BYTES_PLAIN, smem_max);
            if (err != cudaSuccess) return err;
        }
    } else {
        err = allow_smem(bwd_dq<D, true>, L::BYTES_ATOMIC, smem_max);
        if (err != cudaSuccess) return err;
    }

    // Delta, and zeroed fp32 workspaces for whichever gradients the atomics accumulate
    if constexpr (dq_atomic)
        bwd_preprocess<D><<<grid_for(q_rows * 32), NUM_THREADS, 0, stream>>>(o, dout, ws_delta, q_rows, ws_dq, q_rows * D, nullptr, 0);
    else if constexpr (KV_OUTER == 0)
        bwd_preprocess<D><<<grid_for(q_rows * 32), NUM_THREADS, 0, stream>>>(o, dout, ws_delta, q_rows, ws_dk, kv_elems, ws_dv, kv_elems);
    else
        bwd_preprocess<D><<<grid_for(q_rows * 32), NUM_THREADS, 0, stream>>>(o, dout, ws_delta, q_rows, nullptr, 0, nullptr, 0);
    if constexpr (KV_OUTER == 1) {
        bwd_dkdv<D, dq_atomic><<<static_cast<unsigned>(n_blocks), NUM_THREADS, dq_atomic ? L::BYTES_ATOMIC : L::BYTES_PLAIN, stream>>>(
            q, k, v, dout, lse, ws_delta, dk, dv, ws_dq, heads, kv_heads, seqlen, causal, scale, scale_log2);
        if constexpr (dq_atomic) {
            to_bf16<<<grid_for(q_rows * D), NUM_THREADS, 0, stream>>>(ws_dq, dq, q_rows * D);
        } else {
            bwd_dq<D, false><<<static_cast<unsigned>(m_blocks), NUM_THREADS, L::BYTES_PLAIN, stream>>>(
                q, k, v, dout, lse, ws_delta, dq, nullptr, nullptr, heads, kv_heads, seqlen, causal, scale, scale_log2);
        }
    } else {
        bwd_dq<D, true><<<static_cast<unsigned>(m_blocks), NUM_THREADS, L::BYTES_ATOMIC, stream>>>(
            q, k, v, dout, lse, ws_delta, dq, ws_dk, ws_dv, heads, kv_heads, seqlen, causal, scale, scale_log2);
        to_bf16<<<grid_for(kv_elems), NUM_THREADS, 0, stream>>>(ws_dk, dk, kv_elems);
        to_bf16<<<grid_for(kv_elems), NUM_THREADS, 0, stream>>>(ws_dv, dv, kv_elems);
    }
    return cudaGetLastError();
}

bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

}  // namespace

// q, o, dout, dq: [batch, heads, seqlen, head_dim] bf16; k, v, dk, dv: [batch, kv_heads, seqlen, head_dim]
// bf16; lse: [batch, heads, seqlen] fp32 (the forward's, natural log of the scaled scores); workspaces
// the harness provides (contents undefined on entry): ws_delta fp32 [batch, heads, seqlen], ws_dq fp32
// like q, ws_dk and ws_dv fp32 like k. All contiguous. Returns a cudaError_t as int: 0 on a successful
// launch; non-zero, with nothing launched, for an unsupported head_dim, bad sizes, misaligned
// pointers or knobs whose shared memory does not fit.
extern "C" int kloop_flash_attn_bwd(const bf16* q, const bf16* k, const bf16* v, const bf16* o, const bf16* dout,
                                    const float* lse, bf16* dq, bf16* dk, bf16* dv, float* ws_delta, float* ws_dq,
                                    float* ws_dk, float* ws_dv, int batch, int heads, int kv_heads, int seqlen,
                                    int head_dim, int causal, float scale, cudaStream_t stream) {
    if (batch < 0 || heads < 0 || kv_heads < 0 || seqlen < 0) return cudaErrorInvalidValue;
    if (batch == 0 || heads == 0 || seqlen == 0) return cudaSuccess;
    if (kv_heads == 0 || heads % kv_heads != 0) return cudaErrorInvalidValue;
    const void* p16[] = {q, k, v, o, dout, dq, dk, dv, ws_dq, ws_dk, ws_dv};
    for (const void* p : p16)
        if (!aligned(p, 16)) return cudaErrorInvalidValue;
    if (!aligned(lse, 4) || !aligned(ws_delta, 4)) return cudaErrorInvalidValue;
    causal = causal ? 1 : 0;
    switch (head_dim) {
        case 64: return launch<64>(q, k, v, o, dout, lse, dq, dk, dv, ws_delta, ws_dq, ws_dk, ws_dv, batch, heads, kv_heads, seqlen, causal, scale, stream);
        case 128: return launch<128>(q, k, v, o, dout, lse, dq, dk, dv, ws_delta, ws_dq, ws_dk, ws_dv, batch, heads, kv_heads, seqlen, causal, scale, stream);
        default: return cudaErrorInvalidValue;
    }
}
