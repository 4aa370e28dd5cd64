
// ---- small PTX helpers ------------------------------------------------------------------------
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// cp.async writes are generic-proxy writes; wgmma reads shared memory through the async proxy
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// pin a register's value in program order around the asynchronous MMAs (no code emitted)
__device__ __forceinline__ void reg_fence(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void reg_fence(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Shared-memory tile of R rows x D bf16 in the 128-byte-swizzle layout wgmma reads: split into
// D/64 column blocks of R rows x 128 bytes; inside a block the 16-byte chunk c of row r sits at
// chunk position c ^ (r % 8). Every block starts 1024-byte aligned (the swizzle atom: 8 rows).
template <int R>
__device__ __forceinline__ uint32_t swz_offset(int r, int chunk /* 16-byte chunk in the row */) {
    return static_cast<uint32_t>((chunk >> 3) * (R * 128) + r * 128 + (((chunk & 7) ^ (r & 7)) << 4));
}

// Copy `rows` rows of D bf16 from global row `row0` on (rows >= seqlen zero-filled) into a
// swizzled tile, `threads` threads from `tid` on.
template <int D, int R>
__device__ __forceinline__ void load_tile(uint32_t smem, const __nv_bfloat16* gmem_bh, int row0, int seqlen,
                                          int tid) {
    constexpr int CHUNKS = D / 8;
#pragma unroll
    for (int i = tid; i < R * CHUNKS; i += NUM_THREADS) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        const bool valid = row0 + r < seqlen;
        const __nv_bfloat16* src = valid ? gmem_bh + (size_t)(row0 + r) * D + c * 8 : gmem_bh;
        cp_async_16(smem + swz_offset<R>(r, c), src, valid);
    }
}

// wgmma shared-memory descriptor: start address, leading/stride byte offsets, 128-byte swizzle.
__device__ __forceinline__ uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

template <int N> struct Mma;
template <> struct Mma<64> {
    template <class A> static __device__ __forceinline__ void ss(A& d, uint64_t a, uint64_t b, int s) { wgmma_ss_n64(d, a, b, s); }
    template <class A> static __device__ __forceinline__ void rs(A& d, const uint32_t (&a)[4], uint64_t b, int s) { wgmma_rs_n64(d, a, b, s); }
};
template <> struct Mma<128> {
    template <class A> static __device__ __forceinline__ void ss(A& d, uint64_t a, uint64_t b, int s) { wgmma_ss_n128(d, a, b, s); }
    template <class A> static __device__ __forceinline__ void rs(A& d, const uint32_t (&a)[4], uint64_t b, int s) { wgmma_rs_n128(d, a, b, s); }
};

template <int D> struct Smem {
    static constexpr uint32_t Q = 0;                                   // BLOCK_M x D
    static constexpr uint32_t K = Q + BLOCK_M * D * 2;                 // 2 stages x BLOCK_N x D
    static constexpr uint32_t V = K + 2 * BLOCK_N * D * 2;             // 2 stages x BLOCK_N x D
    static constexpr uint32_t STAGE = BLOCK_N * D * 2;
    static constexpr uint32_t END = V + 2 * BLOCK_N * D * 2;
    static constexpr size_t BYTES = END + 1024;                        // + slack to align the base to 1024
};

template <int D, bool MASK>
__device__ __forceinline__ void softmax_tile(float (&s)[BLOCK_N / 2], float (&o)[D / 2], float (&m)[2], float (&l)[2],
                                             int n0, int q_row0, int seqlen, int causal, float scale_log2,
                                             int lane) {
    // accumulator element i of this thread: row q_row0 + 8 * ((i / 2) % 2), column 8 * (i / 4) + 2 * (lane % 4) + i % 2
    if constexpr (MASK) {
#pragma unroll
        for (int i = 0; i < BLOCK_N / 2; ++i) {
            const int key = n0 + 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
            const int qrow = q_row0 + 8 * ((i / 2) % 2);
            if (key >= seqlen || (causal && key > qrow)) s[i] = -INFINITY;
        }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < BLOCK_N / 2; ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], s[i]);
    float alpha[2], m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m[h], mx[h] * scale_log2);
        // a row with no visible key yet keeps m = -inf: subtract 0 then, never (-inf) - (-inf)
        m_use[h] = (m_new == -INFINITY) ? 0.f : m_new;
        alpha[h] = exp2_approx(m[h] - m_use[h]);
        m[h] = m_new;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < BLOCK_N / 2; ++i) {
        const int h = (i / 2) % 2;
        s[i] = exp2_approx(fmaf(s[i], scale_log2, -m_use[h]));
        sum[h] += s[i];
    }
    // l stays a per-thread partial sum (alpha is uniform across the quad); reduced at the end
    l[0] = l[0] * alpha[0] + sum[0];
    l[1] = l[1] * alpha[1] + sum[1];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i / 2) % 2];
}

