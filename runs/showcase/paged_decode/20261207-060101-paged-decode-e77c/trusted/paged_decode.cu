// paged_decode: one new query token per sequence attending to a paged KV cache (bf16, GQA).
//
// Layout (all row-major, contiguous):
//   q            [batch, q_heads, head_dim]                   bf16
//   k_cache      [num_pages, page_size, kv_heads, head_dim]   bf16  (vLLM-like page pool)
//   v_cache      [num_pages, page_size, kv_heads, head_dim]   bf16
//   block_table  [batch, max_pages_per_seq]                   int32 (page of token t: block_table[b][t / page_size])
//   context_lens [batch]                                      int32 (tokens 0 .. len-1 are attended; len may be 0)
//   out          [batch, q_heads, head_dim]                   bf16
// Query head h reads KV head h / (q_heads / kv_heads).
//   out[b,h,:] = softmax_t(scale * q[b,h,:] . k[b,t,kvh,:]) @ v[b,t,kvh,:]   (zeros when len == 0)
//
// The baseline is deliberately plain (see README.md "Ideas"):
//   * grid (kv_heads * ceil(group / QHEADS_PER_BLOCK), batch, partitions); a block serves up to
//     QHEADS_PER_BLOCK query heads of one KV head, so each K/V row it loads is reused that many times;
//   * inside a block, a "token group" of TPT = min(32, head_dim / VEC) lanes owns one token at a time:
//     each lane loads VEC contiguous bf16 of the K row (and of the V row), the partial dot products
//     are summed with warp shuffles, and every lane keeps an online softmax (running max, running
//     sum, rescaled accumulator) for its slice of head_dim;
//   * the token groups of the block are merged through shared memory at the end;
//   * PARTITION_SIZE > 0 splits each sequence into partitions of that many tokens (split-KV); each
//     (sequence, head, partition) leaves an unnormalised partial result in a scratch buffer that the
//     library allocates once and grows, and a second kernel merges the partitions.
// Supported: head_dim 64, 128 or 256; q_heads a multiple of kv_heads; 16-byte aligned pointers.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <mutex>
#include <stddef.h>
#include <stdint.h>

// ---- knobs (passed as -D by the build; the values allowed are in task.toml) --------------------
#ifndef THREADS
#define THREADS 128  // threads per block of the attention kernel
#endif
#ifndef QHEADS_PER_BLOCK
#define QHEADS_PER_BLOCK 1  // query heads of one GQA group served by one block
#endif
#ifndef VEC
#define VEC 2  // bf16 elements per K/V load of one lane (2: 4-byte, 4: 8-byte, 8: 16-byte loads)
#endif
#ifndef PARTITION_SIZE
#define PARTITION_SIZE 0  // tokens per split-KV partition; 0: one block walks the whole sequence
#endif

static_assert(THREADS % 32 == 0 && THREADS >= 32 && THREADS <= 1024, "THREADS must be a multiple of 32 in [32, 1024]");
static_assert(QHEADS_PER_BLOCK >= 1 && QHEADS_PER_BLOCK <= 16, "QHEADS_PER_BLOCK must be in [1, 16]");
static_assert(VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 2, 4 or 8");
static_assert(PARTITION_SIZE >= 0, "PARTITION_SIZE must be >= 0");

namespace {

constexpr int REDUCE_THREADS = 128;
constexpr int LOAD_VEC = 8;    // bf16 per K/V load of one lane: always 16-byte loads (VEC is not used)
#ifndef KTILE
#define KTILE 8
#endif
#ifndef LANES
#define LANES 8
#endif
constexpr int TILE = KTILE;        // tokens a token group loads before it computes: 16 loads in flight per lane
constexpr float LOG2E = 1.4426950408889634f;

// Work split of one head row of D elements over the lanes of a token group (16-byte pieces).
template <int D>
struct RowSplit {
    static constexpr int VECS = D / LOAD_VEC;              // 16-byte pieces in a row
    static constexpr int WANT = D > 128 ? 2 * LANES : LANES;  // long rows: more lanes, fewer registers
    static constexpr int TPT = VECS < WANT ? VECS : (WANT < 32 ? WANT : 32);      // lanes per token (a power of two)
    static constexpr int PIECES = VECS / TPT;              // pieces per lane
    static constexpr int DPL = PIECES * LOAD_VEC;          // elements of the row held by one lane
    static constexpr int TOKENS_PER_WARP = 32 / TPT;
    static constexpr int GROUPS = (THREADS / 32) * TOKENS_PER_WARP;  // token groups per block
    static_assert(D % LOAD_VEC == 0 && VECS % TPT == 0 && 32 % TPT == 0, "unsupported head_dim");
    // element index of the first of the 8 values of piece p held by lane tl
    __device__ static __forceinline__ int dim(int tl, int p) { return (p * TPT + tl) * LOAD_VEC; }
};

__device__ __forceinline__ void unpack8(const uint4& raw, float* dst) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        dst[2 * i] = f.x;
        dst[2 * i + 1] = f.y;
    }
}

