"""examples/decoder_swap.py's plumbing on the CPU: the swapped path (ops with the exported packages'
signatures, here implemented by the tasks' own references) gives the unswapped model's logits, so the
paged-KV layout (scattered block tables, lengths, GQA) and the prefill layout are what the ops expect."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.script_module import load_script
from tools.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def _load_example():
    return load_script("examples/decoder_swap.py")


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


def test_the_yardstick_is_fp32_attention_and_the_bound_follows_torchs_own_noise():
    """In a bf16 model, torch's bf16 SDPA sits a little off the fp32-attention model (the noise the bound
    scales with); a swapped decode that drops the newest token sits far outside that bound."""
    ex = _load_example()
    dec_spec = load_spec(ROOT / "kernels/paged_decode/spec.py")

    def paged_short(q, k_cache, v_cache, block_table, context_lens, batch, q_heads, kv_heads, head_dim, page_size, ctx):
        dims = dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, ctx=ctx)
        ref = dec_spec.reference(dims, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,
                                        "context_lens": context_lens - 1})
        return ref["out"].to(q.dtype)

    cfg = ex.Config(vocab=97, layers=2, q_heads=4, kv_heads=2, head_dim=16, mlp=64, page_size=4)
    model = ex.Decoder(cfg, torch.Generator().manual_seed(0), torch.device("cpu"))  # bf16, as on the GPU
    prompt = torch.randint(0, cfg.vocab, (3, 10), generator=torch.Generator().manual_seed(1))
    ref, tokens, _, _ = ex.generate(model, prompt, 5, ex.TorchAttention(), seed=3)
    exact, _, _, _ = ex.generate(model, prompt, 5, ex.TorchAttention(fp32=True), seed=3, forced=tokens)
    noise = ex.compare(exact, ref)
    assert 0 < noise < 0.2, noise
    flash = ex.TorchAttention().prefill  # an honest prefill in the exported op's place
    bad, _, _, _ = ex.generate(model, prompt, 5, ex.KloopAttention(
        lambda q, k, v, *dims: (flash(q, k, v), None), paged_short), seed=3, forced=tokens)
    assert ex.compare(exact, bad) > ex.allowed(noise, 0.05, 2.0)
    assert ex.allowed(0.2, 0.05, 2.0) == 0.4 and ex.allowed(0.01, 0.05, 2.0) == 0.05
