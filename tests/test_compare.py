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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(6))
def test_the_quick_path_gives_the_general_path_s_figures_exactly(dtype, seed):
    """An output that passes with every value finite takes a shorter path (fewer passes over memory, for the
    gate's re-checks of big outputs); its figures must be the general path's to the bit, and anything else
    (a mismatch, a non-finite value, a norm over its bound) must go the general way."""
    from tools.check import _NARROW_FLOATS, _general, _passing_finite

    gen = torch.Generator().manual_seed(seed)
    want = torch.randn(4099, generator=gen, dtype=torch.float32) * 10 ** (seed - 2)
    got = (want * (1 + 1e-3 * torch.randn(4099, generator=gen))).to(dtype)
    atol, rtol = 2e-2 * 10 ** (seed - 2), 1e-2
    dt = torch.float32 if got.dtype in _NARROW_FLOATS else torch.float64
    g, w = got.to(dt), want.to(dt)
    slow = _general("y", g, w, atol, rtol, 0.05, 4099, (4099,), dt)
    quick = _passing_finite("y", g, w, atol, rtol, 0.05, 4099)
    assert slow.passed and quick is not None
    assert quick.model_dump() == slow.model_dump()
    assert compare("y", got, want, atol, rtol, 0.05).model_dump() == slow.model_dump()
    # what the quick path must hand on: one element out of bounds, a NaN, an inf, a norm over its bound
    for bad in ("mismatch", "nan", "inf", "norm"):
        g2 = g.clone()
        if bad == "mismatch":
            g2[7] = w[7] + 10 * (atol + rtol * abs(float(w[7])))
        elif bad != "norm":
            g2[7] = float(bad)
        assert _passing_finite("y", g2, w, atol, rtol, 0.0 if bad == "norm" else 0.05, 4099) is None, bad
        full = compare("y", g2.to(dtype), want, atol, rtol, 0.0 if bad == "norm" else 0.05)
        assert not full.passed and full.worst_index == [7] or bad == "norm", (bad, full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", range(8))
def test_the_recheck_fast_path_never_passes_what_compare_fails(dtype, seed):
    """tools.check.passes_clearly (the gate's timed re-checks) may say False for a passing output, then
    compare decides; it must never say True where compare fails: errors scaled onto either side of the
    bound, one element at a time and all at once, NaN and inf, a norm over its bound."""
    from tools.check import passes_clearly

    gen = torch.Generator().manual_seed(seed)
    n = 3001
    want = torch.randn(n, generator=gen, dtype=torch.float32) * 10 ** (seed % 4 - 2)
    atol, rtol = 2e-2 * 10 ** (seed % 4 - 2), 1e-2
    bound = atol + rtol * want.abs()
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    clear = (want + 0.3 * bound * sign).to(dtype)
    assert compare("y", clear, want, atol, rtol, 0.05).passed
    assert passes_clearly(clear, want, atol, rtol, 0.05)  # the common case takes the fast path
    for scale in (0.999, 0.9999, 1.0, 1.0001, 1.001, 1.5):
        for which in ("one", "all"):
            got = want.clone()
            if which == "one":
                got[seed * 7] = want[seed * 7] + scale * bound[seed * 7] * sign[seed * 7]
            else:
                got = want + scale * bound * sign
            got = got.to(dtype)
            if passes_clearly(got, want, atol, rtol, None):
                assert compare("y", got, want, atol, rtol, None).passed, (scale, which)
    for bad in (float("nan"), float("inf"), -float("inf")):
        got = clear.clone()
        got[3] = bad
        assert not passes_clearly(got, want, atol, rtol, 0.05)
    assert not passes_clearly(clear, want, atol, rtol, 0.0)  # a norm bound the error exceeds
    assert not passes_clearly(None, want, atol, rtol, 0.05)
    assert not passes_clearly(clear[:-1], want, atol, rtol, 0.05)
