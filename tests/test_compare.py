"""tools.check.compare against a plain fp64 oracle: the same verdict and figures on nasty outputs
(NaN, +-inf, a non-finite reference, values at the tolerance's edge) in every dtype it meets."""

import math

import pytest
import torch

from tools.check import compare


def oracle(got, want, atol, rtol, norm_rtol):
    """Element by element in Python floats: (passed, mismatches, nonfinite, max_abs, norm_rel)."""
    mismatches = nonfinite = 0
    max_abs, err2, ref2 = 0.0, 0.0, 0.0
    for g, w in zip(got.double().flatten().tolist(), want.double().flatten().tolist()):
        if not math.isfinite(w):
            ok = g == w
            mismatches += not ok
            nonfinite += (not math.isfinite(g)) and not ok
            continue
        d = abs(g - w) if math.isfinite(g) else math.inf
        nonfinite += not math.isfinite(g)
        mismatches += not d <= atol + rtol * abs(w)
        max_abs = max(max_abs, d)
        err2 += d * d
        ref2 += w * w
    norm_rel = math.sqrt(err2) / math.sqrt(ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)
    passed = nonfinite == 0 and mismatches == 0 and (norm_rtol is None or norm_rel <= norm_rtol)
    return passed, mismatches, nonfinite, max_abs, norm_rel


def cases():
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        want = torch.randn(257, generator=gen, dtype=torch.float64)
        got = (want + 1e-3 * torch.randn(257, generator=gen, dtype=torch.float64)).to(dtype)
        yield f"{dtype}-close", got, want.float(), 1e-2, 1e-2, None
        yield f"{dtype}-tight", got, want.float(), 1e-5, 1e-5, None
        bad = got.clone()
        bad[[3, 50, 100]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
        yield f"{dtype}-nonfinite", bad, want.float(), 1e-2, 1e-2, None
        ref = want.clone()
        ref[[7, 8, 9]] = torch.tensor([-math.inf, math.inf, math.nan], dtype=torch.float64)
        out = got.clone().double()
        out[[7, 8, 9]] = torch.tensor([-math.inf, 0.0, math.nan], dtype=torch.float64)
        yield f"{dtype}-nonfinite-ref", out.to(dtype), ref.to(dtype if dtype == torch.float64 else torch.float32), 1e-2, 1e-2, None
        yield f"{dtype}-norm", got, want.float(), 1.0, 1.0, 1e-6
    yield "int-exact", torch.arange(2**25, 2**25 + 64, dtype=torch.int64), torch.arange(2**25, 2**25 + 64, dtype=torch.int64), 0.0, 0.0, None
    off = torch.arange(2**25, 2**25 + 64, dtype=torch.int64)
    off[5] += 1  # one apart at 2^25: invisible in fp32, caught in fp64
    yield "int-one-apart", off, torch.arange(2**25, 2**25 + 64, dtype=torch.int64), 0.0, 0.0, None


@pytest.mark.parametrize("label, got, want, atol, rtol, norm_rtol", list(cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_compare_agrees_with_an_fp64_oracle(label, got, want, atol, rtol, norm_rtol):
    err = compare("y", got, want, atol, rtol, norm_rtol)
    passed, mismatches, nonfinite, max_abs, norm_rel = oracle(got, want, atol, rtol, norm_rtol)
    assert (err.passed, err.mismatches, err.nonfinite) == (passed, mismatches, nonfinite), (label, err)
    assert err.max_abs == pytest.approx(max_abs, rel=1e-5, abs=1e-12) or (math.isinf(max_abs) and math.isinf(err.max_abs))
    if math.isfinite(norm_rel):
        assert err.norm_rel == pytest.approx(norm_rel, rel=1e-4, abs=1e-12), (label, err)
    else:
        assert not math.isfinite(err.norm_rel), (label, err)
    if not err.passed and err.mismatches:
        w = want.double().flatten()[math.prod(err.worst_index) if len(err.worst_index) == 1 else 0]
        assert len(err.worst_index) == 1 and err.worst_want == pytest.approx(float(w), nan_ok=True)