template <int D>
__global__ void __launch_bounds__(NUM_THREADS, 1)
flash_attn_fwd_wgmma(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                     const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ o, float* __restrict__ lse,
                     int seqlen, int num_m_blocks, int num_bh, int causal, float scale_log2) {
    using L = Smem<D>;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    const uint32_t base_s = (raw + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base_s - raw);

    const int tid = threadIdx.x;
    const int wg = tid / 128;            // warpgroup: query rows 64*wg .. 64*wg+63 of the block
    const int lane = tid % 32;
    const int warp_in_wg = (tid % 128) / 32;

    // causal: heaviest query blocks first, across all heads; otherwise all blocks of one head
    // together (they share K/V in L2)
    int m_block;
    size_t bh;
    if (causal) {
        m_block = num_m_blocks - 1 - static_cast<int>(blockIdx.x / num_bh);
        bh = blockIdx.x % num_bh;
    } else {
        m_block = static_cast<int>(blockIdx.x % num_m_blocks);
        bh = blockIdx.x / num_m_blocks;
    }
    const int m0 = m_block * BLOCK_M;
    const size_t base = bh * (size_t)seqlen * D;
    const __nv_bfloat16* q_bh = q + base;
    const __nv_bfloat16* k_bh = k + base;
    const __nv_bfloat16* v_bh = v + base;

    const int kv_end = causal ? min(seqlen, m0 + BLOCK_M) : seqlen;
    const int n_tiles = (kv_end + BLOCK_N - 1) / BLOCK_N;

    load_tile<D, BLOCK_M>(base_s + L::Q, q_bh, m0, seqlen, tid);
    load_tile<D, BLOCK_N>(base_s + L::K, k_bh, 0, seqlen, tid);
    load_tile<D, BLOCK_N>(base_s + L::V, v_bh, 0, seqlen, tid);
    cp_async_commit();

    float acc_o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.f, 0.f};

    const int row_in_wg = 16 * warp_in_wg + lane / 4;      // and row_in_wg + 8
    const int q_row0 = m0 + 64 * wg + row_in_wg;            // global query row of half 0
    const int wg_first = m0 + 64 * wg, wg_last = wg_first + 63;
    // Q of this warpgroup: its 64 rows inside each 64-column block
    const uint32_t q_s = base_s + L::Q + 64 * wg * 128;

    for (int j = 0; j < n_tiles; ++j) {
        const int n0 = j * BLOCK_N;
        const int stage = j & 1;
        if (j + 1 < n_tiles) {
            load_tile<D, BLOCK_N>(base_s + L::K + (stage ^ 1) * L::STAGE, k_bh, n0 + BLOCK_N, seqlen, tid);
            load_tile<D, BLOCK_N>(base_s + L::V + (stage ^ 1) * L::STAGE, v_bh, n0 + BLOCK_N, seqlen, tid);
        }
        cp_async_commit();  // possibly empty: keeps the group count uniform
        cp_async_wait<1>();
        fence_proxy_async();
        __syncthreads();

        // a warpgroup whose rows all precede this tile's keys (causal) skips it
        if (!(causal && n0 > wg_last)) {
            const uint32_t k_s = base_s + L::K + stage * L::STAGE;
            const uint32_t v_s = base_s + L::V + stage * L::STAGE;
            float s[BLOCK_N / 2];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                // K-major: the k16 step moves 32 bytes inside a 128-byte row, the 64-column block by R*128
                const uint64_t da = make_desc(q_s + (kk / 4) * (BLOCK_M * 128) + (kk % 4) * 32, 16, 1024);
                const uint64_t db = make_desc(k_s + (kk / 4) * (BLOCK_N * 128) + (kk % 4) * 32, 16, 1024);
                Mma<BLOCK_N>::ss(s, da, db, kk > 0 ? 1 : 0);
            }
            wgmma_commit();
            wgmma_wait0();
#pragma unroll
            for (int i = 0; i < BLOCK_N / 2; ++i) reg_fence(s[i]);

            const bool need_mask = (n0 + BLOCK_N > seqlen) || (causal && n0 + BLOCK_N - 1 > wg_first);
            if (need_mask)
                softmax_tile<D, true>(s, acc_o, m, l, n0, q_row0, seqlen, causal, scale_log2, lane);
            else
                softmax_tile<D, false>(s, acc_o, m, l, n0, q_row0, seqlen, causal, scale_log2, lane);

            uint32_t p[BLOCK_N / 16][4];
#pragma unroll
            for (int kb = 0; kb < BLOCK_N / 16; ++kb) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    p[kb][r] = pack_bf16(s[8 * kb + 2 * r], s[8 * kb + 2 * r + 1]);
                    reg_fence(p[kb][r]);
                }
            }
