"""FlashAttention forward in Triton, bf16 in / bf16 out, fp32 log-sum-exp (natural log).

A plain baseline: one program owns BLOCK_M query rows of one (batch, head) and walks the keys and
values in tiles of BLOCK_N rows with an online softmax (running max m, running sum l, exp2 of
scores pre-multiplied by scale * log2(e)); S = Q K^T and O += P V on the tensor cores (tl.dot, fp32
accumulate, P rounded to bf16). Causal programs stop at their diagonal tile.

The launch (grid, arguments, knobs) is the task's, in task.toml and spec.py: grid =
(cdiv(seqlen, BLOCK_M), batch * heads); q, k, v, o are contiguous [batch, heads, seqlen, HEAD_DIM].
Knobs: BLOCK_M, BLOCK_N (constexprs), num_warps, num_stages.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def attn_fwd(Q, K, V, O, LSE, seqlen, sm_scale,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * seqlen * HEAD_DIM
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < seqlen
    q = tl.load(Q + base + rows[:, None] * HEAD_DIM + cols_d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    hi = seqlen
    if IS_CAUSAL:
        hi = tl.minimum(seqlen, (start_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        key_ok = keys < seqlen
        k = tl.load(K + base + keys[None, :] * HEAD_DIM + cols_d[:, None], mask=key_ok[None, :], other=0.0)
        s = tl.dot(q, k) * qk_scale
        ok = key_ok[None, :]
        if IS_CAUSAL:
            ok = ok & (keys[None, :] <= rows[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows that have seen no key yet keep m = -inf: use 0 so exp2 stays finite
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(V + base + keys[:, None] * HEAD_DIM + cols_d[None, :], mask=key_ok[:, None], other=0.0)
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + base + rows[:, None] * HEAD_DIM + cols_d[None, :], out.to(tl.bfloat16), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_safe)) * LN2
    tl.store(LSE + bh.to(tl.int64) * seqlen + rows, lse, mask=row_ok)
