// FlashAttention forward, FP8 (e4m3) Q, K, V with fp32 descales, bf16 O and fp32 log-sum-exp, for
// Hopper (sm_90a). Grouped-query attention: K/V have kv_heads heads, each shared by heads/kv_heads
// query heads. The descales are fp32 [batch, kv_heads] (one per batch and kv head; Q's is shared by
// the kv head's query group), as FlashAttention-3's FP8 interface takes them.
//
// A plain baseline in the bf16 task's style: tiles of e4m3 arrive in shared memory through cp.async
// (STAGES = 2 prefetches the next K/V tile), are converted to bf16 there (exact: every e4m3 value is
// a bf16 value), and the rest is the bf16 forward: WMMA 16x16x16 (bf16 operands, fp32 accumulate),
//
//   S = Q K^T                 raw e4m3 values; the descales are folded into the softmax scale
//   online softmax on S       one warp per row: running max m, running sum l, P = exp2(...) as bf16
//   O = alpha * O + P V       O in accumulator fragments for the whole loop
//
// and at the end O * v_descale / l goes out as bf16, lse = m + log(l) (natural log) as fp32.
// The FP8 tensor cores (wgmma e4m3, twice the bf16 rate) are not used: that is the loop's room.
//
// Knobs (-D defines; allowed values in task.toml): BLOCK_M, BLOCK_N, NUM_WARPS, STAGES.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
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
#ifndef STAGES
#define STAGES 2
#endif

static_assert(BLOCK_M % 16 == 0 && BLOCK_M >= 16, "BLOCK_M must be a multiple of 16");
static_assert(BLOCK_N % 32 == 0 && BLOCK_N >= 32, "BLOCK_N must be a multiple of 32 (one warp spans a row)");
static_assert(NUM_WARPS >= 1 && NUM_WARPS <= 32, "NUM_WARPS out of range");
static_assert(STAGES == 1 || STAGES == 2, "STAGES must be 1 or 2");

