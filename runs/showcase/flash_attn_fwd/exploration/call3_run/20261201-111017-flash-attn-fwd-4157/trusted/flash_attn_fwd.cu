// FlashAttention forward, bf16 in / bf16 out, fp32 log-sum-exp, for Hopper (sm_90a).
//
// A plain baseline: tiled online softmax on the tensor cores through WMMA 16x16x16 (bf16 operands,
// fp32 accumulate). One thread block owns BLOCK_M query rows of one (batch, head) and walks the
// keys/values in tiles of BLOCK_N rows:
//
//   S = Q K^T                 WMMA, fp32 tile written to shared memory
//   online softmax on S       one warp per row: running max m, running sum l, P = exp(S - m) as bf16
//   O = alpha * O + P V       WMMA; O lives in registers (accumulator fragments) for the whole loop
//
// K/V tiles arrive through cp.async (STAGES = 2 prefetches the next tile while this one is used).
// At the end O / l goes out as bf16 and lse = m + log(l) (natural log, of scaled scores) as fp32.
//
// Knobs (-D defines; allowed values in task.toml): BLOCK_M, BLOCK_N, NUM_WARPS, STAGES.
// A knob combination whose shared memory does not fit the device makes the entry point return an
// error code with no launch.

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

// Row strides in shared memory, padded by 16 bytes (bf16) or 16 bytes (fp32) to spread banks.
// WMMA needs ldm to be a multiple of 8 (16-bit types) or 4 (fp32): all of these are.
template <int D> struct Layout {
    static constexpr int LDQ = D + 8;            // Q, K, V rows (bf16)
    static constexpr int LDS = BLOCK_N + 4;      // S rows (fp32)
    static constexpr int LDP = BLOCK_N + 8;      // P rows (bf16)
    static constexpr int LDO = D + 4;            // epilogue O rows (fp32)

    static constexpr size_t align(size_t n) { return (n + 127) / 128 * 128; }

    // byte offsets of each region in dynamic shared memory
    static constexpr size_t STATS = 0;                                              // m, l, alpha: 3 x BLOCK_M fp32
    static constexpr size_t Q = STATS + align(3 * BLOCK_M * sizeof(float));
    static constexpr size_t K = Q + align(size_t(BLOCK_M) * LDQ * 2);
    static constexpr size_t V = K + align(size_t(STAGES) * BLOCK_N * LDQ * 2);
    static constexpr size_t S = V + align(size_t(STAGES) * BLOCK_N * LDQ * 2);
    static constexpr size_t P = S + align(size_t(BLOCK_M) * LDS * 4);
    static constexpr size_t MAIN_END = P + align(size_t(BLOCK_M) * LDP * 2);
    // the epilogue stages O (fp32) over the Q/K/V/S/P regions once the loop is done
    static constexpr size_t O = Q;
    static constexpr size_t EPI_END = O + align(size_t(BLOCK_M) * LDO * 4);
    static constexpr size_t BYTES = MAIN_END > EPI_END ? MAIN_END : EPI_END;

    // WMMA tiles of the output O (BLOCK_M x D) each warp owns for the whole kernel
    static constexpr int O_TILES = (BLOCK_M / 16) * (D / 16);
    static_assert(O_TILES % NUM_WARPS == 0, "output tiles must split evenly over the warps");
    static constexpr int O_TILES_PER_WARP = O_TILES / NUM_WARPS;
};

