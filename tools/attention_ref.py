"""Reference attention for the attention task specs (kernels/flash_attn_*/spec.py): the forward in a
chosen precision, chunked so that the 16k-token bench shapes fit in memory, with grouped-query heads.

    S = Q K^T * scale (causal: S[i, j] = -inf for j > i),  O = softmax(S) V,  LSE = logsumexp(S)

q: [batch, heads_q, seqlen, d]; k, v: [batch, heads_kv, seqlen, d] with heads_q a multiple of
heads_kv (query head h reads key/value head h // (heads_q // heads_kv), as FlashAttention's GQA).
"""

from __future__ import annotations

import torch

# the reference materialises scores in chunks of at most this many bytes
CHUNK_BYTES = 1 << 28


def tf32_may_be_on() -> bool:
    """Whether CUDA matmuls may silently run in TF32 (then a reference must use fp64)."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except Exception:  # newer torch may refuse the legacy flag after the new API was used
        return True


def reference_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 on a GPU where TF32 may be on (never a silent drop to 10-bit mantissas)."""
    return torch.float64 if t.is_cuda and tf32_may_be_on() else torch.float32


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      dtype: torch.dtype = torch.float32,
                      chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [b, hq, s, d], LSE [b, hq, s]) in `dtype`, in chunks of (query heads, query rows)."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    if k.shape != (b, hkv, s, d) or v.shape != k.shape or hq % max(hkv, 1):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected k, v "
                         f"[b, hkv, s, d] with hq a multiple of hkv")
    group = hq // hkv
    budget = chunk_bytes or CHUNK_BYTES
    o = torch.empty((b, hq, s, d), device=q.device, dtype=dtype)
    lse = torch.empty((b, hq, s), device=q.device, dtype=dtype)
    elt = torch.finfo(dtype).bits // 8
    per_head = s * s * elt
    if per_head <= budget:
        heads_per, rows_per = max(1, budget // per_head), s
    else:
        heads_per, rows_per = 1, max(1, budget // (s * elt))
    heads_per = min(heads_per, group)  # a chunk never spans two key/value heads
    cols = torch.arange(s, device=q.device)
    for bi in range(b):
        for g in range(hkv):
            kh = k[bi, g].to(dtype)
            vh = v[bi, g].to(dtype)
            for h0 in range(g * group, (g + 1) * group, heads_per):
                h1 = min((g + 1) * group, h0 + heads_per)
                for r0 in range(0, s, rows_per):
                    r1 = min(s, r0 + rows_per)
                    scores = torch.matmul(q[bi, h0:h1, r0:r1].to(dtype), kh.transpose(-1, -2)) * scale
                    if causal:
                        rows = torch.arange(r0, r1, device=q.device)
                        scores.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
                    row_lse = torch.logsumexp(scores, dim=-1)
                    probs = torch.exp(scores - row_lse[..., None])
                    o[bi, h0:h1, r0:r1] = torch.matmul(probs, vh)
                    lse[bi, h0:h1, r0:r1] = row_lse
                    del scores, probs
    return o, lse


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
                       scale: float, dtype: torch.dtype = torch.float32, o: torch.Tensor | None = None,
                       chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in `dtype` through torch autograd of the forward recomputed in `dtype` from q, k, v,
    dK and dV summed over each kv head's query heads. In chunks of (query heads, query rows): the
    rows of one chunk depend on all of K, V and on their own Q rows only, so autograd of each chunk's
    loss gives its dQ rows exactly and its share of dK, dV (summed over the chunks).

    `o`: the forward output a backward kernel is given (e.g. bf16). Autograd's softmax backward uses
    Delta = rowsum(dO * O) of its own fp32 O; a FlashAttention backward uses the given O. With `o`,
    the loss gets the term sum_i (Delta_i - Delta'_i) * LSE_i (dLSE_i/dS_ij = P_ij), so the gradient
    is the exact one for Delta' = rowsum(dO * o): dS = P * (dP - Delta'). Without it, o's rounding
    (the forward's error, not the backward's) dominates dQ where dS nearly cancels (one-hot rows)."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    budget = (chunk_bytes or CHUNK_BYTES) // 4  # autograd keeps ~3 score-sized tensors per chunk
    elt = torch.finfo(dtype).bits // 8
    per_head = s * s * elt
    if per_head <= budget:
        heads_per, rows_per = min(group, max(1, budget // per_head)), s
    else:
        heads_per, rows_per = 1, max(1, budget // (s * elt))
    dq = torch.empty((b, hq, s, d), device=q.device, dtype=dtype)
    dk = torch.zeros((b, hkv, s, d), device=q.device, dtype=dtype)
    dv = torch.zeros((b, hkv, s, d), device=q.device, dtype=dtype)
    cols = torch.arange(s, device=q.device)
    for bi in range(b):
        for g in range(hkv):
            with torch.enable_grad():
                kh = k[bi, g].detach().to(dtype).requires_grad_(True)
                vh = v[bi, g].detach().to(dtype).requires_grad_(True)
                for h0 in range(g * group, (g + 1) * group, heads_per):
                    h1 = min((g + 1) * group, h0 + heads_per)
                    for r0 in range(0, s, rows_per):
                        r1 = min(s, r0 + rows_per)
                        qc = q[bi, h0:h1, r0:r1].detach().to(dtype).requires_grad_(True)
                        scores = torch.matmul(qc, kh.transpose(-1, -2)) * scale
                        if causal:
                            rows = torch.arange(r0, r1, device=q.device)
                            scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
                        lse = torch.logsumexp(scores, dim=-1)
                        out = torch.matmul(torch.exp(scores - lse[..., None]), vh)
                        doc = do[bi, h0:h1, r0:r1].to(dtype)
                        loss = (out * doc).sum()
                        if o is not None:
                            given = (o[bi, h0:h1, r0:r1].to(dtype) * doc).sum(-1)
                            loss = loss + ((out.detach() * doc).sum(-1) - given).mul(lse).sum()
                        gq, gk, gv = torch.autograd.grad(loss, (qc, kh, vh))
                        dq[bi, h0:h1, r0:r1] = gq
                        dk[bi, g] += gk
                        dv[bi, g] += gv
                        del scores, out, gq, gk, gv
    return dq, dk, dv


class PerInputCache:
    """What a comparator derives once per input set (dequantised copies, a forward graph), kept for the
    timed calls: keyed by the inputs' addresses *and* shapes (a freed set's addresses come back for
    the next shape's equally sized tensors), least recently used dropped past `size` entries (the
    bench rotates over several input sets)."""

    def __init__(self, size: int = 16):
        self.size = size
        self._entries: dict = {}

    def get(self, inputs: dict, names: tuple[str, ...], extra: tuple, make):
        key = tuple((inputs[n].data_ptr(), tuple(inputs[n].shape), str(inputs[n].dtype)) for n in names) + extra
        if key in self._entries:
            value = self._entries.pop(key)
        else:
            value = make()
            while len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))
        self._entries[key] = value
        return value
