"""Spec of the flash_attn_bwd task: inputs (Q, K, V, dO and the forward's O, LSE), the fp32 autograd
reference, the ctypes call, FLOP/byte counts, SDPA-backward comparators.

Read-only: the gate takes this file from the run's base commit, never from a candidate.

    S = Q K^T * scale (causal: S[i, j] = -inf for j > i),  P = softmax(S),  O = P V
    dQ, dK, dV = the gradients of sum(O * dO) w.r.t. Q, K, V            bf16, like Q, K, V

Q, O, dO: [batch, heads, seqlen, d]; K, V: [batch, kv_heads, seqlen, d] (GQA: query head h uses kv
head h // (heads / kv_heads), and dK, dV sum over each kv head's group). scale = 1 / sqrt(head_dim).
O (bf16) and LSE (fp32, natural log of the scaled scores' row sums) are what an accurate forward
gives for these Q, K, V: computed here in fp32 (fp64 on a GPU where TF32 may be on, check shapes),
O rounded to bf16 as a bf16 forward kernel would. The reference recomputes the forward from Q, K,
V in fp32 (fp64 as above) and differentiates it with torch autograd, with Delta = rowsum(dO * O)
taken from the given (bf16) O as every FlashAttention backward takes it (tools/attention_ref.py:
an LSE term in the loss); otherwise O's rounding, the forward's error, would dominate dQ on
near-one-hot rows (a 10% norm error on "ramp" for an otherwise exact backward).

Workspaces the kernel may use (outputs the check does not compare; poisoned with NaN before every
checked call, so a kernel must initialise what it reads): ws_delta fp32 [batch, heads, seqlen],
ws_dq fp32 like Q, ws_dk and ws_dv fp32 like K.

Kinds (the shape's `inputs` dim; check shapes only):
    "large"  q, k randn * sqrt(LARGE_SCORE_STD): scores ~N(0, 30^2), near one-hot rows: an exp of S
             without the LSE subtracted overflows, scores rounded to bf16 are off by ~0.25
(The forward's "ramp" kind is not used: a backward keeps no running max, and its keys' large shared
component makes dQ a near-cancelling sum whose bf16-dS error, ~5% of the norm, no honest bf16
backward avoids.)
"""

from __future__ import annotations

import ctypes
import math

import torch

from tools.attention_ref import PerInputCache, attention_backward, attention_forward, reference_dtype
from tools.spec import check_status, ptr

ENTRY = "kloop_flash_attn_bwd"
INPUT_KINDS = ("normal", "large")
LARGE_SCORE_STD = 30.0
# inputs whose scores take more than this many elements get their O, LSE in fp32 (the bench shapes:
# fp64 there would take tens of seconds); the check shapes are far below it
_PRECISE_LIMIT = 1 << 26


def _dims(shape: dict) -> tuple[int, int, int, int, int, bool]:
    b, h, s, d = (int(shape[k]) for k in ("batch", "heads", "seqlen", "head_dim"))
    hkv = int(shape.get("kv_heads", h))
    if hkv < 1 or h % hkv:
        raise ValueError(f"heads = {h} must be a multiple of kv_heads = {hkv}")
    return b, h, hkv, s, d, bool(shape["causal"])


def scale_of(shape: dict) -> float:
    return 1.0 / math.sqrt(int(shape["head_dim"]))


def input_kind(shape: dict) -> str:
    kind = str(shape.get("inputs", "normal"))
    if kind not in INPUT_KINDS:
        raise ValueError(f"inputs = {kind!r}: expected one of {INPUT_KINDS}")
    return kind


def make_inputs(shape: dict, gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    b, h, hkv, s, d, causal = _dims(shape)
    kind = input_kind(shape)
    dev = gen.device

    def draw(heads: int) -> torch.Tensor:
        return torch.randn((b, heads, s, d), generator=gen, device=dev, dtype=torch.float32)

    q, k, v, do = draw(h), draw(hkv), draw(hkv), draw(h)
    if kind == "large":
        q.mul_(math.sqrt(LARGE_SCORE_STD))
        k.mul_(math.sqrt(LARGE_SCORE_STD))

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=torch.bfloat16).contiguous()

    q, k, v, do = cast(q), cast(k), cast(v), cast(do)
    dtype = reference_dtype(q) if b * h * s * s <= _PRECISE_LIMIT else torch.float32
    o, lse = attention_forward(q, k, v, causal, scale_of(shape), dtype)
    return {"q": q, "k": k, "v": v, "o": cast(o), "do": do, "lse": lse.float().contiguous()}


