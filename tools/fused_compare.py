"""One pass over an output and its reference on the GPU: the figures `tools.check.compare` decides on.

The gate re-checks timed outputs every pass. With torch ops the comparison of a 268M-element output
is some 25 elementwise kernels and their temporaries (about 15 ms on the H200, 40% of a decision's
loop); this Triton kernel reads each side once and writes a few figures per block. It is used only
where both sides are fp32/fp16/bf16 tensors on one CUDA device and the kernel was warmed (`warm`); `compare` runs
its torch version whenever this one says "not passed" (the report of a failure, its worst element
included, comes from one implementation), so an error here can only cost time, never pass an output
the torch version fails, as long as the figures of a passing output are right: tests/test_compare.py
checks them against the torch version, on the CPU through Triton's interpreter and on the GPU.
"""

from __future__ import annotations

import os

import torch

_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
BLOCK = 4096
# per block: non-finite outputs, elements out of bound, max |diff|, max |diff| / scale, sum w^2, sum diff^2,
# finite references
_FIGURES = 7

_KERNEL = None


def _available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        from tools.compare_kernel import compare_kernel

        _KERNEL = compare_kernel
    return _KERNEL


_READY = False  # the kernel compiled and loaded in this process (warm), on a CUDA device
_BROKEN: str | None = None  # why the kernel is not used here (a failed compile or launch)


def warm(device: torch.device) -> None:
    """Compile and load the kernel now, in the judge, before any library is loaded: its one signature
    (fp32 pointers aligned to 16 bytes, an unspecialised 32-bit length) is then in memory, and `figures`
    never launches another, so nothing a runner writes into a cache directory can reach it later.
    The cache is a private directory of this process. A failure leaves the torch version in use."""
    global _READY, _BROKEN
    if device.type != "cuda" or _READY or not _available():
        return
    try:
        import tempfile

        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kloop-judge-triton-")
        g = torch.zeros(2 * BLOCK + 3, device=device)
        _launch(g, g.clone(), 0.0, 0.0)
        torch.cuda.synchronize(device)
        _READY = True
    except Exception as exc:  # noqa: BLE001 - any failure here only means the slower path
        _BROKEN = f"{type(exc).__name__}: {exc}"


def usable(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether the kernel applies: warmed on this CUDA device (or running under Triton's interpreter on
    the CPU, which is how the tests check it there), both sides fp32/fp16/bf16 on one device, fewer
    than 2^31 elements."""
    if _BROKEN or got.dtype not in _DTYPES or want.dtype not in _DTYPES:
        return False
    if got.device != want.device or want.numel() >= 2**31:
        return False
    return (got.device.type == "cuda" and _READY) or (_interpreted() and _available())


def usable_on(device: torch.device) -> bool:
    """Whether this process compares on `device` with the kernel (warmed, not broken since)."""
    return device.type == "cuda" and _READY and not _BROKEN


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _fp32(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    if t.dtype != torch.float32 or t.data_ptr() % 16:  # a fresh fp32 copy: the one signature warm() loaded
        t = t.to(torch.float32, copy=True)
    return t.contiguous()


def figures(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> list[float] | None:
    """[non-finite outputs, out of bound, max abs diff, max rel diff, |ref| (finite part), |diff|, any
    finite reference (1.0/0.0)] as `compare` defines them, in one transfer; None where the kernel failed
    (it is then not used again in this process)."""
    global _BROKEN
    try:
        return _launch(_fp32(got), _fp32(want), atol, rtol)
    except Exception as exc:  # noqa: BLE001 - the caller falls back to the torch version
        _BROKEN = f"{type(exc).__name__}: {exc}"
        return None


def _launch(g: torch.Tensor, w: torch.Tensor, atol: float, rtol: float) -> list[float]:
    n = w.numel()
    blocks = -(-n // BLOCK)
    partial = torch.empty((blocks, _FIGURES), dtype=torch.float64, device=w.device)
    _kernel()[(blocks,)](g, w, partial, n, float(atol), float(rtol), max(float(atol), 1e-30), BLOCK=BLOCK)
    sums = partial[:, [0, 1, 4, 5, 6]].sum(dim=0)
    maxes = partial[:, [2, 3]].amax(dim=0)
    nonfinite, bad, ref_sq, err_sq, finite, max_abs, max_rel = torch.cat([sums, maxes]).tolist()
    return [nonfinite, bad, max_abs, max_rel, ref_sq ** 0.5, err_sq ** 0.5, 1.0 if finite > 0 else 0.0]
