// paged_decode v5: tensor-core decode attention over a paged KV cache (bf16, GQA), sm_90a.
//
// Layout (all row-major, contiguous), ABI identical to v4.cu / the shipped kernel:
//   q            [batch, q_heads, head_dim]                   bf16
//   k_cache      [num_pages, page_size, kv_heads, head_dim]   bf16  (vLLM-like page pool)
//   v_cache      [num_pages, page_size, kv_heads, head_dim]   bf16
//   block_table  [batch, max_pages_per_seq]                   int32 (page of token t: block_table[b][t / page_size])
//   context_lens [batch]                                      int32 (tokens 0 .. len-1 are attended; len may be 0)
//   out          [batch, q_heads, head_dim]                   bf16
//   out[b,h,:] = softmax_t(scale * q[b,h,:] . k[b,t,h/group,:]) @ v[b,t,h/group,:]   (zeros when len == 0)
//
// What v4 spent its issue slots on (a shuffle tree per score, an exp per lane group, fp32 FMAs per
// element and query head) moves to the tensor cores here:
//   * grid (kv_heads * ceil(group / 8), batch, partitions); a block serves up to 8 query heads of one
//     KV head (the whole group for group <= 8) over one token range (the whole sequence, or one
//     split-KV partition chosen at run time);
//   * a warp owns every WARPS-th 16-token chunk of the range and runs its own cp.async pipeline
//     (STAGES chunks of K and V in a private shared-memory ring, 16-byte copies, zero-fill past the
//     range end, block-table entries fetched one chunk ahead); no block barrier until the end;
//   * S = Q K^T with mma.sync m16n8k16 bf16 -> fp32: A = the group's query heads (rows 0..7; rows
//     8..15 are zero), B = K straight from shared memory with ldmatrix (XOR-swizzled 16-byte
//     columns: conflict-free); the scale (and log2 e) is applied to the fp32 scores, never to bf16 q;
//   * online softmax in fp32 registers, one max/rescale per chunk: per head row the 16 scores sit in
//     the 4 lanes of a quad (2 shuffles for the max; the row sum stays per lane until the end);
//   * O^T += V^T P^T with mma.sync (dims as M = 16 rows, the 8 heads as N: no padding waste): V^T is
//     the A operand through ldmatrix.trans, P^T the B operand, which is exactly the C fragment of S
//     re-packed (no data movement); P goes in as bf16 hi + lo (two MMAs, ~fp32-accurate weights);
//     the per-head rescale needs the alphas of heads 2tig, 2tig+1 (two shuffles per chunk);
//   * the warps of the block are merged through shared memory (the pipeline buffers, reused);
//     with split-KV each partition leaves (unnormalised O, max, sum) in a cached scratch buffer and a
//     second kernel merges the partitions (8 warps per (sequence, head), online merge).
// Shared memory is static and at most 48 KB a block (no attribute call): the warps per block are
// capped by that (head_dim 128, 3 stages: 2 warps, 4 blocks / 8 warps / ~130 KB in flight per SM).
// Supported: head_dim 64, 128 or 256; q_heads a multiple of kv_heads (any group size); 16-byte
// aligned pointers.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <mutex>
#include <stddef.h>
#include <stdint.h>

// ---- knobs of the task (accepted for build compatibility; the v5 design does not use them) ------
#ifndef THREADS
#define THREADS 128
#endif
#ifndef QHEADS_PER_BLOCK
#define QHEADS_PER_BLOCK 4
#endif
#ifndef VEC
#define VEC 8
#endif
#ifndef PARTITION_SIZE
#define PARTITION_SIZE 0  // > 0 forces split-KV partitions of that many tokens (rounded up to 16)
#endif

