"""A small decoder with its attention swapped for kloop-exported ops: logits checked, tokens/s before and after.

    kloop export RUN_FLASH -o pkgs/flash && kloop export RUN_DECODE -o pkgs/decode
    pip install pkgs/flash pkgs/decode
    python examples/decoder_swap.py                 # on the GPU the kernels were judged on

The model is pure torch with random weights (no download): token embedding, `layers` pre-norm blocks
(RMSNorm, attention with grouped KV heads, a SiLU MLP), a tied output head, bf16. Two attention
paths, chosen per run:

    torch   prefill: F.scaled_dot_product_attention (causal), decode: the KV pages gathered, then SDPA
    kloop   prefill: torch.ops.kloop.flash_attn_fwd (q, k, v [batch, heads, seq, head_dim]; KV heads
            repeated to the query heads, as that task has no GQA), decode: torch.ops.kloop.paged_decode
            over the paged KV cache (the layout serving engines use, below)

The KV cache is paged as in vLLM: a pool `k_cache`, `v_cache` [num_pages, page_size, kv_heads, head_dim],
a `block_table` [batch, max_pages] naming each sequence's pages (scattered at random here, as an
allocator leaves them), and `context_lens` [batch]. Both paths write the same cache, so the decode
step of each reads exactly what the other would.

The logits after prefill and after every decode step are compared with those of the same model whose
attention runs in fp32 (SDPA on upcast inputs): the run fails (exit 1) if the swapped model sits further
from them than `--factor` times torch's own bf16 attention does (or `--tolerance`, whichever is larger).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Config:
    vocab: int = 8192
    layers: int = 4
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 8192
    page_size: int = 16

    @property
    def width(self) -> int:
        return self.q_heads * self.head_dim


class Decoder(torch.nn.Module):
    def __init__(self, cfg: Config, gen: torch.Generator, device, dtype=torch.bfloat16):
        super().__init__()
        self.cfg = cfg
        w, kvw = cfg.width, cfg.kv_heads * cfg.head_dim

        def param(*shape, std):
            return torch.nn.Parameter((torch.randn(*shape, generator=gen) * std).to(device, dtype), requires_grad=False)

        self.embed = param(cfg.vocab, w, std=1.0)
        self.blocks = []
        for _ in range(cfg.layers):
            self.blocks.append({
                "wq": param(w, w, std=w ** -0.5), "wk": param(kvw, w, std=w ** -0.5), "wv": param(kvw, w, std=w ** -0.5),
                "wo": param(w, w, std=w ** -0.5), "up": param(cfg.mlp, w, std=w ** -0.5),
                "gate": param(cfg.mlp, w, std=w ** -0.5), "down": param(w, cfg.mlp, std=cfg.mlp ** -0.5)})

    @staticmethod
    def norm(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def logits(self, x):
        return (self.norm(x) @ self.embed.t()).float()


class PagedCache:
    """Per layer a page pool for K and V, one block table and the context lengths (shared by the layers)."""

    def __init__(self, cfg: Config, batch: int, capacity: int, gen: torch.Generator, device, dtype=torch.bfloat16):
        self.cfg = cfg
        self.max_pages = -(-capacity // cfg.page_size)
        pool = batch * self.max_pages + max(1, batch * self.max_pages // 4)
        perm = torch.randperm(pool, generator=gen)[: batch * self.max_pages]
        self.block_table = perm.reshape(batch, self.max_pages).to(device, torch.int32)
        shape = (pool, cfg.page_size, cfg.kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.lens = torch.zeros(batch, device=device, dtype=torch.int32)

    def write(self, layer: int, start: int, k, v) -> None:
        """k, v [batch, tokens, kv_heads, head_dim] at positions start.. of every sequence."""
        b, t = k.shape[:2]
        pos = torch.arange(start, start + t, device=k.device)
        pages = self.block_table[:, pos // self.cfg.page_size].long()  # [batch, tokens]
        slots = (pos % self.cfg.page_size).expand(b, t)
        self.k[layer][pages, slots] = k
        self.v[layer][pages, slots] = v

    def gathered(self, layer: int, length: int):
        """The first `length` tokens of every sequence: [batch, length, kv_heads, head_dim] (a copy)."""
        b = self.block_table.shape[0]
        k = self.k[layer][self.block_table.long()].reshape(b, -1, self.cfg.kv_heads, self.cfg.head_dim)
        v = self.v[layer][self.block_table.long()].reshape(b, -1, self.cfg.kv_heads, self.cfg.head_dim)
        return k[:, :length], v[:, :length]


# ---- the two attention paths -------------------------------------------------------------------

class TorchAttention:
    """torch's SDPA in the model's dtype, or (fp32=True) on inputs upcast to fp32, its output rounded back:
    the yardstick both bf16 paths are measured against."""

    def __init__(self, fp32: bool = False):
        self.fp32 = fp32
        self.name = "fp32" if fp32 else "torch"

    def _sdpa(self, q, k, v, causal: bool):
        if not self.fp32:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        group = q.shape[1] // k.shape[1]  # repeated, not enable_gqa: fp32 then takes a fused kernel, not the math path
        k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q.float(), k, v, is_causal=causal).to(q.dtype)

    def prefill(self, q, k, v):
        """q [b, qh, s, d], k, v [b, kvh, s, d] -> [b, qh, s, d]."""
        return self._sdpa(q, k, v, causal=True)

    def decode(self, q, cache: PagedCache, layer: int, length: int):
        """q [b, qh, d] -> [b, qh, d], over the first `length` cached tokens of each sequence."""
        k, v = cache.gathered(layer, length)
        return self._sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), causal=False)[:, :, 0]


class KloopAttention:
    name = "kloop"

    def __init__(self, fwd=None, dec=None):
        self.fwd = fwd or torch.ops.kloop.flash_attn_fwd
        self.dec = dec or torch.ops.kloop.paged_decode

    def prefill(self, q, k, v):
        b, qh, s, d = q.shape
        group = qh // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        o, _lse = self.fwd(q, k, v, b, qh, s, d, True)
        return o

    def decode(self, q, cache: PagedCache, layer: int, length: int):
        b, qh, d = q.shape
        cfg = cache.cfg
        return self.dec(q, cache.k[layer], cache.v[layer], cache.block_table, cache.lens,
                        b, qh, cfg.kv_heads, d, cfg.page_size, cache.max_pages * cfg.page_size)


def forward(model: Decoder, tokens, cache: PagedCache, start: int, attn):
    """tokens [batch, t] at positions start..start+t-1 -> logits of the last position [batch, vocab]."""
    cfg = model.cfg
    b, t = tokens.shape
    x = model.embed[tokens]
    for i, p in enumerate(model.blocks):
        h = model.norm(x)
        q = (h @ p["wq"].t()).view(b, t, cfg.q_heads, cfg.head_dim)
        k = (h @ p["wk"].t()).view(b, t, cfg.kv_heads, cfg.head_dim)
        v = (h @ p["wv"].t()).view(b, t, cfg.kv_heads, cfg.head_dim)
        cache.write(i, start, k, v)
        if start == 0:
            a = attn.prefill(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
            a = a.transpose(1, 2).reshape(b, t, cfg.width)
        else:
            assert t == 1, "decode takes one token per sequence"
            cache.lens.fill_(start + 1)
            a = attn.decode(q[:, 0].contiguous(), cache, i, start + 1).reshape(b, 1, cfg.width)
        x = x + a @ p["wo"].t()
        h = model.norm(x)
        x = x + (F.silu(h @ p["gate"].t()) * (h @ p["up"].t())) @ p["down"].t()
    return model.logits(x[:, -1])


def generate(model, prompt, new_tokens: int, attn, seed: int, forced=None):
    """Greedy decoding (or the tokens `forced` [batch, new_tokens], so two paths see the same inputs);
    returns the logits after prefill and after each step, the tokens fed, and the seconds of each phase."""
    cfg = model.cfg
    dev = prompt.device
    b, s = prompt.shape
    cache = PagedCache(cfg, b, s + new_tokens, torch.Generator().manual_seed(seed), dev, model.embed.dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    logits = [forward(model, prompt, cache, 0, attn)]
    sync()
    t1 = time.perf_counter()
    fed = []
    for step in range(new_tokens):
        tok = logits[-1].argmax(-1, keepdim=True) if forced is None else forced[:, step:step + 1]
        fed.append(tok)
        logits.append(forward(model, tok, cache, s + step, attn))
    sync()
    return logits, torch.cat(fed, 1) if fed else None, t1 - t0, time.perf_counter() - t1


def compare(ref, got) -> float:
    """The largest logit difference, relative to the reference logits' spread."""
    return max(float((a.float() - b.float()).abs().max() / a.float().std()) for a, b in zip(ref, got))


