"""examples/decoder_swap.py's plumbing on the CPU: the swapped path (ops with the exported packages'
signatures, here implemented by the tasks' own references) gives the unswapped model's logits, so the
paged-KV layout (scattered block tables, lengths, GQA) and the prefill layout are what the ops expect."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from tools.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def _load_example():
    spec = importlib.util.spec_from_file_location("decoder_swap", ROOT / "examples" / "decoder_swap.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["decoder_swap"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_swapped_attention_gives_the_unswapped_logits():
    ex = _load_example()
    fwd_spec = load_spec(ROOT / "kernels/flash_attn_fwd/spec.py")
    dec_spec = load_spec(ROOT / "kernels/paged_decode/spec.py")

    # the exported ops' argument order (agent/export.py op_signature), computed by each task's reference
    def flash(q, k, v, batch, heads, seqlen, head_dim, causal):
        dims = dict(batch=batch, heads=heads, seqlen=seqlen, head_dim=head_dim, causal=causal)
        ref = fwd_spec.reference(dims, {"q": q, "k": k, "v": v})
        return ref["o"].to(q.dtype), ref["lse"]

    def paged(q, k_cache, v_cache, block_table, context_lens, batch, q_heads, kv_heads, head_dim, page_size, ctx):
        dims = dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, ctx=ctx)
        ref = dec_spec.reference(dims, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,
                                        "context_lens": context_lens})
        return ref["out"].to(q.dtype)

    cfg = ex.Config(vocab=97, layers=2, q_heads=4, kv_heads=2, head_dim=16, mlp=64, page_size=4)
    model = ex.Decoder(cfg, torch.Generator().manual_seed(0), torch.device("cpu"), dtype=torch.float32)
    prompt = torch.randint(0, cfg.vocab, (3, 10), generator=torch.Generator().manual_seed(1))
    ref, tokens, _, _ = ex.generate(model, prompt, 5, ex.TorchAttention(), seed=3)
    got, fed, _, _ = ex.generate(model, prompt, 5, ex.KloopAttention(flash, paged), seed=3, forced=tokens)
    assert torch.equal(fed, tokens) and len(got) == len(ref) == 6
    assert ex.compare(ref, got) < 1e-4
    # and the comparison is not vacuous: a decode that drops the newest token is caught
    def short(q, k_cache, v_cache, block_table, context_lens, *dims):
        return paged(q, k_cache, v_cache, block_table, context_lens - 1, *dims)

    bad, _, _, _ = ex.generate(model, prompt, 5, ex.KloopAttention(flash, short), seed=3, forced=tokens)
    assert ex.compare(ref, bad) > 1e-2