// ---- v5's own build-time constants (exploration: -D in devbench5.py) ----------------------------
#ifndef V5_STAGES
#define V5_STAGES 3  // chunks in a warp's cp.async ring (capped per head_dim by the 48 KB budget)
#endif
#ifndef V5_WARPS
#define V5_WARPS 2  // warps per block at most (capped per head_dim by the 48 KB budget)
#endif
#ifndef V5_SPLIT_WAVES
#define V5_SPLIT_WAVES 4  // when splitting: aim for about this many waves of resident blocks
#endif
#ifndef V5_NOSPLIT_WAVES_X10
#define V5_NOSPLIT_WAVES_X10 15  // no split when the unsplit blocks fill this many waves (x10)
#endif
#ifndef V5_MIN_PART
#define V5_MIN_PART 256  // fewest tokens per split-KV partition
#endif

static_assert(V5_STAGES >= 2, "V5_STAGES must be >= 2");
static_assert(V5_WARPS >= 1 && V5_WARPS <= 16, "V5_WARPS must be in [1, 16]");
static_assert(PARTITION_SIZE >= 0, "PARTITION_SIZE must be >= 0");

namespace {

constexpr int CHUNK = 16;        // tokens per pipeline stage of one warp (= the k extent of the P V mma)
constexpr int ROWS = 8;          // query heads per block (A rows 0..7 of the m16 MMA)
constexpr int SMEM_LIMIT = 48 * 1024;
constexpr int SM_SMEM = 228 * 1024;  // shared memory per SM on Hopper (1 KB of it reserved per block)
constexpr int MERGE_WARPS = 8;
constexpr float LOG2E = 1.4426950408889634f;

template <int D>
struct Cfg {
    static constexpr int TILE_BYTES = CHUNK * D * 2;      // one K (or V) tile: 16 rows of D bf16
    static constexpr int STAGE_BYTES = 2 * TILE_BYTES;    // K then V
    static constexpr int MAX_STAGES = SMEM_LIMIT / STAGE_BYTES;
    static constexpr int STAGES = V5_STAGES < MAX_STAGES ? V5_STAGES : MAX_STAGES;
    static constexpr int WARP_BYTES = STAGES * STAGE_BYTES;
    static constexpr int W0 = SMEM_LIMIT / WARP_BYTES;
    static constexpr int WARPS = W0 < V5_WARPS ? W0 : V5_WARPS;
    static constexpr int NTHREADS = WARPS * 32;
    static constexpr int SMEM = WARPS * WARP_BYTES;
    static constexpr int CPR = D / 8;                     // 16-byte pieces per row
    static constexpr int PIECES = CHUNK * CPR / 32;       // pieces of one tile per lane
    static constexpr int KS = D / 16;                     // k-steps of Q K^T
    static constexpr int MT = D / 16;                     // m-tiles of O^T = V^T P^T
    static constexpr int OSTRIDE = D + 4;                 // floats per head row of the merge buffer
    static constexpr int MERGE_BYTES = (WARPS * ROWS * OSTRIDE + 2 * WARPS * ROWS) * 4;
    static constexpr int BPS0 = SM_SMEM / (SMEM + 1024);
    static constexpr int BLOCKS_PER_SM = BPS0 < 1 ? 1 : (BPS0 * WARPS > 64 ? 64 / WARPS : BPS0);
    static_assert(STAGES >= 2, "a head_dim whose two-stage ring exceeds 48 KB");
    static_assert(WARPS >= 1, "no warp fits");
    static_assert(SMEM <= SMEM_LIMIT, "static shared memory over 48 KB");
    static_assert(MERGE_BYTES <= SMEM, "merge buffers must fit in the pipeline buffers");
    static_assert(CPR >= 8 && (CPR & (CPR - 1)) == 0, "head_dim must be 64, 128 or 256");
};

// ---- PTX helpers ----------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// d += A B with A rows 8..15 zero: a0 = (row g, k 2t..2t+1), a2 = (row g, k 2t+8..2t+9) (the
// a1 / a3 registers of rows g+8 are zero), b0 = (k 2t..2t+1, col g), b1 = (k 2t+8..2t+9, col g).
__device__ __forceinline__ void mma_top(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// d += A B, all four A registers given (a0: row g, k 2t; a1: row g+8, k 2t; a2: row g, k 2t+8;
// a3: row g+8, k 2t+8), b0 = (k 2t..2t+1, col g), b1 = (k 2t+8..2t+9, col g).
__device__ __forceinline__ void mma_full(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
    return *reinterpret_cast<const uint32_t*>(&v);
}

// (lo, hi) -> bf16 pairs hi = rn(x), lo = rn(x - hi): x = hi + lo to about 2^-17 relative
__device__ __forceinline__ void split_bf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    const float2 hf = __bfloat1622float2(h);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    lo = pack_bf16(x0 - hf.x, x1 - hf.y);
}

// ---- the attention kernel -------------------------------------------------------------------------
// Without split-KV it writes `out`; with it, partition z of (b, h) leaves its unnormalised O in
// part_o [batch, q_heads, max_parts, D] and (max in the log2 domain, sum) in part_ml [.., 2].
template <int D, bool SPLIT>
__global__ void __launch_bounds__(Cfg<D>::NTHREADS) paged_decode_v5(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const int* __restrict__ block_table,
    const int* __restrict__ context_lens, __nv_bfloat16* __restrict__ out, float* __restrict__ part_o,
    float* __restrict__ part_ml, int q_heads, int kv_heads, int page_size, int max_pages_per_seq, int max_parts,
    int part_size, int head_chunks, float sl2) {
    using C = Cfg<D>;
    constexpr int W = C::WARPS;
    constexpr int S = C::STAGES;
    __shared__ __align__(128) unsigned char smem[C::SMEM];

    const int group = q_heads / kv_heads;
    const int kvh = blockIdx.x / head_chunks;
    const int hc = blockIdx.x - kvh * head_chunks;
    const int h0 = kvh * group + hc * ROWS;         // first query head of this block
    const int nh = min(ROWS, group - hc * ROWS);    // query heads it serves (1..8)
    const int b = blockIdx.y;
    const int len = context_lens[b];

    int t_begin = 0, t_end = len;
    if (SPLIT) {
        t_begin = blockIdx.z * part_size;
        if (t_begin >= len) return;  // (block-uniform) the merge reads only partitions holding tokens
        t_end = min(len, t_begin + part_size);
    }

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int gid = lane >> 2;  // MMA row group: query head row gid (and gid + 8, unused)
    const int tig = lane & 3;   // thread in group

    // Q as the A operand (rows >= nh zero): registers qa[ks][0] = (row gid, k 16ks + 2tig, +1),
    // qa[ks][1] = (row gid, k 16ks + 8 + 2tig, +1).
    uint32_t qa[C::KS][2];
    {
        const bool hv = gid < nh;
        const __nv_bfloat16* qp = q + ((size_t)b * q_heads + h0 + (hv ? gid : 0)) * D + 2 * tig;
#pragma unroll
        for (int ks = 0; ks < C::KS; ++ks) {
            qa[ks][0] = hv ? __ldg(reinterpret_cast<const unsigned int*>(qp + 16 * ks)) : 0u;
            qa[ks][1] = hv ? __ldg(reinterpret_cast<const unsigned int*>(qp + 16 * ks + 8)) : 0u;
        }
    }

    const int nchunks = (t_end - t_begin + CHUNK - 1) / CHUNK;
    const int my = nchunks > warp ? (nchunks - warp + W - 1) / W : 0;  // chunks of this warp (warp-uniform)
    const int* table = block_table + (size_t)b * max_pages_per_seq;
    const size_t row_stride = (size_t)kv_heads * D;  // elements between consecutive pool rows (tokens)
    const __nv_bfloat16* k_head = k_cache + (size_t)kvh * D;
    const __nv_bfloat16* v_head = v_cache + (size_t)kvh * D;
    const uint32_t wbase = smem_u32(smem) + warp * C::WARP_BYTES;

    // Block-table look-up for chunk i of this warp: lane l covers token (l & 15) of the chunk. The raw
    // table entry is loaded a chunk ahead of its use (pg); the pool row is formed when issuing.
    auto lookup = [&](int i, int& pg, int& slot, bool& ok) {
        const int t = t_begin + (warp + i * W) * CHUNK + (lane & 15);
        ok = t < t_end;
        const int tc = ok ? t : t_end - 1;  // clamped: a valid address even for zero-filled rows
        pg = __ldg(table + tc / page_size);
        slot = tc - (tc / page_size) * page_size;
    };
    // Copy chunk (pool rows per token from lanes 0..15) into ring slot `stage`: K tile then V tile,
    // row r's 16-byte column c stored at column c ^ (r & 7).
    auto issue = [&](int stage, int pg, int slot, bool ok) {
        const int prow = pg * page_size + slot;
        const int code = ok ? prow : ~prow;  // sign bit = past the range end
        const uint32_t sbase = wbase + stage * C::STAGE_BYTES;
#pragma unroll
        for (int r = 0; r < C::PIECES; ++r) {
            const int p = r * 32 + lane;
            const int row = p / C::CPR;
            const int c = p % C::CPR;
            const int src = __shfl_sync(0xffffffffu, code, row);
            const bool valid = src >= 0;
            const size_t goff = (size_t)(valid ? src : ~src) * row_stride + c * 8;
            const uint32_t dst = sbase + row * (2 * D) + ((c ^ (row & 7)) << 4);
            cp_async16(dst, k_head + goff, valid ? 16 : 0);
            cp_async16(dst + C::TILE_BYTES, v_head + goff, valid ? 16 : 0);
        }
    };

    // O^T accumulators: o[mt] = (dim 16mt + gid, heads 2tig, 2tig + 1), (dim 16mt + gid + 8, same heads)
    float o[C::MT][4];
#pragma unroll
    for (int j = 0; j < C::MT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run = -INFINITY;  // running max of row gid (log2 domain), the same in the 4 lanes of a quad
    float l_run = 0.f;        // this lane's part of the running sum of row gid

    // ldmatrix lane roles: matrix mi = lane / 8, row-in-matrix rr = lane % 8.
    const int mi = lane >> 3;
    const int rr = lane & 7;
    // Both tiles use matrices (tokens 0-7, 16-byte column lo), (0-7, hi), (8-15, lo), (8-15, hi):
    // K non-trans gives the B operand of S = Q K^T for n-tiles 0 (regs 0, 1) and 1 (regs 2, 3);
    // V trans gives the A operand of O^T = V^T P^T (regs: (dims lo, tok 0-7), (hi, 0-7), (lo, 8-15), (hi, 8-15)).
    const uint32_t lane_row = (uint32_t)((((mi >> 1) << 3) + rr) * (2 * D));
    const int lane_col = mi & 1;

    // prologue: S - 1 chunks in flight, the table entry of chunk S - 1 in registers
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < my) {
            int pg, slot;
            bool ok;
            lookup(s, pg, slot, ok);
            issue(s, pg, slot, ok);
        }
        cp_async_commit();
    }
    int pg_n = 0, slot_n = 0;
    bool ok_n = false;
    if (S - 1 < my) lookup(S - 1, pg_n, slot_n, ok_n);