// ---- cp.async helpers (16-byte copies; src_bytes = 0 zero-fills the destination) ----------------
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Copy `rows` rows of D bf16 starting at global row `row0` (of `seqlen`) into smem with stride LDQ.
// Rows at or past seqlen are zero-filled, so they contribute nothing (and no NaN) downstream.
template <int D>
__device__ __forceinline__ void load_tile(__nv_bfloat16* smem, const __nv_bfloat16* gmem_bh, int row0, int rows,
                                          int seqlen) {
    constexpr int CHUNKS_PER_ROW = D / 8;  // 8 bf16 = 16 bytes per chunk
    for (int i = threadIdx.x; i < rows * CHUNKS_PER_ROW; i += NUM_THREADS) {
        const int r = i / CHUNKS_PER_ROW;
        const int c = (i % CHUNKS_PER_ROW) * 8;
        const bool valid = row0 + r < seqlen;
        const __nv_bfloat16* src = valid ? gmem_bh + (size_t)(row0 + r) * D + c : gmem_bh;
        cp_async_16(smem + r * Layout<D>::LDQ + c, src, valid);
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
flash_attn_fwd_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                      const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ o, float* __restrict__ lse,
                      int seqlen, int num_m_blocks, int causal, float scale_log2) {
    using L = Layout<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    float* s_m = reinterpret_cast<float*>(smem + L::STATS);      // running max (log2 units)
    float* s_l = s_m + BLOCK_M;                                   // running sum of exp2
    float* s_alpha = s_l + BLOCK_M;                               // rescale factor of this tile
    __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem + L::Q);
    __nv_bfloat16* sK = reinterpret_cast<__nv_bfloat16*>(smem + L::K);
    __nv_bfloat16* sV = reinterpret_cast<__nv_bfloat16*>(smem + L::V);
    float* sS = reinterpret_cast<float*>(smem + L::S);
    __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + L::P);
    float* sO = reinterpret_cast<float*>(smem + L::O);

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    // Heaviest query blocks first (they see the most keys when causal).
    const int m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x % num_m_blocks);
    const size_t bh = blockIdx.x / num_m_blocks;
    const int m0 = m_block * BLOCK_M;
    const size_t base = bh * (size_t)seqlen * D;  // 64-bit: batch*heads*seqlen*D may pass 2^31
    const __nv_bfloat16* q_bh = q + base;
    const __nv_bfloat16* k_bh = k + base;
    const __nv_bfloat16* v_bh = v + base;

    // Keys this block needs: all of them, or (causal) those <= its last query row.
    const int kv_end = causal ? min(seqlen, m0 + BLOCK_M) : seqlen;
    const int n_tiles = (kv_end + BLOCK_N - 1) / BLOCK_N;

    // Prologue: Q and the first K/V tile in one cp.async group.
    load_tile<D>(sQ, q_bh, m0, BLOCK_M, seqlen);
    load_tile<D>(sK, k_bh, 0, BLOCK_N, seqlen);
    load_tile<D>(sV, v_bh, 0, BLOCK_N, seqlen);
    cp_async_commit();

    for (int r = threadIdx.x; r < BLOCK_M; r += NUM_THREADS) {
        s_m[r] = -INFINITY;
        s_l[r] = 0.f;
    }

    // Which row of its 16x16 tile each accumulator element holds. WMMA leaves the element layout
    // unspecified, but it is the same for a loaded accumulator and one mma_sync produced, so loading
    // a matrix whose entry (r, c) is r tells each thread the row of each of its elements. That lets
    // us scale O's rows by the softmax rescale factor without leaving registers.
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
        // -- wait for tile j (and, with two stages, start fetching tile j + 1) ---------------------
        if constexpr (STAGES == 2) {
            if (j + 1 < n_tiles) {
                const int next = (j + 1) & 1;
                load_tile<D>(sK + next * BLOCK_N * L::LDQ, k_bh, n0 + BLOCK_N, BLOCK_N, seqlen);
                load_tile<D>(sV + next * BLOCK_N * L::LDQ, v_bh, n0 + BLOCK_N, BLOCK_N, seqlen);
            }
            cp_async_commit();  // possibly empty: keeps the group count uniform
            cp_async_wait<1>();
        } else {
            if (j > 0) {
                load_tile<D>(sK, k_bh, n0, BLOCK_N, seqlen);
                load_tile<D>(sV, v_bh, n0, BLOCK_N, seqlen);
                cp_async_commit();
            }
            cp_async_wait<0>();
        }
        __syncthreads();
        const __nv_bfloat16* sKt = sK + stage * BLOCK_N * L::LDQ;
        const __nv_bfloat16* sVt = sV + stage * BLOCK_N * L::LDQ;

        // -- S = Q K^T (raw dot products, fp32) ---------------------------------------------------
        constexpr int S_TILES_N = BLOCK_N / 16;
        for (int t = warp; t < (BLOCK_M / 16) * S_TILES_N; t += NUM_WARPS) {
            const int mi = t / S_TILES_N, ni = t % S_TILES_N;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;  // K^T
                wmma::load_matrix_sync(a, sQ + mi * 16 * L::LDQ + kk * 16, L::LDQ);
                wmma::load_matrix_sync(b, sKt + ni * 16 * L::LDQ + kk * 16, L::LDQ);
                wmma::mma_sync(acc, a, b, acc);
            }
            wmma::store_matrix_sync(sS + mi * 16 * L::LDS + ni * 16, acc, L::LDS, wmma::mem_row_major);
        }
        __syncthreads();

        // -- online softmax: one warp per row, lanes across the BLOCK_N columns ---------------------
        for (int r = warp; r < BLOCK_M; r += NUM_WARPS) {
            const int qi = m0 + r;
            float x[BLOCK_N / 32];
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < BLOCK_N / 32; ++i) {
                const int c = lane + 32 * i;
                const int kj = n0 + c;
                const bool masked = kj >= seqlen || (causal && kj > qi);
                x[i] = masked ? -INFINITY : sS[r * L::LDS + c] * scale_log2;
                mx = fmaxf(mx, x[i]);
            }
            mx = warp_max(mx);
            const float m_old = s_m[r];
            const float m_new = fmaxf(m_old, mx);
            // a row with no visible key so far keeps m = -inf; subtract 0 then, never (-inf) - (-inf)
            const float m_use = (m_new == -INFINITY) ? 0.f : m_new;
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < BLOCK_N / 32; ++i) {
                const float p = exp2f(x[i] - m_use);
                sP[r * L::LDP + lane + 32 * i] = __float2bfloat16_rn(p);
                sum += p;
            }
            sum = warp_sum(sum);
            const float alpha = exp2f(m_old - m_use);  // 0 on the first visible tile (m_old = -inf)
            const float l_new = s_l[r] * alpha + sum;
            __syncwarp();  // every lane has read s_m[r] / s_l[r] before lane 0 overwrites them
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
                wmma::load_matrix_sync(b, sVt + kk * 16 * L::LDQ + di * 16, L::LDQ);
                wmma::mma_sync(acc_o[i], a, b, acc_o[i]);
            }
        }
        __syncthreads();  // S, P and this K/V stage are rewritten by the next tile
    }

    // -- epilogue: stage O in shared memory, then one warp per row writes O / l and lse -------------
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
        if (qi >= seqlen) continue;  // padding rows of the last query block
        const float l = s_l[r];
        const float inv_l = l > 0.f ? 1.f / l : 0.f;  // l = 0 only for a row that sees no key
        __nv_bfloat16* o_row = o + base + (size_t)qi * D;
        for (int c = 2 * lane; c < D; c += 64) {
            const float2 acc = *reinterpret_cast<const float2*>(sO + r * L::LDO + c);
            *reinterpret_cast<__nv_bfloat162*>(o_row + c) = __floats2bfloat162_rn(acc.x * inv_l, acc.y * inv_l);
        }
        if (lane == 0) lse[bh * (size_t)seqlen + qi] = l > 0.f ? (s_m[r] + log2f(l)) * LN2 : -INFINITY;
    }
}