namespace {

using namespace nvcuda;

constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

template <int D> struct Layout {
    static constexpr int LDQ = D + 8;        // bf16 Q, K, V rows (16 bytes of padding against bank conflicts)
    static constexpr int LDS = BLOCK_N + 4;  // S rows (fp32)
    static constexpr int LDP = BLOCK_N + 8;  // P rows (bf16)
    static constexpr int LDO = D + 4;        // epilogue O rows (fp32)

    static constexpr size_t align(size_t n) { return (n + 127) / 128 * 128; }

    static constexpr size_t STATS = 0;                                            // m, l, alpha: 3 x BLOCK_M fp32
    static constexpr size_t RAW_Q = STATS + align(3 * BLOCK_M * sizeof(float));   // e4m3 Q tile
    static constexpr size_t RAW_K = RAW_Q + align(size_t(BLOCK_M) * D);           // e4m3 K tiles (STAGES)
    static constexpr size_t RAW_V = RAW_K + align(size_t(STAGES) * BLOCK_N * D);  // e4m3 V tiles (STAGES)
    static constexpr size_t Q = RAW_V + align(size_t(STAGES) * BLOCK_N * D);      // bf16 tiles
    static constexpr size_t K = Q + align(size_t(BLOCK_M) * LDQ * 2);
    static constexpr size_t V = K + align(size_t(BLOCK_N) * LDQ * 2);
    static constexpr size_t S = V + align(size_t(BLOCK_N) * LDQ * 2);
    static constexpr size_t P = S + align(size_t(BLOCK_M) * LDS * 4);
    static constexpr size_t MAIN_END = P + align(size_t(BLOCK_M) * LDP * 2);
    static constexpr size_t O = RAW_Q;  // the epilogue stages O (fp32) over the tiles once the loop is done
    static constexpr size_t EPI_END = O + align(size_t(BLOCK_M) * LDO * 4);
    static constexpr size_t BYTES = MAIN_END > EPI_END ? MAIN_END : EPI_END;

    static constexpr int O_TILES = (BLOCK_M / 16) * (D / 16);
    static_assert(O_TILES % NUM_WARPS == 0, "output tiles must split evenly over the warps");
    static constexpr int O_TILES_PER_WARP = O_TILES / NUM_WARPS;
};

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// `rows` rows of D e4m3 bytes from global row `row0` into a dense smem tile; rows past seqlen are
// zero-filled (e4m3 0x00 = +0), so they contribute nothing downstream.
template <int D>
__device__ __forceinline__ void load_raw(uint8_t* smem, const uint8_t* gmem_bh, int row0, int rows, int seqlen) {
    constexpr int CHUNKS_PER_ROW = D / 16;
    for (int i = threadIdx.x; i < rows * CHUNKS_PER_ROW; i += NUM_THREADS) {
        const int r = i / CHUNKS_PER_ROW;
        const int c = (i % CHUNKS_PER_ROW) * 16;
        const bool valid = row0 + r < seqlen;
        const uint8_t* src = valid ? gmem_bh + (size_t)(row0 + r) * D + c : gmem_bh;
        cp_async_16(smem + r * D + c, src, valid);
    }
}

// e4m3 tile (dense rows of D bytes) -> bf16 tile (rows of LDQ), 16 values per thread step. Exact.
template <int D>
__device__ __forceinline__ void convert_tile(__nv_bfloat16* dst, const uint8_t* src, int rows) {
    constexpr int CHUNKS_PER_ROW = D / 16;
    for (int i = threadIdx.x; i < rows * CHUNKS_PER_ROW; i += NUM_THREADS) {
        const int r = i / CHUNKS_PER_ROW;
        const int c = (i % CHUNKS_PER_ROW) * 16;
        const uint4 raw = *reinterpret_cast<const uint4*>(src + r * D + c);
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        __align__(16) __nv_bfloat162 out[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>((words[w] >> (16 * half)) & 0xffffu);
                const __half2 h2 = __half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
                out[2 * w + half] = __float22bfloat162_rn(__half22float2(h2));
            }
        }
        uint4* d = reinterpret_cast<uint4*>(dst + r * Layout<D>::LDQ + c);
        d[0] = *reinterpret_cast<const uint4*>(&out[0]);
        d[1] = *reinterpret_cast<const uint4*>(&out[4]);
    }
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <int D>
__global__ void __launch_bounds__(NUM_THREADS)
flash_attn_fwd_fp8_kernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ k, const uint8_t* __restrict__ v,
                          const float* __restrict__ q_descale, const float* __restrict__ k_descale,
                          const float* __restrict__ v_descale, __nv_bfloat16* __restrict__ o, float* __restrict__ lse,
                          int heads, int kv_heads, int seqlen, int num_m_blocks, int causal, float scale_log2) {
    using L = Layout<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    float* s_m = reinterpret_cast<float*>(smem + L::STATS);
    float* s_l = s_m + BLOCK_M;
    float* s_alpha = s_l + BLOCK_M;
    uint8_t* rQ = smem + L::RAW_Q;
    uint8_t* rK = smem + L::RAW_K;
    uint8_t* rV = smem + L::RAW_V;
    __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem + L::Q);
    __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem + L::K);
    __nv_bfloat16* sV = reinterpret_cast<__nv_bfloat16*>(smem + L::V);
    float* sS = reinterpret_cast<float*>(smem + L::S);
    __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + L::P);
    float* sO = reinterpret_cast<float*>(smem + L::O);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    const int m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x % num_m_blocks);  // heaviest first
    const size_t bh = blockIdx.x / num_m_blocks;         // batch * heads + head
    const size_t batch = bh / heads;
    const int head = static_cast<int>(bh % heads);
    const size_t bkv = batch * kv_heads + head / (heads / kv_heads);  // its kv head
    const int m0 = m_block * BLOCK_M;
    const uint8_t* q_bh = q + bh * (size_t)seqlen * D;
    const uint8_t* k_bh = k + bkv * (size_t)seqlen * D;
    const uint8_t* v_bh = v + bkv * (size_t)seqlen * D;
    // the descales: Q's and K's scale the scores, V's the output
    const float score_scale = scale_log2 * q_descale[bkv] * k_descale[bkv];
    const float out_scale = v_descale[bkv];

    const int kv_end = causal ? min(seqlen, m0 + BLOCK_M) : seqlen;
    const int n_tiles = (kv_end + BLOCK_N - 1) / BLOCK_N;

    load_raw<D>(rQ, q_bh, m0, BLOCK_M, seqlen);
    load_raw<D>(rK, k_bh, 0, BLOCK_N, seqlen);
    load_raw<D>(rV, v_bh, 0, BLOCK_N, seqlen);
    cp_async_commit();

    for (int r = threadIdx.x; r < BLOCK_M; r += NUM_THREADS) {
        s_m[r] = -INFINITY;
        s_l[r] = 0.f;
    }
    // which row of its 16x16 tile each accumulator element holds (see the bf16 task's kernel)
    for (int i = threadIdx.x; i < 16 * 16; i += NUM_THREADS) sS[(i / 16) * L::LDS + i % 16] = float(i / 16);
    __syncthreads();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> row_of;
    wmma::load_matrix_sync(row_of, sS, L::LDS, wmma::mem_row_major);

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc_o[L::O_TILES_PER_WARP];
#pragma unroll
    for (int i = 0; i < L::O_TILES_PER_WARP; ++i) wmma::fill_fragment(acc_o[i], 0.f);

    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BLOCK_N;
        const int stage = (STAGES == 2) ? (j & 1) : 0;
        if constexpr (STAGES == 2) {
            if (j + 1 < n_tiles) {  // the other raw stage was converted last iteration (a barrier since)
                const int next = (j + 1) & 1;
                load_raw<D>(rK + next * BLOCK_N * D, k_bh, n0 + BLOCK_N, BLOCK_N, seqlen);
                load_raw<D>(rV + next * BLOCK_N * D, v_bh, n0 + BLOCK_N, BLOCK_N, seqlen);
            }
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            if (j > 0) {
                load_raw<D>(rK, k_bh, n0, BLOCK_N, seqlen);
                load_raw<D>(rV, v_bh, n0, BLOCK_N, seqlen);
                cp_async_commit();
            }
            cp_async_wait<0>();
        }
        __syncthreads();
        if (j == 0) convert_tile<D>(sQ, rQ, BLOCK_M);
        convert_tile<D>(sK, rK + stage * BLOCK_N * D, BLOCK_N);
        convert_tile<D>(sV, rV + stage * BLOCK_N * D, BLOCK_N);
        __syncthreads();

        // -- S = Q K^T (raw e4m3 dot products, exact products, fp32 sums) --------------------------
        constexpr int S_TILES_N = BLOCK_N / 16;
        for (int t = warp; t < (BLOCK_M / 16) * S_TILES_N; t += NUM_WARPS) {
            const int mi = t / S_TILES_N, ni = t % S_TILES_N;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
                wmma::load_matrix_sync(a, sQ + mi * 16 * L::LDQ + kk * 16, L::LDQ);
                wmma::load_matrix_sync(b, sK + ni * 16 * L::LDQ + kk * 16, L::LDQ);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(sS + mi * 16 * L::LDS + ni * 16, acc, L::LDS, wmma::mem_row_major);
        }
        __syncthreads();

        // -- online softmax: one warp per row ----------------------------------------------------
        for (int r = warp; r < BLOCK_M; r += NUM_WARPS) {
            const int qi = m0 + r;
            float x[BLOCK_N / 32];
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < BLOCK_N / 32; ++i) {
                const int c = lane + 32 * i;
                const int kj = n0 + c;
                const bool masked = kj >= seqlen || (causal && kj > qi);
                x[i] = masked ? -INFINITY : sS[r * L::LDS + c] * score_scale;
                mx = fmaxf(mx, x[i]);
            }
            mx = warp_max(mx);
            const float m_old = s_m[r];
            const float m_new = fmaxf(m_old, mx);
            const float m_use = (m_new == -INFINITY) ? 0.f : m_new;  // never (-inf) - (-inf)
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < BLOCK_N / 32; ++i) {
                const float p = exp2f(x[i] - m_use);
                sP[r * L::LDP + lane + 32 * i] = __float2bfloat16_rn(p);
                sum += p;
            }
            sum = warp_sum(sum);
            const float alpha = exp2f(m_old - m_use);
            const float l_new = s_l[r] * alpha + sum;
            __syncwarp();
            if (lane == 0) {
                s_m[r] = m_new;
                s_l[r] = l_new;
                s_alpha[r] = alpha;
            }
        }
        __syncthreads();

        // -- O = alpha * O + P V -----------------------------------------------------------------
        constexpr int O_TILES_D = D / 16;