// Attention over tokens [t_begin, t_end) of one sequence for up to QHEADS_PER_BLOCK query heads of one
// KV head. Each token group (TPT lanes) takes TILE consecutive tokens per step: it issues all their K
// and V loads first (memory-level parallelism), then scores them and does one online-softmax rescale
// per tile (exp2 with log2(e) folded into q). Without split-KV it writes `out`; with it, the
// unnormalised partial sums go to part_acc [batch, q_heads, max_parts, D] and (max, sum) pairs (max in
// the natural-log domain) to part_ml [batch, q_heads, max_parts, 2].
template <int D, bool SPLIT>
__global__ void __launch_bounds__(THREADS) paged_decode_kernel(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table,
    const int* __restrict__ context_lens, __nv_bfloat16* __restrict__ out, float* __restrict__ part_acc,
    float* __restrict__ part_ml, int q_heads, int kv_heads, int page_size, int max_pages_per_seq,
    int max_parts, int part_size, float scale) {
    using S = RowSplit<D>;
    constexpr int QH = QHEADS_PER_BLOCK;

    const int group = q_heads / kv_heads;
    const int chunks = (group + QH - 1) / QH;
    const int kvh = blockIdx.x / chunks;
    const int h0 = kvh * group + (blockIdx.x % chunks) * QH;  // first query head of this block
    const int nh = min(QH, (kvh + 1) * group - h0);           // query heads this block serves
    const int b = blockIdx.y;
    const int len = context_lens[b];

    int t_begin = 0, t_end = len;
    if (SPLIT) {
        t_begin = blockIdx.z * part_size;
        if (t_begin >= len) return;  // the merge kernel reads only partitions that hold tokens
        t_end = min(len, t_begin + part_size);
    }

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int slot = lane / S::TPT;  // token group within the warp
    const int tl = lane % S::TPT;    // lane within the token group
    const int grp = warp * S::TOKENS_PER_WARP + slot;

    // this lane's slice of q (scaled by scale * log2 e: scores are in the log2 domain), and its
    // online-softmax state per query head
    float qr[QH][S::DPL];
    float acc[QH][S::DPL];
    float m[QH], l[QH];
#pragma unroll
    for (int h = 0; h < QH; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.f;
        const int hh = h < nh ? h0 + h : h0;  // unused heads repeat the first one (never written)
        const __nv_bfloat16* qp = q + ((size_t)b * q_heads + hh) * D;
#pragma unroll
        for (int p = 0; p < S::PIECES; ++p) {
            unpack8(*reinterpret_cast<const uint4*>(qp + S::dim(tl, p)), &qr[h][p * LOAD_VEC]);
        }
#pragma unroll
        for (int i = 0; i < S::DPL; ++i) {
            qr[h][i] *= scale * LOG2E;
            acc[h][i] = 0.f;
        }
    }

    const int* table = block_table + (size_t)b * max_pages_per_seq;
    const size_t row_stride = (size_t)kv_heads * D;  // elements between consecutive tokens of a page
    const __nv_bfloat16* k_head = k_cache + (size_t)kvh * D;
    const __nv_bfloat16* v_head = v_cache + (size_t)kvh * D;

    // Every group of the block steps together (the loop bound is block-uniform), so whole warps
    // take part in the shuffles; tokens past t_end are masked.
    for (int base = t_begin; base < t_end; base += S::GROUPS * TILE) {
        const int t0 = base + grp * TILE;
        uint4 kr[TILE][S::PIECES], vr[TILE][S::PIECES];
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
            const int t = min(t0 + j, t_end - 1);  // masked tokens re-read a valid row (no fault, no use)
            const size_t row = ((size_t)table[t / page_size] * page_size + t % page_size) * row_stride;
#pragma unroll
            for (int p = 0; p < S::PIECES; ++p) {
                kr[j][p] = __ldg(reinterpret_cast<const uint4*>(k_head + row + S::dim(tl, p)));
                vr[j][p] = __ldg(reinterpret_cast<const uint4*>(v_head + row + S::dim(tl, p)));
            }
        }
        float s[QH][TILE];
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
            float kf[S::DPL];
#pragma unroll
            for (int p = 0; p < S::PIECES; ++p) unpack8(kr[j][p], &kf[p * LOAD_VEC]);
#pragma unroll
            for (int h = 0; h < QH; ++h) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < S::DPL; ++i) d = fmaf(qr[h][i], kf[i], d);
                s[h][j] = d;
            }
        }