    int stage = 0;  // ring slot of chunk i
    for (int i = 0; i < my; ++i) {
        cp_async_wait<S - 2>();  // this lane's copies of chunk i have landed
        __syncwarp();            // ... and every lane's; slot (i - 1) % S is free again
        {
            const int j = i + S - 1;
            if (j < my) issue(stage == 0 ? S - 1 : stage - 1, pg_n, slot_n, ok_n);
            cp_async_commit();
            if (j + 1 < my) lookup(j + 1, pg_n, slot_n, ok_n);
        }

        const uint32_t kb = wbase + stage * C::STAGE_BYTES;
        const uint32_t vb = kb + C::TILE_BYTES;
        const int t0 = t_begin + (warp + i * W) * CHUNK;

        // S = Q K^T: two n-tiles of 8 tokens, two accumulators each (even / odd k-steps)
        float sa[2][2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) sa[n][e][0] = sa[n][e][1] = sa[n][e][2] = sa[n][e][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < C::KS; ++ks) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4(kb + lane_row + (((2 * ks + lane_col) ^ rr) << 4), b0, b1, b2, b3);
            mma_top(sa[0][ks & 1], qa[ks][0], qa[ks][1], b0, b1);
            mma_top(sa[1][ks & 1], qa[ks][0], qa[ks][1], b2, b3);
        }
        // scores of row gid, tokens t0 + 8n + 2tig + e (log2 domain), masked past the range end
        float s[4];
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float v = (sa[n][0][e] + sa[n][1][e]) * sl2;
                s[2 * n + e] = (t0 + 8 * n + 2 * tig + e < t_end) ? v : -INFINITY;
            }
        float cm = fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3]));
        cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 1));
        cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 2));
        // token t0 is always valid (lane tig 0 holds it): cm and m_new are finite
        const float m_new = fmaxf(m_run, cm);
        const float alpha = exp2f(m_run - m_new);  // 0 on the first chunk (m_run = -inf)
        m_run = m_new;
        float p[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) p[k] = exp2f(s[k] - m_new);  // 0 for masked tokens
        l_run = l_run * alpha + ((p[0] + p[1]) + (p[2] + p[3]));
        // the accumulators of this lane are heads 2tig, 2tig + 1: their alphas live in quads 2tig, 2tig + 1
        const float al0 = __shfl_sync(0xffffffffu, alpha, 8 * tig);
        const float al1 = __shfl_sync(0xffffffffu, alpha, 8 * tig + 4);
