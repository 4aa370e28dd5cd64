"""The attention tasks' end-to-end model (tools/e2e.py): a tiny causal transformer LM trained on a
seeded copy task, with a kernel in place of its attention's forward or backward.

The tasks' e2e scripts (read-only, in their folders) are one line each over this module, so the model
lives once, in the installed kloop: `kernels/flash_attn_fwd/e2e.py` trains with the candidate forward
and the reference backward (`train_forward`), a backward task (`flash_attn_bwd`: inputs q, k, v, o,
do, lse -> dq, dk, dv) with the reference forward and the candidate backward (`train_backward`).

Everything comes from `seed` (no downloads): sequences of SEQ tokens over VOCAB symbols in which each
token copies a random earlier one with probability COPY (`batch`); the loss is the next-token
cross-entropy, which only attention can take below the uniform's (the prefix's histogram). Two pre-norm layers of HEADS x HEAD_DIM causal attention and a 4x MLP, AdamW; weights and
activations fp32, q/k/v handed to the kernel in bf16 as the specs' inputs, its bf16 outputs back to
fp32.

The side that is not the candidate is the reference, in fp32 torch: the forward's backward is a
recomputation from q, k, v (never the candidate's output), so a forward task is judged on what its
forward does to training, a backward task on what its gradients do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 16, 48, 16
HEADS, HEAD_DIM, LAYERS = 1, 64, 2
WIDTH = HEADS * HEAD_DIM
LR = 3e-3
COPY = 0.75  # the chance that a token copies an earlier one


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 causal attention, differentiable (the backward's recomputation)."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


def _dims(q: torch.Tensor) -> dict:
    b, h, s, d = q.shape
    return {"batch": b, "heads": h, "seqlen": s, "head_dim": d, "causal": True}


def attention_op(forward=None, backward=None):
    """softmax(q k^T / sqrt(d), causal) v as an autograd function. `forward(dims, {q, k, v}) -> {o, ...}`
    (the forward task's kernel) and `backward(dims, {q, k, v, o, do, lse}) -> {dq, dk, dv, ...}` (the
    backward task's; dims also carry kv_heads = heads); None: the fp32 reference, in torch."""

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            qb, kb, vb = (t.detach().to(torch.bfloat16).contiguous() for t in (q, k, v))
            if forward is not None:
                out = forward(_dims(qb), {"q": qb, "k": kb, "v": vb})["o"]
            else:  # the reference in fp32, rounded as a bf16 forward writes it
                out = _reference_attention(qb.float(), kb.float(), vb.float()).to(torch.bfloat16)
            ctx.save_for_backward(qb, kb, vb, out)
            return out.to(q.dtype)

        @staticmethod
        def backward(ctx, do):
            qb, kb, vb, ob = ctx.saved_tensors
            if backward is not None:
                q, k = qb.float(), kb.float()
                scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
                mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).triu(1)
                lse = torch.logsumexp(scores.masked_fill(mask, float("-inf")), dim=-1).contiguous()
                grads = backward({**_dims(qb), "kv_heads": qb.shape[1]},
                                 {"q": qb, "k": kb, "v": vb, "o": ob.contiguous(),
                                  "do": do.to(torch.bfloat16).contiguous(), "lse": lse})
                return tuple(grads[n].float() for n in ("dq", "dk", "dv"))
            with torch.enable_grad():
                q, k, v = (t.float().requires_grad_(True) for t in (qb, kb, vb))
                o = _reference_attention(q, k, v)
                return torch.autograd.grad(o, (q, k, v), do.float())

    return Attention.apply


class Block(torch.nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.attend = attend
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self.attend(q, k, v).transpose(1, 2).reshape(b, s, WIDTH))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(attend) for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def batch(gen: torch.Generator, device) -> torch.Tensor:
    """Sequences where each token copies a uniformly drawn earlier one with probability COPY (else it
    is fresh): the best prediction of the next token is COPY x the prefix's token histogram + the rest
    uniform, which a causal attention computes (uniform weights over the prefix, token identity in V).
    Learnt smoothly from the start (no phase change: honest rounding does not move when it happens)."""
    fresh = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    copy = torch.rand(BATCH, SEQ, generator=gen) < COPY
    pick = (torch.rand(BATCH, SEQ, generator=gen) * torch.arange(SEQ)).long()  # a position < i
    tokens = fresh.clone()
    for i in range(1, SEQ):
        tokens[:, i] = torch.where(copy[:, i], tokens[torch.arange(BATCH), pick[:, i]], fresh[:, i])
    return tokens.to(device)


def train_forward(kernel, seed: int, steps: int, device: torch.device) -> list[float]:
    """The candidate computes the attention forward; the backward is the reference's."""
    return train(attention_op(forward=kernel), seed, steps, device)


def train_backward(kernel, seed: int, steps: int, device: torch.device) -> list[float]:
    """The candidate computes dQ, dK, dV from q, k, v, o, do, lse; the forward is the reference's."""
    return train(attention_op(backward=kernel), seed, steps, device)


def train(attend, seed: int, steps: int, device: torch.device) -> list[float]:
    torch.manual_seed(seed)  # the initial weights (the judge's global generator: the script's alone)
    model = TinyLM(attend).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        tokens = batch(gen, device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