#pragma unroll
        for (int off = S::TPT / 2; off > 0; off /= 2) {
#pragma unroll
            for (int h = 0; h < QH; ++h) {
#pragma unroll
                for (int j = 0; j < TILE; ++j) s[h][j] += __shfl_xor_sync(0xffffffffu, s[h][j], off);
            }
        }
#pragma unroll
        for (int h = 0; h < QH; ++h) {
            float mt = -INFINITY;
#pragma unroll
            for (int j = 0; j < TILE; ++j) {
                if (t0 + j >= t_end) s[h][j] = -INFINITY;
                mt = fmaxf(mt, s[h][j]);
            }
            const float m_new = fmaxf(m[h], mt);
            if (m_new == -INFINITY) continue;  // no valid token in this tile for this group
            const float alpha = exp2f(m[h] - m_new);  // 0 on the first tile (m = -inf)
            l[h] *= alpha;
#pragma unroll
            for (int i = 0; i < S::DPL; ++i) acc[h][i] *= alpha;
            m[h] = m_new;
#pragma unroll
            for (int j = 0; j < TILE; ++j) s[h][j] = exp2f(s[h][j] - m_new);  // 0 for masked tokens
        }
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
            float vf[S::DPL];
#pragma unroll
            for (int p = 0; p < S::PIECES; ++p) unpack8(vr[j][p], &vf[p * LOAD_VEC]);
#pragma unroll
            for (int h = 0; h < QH; ++h) {
                if (m[h] == -INFINITY) continue;
                const float p = s[h][j];
                l[h] += p;
#pragma unroll
                for (int i = 0; i < S::DPL; ++i) acc[h][i] = fmaf(p, vf[i], acc[h][i]);
            }
        }
    }

    // Merge the token groups of the block, one query head at a time (m in the log2 domain here).
    __shared__ float red_m[S::GROUPS];
    __shared__ float red_l[S::GROUPS];
    __shared__ float red_acc[S::GROUPS][D];
#pragma unroll
    for (int h = 0; h < QH; ++h) {
        if (h >= nh) break;  // nh is the same for the whole block
        if (tl == 0) red_m[grp] = m[h];
        __syncthreads();
        float mx = -INFINITY;
        for (int g = 0; g < S::GROUPS; ++g) mx = fmaxf(mx, red_m[g]);
        const float f = (m[h] == -INFINITY) ? 0.f : exp2f(m[h] - mx);
        if (tl == 0) red_l[grp] = l[h] * f;
#pragma unroll
        for (int p = 0; p < S::PIECES; ++p) {
#pragma unroll
            for (int i = 0; i < LOAD_VEC; ++i) red_acc[grp][S::dim(tl, p) + i] = acc[h][p * LOAD_VEC + i] * f;
        }
        __syncthreads();
        float sum_l = 0.f;
        for (int g = 0; g < S::GROUPS; ++g) sum_l += red_l[g];
        const int hq = h0 + h;
        for (int d = threadIdx.x; d < D; d += THREADS) {
            float a = 0.f;
            for (int g = 0; g < S::GROUPS; ++g) a += red_acc[g][d];
            if (SPLIT) {
                part_acc[(((size_t)b * q_heads + hq) * max_parts + blockIdx.z) * D + d] = a;
            } else {
                out[((size_t)b * q_heads + hq) * D + d] = __float2bfloat16(sum_l > 0.f ? a / sum_l : 0.f);
            }
        }
        if (SPLIT && threadIdx.x == 0) {
            float* ml = part_ml + (((size_t)b * q_heads + hq) * max_parts + blockIdx.z) * 2;
            ml[0] = mx / LOG2E;  // natural-log domain for the merge kernel
            ml[1] = sum_l;
        }
        __syncthreads();  // red_* are reused by the next head
    }
}