#pragma unroll
        for (int j = 0; j < C::MT; ++j) {
            o[j][0] *= al0;
            o[j][1] *= al1;
            o[j][2] *= al0;
            o[j][3] *= al1;
        }
        // P^T as the B operand: (tokens 2tig, +1; head gid) = n-tile 0's C, (8 + 2tig, +1; gid) = n-tile 1's.
        // P goes in as bf16 hi + lo (two MMAs): bf16 P alone errs by 2^-9 of the dominant weights, which
        // with short contexts reaches the 2e-3 atol on outputs near 0; hi + lo is ~2^-17.
        uint32_t pb0, pb1, pl0, pl1;
        split_bf16(p[0], p[1], pb0, pl0);
        split_bf16(p[2], p[3], pb1, pl1);
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
            uint32_t a0, a1, a2, a3;
            ldsm_x4_t(vb + lane_row + (((2 * mt + lane_col) ^ rr) << 4), a0, a1, a2, a3);
            mma_full(o[mt], a0, a1, a2, a3, pb0, pb1);
            mma_full(o[mt], a0, a1, a2, a3, pl0, pl1);
        }
        stage = stage == S - 1 ? 0 : stage + 1;
    }
    cp_async_wait<0>();

    // ---- merge the warps of the block (row gid's sum: over the quad first) ----
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    __syncthreads();  // every warp is done with its ring: reuse it
    constexpr int OS = C::OSTRIDE;
    float* sm_o = reinterpret_cast<float*>(smem);  // [W][ROWS][OS]
    float* sm_m = sm_o + W * ROWS * OS;            // [W][ROWS]
    float* sm_l = sm_m + W * ROWS;                 // [W][ROWS]
    {
        float* my_o = sm_o + (warp * ROWS + 2 * tig) * OS + gid;  // (head 2tig, dim gid)
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt) {
            my_o[16 * mt] = o[mt][0];
            my_o[OS + 16 * mt] = o[mt][1];
            my_o[16 * mt + 8] = o[mt][2];
            my_o[OS + 16 * mt + 8] = o[mt][3];
        }
    }
    if (tig == 0) {
        sm_m[warp * ROWS + gid] = m_run;
        sm_l[warp * ROWS + gid] = l_run;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nh * (D / 2); idx += C::NTHREADS) {
        const int row = idx / (D / 2);
        const int d = (idx - row * (D / 2)) * 2;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < W; ++w) mx = fmaxf(mx, sm_m[w * ROWS + row]);
        float sum_l = 0.f, a0 = 0.f, a1 = 0.f;
        if (mx != -INFINITY) {
#pragma unroll
            for (int w = 0; w < W; ++w) {
                const float f = exp2f(sm_m[w * ROWS + row] - mx);  // 0 for a warp without chunks
                sum_l += f * sm_l[w * ROWS + row];
                const float2 v = *reinterpret_cast<const float2*>(&sm_o[(w * ROWS + row) * OS + d]);
                a0 += f * v.x;
                a1 += f * v.y;
            }
        }
        const size_t hq = (size_t)b * q_heads + h0 + row;
        if (SPLIT) {
            const size_t slot = hq * max_parts + blockIdx.z;
            *reinterpret_cast<float2*>(&part_o[slot * D + d]) = make_float2(a0, a1);
            if (d == 0) *reinterpret_cast<float2*>(&part_ml[slot * 2]) = make_float2(mx, sum_l);
        } else {
            const float inv = sum_l > 0.f ? 1.f / sum_l : 0.f;
            *reinterpret_cast<__nv_bfloat162*>(&out[hq * D + d]) = __floats2bfloat162_rn(a0 * inv, a1 * inv);
        }
    }
}