def make_outputs(shape: dict, inputs: dict) -> dict[str, torch.Tensor]:
    b, h, hkv, s, d, _ = _dims(shape)
    dev = inputs["q"].device

    def empty(heads: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((b, heads, s, d), device=dev, dtype=dtype)

    return {
        "dq": empty(h, torch.bfloat16), "dk": empty(hkv, torch.bfloat16), "dv": empty(hkv, torch.bfloat16),
        "ws_delta": torch.empty((b, h, s), device=dev, dtype=torch.float32),
        "ws_dq": empty(h, torch.float32), "ws_dk": empty(hkv, torch.float32), "ws_dv": empty(hkv, torch.float32),
    }


def reference(shape: dict, inputs: dict) -> dict[str, torch.Tensor]:
    causal = _dims(shape)[5]
    dtype = reference_dtype(inputs["q"])
    dq, dk, dv = attention_backward(inputs["q"], inputs["k"], inputs["v"], inputs["do"], causal, scale_of(shape), dtype,
                                    o=inputs["o"])
    return {"dq": dq.float(), "dk": dk.float(), "dv": dv.float()}


def setup(lib) -> None:
    fn = getattr(lib, ENTRY)
    fn.argtypes = [ctypes.c_void_p] * 13 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p]
    fn.restype = ctypes.c_int


def launch(lib, shape: dict, inputs: dict, outputs: dict, stream: int) -> None:
    b, h, hkv, s, d, causal = _dims(shape)
    status = getattr(lib, ENTRY)(
        *(ptr(inputs[n]) for n in ("q", "k", "v", "o", "do", "lse")),
        *(ptr(outputs[n]) for n in ("dq", "dk", "dv", "ws_delta", "ws_dq", "ws_dk", "ws_dv")),
        b, h, hkv, s, d, int(causal), ctypes.c_float(scale_of(shape)), ctypes.c_void_p(stream or None),
    )
    check_status(status, ENTRY)


def flops(shape: dict) -> float:
    b, h, _, s, d, causal = _dims(shape)
    # five matmuls of 2*s*s*d (S, dP, dV, dK, dQ): 2.5x the forward's, the FlashAttention papers' count
    # (the recomputation of S is counted once)
    total = 10.0 * b * h * s * s * d
    return total / 2 if causal else total


def bytes_moved(shape: dict) -> float:
    b, h, hkv, s, d, _ = _dims(shape)
    q_like, kv_like = b * h * s * d, b * hkv * s * d
    # read q, o, do, k, v (bf16) and lse (fp32); write dq, dk, dv (bf16)
    return 2.0 * (3 * q_like + 2 * kv_like) + 4.0 * b * h * s + 2.0 * (q_like + 2 * kv_like)


def _sdpa_backward(backend_name: str):
    """The backward of torch SDPA (through autograd) in one backend: the forward graph is built once
    per input set and kept (the timed call is the backward alone, retain_graph); GQA by repeating
    K/V inside the graph, so dK/dV come back summed over the group. For timing, not checked."""
    cache = PerInputCache()

    def forward(shape: dict, inputs: dict):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (inputs[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v"))
        group = q.shape[1] // k.shape[1]
        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                                 is_causal=_dims(shape)[5], scale=scale_of(shape))
        return (q, k, v), out

    def run(shape: dict, inputs: dict, outputs: dict) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        leaves, out = cache.get(inputs, ("q", "k", "v"), (_dims(shape)[5],), lambda: forward(shape, inputs))
        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            dq, dk, dv = torch.autograd.grad(out, leaves, inputs["do"], retain_graph=True)
        outputs["dq"].copy_(dq)
        outputs["dk"].copy_(dk)
        outputs["dv"].copy_(dv)

    run.__name__ = f"sdpa_{backend_name.lower()}_backward"
    return run


COMPARATORS = {
    "sdpa_flash_bwd": _sdpa_backward("FLASH_ATTENTION"),
    "sdpa_cudnn_bwd": _sdpa_backward("CUDNN_ATTENTION"),
}