#pragma unroll
        for (int i = 0; i < L::O_TILES_PER_WARP; ++i) {
            const int t = warp * L::O_TILES_PER_WARP + i;
            const int mi = t / O_TILES_D, di = t % O_TILES_D;
#pragma unroll
            for (int e = 0; e < acc_o[i].num_elements; ++e)
                acc_o[i].x[e] *= s_alpha[mi * 16 + static_cast<int>(row_of.x[e])];
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
                wmma::load_matrix_sync(a, sP + mi * 16 * L::LDP + kk * 16, L::LDP);
                wmma::load_matrix_sync(b, sV + kk * 16 * L::LDQ + di * 16, L::LDQ);
                wmma::mma_sync(acc_o[i], a, b, acc_o[i]);
            }
        }
        __syncthreads();  // S, P, the bf16 K/V and this raw stage are rewritten by the next tile
    }

    // -- epilogue: O * v_descale / l as bf16, lse ----------------------------------------------
    {
        constexpr int O_TILES_D = D / 16;
#pragma unroll
        for (int i = 0; i < L::O_TILES_PER_WARP; ++i) {
            const int t = warp * L::O_TILES_PER_WARP + i;
            const int mi = t / O_TILES_D, di = t % O_TILES_D;
            wmma::store_matrix_sync(sO + mi * 16 * L::LDO + di * 16, acc_o[i], L::LDO, wmma::mem_row_major);
        }
    }
    __syncthreads();
    for (int r = warp; r < BLOCK_M; r += NUM_WARPS) {
        const int qi = m0 + r;
        if (qi >= seqlen) continue;
        const float l = s_l[r];
        const float f = l > 0.f ? out_scale / l : 0.f;
        __nv_bfloat16* o_row = o + bh * (size_t)seqlen * D + (size_t)qi * D;
        for (int c = 2 * lane; c < D; c += 64) {
            const float2 acc = *reinterpret_cast<const float2*>(sO + r * L::LDO + c);
            *reinterpret_cast<__nv_bfloat162*>(o_row + c) = __floats2bfloat162_rn(acc.x * f, acc.y * f);
        }
        if (lane == 0) lse[bh * (size_t)seqlen + qi] = l > 0.f ? (s_m[r] + log2f(l)) * LN2 : -INFINITY;
    }
}