// Split-KV merge, grid (q_heads, batch): warp w merges partitions w, w + 8, ... online (max in the
// log2 domain), lane l holds D / 32 consecutive dims; the 8 warps are merged in shared memory.
template <int D>
__global__ void __launch_bounds__(MERGE_WARPS * 32) paged_decode_v5_merge(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, const int* __restrict__ context_lens,
    __nv_bfloat16* __restrict__ out, int q_heads, int max_parts, int part_size) {
    constexpr int EPL = D / 32;  // 2, 4 or 8
    __shared__ float sm_o[MERGE_WARPS][D];
    __shared__ float sm_m[MERGE_WARPS], sm_l[MERGE_WARPS];
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int len = context_lens[b];
    const int nparts = min(max_parts, (len + part_size - 1) / part_size);
    const size_t first = ((size_t)b * q_heads + h) * max_parts;

    float m = -INFINITY, l = 0.f, acc[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[e] = 0.f;
#pragma unroll 2
    for (int p = warp; p < nparts; p += MERGE_WARPS) {
        const float2 ml = *reinterpret_cast<const float2*>(&part_ml[(first + p) * 2]);  // ml.x finite
        float v[EPL];
        const float* src = part_o + (first + p) * D + lane * EPL;
#pragma unroll
        for (int e = 0; e < EPL; e += 2) {
            const float2 t = *reinterpret_cast<const float2*>(src + e);
            v[e] = t.x;
            v[e + 1] = t.y;
        }
        const float m_new = fmaxf(m, ml.x);
        const float fa = exp2f(m - m_new);  // 0 the first time
        const float fb = exp2f(ml.x - m_new);
        l = l * fa + ml.y * fb;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[e] = acc[e] * fa + v[e] * fb;
        m = m_new;
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) sm_o[warp][lane * EPL + e] = acc[e];
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
    __syncthreads();
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < MERGE_WARPS; ++w) mx = fmaxf(mx, sm_m[w]);
    float f[MERGE_WARPS];
    float sum_l = 0.f;
#pragma unroll
    for (int w = 0; w < MERGE_WARPS; ++w) {
        f[w] = mx == -INFINITY ? 0.f : exp2f(sm_m[w] - mx);
        sum_l += f[w] * sm_l[w];
    }
    const float inv = sum_l > 0.f ? 1.f / sum_l : 0.f;
    for (int d = threadIdx.x; d < D; d += MERGE_WARPS * 32) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < MERGE_WARPS; ++w) a += f[w] * sm_o[w][d];
        out[((size_t)b * q_heads + h) * D + d] = __float2bfloat16(a * inv);
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