template <int D>
int launch(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* o, float* lse,
           int batch, int heads, int seqlen, int causal, float scale, cudaStream_t stream) {
    using L = Layout<D>;
    constexpr size_t smem = L::BYTES;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    int smem_max = 0;
    err = cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err != cudaSuccess) return err;
    if (smem > static_cast<size_t>(smem_max)) return cudaErrorInvalidConfiguration;  // knobs too big: no launch
    auto kernel = flash_attn_fwd_kernel<D>;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;

    const long long num_m_blocks = (seqlen + BLOCK_M - 1) / BLOCK_M;
    const long long blocks = num_m_blocks * batch * heads;
    if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
    kernel<<<static_cast<unsigned>(blocks), NUM_THREADS, smem, stream>>>(q, k, v, o, lse, seqlen,
                                                                        static_cast<int>(num_m_blocks), causal,
                                                                        scale * LOG2E);
    return cudaGetLastError();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

// q, k, v, o: [batch, heads, seqlen, head_dim] bf16, contiguous; lse: [batch, heads, seqlen] fp32.
// Returns a cudaError_t as int: 0 on a successful launch; non-zero, with nothing launched, for an
// unsupported head_dim, bad sizes, misaligned pointers or knobs whose shared memory does not fit.
extern "C" int kloop_flash_attn_fwd(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                                    __nv_bfloat16* o, float* lse, int batch, int heads, int seqlen, int head_dim,
                                    int causal, float scale, cudaStream_t stream) {
    if (batch < 0 || heads < 0 || seqlen < 0) return cudaErrorInvalidValue;
    if (batch == 0 || heads == 0 || seqlen == 0) return cudaSuccess;  // nothing to compute
    if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(o) || (reinterpret_cast<uintptr_t>(lse) & 3u) != 0)
        return cudaErrorInvalidValue;
    causal = causal ? 1 : 0;
    switch (head_dim) {
        case 64: return launch<64>(q, k, v, o, lse, batch, heads, seqlen, causal, scale, stream);
        case 128: return launch<128>(q, k, v, o, lse, batch, heads, seqlen, causal, scale, stream);
        default: return cudaErrorInvalidValue;
    }
}