// Split-KV merge: out[b,h,:] = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p over the partitions
// p that hold tokens. Grid (q_heads, batch).
template <int D>
__global__ void __launch_bounds__(REDUCE_THREADS) paged_decode_merge(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, const int* __restrict__ context_lens,
    __nv_bfloat16* __restrict__ out, int q_heads, int max_parts, int part_size) {
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int len = context_lens[b];
    const int nparts = min(max_parts, (len + part_size - 1) / part_size);
    const size_t first = ((size_t)b * q_heads + h) * max_parts;
    const float* ml = part_ml + first * 2;
    const float* acc = part_acc + first * D;

    float mx = -INFINITY;
    for (int p = 0; p < nparts; ++p) mx = fmaxf(mx, ml[2 * p]);
    float sum_l = 0.f;
    for (int p = 0; p < nparts; ++p) sum_l += ml[2 * p + 1] * expf(ml[2 * p] - mx);
    for (int d = threadIdx.x; d < D; d += REDUCE_THREADS) {
        float a = 0.f;
        for (int p = 0; p < nparts; ++p) a += acc[(size_t)p * D + d] * expf(ml[2 * p] - mx);
        out[((size_t)b * q_heads + h) * D + d] = __float2bfloat16(sum_l > 0.f ? a / sum_l : 0.f);
    }
}

// ---- split-KV scratch: allocated once per device, grown when a call needs more ----------------
constexpr int MAX_DEVICES = 64;
std::mutex scratch_lock;
float* scratch_ptr[MAX_DEVICES] = {};
size_t scratch_bytes[MAX_DEVICES] = {};
int sm_count[MAX_DEVICES] = {};

cudaError_t get_scratch(int dev, size_t bytes, float** out_ptr) {
    std::lock_guard<std::mutex> guard(scratch_lock);
    if (scratch_bytes[dev] < bytes) {
        if (scratch_ptr[dev]) cudaFree(scratch_ptr[dev]);
        scratch_ptr[dev] = nullptr;
        scratch_bytes[dev] = 0;
        size_t grown = bytes + bytes / 4;
        cudaError_t err = cudaMalloc(&scratch_ptr[dev], grown);
        if (err != cudaSuccess) {
            scratch_ptr[dev] = nullptr;
            return err;
        }
        scratch_bytes[dev] = grown;
    }
    *out_ptr = scratch_ptr[dev];
    return cudaSuccess;
}

// Tokens per split-KV partition: none when the (sequence, head group) blocks already fill the GPU
// twice over, else enough partitions for about three blocks per SM (a multiple of 64, >= 256).
// PARTITION_SIZE > 0 forces that size.
int choose_partition(int blocks, int max_len, int sms) {
    if (PARTITION_SIZE > 0) return PARTITION_SIZE;
    if (blocks >= 2 * sms || max_len <= 256) return 0;
    const int want_parts = (3 * sms + blocks - 1) / blocks;
    int size = (max_len + want_parts - 1) / want_parts;
    size = ((size + 63) / 64) * 64;
    return size < 256 ? 256 : size;
}

