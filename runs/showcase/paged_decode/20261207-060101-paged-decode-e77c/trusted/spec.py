"""paged_decode: decode attention (one query token per sequence) over a paged bf16 KV cache, GQA.

Layout (see README.md):
    q            [batch, q_heads, head_dim]                   bf16
    k_cache      [num_pages, page_size, kv_heads, head_dim]   bf16   (a page pool, vLLM-like)
    v_cache      [num_pages, page_size, kv_heads, head_dim]   bf16
    block_table  [batch, max_pages_per_seq]                   int32  (token t of sequence b lives in page
                                                                      block_table[b, t // page_size], slot t % page_size)
    context_lens [batch]                                      int32  (1 <= len <= ctx)
    out          [batch, q_heads, head_dim]                   bf16
    out[b, h] = softmax(scale * q[b, h] . K_b^T) V_b with K_b, V_b the first len_b tokens of KV head
    h // (q_heads // kv_heads), scale = 1 / sqrt(head_dim).

Shape dims: batch, q_heads, kv_heads, head_dim, page_size, ctx (the longest context) and lens:
    "random"  lengths drawn uniformly from [1, ctx] by the generator (check shapes)
    "fixed"   every length equals ctx (bench shapes: bytes_moved is exact)
    "ramp"    len_i = ctx - (i * (ctx - 1)) // (2 * batch): a fixed ragged batch from ctx down to about ctx / 2
Every block-table entry (padding past a sequence's last page too) names a distinct page of the pool
(except for inputs = "shared", below),
drawn by a random permutation; the pool holds a quarter more pages than the tables name, so the pages
of a sequence are scattered and never contiguous by construction.

Adversarial inputs, so range shortcuts fail the check (check shapes only; dim `inputs`, default "normal"):
    "large"  q = randn * LARGE_SCORE_STD: scores ~N(0, 30^2), the top ones near +-100: exp without the
             max subtraction overflows fp32 (e^88.7), scores rounded to bf16 are off by ~0.25;
    "late"   the last token of every sequence dominates its softmax by ~LATE_SCORE (120): q gets a
             random +-1 vector u per (sequence, KV head) added, that token's K gets u * LATE_SCORE /
             sqrt(head_dim). The max sits in the tail (usually partial) page, so a kernel that keeps
             the first page's or partition's max (no rescale) overflows, and one that drops or misplaces
             the tail tokens is far off;
    "shared" prefix sharing (vLLM's prefix caching, beam search): every sequence's first half of table
             entries names the same pages as sequence 0's (the pool and the other entries as above), so
             one page is read by several sequences: a kernel that walks the pool page by page and
             credits each page to one owner (an inverse of the table) leaves the others without it.
"""

import ctypes
import math

import torch
import torch.nn.functional as F

from tools.spec import adversarial_rows, check_status, ptr

LENS_MODES = ("random", "fixed", "ramp")
INPUT_KINDS = ("normal", "large", "late", "shared")
LARGE_SCORE_STD = 30.0
# every shape ("normal" included, the timed ones too) also holds "large" and "late" sequences, an eighth
# each at positions drawn from the secret-seeded generator: no kernel can know which to treat with care
PLANTED_SEQ_FRACTION = 1 / 8
LATE_SCORE = 120.0


def input_kind(shape) -> str:
    kind = str(shape.get("inputs", "normal"))
    if kind not in INPUT_KINDS:
        raise ValueError(f"inputs = {kind!r}: expected one of {INPUT_KINDS}")
    return kind


def _dims(shape):
    b, qh, kvh = int(shape["batch"]), int(shape["q_heads"]), int(shape["kv_heads"])
    d, ps, ctx = int(shape["head_dim"]), int(shape["page_size"]), int(shape["ctx"])
    if min(b, qh, kvh, d, ps, ctx) < 1 or qh % kvh:
        raise ValueError(f"bad dims {shape}: all must be >= 1 and q_heads a multiple of kv_heads")
    return b, qh, kvh, d, ps, ctx


def _mode(shape):
    mode = str(shape.get("lens", "random"))
    if mode not in LENS_MODES:
        raise ValueError(f"lens = {mode!r}: expected one of {LENS_MODES}")
    return mode