template <int D>
int launch(const uint8_t* q, const uint8_t* k, const uint8_t* v, const float* qd, const float* kd, const float* vd,
           __nv_bfloat16* o, float* lse, int batch, int heads, int kv_heads, int seqlen, int causal, float scale,
           cudaStream_t stream) {
    using L = Layout<D>;
    constexpr size_t smem = L::BYTES;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    int smem_max = 0;
    err = cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err != cudaSuccess) return err;
    if (smem > static_cast<size_t>(smem_max)) return cudaErrorInvalidConfiguration;
    auto kernel = flash_attn_fwd_fp8_kernel<D>;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    const long long num_m_blocks = (seqlen + BLOCK_M - 1) / BLOCK_M;
    const long long blocks = num_m_blocks * batch * heads;
    if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
    kernel<<<static_cast<unsigned>(blocks), NUM_THREADS, smem, stream>>>(
        q, k, v, qd, kd, vd, o, lse, heads, kv_heads, seqlen, static_cast<int>(num_m_blocks), causal, scale * LOG2E);
    return cudaGetLastError();
}

bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

}  // namespace

// q: [batch, heads, seqlen, head_dim], k, v: [batch, kv_heads, seqlen, head_dim], e4m3, contiguous;
// q_descale, k_descale, v_descale: fp32 [batch, kv_heads]; o: bf16 like q; lse: fp32 [batch, heads, seqlen].
// Returns a cudaError_t as int: 0 on a successful launch; non-zero, with nothing launched, for an
// unsupported head_dim, bad sizes (heads not a multiple of kv_heads), misaligned pointers or knobs
// whose shared memory does not fit.
extern "C" int kloop_flash_attn_fwd_fp8(const uint8_t* q, const uint8_t* k, const uint8_t* v, const float* q_descale,
                                        const float* k_descale, const float* v_descale, __nv_bfloat16* o, float* lse,
                                        int batch, int heads, int kv_heads, int seqlen, int head_dim, int causal,
                                        float scale, cudaStream_t stream) {
    if (batch < 0 || heads < 0 || kv_heads < 0 || seqlen < 0) return cudaErrorInvalidValue;
    if (batch == 0 || heads == 0 || seqlen == 0) return cudaSuccess;
    if (kv_heads == 0 || heads % kv_heads != 0) return cudaErrorInvalidValue;
    if (!aligned(q, 16) || !aligned(k, 16) || !aligned(v, 16) || !aligned(o, 16) || !aligned(lse, 4) ||
        !aligned(q_descale, 4) || !aligned(k_descale, 4) || !aligned(v_descale, 4))
        return cudaErrorInvalidValue;
    causal = causal ? 1 : 0;
    switch (head_dim) {
        case 64: return launch<64>(q, k, v, q_descale, k_descale, v_descale, o, lse, batch, heads, kv_heads, seqlen, causal, scale, stream);
        case 128: return launch<128>(q, k, v, q_descale, k_descale, v_descale, o, lse, batch, heads, kv_heads, seqlen, causal, scale, stream);
        default: return cudaErrorInvalidValue;
    }
}
