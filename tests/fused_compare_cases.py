"""tools/fused_compare's figures against the torch version of tools.check.compare, case by case: the
same verdict, counts and figures. Run as a script (the CPU test sets TRITON_INTERPRET=1 first, since
Triton reads it when the kernel is defined) or called on a CUDA device by the GPU test."""

from __future__ import annotations

import math
import sys

import torch

from tools import fused_compare
from tools.check import _error_of, compare


def cases(device: str):
    gen = torch.Generator().manual_seed(5)
    n = 3 * fused_compare.BLOCK + 17  # several blocks and a ragged last one
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = torch.randn(n, generator=gen)
        got = (want.double() + 1e-3 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
        yield f"{dtype}-close", got, want, 1e-2, 1e-2, None
        yield f"{dtype}-tight", got, want, 1e-5, 1e-5, None
        bad = got.clone()
        bad[[3, 5000, n - 1]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
        yield f"{dtype}-nonfinite", bad, want, 1e-2, 1e-2, None
        ref, out = want.clone(), got.clone()
        ref[[7, 4100, 9000]] = torch.tensor([-math.inf, math.inf, math.nan])
        out[[7, 4100, 9000]] = torch.tensor([-math.inf, 0.0, math.nan], dtype=dtype)
        yield f"{dtype}-nonfinite-ref", out, ref, 1e-2, 1e-2, None
        ref, out = want.clone(), got.clone()
        ref[[7, 4100]] = torch.tensor([-math.inf, math.inf])
        out[[7, 4100]] = torch.tensor([-math.inf, math.inf], dtype=dtype)
        yield f"{dtype}-matched-inf", out, ref, 1e-2, 1e-2, None
        yield f"{dtype}-norm", got, want, 1.0, 1.0, 1e-6
        yield f"{dtype}-bf16-ref", got, want.to(torch.bfloat16), 1e-2, 1e-2, None
        one = got.clone()
        one[n - 5] += 0.5  # one element out of bound, in the ragged block
        yield f"{dtype}-one-off", one, want, 1e-2, 1e-2, None
        yield f"{dtype}-offset-view", got[1:], want[1:], 1e-2, 1e-2, None  # not 16-byte aligned: copied


def disagreements(device: str) -> list[str]:
    """Every case where the kernel's verdict or figures differ from the torch version's."""
    problems = []
    for label, got, want, atol, rtol, norm_rtol in cases(device):
        got, want = got.to(device), want.to(device)
        if not fused_compare.usable(got, want):
            problems.append(f"{label}: the kernel is not used")
            continue
        figures = fused_compare.figures(got, want, atol, rtol)
        if figures is None:
            problems.append(f"{label}: the kernel failed: {fused_compare._BROKEN}")
            fused_compare._BROKEN = None
            continue
        fused = _error_of("y", figures, want.numel(), norm_rtol)
        fused_compare._BROKEN = "off for the torch version"
        try:
            ref = compare("y", got, want, atol, rtol, norm_rtol)
        finally:
            fused_compare._BROKEN = None
        same = (fused.passed, fused.mismatches, fused.nonfinite) == (ref.passed, ref.mismatches, ref.nonfinite)
        same &= _close(fused.max_abs, ref.max_abs, 1e-6) and _close(fused.norm_rel, ref.norm_rel, 1e-5)
        if not same:
            problems.append(f"{label}: kernel {fused} != torch {ref}")
    return problems


def _close(a: float, b: float, rel: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-12


if __name__ == "__main__":
    found = disagreements(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    print("\n".join(found) or "all cases agree")
    sys.exit(1 if found else 0)