#pragma unroll
            for (int i = 0; i < D / 2; ++i) reg_fence(acc_o[i]);
            wgmma_fence();
#pragma unroll
            for (int kb = 0; kb < BLOCK_N / 16; ++kb) {
                // V is [keys][D]: MN-major B; 16 keys = 2 swizzle atoms of 8 rows (2048 bytes),
                // LBO = the next 64-column block, SBO = the next 8 keys
                const uint64_t db = make_desc(v_s + kb * 2048, BLOCK_N * 128, 1024);
                Mma<D>::rs(acc_o, p[kb], db, 1);
            }
            wgmma_commit();
            wgmma_wait0();
#pragma unroll
            for (int i = 0; i < D / 2; ++i) reg_fence(acc_o[i]);
        }
        __syncthreads();  // this stage is refilled by the next iteration's prefetch
    }

    // ---- epilogue: O / l as bf16 into this warpgroup's Q rows (swizzled), then 16-byte stores ----
    float inv_l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float lt = l[h];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        inv_l[h] = lt > 0.f ? 1.f / lt : 0.f;
        const int qi = q_row0 + 8 * h;
        if (lane % 4 == 0 && qi < seqlen)
            lse[bh * (size_t)seqlen + qi] = lt > 0.f ? (m[h] + __log2f(lt)) * LN2 : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < D / 2; i += 2) {
        const int h = (i / 2) % 2;
        const int col = 8 * (i / 4) + 2 * (lane % 4);
        const int r = 64 * wg + row_in_wg + 8 * h;
        const uint32_t off = swz_offset<BLOCK_M>(r, col / 8) + (col % 8) * 2;
        *reinterpret_cast<uint32_t*>(smem + L::Q + off) = pack_bf16(acc_o[i] * inv_l[h], acc_o[i + 1] * inv_l[h]);
    }
    named_barrier(1 + wg, 128);
    constexpr int CHUNKS = D / 8;
    const int t = tid % 128;
#pragma unroll
    for (int i = t; i < 64 * CHUNKS; i += 128) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        const int qi = m0 + 64 * wg + r;
        if (qi < seqlen) {
            const uint4 val = *reinterpret_cast<const uint4*>(smem + L::Q + swz_offset<BLOCK_M>(64 * wg + r, c));
            *reinterpret_cast<uint4*>(o + base + (size_t)qi * D + c * 8) = val;
        }
    }
}

template <int D>
int launch(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* o, float* lse,
           int batch, int heads, int seqlen, int causal, float scale, cudaStream_t stream) {
    constexpr size_t smem = Smem<D>::BYTES;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    int smem_max = 0;
    err = cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err != cudaSuccess) return err;
    if (smem > static_cast<size_t>(smem_max)) return cudaErrorInvalidConfiguration;
    auto kernel = flash_attn_fwd_wgmma<D>;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;

    const long long num_m_blocks = (seqlen + BLOCK_M - 1) / BLOCK_M;
    const long long num_bh = (long long)batch * heads;
    const long long blocks = num_m_blocks * num_bh;
    if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
    kernel<<<static_cast<unsigned>(blocks), NUM_THREADS, smem, stream>>>(
        q, k, v, o, lse, seqlen, static_cast<int>(num_m_blocks), static_cast<int>(num_bh), causal, scale * LOG2E);
    return cudaGetLastError();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

// q, k, v, o: [batch, heads, seqlen, head_dim] bf16, contiguous; lse: [batch, heads, seqlen] fp32.
// Returns a cudaError_t as int: 0 on a successful launch; non-zero, with nothing launched, for an
// unsupported head_dim, bad sizes, misaligned pointers or a shared-memory need past the device's.
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