template <int D>
cudaError_t launch(const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                   const int* block_table, const int* context_lens, __nv_bfloat16* out, int batch, int q_heads,
                   int kv_heads, int page_size, int max_pages_per_seq, float scale, cudaStream_t stream) {
    const int group = q_heads / kv_heads;
    const int chunks = (group + QHEADS_PER_BLOCK - 1) / QHEADS_PER_BLOCK;
    const long long grid_x = (long long)kv_heads * chunks;
    if (grid_x > 0x7fffffffLL || batch > 65535) return cudaErrorInvalidValue;

    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    if (dev < 0 || dev >= MAX_DEVICES) return cudaErrorInvalidDevice;
    if (sm_count[dev] == 0) {  // once per device
        err = cudaDeviceGetAttribute(&sm_count[dev], cudaDevAttrMultiProcessorCount, dev);
        if (err != cudaSuccess) return err;
    }
    const long long max_len = (long long)max_pages_per_seq * page_size;
    const int part = choose_partition((int)min(grid_x * batch, 0x7fffffffLL), (int)min(max_len, 0x7fffffffLL), sm_count[dev]);
    if (part == 0) {
        const dim3 grid((unsigned)grid_x, batch, 1);
        paged_decode_kernel<D, false><<<grid, THREADS, 0, stream>>>(
            q, k_cache, v_cache, block_table, context_lens, out, nullptr, nullptr, q_heads, kv_heads, page_size,
            max_pages_per_seq, 1, 0, scale);
        return cudaGetLastError();
    }
    const long long parts = (max_len + part - 1) / part;
    if (parts > 65535) return cudaErrorInvalidValue;
    const int max_parts = (int)parts;
    const size_t n = (size_t)batch * q_heads * max_parts;
    float* scratch = nullptr;
    err = get_scratch(dev, n * (D + 2) * sizeof(float), &scratch);
    if (err != cudaSuccess) return err;
    float* part_acc = scratch;
    float* part_ml = scratch + n * D;
    const dim3 grid((unsigned)grid_x, batch, max_parts);
    paged_decode_kernel<D, true><<<grid, THREADS, 0, stream>>>(
        q, k_cache, v_cache, block_table, context_lens, out, part_acc, part_ml, q_heads, kv_heads, page_size,
        max_pages_per_seq, max_parts, part, scale);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    paged_decode_merge<D><<<dim3(q_heads, batch), REDUCE_THREADS, 0, stream>>>(part_acc, part_ml, context_lens, out,
                                                                              q_heads, max_parts, part);
    return cudaGetLastError();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" int kloop_paged_decode(const __nv_bfloat16* q, const __nv_bfloat16* k_cache,
                                  const __nv_bfloat16* v_cache, const int* block_table, const int* context_lens,
                                  __nv_bfloat16* out, int batch, int q_heads, int kv_heads, int head_dim,
                                  int page_size, int max_pages_per_seq, float scale, cudaStream_t stream) {
    // Unsupported configurations return an error without launching anything.
    if (batch < 0 || q_heads <= 0 || kv_heads <= 0 || q_heads % kv_heads != 0 || page_size <= 0 ||
        max_pages_per_seq <= 0)
        return (int)cudaErrorInvalidValue;
    if (batch == 0) return (int)cudaSuccess;
    if (!q || !k_cache || !v_cache || !block_table || !context_lens || !out) return (int)cudaErrorInvalidValue;
    if (!aligned16(q) || !aligned16(k_cache) || !aligned16(v_cache) || !aligned16(out))
        return (int)cudaErrorMisalignedAddress;
    cudaError_t err;
    switch (head_dim) {
        case 64:
            err = launch<64>(q, k_cache, v_cache, block_table, context_lens, out, batch, q_heads, kv_heads, page_size,
                             max_pages_per_seq, scale, stream);
            break;
        case 128:
            err = launch<128>(q, k_cache, v_cache, block_table, context_lens, out, batch, q_heads, kv_heads,
                              page_size, max_pages_per_seq, scale, stream);
            break;
        case 256:
            err = launch<256>(q, k_cache, v_cache, block_table, context_lens, out, batch, q_heads, kv_heads,
                              page_size, max_pages_per_seq, scale, stream);
            break;
        default:
            return (int)cudaErrorInvalidValue;
    }
    return (int)err;
}