def max_pages_per_seq(shape) -> int:
    _, _, _, _, ps, ctx = _dims(shape)
    return -(-ctx // ps)


def fixed_lengths(shape) -> list[int] | None:
    """The context lengths of a "fixed" or "ramp" shape; None for "random" (drawn in make_inputs)."""
    b, _, _, _, _, ctx = _dims(shape)
    mode = _mode(shape)
    if mode == "fixed":
        return [ctx] * b
    if mode == "ramp":
        return [ctx - (i * (ctx - 1)) // (2 * b) for i in range(b)]
    return None


def num_pages(shape) -> int:
    """Pages in the pool: every block-table entry gets its own page, plus a quarter spare."""
    b = _dims(shape)[0]
    named = b * max_pages_per_seq(shape)
    return named + max(1, named // 4)


def make_inputs(shape, gen, device):
    b, qh, kvh, d, ps, ctx = _dims(shape)
    gd = gen.device
    lens = fixed_lengths(shape)
    if lens is None:
        context_lens = torch.randint(1, ctx + 1, (b,), generator=gen, device=gd, dtype=torch.int32)
    else:
        context_lens = torch.tensor(lens, dtype=torch.int32, device=gd)
    mp = max_pages_per_seq(shape)
    pool = num_pages(shape)
    perm = torch.randperm(pool, generator=gen, device=gd)
    block_table = perm[: b * mp].to(torch.int32).reshape(b, mp)
    q = torch.randn(b, qh, d, generator=gen, device=gd, dtype=torch.bfloat16)
    k_cache = torch.randn(pool, ps, kvh, d, generator=gen, device=gd, dtype=torch.bfloat16)
    v_cache = torch.randn(pool, ps, kvh, d, generator=gen, device=gd, dtype=torch.bfloat16)
    kind = input_kind(shape)
    if kind == "shared":
        block_table[1:, : mp // 2] = block_table[0, : mp // 2]
    everyone = torch.arange(b, device=gd)
    big, late = (everyone, everyone[:0]) if kind == "large" else (everyone[:0], everyone) if kind == "late" else (
        adversarial_rows(gen, b, PLANTED_SEQ_FRACTION, kinds=2) if kind == "normal" else (everyone[:0], everyone[:0]))
    if len(big):
        q[big] = (q[big].float() * LARGE_SCORE_STD).bfloat16()
    if len(late):
        n = len(late)
        u = torch.randint(0, 2, (n, kvh, d), generator=gen, device=gd).float().mul_(2).sub_(1)
        q[late] = (q[late].float().reshape(n, kvh, qh // kvh, d) + u[:, :, None, :]).reshape(n, qh, d).bfloat16()
        last = context_lens[late].long() - 1
        pages, slots = block_table[late, last // ps].long(), last % ps
        k_cache[pages, slots] = (k_cache[pages, slots].float() + u * (LATE_SCORE / math.sqrt(d))).bfloat16()
    inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table, "context_lens": context_lens}
    return {k: v.to(device) for k, v in inputs.items()}


def make_outputs(shape, inputs):
    q = inputs["q"]
    return {"out": torch.empty_like(q)}


def _gather(cache, block_table, rows):
    """Pages of `rows` sequences -> [len(rows), max_pages * page_size, kv_heads, head_dim] (a copy)."""
    pages = cache[block_table[rows].long()]  # [n, max_pages, page_size, kv_heads, d]
    n, mp, ps, kvh, d = pages.shape
    return pages.reshape(n, mp * ps, kvh, d)


def reference(shape, inputs):
    """fp32: gather the pages of a few sequences at a time, mask past each length, softmax, weight V."""
    b, qh, kvh, d, ps, ctx = _dims(shape)
    q, kc, vc = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    bt, lens = inputs["block_table"], inputs["context_lens"].long()
    group = qh // kvh
    tokens = bt.shape[1] * ps
    scale = 1.0 / math.sqrt(d)
    out = torch.empty(b, qh, d, dtype=torch.float32, device=q.device)
    # about 64 Mi fp32 elements of gathered K per step, whatever the shape
    step = max(1, (1 << 26) // (tokens * kvh * d))
    pos = torch.arange(tokens, device=q.device)
    for s in range(0, b, step):
        rows = torch.arange(s, min(b, s + step), device=q.device)
        k = _gather(kc, bt, rows).float()  # [n, T, kvh, d]
        v = _gather(vc, bt, rows).float()
        qq = q[rows].float().reshape(len(rows), kvh, group, d)
        scores = torch.einsum("nhgd,nthd->nhgt", qq, k) * scale
        valid = pos[None, :] < lens[rows][:, None]  # [n, T]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("nhgt,nthd->nhgd", p, v).reshape(len(rows), qh, d)
    return {"out": out}


def setup(lib):
    lib.kloop_paged_decode.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p]
    lib.kloop_paged_decode.restype = ctypes.c_int


def launch(lib, shape, inputs, outputs, stream):
    b, qh, kvh, d, ps, _ = _dims(shape)
    status = lib.kloop_paged_decode(
        ptr(inputs["q"]), ptr(inputs["k_cache"]), ptr(inputs["v_cache"]), ptr(inputs["block_table"]),
        ptr(inputs["context_lens"]), ptr(outputs["out"]),
        b, qh, kvh, d, ps, inputs["block_table"].shape[1], ctypes.c_float(1.0 / math.sqrt(d)),
        ctypes.c_void_p(stream),
    )
    check_status(status, "kloop_paged_decode")


def _expected_tokens_and_pages(shape) -> tuple[float, float]:
    """Sum over the batch of the context lengths and of the pages they occupy (expectations for "random")."""
    b, _, _, _, ps, ctx = _dims(shape)
    lens = fixed_lengths(shape)
    if lens is not None:
        return float(sum(lens)), float(sum(-(-n // ps) for n in lens))
    # len uniform on 1..ctx: E[len] = (ctx + 1) / 2, E[ceil(len / ps)] summed exactly
    pages = sum(-(-n // ps) for n in range(1, ctx + 1)) / ctx
    return b * (ctx + 1) / 2.0, b * pages


def flops(shape):
    _, qh, _, d, _, _ = _dims(shape)
    tokens, _ = _expected_tokens_and_pages(shape)
    return 4.0 * tokens * qh * d  # q.k and p.v, 2 FLOP per multiply-add each


def bytes_moved(shape):
    """K and V rows actually attended + q + out + the block-table entries used + the lengths.

    Exact for "fixed" and "ramp"; the expectation over the length distribution for "random".
    """
    b, qh, kvh, d, _, _ = _dims(shape)
    tokens, pages = _expected_tokens_and_pages(shape)
    kv = tokens * kvh * d * 2 * 2  # K and V, bf16
    q_out = 2 * b * qh * d * 2
    return kv + q_out + pages * 4 + b * 4


def _gather_sdpa(shape, inputs, outputs):
    """What a framework would do: gather the pages into padded [b, kv_heads, T, d] K/V, then SDPA.

    GQA as attention of the `group` query heads of each KV head (as `group` query rows), so no K/V
    copy per query head; a boolean mask hides the positions past each length.
    """
    q, kc, vc = inputs["q"], inputs["k_cache"], inputs["v_cache"]
    bt, lens = inputs["block_table"], inputs["context_lens"]
    b, qh, d = q.shape
    kvh = kc.shape[2]
    rows = torch.arange(b, device=q.device)
    k = _gather(kc, bt, rows).transpose(1, 2)  # [b, kvh, T, d]
    v = _gather(vc, bt, rows).transpose(1, 2)
    tokens = k.shape[2]
    mask = (torch.arange(tokens, device=q.device)[None, :] < lens[:, None]).view(b, 1, 1, tokens)
    o = F.scaled_dot_product_attention(q.view(b, kvh, qh // kvh, d), k, v, attn_mask=mask, scale=1.0 / math.sqrt(d))
    outputs["out"].copy_(o.reshape(b, qh, d))


COMPARATORS = {"gather_sdpa": _gather_sdpa}