// Tokens per split-KV partition (a multiple of 16), 0 = no split: none when the unsplit blocks fill
// V5_NOSPLIT_WAVES waves of resident blocks, else about V5_SPLIT_WAVES waves of partitions of at
// least V5_MIN_PART tokens. PARTITION_SIZE > 0 forces that size.
long long choose_partition(long long blocks, long long max_len, long long slots) {
    if (PARTITION_SIZE > 0) return ((PARTITION_SIZE + CHUNK - 1) / CHUNK) * CHUNK;
    if (blocks * 10 >= (long long)V5_NOSPLIT_WAVES_X10 * slots || max_len <= V5_MIN_PART) return 0;
    const long long want_parts = (V5_SPLIT_WAVES * slots + blocks - 1) / blocks;
    long long size = (max_len + want_parts - 1) / want_parts;
    size = ((size + CHUNK - 1) / CHUNK) * CHUNK;
    if (size < V5_MIN_PART) size = V5_MIN_PART;
    return size >= max_len ? 0 : size;
}

template <int D>
cudaError_t launch(const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                   const int* block_table, const int* context_lens, __nv_bfloat16* out, int batch, int q_heads,
                   int kv_heads, int page_size, int max_pages_per_seq, float scale, cudaStream_t stream) {
    using C = Cfg<D>;
    const int group = q_heads / kv_heads;
    const int head_chunks = (group + ROWS - 1) / ROWS;
    const long long grid_x = (long long)kv_heads * head_chunks;
    if (grid_x > 0x7fffffffLL || batch > 65535) return cudaErrorInvalidValue;
    const long long max_len = (long long)max_pages_per_seq * page_size;
    if (max_len > 0x7fffffffLL) return cudaErrorInvalidValue;

    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    if (dev < 0 || dev >= MAX_DEVICES) return cudaErrorInvalidDevice;
    if (sm_count[dev] == 0) {  // once per device
        err = cudaDeviceGetAttribute(&sm_count[dev], cudaDevAttrMultiProcessorCount, dev);
        if (err != cudaSuccess) return err;
    }
    const float sl2 = scale * LOG2E;
    const long long part =
        choose_partition(grid_x * batch, max_len, (long long)sm_count[dev] * C::BLOCKS_PER_SM);
    if (part == 0) {
        const dim3 grid((unsigned)grid_x, batch, 1);
        paged_decode_v5<D, false><<<grid, C::NTHREADS, 0, stream>>>(
            q, k_cache, v_cache, block_table, context_lens, out, nullptr, nullptr, q_heads, kv_heads, page_size,
            max_pages_per_seq, 1, 0, head_chunks, sl2);
        return cudaGetLastError();
    }
    const long long parts = (max_len + part - 1) / part;
    if (parts > 65535) return cudaErrorInvalidValue;
    const int max_parts = (int)parts;
    const size_t n = (size_t)batch * q_heads * max_parts;
    float* scratch = nullptr;
    err = get_scratch(dev, n * (D + 2) * sizeof(float), &scratch);
    if (err != cudaSuccess) return err;
    float* part_o = scratch;
    float* part_ml = scratch + n * D;  // n * D is even: 8-byte aligned pairs
    const dim3 grid((unsigned)grid_x, batch, max_parts);
    paged_decode_v5<D, true><<<grid, C::NTHREADS, 0, stream>>>(
        q, k_cache, v_cache, block_table, context_lens, out, part_o, part_ml, q_heads, kv_heads, page_size,
        max_pages_per_seq, max_parts, (int)part, head_chunks, sl2);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    paged_decode_v5_merge<D><<<dim3(q_heads, batch), MERGE_WARPS * 32, 0, stream>>>(
        part_o, part_ml, context_lens, out, q_heads, max_parts, (int)part);
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