def allowed(torch_error: float, tolerance: float, factor: float) -> float:
    """How far the swapped model's logits may sit from the fp32-attention model's: `factor` x torch's own bf16
    attention's distance from it (the noise a bf16 attention brings to this model), and never less than
    `tolerance`. (A fixed bound alone failed an honest swap on the H200: four bf16 layers of 4096 put torch's
    own flash path 0.2 standard deviations from fp32 attention at the largest of 4.3M logits.)"""
    return max(tolerance, factor * torch_error)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="logit difference from the fp32-attention model always allowed, relative to the logits' "
                         "standard deviation")
    ap.add_argument("--factor", type=float, default=2.0,
                    help="the swapped model may sit this many times torch's own bf16 distance from the fp32-attention model")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs the CUDA GPU the exported kernels were built for", file=sys.stderr)
        return 2
    try:
        import kloop_flash_attn_fwd  # noqa: F401  (registers torch.ops.kloop.flash_attn_fwd)
        import kloop_paged_decode  # noqa: F401
    except ImportError as exc:
        print(f"{exc}: install the exported packages first (kloop export ... -o DIR; pip install DIR)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    cfg = Config(layers=args.layers)
    model = Decoder(cfg, torch.Generator().manual_seed(args.seed), dev)
    prompt = torch.randint(0, cfg.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(args.seed + 1)).to(dev)
    attns = [TorchAttention(), KloopAttention()]
    with torch.inference_mode():
        for attn in attns:  # warm-up: builds, autotuning, allocator
            generate(model, prompt[:, :256], 2, attn, args.seed)
        results = {"torch": generate(model, prompt, args.new, attns[0], args.seed)}
        # the same tokens into every model (teacher forcing): one flipped argmax must not fork the comparison
        forced = results["torch"][1]
        results["kloop"] = generate(model, prompt, args.new, attns[1], args.seed, forced=forced)
        exact = generate(model, prompt, args.new, TorchAttention(fp32=True), args.seed, forced=forced)[0]
    ref, got = results["torch"][0], results["kloop"][0]
    torch_error, kloop_error = compare(exact, ref), compare(exact, got)
    bound = allowed(torch_error, args.tolerance, args.factor)
    same_tokens = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ref, got))
    total = sum(a.shape[0] for a in ref)
    name = torch.cuda.get_device_name()
    print(f"decoder: {cfg.layers} layers, width {cfg.width}, {cfg.q_heads}/{cfg.kv_heads} heads x {cfg.head_dim}, "
          f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens; {name}, torch {torch.__version__}")
    print(f"{'attention':<10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for a in attns:
        _, _, pre, dec = results[a.name]
        print(f"{a.name:<10} {args.batch * args.prompt / pre:>14,.0f} {args.batch * args.new / dec:>13,.0f}")
    print(f"logits against the model with fp32 attention (largest difference, in standard deviations of the logits): "
          f"torch {torch_error:.4f}, kloop {kloop_error:.4f} (allowed {bound:.4f}: {args.factor:g} x torch's, at least "
          f"{args.tolerance:g}); kloop against torch {compare(ref, got):.4f}; greedy next token the same as torch's in "
          f"{same_tokens} of {total} positions")
    return 0 if kloop_error <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
