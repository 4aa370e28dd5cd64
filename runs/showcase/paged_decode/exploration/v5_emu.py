"""Pure-CPU, lane-by-lane emulation of v5.cu's index math (cp.async swizzle, ldmatrix, mma.m16n8k16
fragment layouts, online softmax, warp merge, split-KV merge), checked against a float64 reference.
Not a performance model. Usage: python3 v5_emu.py  (numpy only; a few seconds)."""
import math
import numpy as np

CHUNK, ROWS = 16, 8


def bf16(x):
    """Round float32 to bf16 (round to nearest even) and back to float32."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def ldmatrix(tile, lane_addr, trans):
    """tile[row][physical 16-byte column] -> 8 bf16; lane_addr[l] = (row, physcol) of the row lane l
    names (lanes 8i..8i+7: matrix i). Returns regs[lane][i] = (lo, hi)."""
    regs = [[None] * 4 for _ in range(32)]
    for i in range(4):
        M = np.stack([tile[lane_addr[8 * i + r][0]][lane_addr[8 * i + r][1]] for r in range(8)])  # [8 rows][8]
        for t in range(32):
            g, q = t // 4, t % 4
            regs[t][i] = (M[2 * q][g], M[2 * q + 1][g]) if trans else (M[g][2 * q], M[g][2 * q + 1])
    return regs


def mma(d, a, b):
    """d[lane][4] += A B; a[lane] = 4 regs of (lo, hi), b[lane] = 2 regs; PTX m16n8k16 layouts."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); C = np.zeros((16, 8))
    for t in range(32):
        g, q = t // 4, t % 4
        for i in range(8):
            row = g + 8 * ((i // 2) % 2); col = 2 * q + (i % 2) + 8 * (i >= 4)
            A[row, col] = a[t][i // 2][i % 2]
        for i in range(4):
            B[2 * q + (i % 2) + 8 * (i >= 2), g] = b[t][i // 2][i % 2]
        for i in range(4):
            C[g + 8 * (i >= 2), 2 * q + (i % 2)] = d[t][i]
    Dm = A @ B + C
    for t in range(32):
        g, q = t // 4, t % 4
        for i in range(4):
            d[t][i] = np.float32(Dm[g + 8 * (i >= 2), 2 * q + (i % 2)])


def shfl(vals, src):
    return [vals[src[l]] for l in range(32)]


def run_block(D, W, S, q, kc, vc, table_b, t_begin, t_end, kvh, h0, nh, ps, sl2):
    """One block of paged_decode_v5: returns per head row (m, l, O[D]) after the warp merge."""
    CPR = D // 8; PIECES = CHUNK * CPR // 32; KS = D // 16; MT = D // 16
    nchunks = (t_end - t_begin + CHUNK - 1) // CHUNK
    warp_res = []
    for warp in range(W):
        my = (nchunks - warp + W - 1) // W if nchunks > warp else 0
        # Q fragments
        qa = [[None, None] for _ in range(32)]
        for lane in range(32):
            g, tg = lane >> 2, lane & 3
            hv = g < nh
            row = q[h0 + (g if hv else 0)]
            qa[lane] = [[(row[16 * ks + 2 * tg], row[16 * ks + 2 * tg + 1]) if hv else (0.0, 0.0),
                         (row[16 * ks + 8 + 2 * tg], row[16 * ks + 8 + 2 * tg + 1]) if hv else (0.0, 0.0)]
                        for ks in range(KS)]
        ring = [[[[None] * CPR for _ in range(16)] for _ in range(2)] for _ in range(S)]  # [stage][K/V][row][col]
        filled = {}

        def issue(stage, i):
            # lookup for lanes
            code = []
            for lane in range(32):
                t = t_begin + (warp + i * W) * CHUNK + (lane & 15)
                ok = t < t_end
                tc = t if ok else t_end - 1
                pg = table_b[tc // ps]; slot = tc - (tc // ps) * ps
                prow = pg * ps + slot
                code.append(prow if ok else ~prow)
            for r in range(PIECES):
                for lane in range(32):
                    p = r * 32 + lane; row = p // CPR; c = p % CPR
                    src = code[row]; valid = src >= 0
                    prow = src if valid else ~src
                    pc = c ^ (row & 7)
                    for kv, cache in ((0, kc), (1, vc)):
                        flat = cache.reshape(-1, cache.shape[2], D)  # [pool rows, kvh, D]
                        data = flat[prow, kvh, c * 8:(c + 1) * 8] if valid else np.zeros(8, np.float32)
                        assert ring[stage][kv][row][pc] is None or filled.get((stage, kv, row, pc)) != i
                        ring[stage][kv][row][pc] = data.copy(); filled[(stage, kv, row, pc)] = i

        o = [[np.float32(0)] * 4 * MT for _ in range(32)]
        o = [[[np.float32(0)] * 4 for _ in range(MT)] for _ in range(32)]
        m_run = [-np.inf] * 32; l_run = [0.0] * 32
        for s in range(S - 1):
            if s < my: issue(s, s)
        stage = 0
        for i in range(my):
            j = i + S - 1
            if j < my: issue(S - 1 if stage == 0 else stage - 1, j)
            for key, v in filled.items():
                if key[0] == stage: assert v == i, "stale slot"
            K, V = ring[stage][0], ring[stage][1]
            t0 = t_begin + (warp + i * W) * CHUNK
            sa = [[[[0.0] * 4 for _ in range(2)] for _ in range(2)] for _ in range(32)]
            for ks in range(KS):
                addr = []
                for lane in range(32):
                    mi, rr = lane >> 3, lane & 7
                    tok = ((mi >> 1) << 3) + rr; col = (2 * ks + (mi & 1)) ^ rr
                    assert tok & 7 == rr
                    addr.append((tok, col))
                regs = ldmatrix(K, addr, False)
                for n in range(2):
                    d = [sa[l][n][ks & 1] for l in range(32)]
                    a = [[qa[l][ks][0], (0, 0), qa[l][ks][1], (0, 0)] for l in range(32)]
                    b = [[regs[l][2 * n], regs[l][2 * n + 1]] for l in range(32)]
                    mma(d, a, b)
            s_ = [[0.0] * 4 for _ in range(32)]
            for lane in range(32):
                tg = lane & 3
                for n in range(2):
                    for e in range(2):
                        v = np.float32(np.float32(sa[lane][n][0][e] + sa[lane][n][1][e]) * sl2)
                        s_[lane][2 * n + e] = v if t0 + 8 * n + 2 * tg + e < t_end else -np.inf
            cm = [max(s_[l]) for l in range(32)]
            cm = [max(cm[l], cm[l ^ 1]) for l in range(32)]
            cm = [max(cm[l], cm[l ^ 2]) for l in range(32)]
            alpha = [0.0] * 32; p = [None] * 32
            for l in range(32):
                m_new = max(m_run[l], cm[l]); assert np.isfinite(m_new)
                alpha[l] = 2.0 ** (m_run[l] - m_new) if m_run[l] != -np.inf else 0.0
                m_run[l] = m_new
                p[l] = [2.0 ** (x - m_new) if x != -np.inf else 0.0 for x in s_[l]]
                l_run[l] = l_run[l] * alpha[l] + ((p[l][0] + p[l][1]) + (p[l][2] + p[l][3]))
            al0 = shfl(alpha, [8 * (l & 3) for l in range(32)])
            al1 = shfl(alpha, [8 * (l & 3) + 4 for l in range(32)])
            for l in range(32):
                for mt in range(MT):
                    o[l][mt][0] *= al0[l]; o[l][mt][1] *= al1[l]; o[l][mt][2] *= al0[l]; o[l][mt][3] *= al1[l]
            pb = [[tuple(bf16([p[l][0], p[l][1]])), tuple(bf16([p[l][2], p[l][3]]))] for l in range(32)]
            pl = [[tuple(bf16([np.float32(p[l][2 * r + e]) - pb[l][r][e] for e in range(2)])) for r in range(2)]
                  for l in range(32)]
            for mt in range(MT):
                addr = []
                for lane in range(32):
                    mi, rr = lane >> 3, lane & 7
                    addr.append((((mi >> 1) << 3) + rr, (2 * mt + (mi & 1)) ^ rr))
                regs = ldmatrix(V, addr, True)
                d = [o[l][mt] for l in range(32)]
                mma(d, [regs[l] for l in range(32)], pb)
                mma(d, [regs[l] for l in range(32)], pl)
            stage = 0 if stage == S - 1 else stage + 1
        # quad sum of l
        l_run = [l_run[l] + l_run[l ^ 1] for l in range(32)]
        l_run = [l_run[l] + l_run[l ^ 2] for l in range(32)]
        OS = D + 4
        sm_o = np.full((ROWS, OS), np.nan)
        for l in range(32):
            g, tg = l >> 2, l & 3
            for mt in range(MT):
                sm_o[2 * tg][16 * mt + g] = o[l][mt][0]
                sm_o[2 * tg + 1][16 * mt + g] = o[l][mt][1]
                sm_o[2 * tg][16 * mt + g + 8] = o[l][mt][2]
                sm_o[2 * tg + 1][16 * mt + g + 8] = o[l][mt][3]
        sm_m = [m_run[4 * g] for g in range(ROWS)]; sm_l = [l_run[4 * g] for g in range(ROWS)]
        warp_res.append((sm_m, sm_l, sm_o[:, :D]))
    res = []
    for row in range(nh):
        mx = max(w[0][row] for w in warp_res)
        sum_l = 0.0; a = np.zeros(D)
        if mx != -np.inf:
            for (mm, ll, oo) in warp_res:
                f = 2.0 ** (mm[row] - mx) if mm[row] != -np.inf else 0.0
                sum_l += f * ll[row]; a += f * oo[row]
        res.append((mx, sum_l, a))
    return res


def emulate(D, W, S, b_, qh, kvh_, ps, lens, part, seed, late=False):
    rng = np.random.default_rng(seed)
    mp = -(-max(lens) // ps)
    pool = b_ * mp + max(1, b_ * mp // 4)
    q = bf16(rng.standard_normal((b_, qh, D)).astype(np.float32))
    kc = bf16(rng.standard_normal((pool, ps, kvh_, D)).astype(np.float32))
    vc = bf16(rng.standard_normal((pool, ps, kvh_, D)).astype(np.float32))
    table = rng.permutation(pool)[: b_ * mp].reshape(b_, mp)
    if late:
        for b in range(b_):
            t = lens[b] - 1
            kc[table[b, t // ps], t % ps] += 120.0 / math.sqrt(D) * np.sign(q[b].reshape(kvh_, -1, D).mean(1))
    scale = 1 / math.sqrt(D); sl2 = np.float32(scale * 1.4426950408889634)
    group = qh // kvh_; hchunks = -(-group // ROWS)
    out = np.zeros((b_, qh, D)); ref = np.zeros((b_, qh, D))
    for b in range(b_):
        L = lens[b]
        for kvh in range(kvh_):
            toks = [table[b, t // ps] * ps + t % ps for t in range(L)]
            Kf = kc.reshape(-1, kvh_, D)[toks, kvh].astype(np.float64)
            Vf = vc.reshape(-1, kvh_, D)[toks, kvh].astype(np.float64)
            for hc in range(hchunks):
                h0 = kvh * group + hc * ROWS; nh = min(ROWS, group - hc * ROWS)
                if part == 0:
                    parts = [(0, L)]
                else:
                    parts = [(z * part, min(L, z * part + part)) for z in range(-(-mp * ps // part)) if z * part < L]
                pres = [run_block(D, W, S, q[b], kc, vc, table[b], tb, te, kvh, h0, nh, ps, sl2) for tb, te in parts]
                for row in range(nh):
                    h = h0 + row
                    mx = max(pr[row][0] for pr in pres) if pres else -np.inf
                    sl = 0.0; a = np.zeros(D)
                    for pr in pres:
                        f = 2.0 ** (pr[row][0] - mx); sl += f * pr[row][1]; a += f * pr[row][2]
                    out[b, h] = a / sl if sl > 0 else 0
                    sc = Kf @ q[b, h].astype(np.float64) * scale
                    w = np.exp(sc - sc.max()); w /= w.sum()
                    ref[b, h] = w @ Vf
    err = np.abs(bf16(out.astype(np.float32)) - ref)
    lim = 2e-3 + 2e-2 * np.abs(ref)
    nrel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    ok = (err <= lim).all() and nrel < 1e-2
    print(f"D={D} W={W} S={S} b={b_} qh={qh} kvh={kvh_} ps={ps} lens={lens} part={part} late={late}: "
          f"{'OK' if ok else 'FAIL'} max_err/lim={(err / lim).max():.3f} nrel={nrel:.2e}")
    return ok


if __name__ == "__main__":
    ok = True
    ok &= emulate(64, 2, 3, 2, 4, 4, 8, [1, 37], 0, 1)              # MHA, page 8, len 1
    ok &= emulate(128, 2, 3, 2, 12, 4, 32, [70, 45], 0, 2)          # group 3, page 32
    ok &= emulate(64, 4, 3, 1, 16, 2, 16, [150], 0, 3, late=True)   # group 8, late token
    ok &= emulate(128, 2, 3, 2, 8, 2, 16, [100, 300], 64, 4)        # split-KV partitions
    ok &= emulate(64, 1, 2, 1, 20, 2, 16, [40], 0, 5)               # group 10 (two head chunks), 2 stages
    ok &= emulate(256, 1, 3, 1, 4, 1, 16, [33], 0, 6)               # d 256
    print("ALL OK" if ok else "SOME FAILED")
