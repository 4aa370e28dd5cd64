"""The shipped `softmax` task (kernels/softmax), checked without a GPU: what is specific to it (what
every task must pass is in tests/test_kernels.py).

- the manifest and the spec make sense (bf16 inputs with spread, rows of the reference sum to 1,
  the byte count, the torch comparator agrees with the reference);
- the task's tolerance passes a correctly rounded bf16 answer with margin and fails plausible bugs;
- softmax.cu compiles for sm_90a with the default knobs, with every value of each knob (one knob at
  a time), and with the gate's test hook (-DKLOOP_TEST_DELAY_NS), with no register spills.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.fakes import task_fixtures
from tests.kernel_builds import build_variants, every_value_once, spills
from tools.check import compare

CPU = torch.device("cpu")
task, spec = task_fixtures("softmax")


def _close(out: torch.Tensor, ref: torch.Tensor, tol) -> bool:
    """The gate's acceptance rule (tools.check.compare) under the task's tolerance."""
    return compare("y", out, ref, tol.atol, tol.rtol, tol.norm_rtol).passed


# ---- manifest + spec ----------------------------------------------------------------------------

def test_manifest(task):
    m = task.manifest
    assert task.name == "softmax" and task.target == "cuda" and m.arch == "sm_90a"
    assert m.sources == ["softmax.cu"]
    assert task.editable_files() == ["softmax.cu"]
    assert set(m.knobs) == {"THREADS", "VEC", "ONLINE"}
    assert task.knob_defaults() == {"THREADS": 256, "VEC": 1, "ONLINE": 0}
    assert m.min_gain == pytest.approx(0.01)
    assert len(task.bench_shapes) >= 2
    # every timed shape is also checked, and the check shapes include ragged and odd widths
    assert all(s.check for s in task.bench_shapes)
    cols = {int(s.dims["cols"]) for s in task.check_shapes}
    assert 1 in cols
    assert any(c % 2 == 1 and c > 1024 for c in cols)  # odd and long: rows start at every alignment
    assert any(c % 2 == 0 and c % 8 != 0 and c > 1024 for c in cols)  # even but not 16-byte rows
    assert any(c % 8 == 0 for c in cols)  # all rows 16-byte aligned
    for s in task.bench_shapes:
        assert 2 * 2 * s.dims["rows"] * s.dims["cols"] >= 64 * 2**20  # large enough to be memory-bound


def test_inputs_are_bf16_with_spread(spec):
    shape = {"rows": 17, "cols": 4097}
    a = spec.make_inputs(shape, torch.Generator().manual_seed(1234), CPU)["x"]
    assert a.dtype == torch.bfloat16 and a.shape == (17, 4097) and a.is_contiguous()
    plain = [r for r in a.float() if torch.isfinite(r).all() and 1.0 < r.std() < 10]  # spread, not zeros
    assert len(plain) >= 17 - 3 * 2 and len(plain) < 17
    out = spec.make_outputs(shape, {"x": a})["y"]
    assert out.dtype == torch.bfloat16 and out.shape == (17, 4097) and out.is_contiguous()


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 7), (5, 1001), (64, 12345)])
def test_reference_rows_sum_to_one(spec, rows, cols):
    shape = {"rows": rows, "cols": cols}
    inputs = spec.make_inputs(shape, torch.Generator().manual_seed(7), CPU)
    ref = spec.reference(shape, inputs)["y"]
    assert ref.shape == (rows, cols) and ref.dtype == torch.float32
    # masked (-inf) entries and the far tail of large-logit rows are exactly 0; plain rows are all > 0
    assert torch.isfinite(ref).all() and (ref >= 0).all() and (ref > 0).all(-1).any()
    torch.testing.assert_close(ref.double().sum(-1), torch.ones(rows, dtype=torch.float64), atol=1e-5, rtol=0)


def test_bytes_are_one_read_and_one_write_of_bf16(spec, task):
    for s in task.manifest.shapes:
        assert spec.bytes_moved(s.dims) == 4 * s.dims["rows"] * s.dims["cols"]


def _kinds(x):
    """Row indices of each adversarial kind, by what the row holds."""
    masked = {r for r in range(x.shape[0]) if (torch.isinf(x[r]) & (x[r] < 0)).any()}
    flat = {r for r in range(x.shape[0]) if r not in masked and x.shape[1] > 1 and (x[r] == x[r, 0]).all()}
    large = {r for r in range(x.shape[0]) if r not in masked | flat and x[r].abs().max() > 200}
    return large, flat, masked


def test_inputs_hold_adversarial_rows(spec):
    """Large logits, flat rows and -inf entries, an eighth of the rows each at positions drawn from the
    generator (tools.spec.adversarial_rows), never a row without a finite entry; a 1-row matrix plain."""
    shape = {"rows": 64, "cols": 1000}
    x = spec.make_inputs(shape, torch.Generator().manual_seed(5), CPU)["x"].float()
    large, flat, masked = _kinds(x)
    assert len(large) == len(flat) == len(masked) == 8
    for r in masked:
        share = (torch.isinf(x[r]) & (x[r] < 0)).float().mean()
        assert 0.1 < share < 0.4 and torch.isfinite(x[r]).any()
    plain = set(range(64)) - large - flat - masked
    assert torch.isfinite(x[sorted(plain)]).all() and x[sorted(plain)].abs().max() < 100
    # where they sit depends on the seed: not row % 8, nothing a kernel can know
    y = spec.make_inputs(shape, torch.Generator().manual_seed(6), CPU)["x"].float()
    assert _kinds(y) != (large, flat, masked)
    assert any(r % 8 not in (1, 2, 3) for r in large | flat | masked)
    one = spec.make_inputs({"rows": 1, "cols": 8}, torch.Generator().manual_seed(5), CPU)["x"]
    assert torch.isfinite(one).all()


def test_comparator_agrees_with_reference(spec, task):
    assert set(spec.comparators) == {"torch.softmax"}
    shape = {"rows": 33, "cols": 1001}
    inputs = spec.make_inputs(shape, torch.Generator().manual_seed(3), CPU)
    outputs = spec.make_outputs(shape, inputs)
    outputs["y"].fill_(float("nan"))
    spec.comparators["torch.softmax"](shape, inputs, outputs)
    assert _close(outputs["y"], spec.reference(shape, inputs)["y"], task.tolerance("y"))


# ---- the tolerance: right answers pass with margin, plausible bugs fail -----------------------

def _tail_zeroed(x, ref):
    w = ref.bfloat16().clone()
    w[:, -1] = 0  # last (tail) element never computed
    return w


def _tail_shifted(x, ref):
    w = ref.bfloat16().clone()
    k = min(5, x.shape[1] - 1)
    if k > 0:
        w[:, -k:] = ref.bfloat16()[:, -k - 1 : -1]  # tail read one element off
    return w


def _sum_missing_tail(x, ref):
    e = torch.exp(x.float() - x.float().max(-1, keepdim=True).values)
    k = max(1, min(3, x.shape[1] - 1))
    return (e / e[:, :-k].sum(-1, keepdim=True).clamp_min(1e-30)).bfloat16()


def _normaliser_off(x, ref):
    return (ref * 1.03).bfloat16()


def _bf16_exponent_argument(x, ref):
    d = (x.float() - x.float().max(-1, keepdim=True).values).bfloat16().float()  # x - max rounded to bf16
    return (torch.exp(d) / torch.exp(d).sum(-1, keepdim=True)).bfloat16()


def _row_from_neighbour(x, ref):
    w = ref.bfloat16().clone()
    if w.shape[0] > 1:
        w[-1] = w[-2]
    return w


WRONG = [_tail_zeroed, _tail_shifted, _sum_missing_tail, _normaliser_off, _bf16_exponent_argument, _row_from_neighbour]


def test_tolerance_separates_right_from_wrong(spec, task):
    """On the task's (non-bench) check shapes: right answers pass every shape with a 3x margin on
    rtol; each plausible bug fails at least one shape (as it would fail the gate's check)."""
    tol = task.tolerance("y")
    shapes = [s.dims for s in task.check_shapes if not s.bench]
    cases = []
    for i, shape in enumerate(shapes):
        x = spec.make_inputs(shape, torch.Generator().manual_seed(100 + i), CPU)["x"]
        cases.append((shape, x, spec.reference(shape, {"x": x})["y"]))

    for shape, x, ref in cases:
        xf = x.float()
        e = torch.exp2((xf - xf.max(-1, keepdim=True).values) * 1.4426950408889634)  # a typical fast path
        fast = (e * (1.0 / e.sum(-1, keepdim=True))).bfloat16()
        for good in (ref.bfloat16(), fast):
            assert _close(good, ref, tol), shape
            # (atol: bf16 denormals, below 1e-38 in the far tail of large-logit rows, round coarsely)
            assert ((good.double() - ref.double()).abs() <= tol.atol + tol.rtol / 3 * ref.double().abs()).all(), shape

    for wrong in WRONG:
        caught = [shape for shape, x, ref in cases if not _close(wrong(x, ref), ref, tol)]
        assert caught, f"the tolerance passes a wrong answer on every check shape: {wrong.__name__}"


# ---- compiling softmax.cu (through tools.build, as the gate does) -------------------------------

@pytest.fixture(scope="module")
def builds(task, kernel_build_cache):
    """Defaults, every value of each knob (in combinations: tests/kernel_builds.every_value_once), then the
    gate's test hook."""
    configs = every_value_once(task) + [{**task.knob_defaults(), "KLOOP_TEST_DELAY_NS": 10000}]
    return build_variants(task, configs, kernel_build_cache)


def test_every_knob_value_builds_one_kernel_without_spills_or_warnings(task, builds):
    """Beyond the shared suite: no variant spills (not only the defaults), the test hook builds its
    delay kernel, and the compiler has nothing to warn about."""
    assert "defaults" in builds and "KLOOP_TEST_DELAY_NS=10000" in builds
    failures = []
    for label, r in builds.items():
        if not r.ok:
            failures.append(f"{label}: build failed\n{r.error_text()}")
            continue
        names = [k.name for k in r.kernels]
        if len([n for n in names if "softmax_rows" in n]) != 1:
            failures.append(f"{label}: expected one softmax_rows kernel in the ptxas report, got {names}")
        for name, (st, ld) in spills(r).items():
            failures.append(f"{label}: {name} spills {st} bytes stores / {ld} bytes loads")
        if "KLOOP_TEST_DELAY_NS" in label and not any("kloop_test_delay" in n for n in names):
            failures.append(f"{label}: the test-hook build has no kloop_test_delay kernel")
        if "KLOOP_TEST_DELAY_NS" not in label and any("kloop_test_delay" in n for n in names):
            failures.append(f"{label}: the test-hook kernel is built without KLOOP_TEST_DELAY_NS")
        elif not hasattr(ctypes.CDLL(r.lib), "kloop_softmax"):
            failures.append(f"{label}: the library does not export kloop_softmax")
        if r.warnings or "warning" in r.log_tail.lower():
            failures.append(f"{label}: compiler warnings\n" + "\n".join(r.warnings or [r.log_tail]))
    assert not failures, "\n".join(failures)
