"""The gate's decision from paired timings (Gate.judge), on synthetic A/B reports."""

import math
import random
from pathlib import Path

import pytest

from agent.gate import Gate
from tools.protocol import ABReport, ShapeAB

TASK = Path(__file__).resolve().parents[1] / "kernels" / "matmul_cpu"


@pytest.fixture(scope="module")
def gate():
    return Gate(TASK, "kernels/matmul_cpu")


def shape(name, speedup, noise=0.002, passes=12, ta=1e-3, extra_a=0.0, extra_b=0.0, ok=True, probes=10, seed=0):
    """A shape's report with `passes` passes of synthetic per-call times: A at `ta`, B at ta/speedup, each
    pass off by `noise` (relative, Gaussian, seeded: the same every run). The gate rebuilds every
    speedup and interval from these passes (the fields given here are placeholders it overwrites)."""
    rng = random.Random(f"{name}/{speedup}/{noise}/{seed}")
    tb = ta / speedup
    pass_a = [ta * (1 + noise * rng.gauss(0, 1)) for _ in range(passes)]
    pass_b = [tb * (1 + noise * rng.gauss(0, 1)) for _ in range(passes)]
    return ShapeAB(shape=name, weight=1.0, pairs=8 * passes, speedup=1.0, speedup_lo=1.0, speedup_hi=1.0,
                   time_a=ta, time_b=tb, pass_a=pass_a, pass_b=pass_b, wall_a=ta + 20e-6, wall_b=tb + 20e-6,
                   extra_a=extra_a, extra_b=extra_b, extra_a_se=0.2e-6, idle_cpu_a=0.0, idle_cpu_b=0.0, probes=probes,
                   timed_outputs_ok=ok, timed_outputs_problem=None if ok else "set 0 output c: 7 wrong")


def report(*shapes, stopped="interval tight", look=1):
    return ABReport(shapes=list(shapes), passes=min(len(s.pass_a) for s in shapes), pairs=sum(s.pairs for s in shapes),
                    timing_seconds=1.0, stopped_because=stopped, look=look)


def test_clear_gain_accepted(gate):
    v = gate.judge(report(shape("sq192", 1.05), shape("wide", 1.04)))
    assert v.accepted and v.stage == "accepted"


def test_gain_whose_lower_bound_misses_min_gain_rejected(gate):
    v = gate.judge(report(shape("sq192", 1.008), shape("wide", 1.008)))
    assert not v.accepted and v.stage == "timing" and "lower bound must exceed x1.010" in v.reason


def test_regression_on_one_shape_rejected_despite_overall_gain(gate):
    v = gate.judge(report(shape("sq192", 1.30), shape("wide", 0.93)))
    assert not v.accepted and v.stage == "timing" and "wide" in v.reason and "allowance" in v.reason


def test_wrong_timed_outputs_rejected(gate):
    v = gate.judge(report(shape("sq192", 2.0, ok=False), shape("wide", 2.0)))
    assert not v.accepted and "outputs of timed calls are wrong" in v.reason


def test_work_escaping_the_timed_region_rejected(gate):
    # the candidate's timer says 10x faster, but 0.95 ms per call happens outside what was timed
    escaped = shape("sq192", 10.0, ta=1e-3, extra_b=0.95e-3)
    v = gate.judge(report(escaped, shape("wide", 1.0)))
    assert not v.accepted and "outside the timed region" in v.reason


def test_escape_check_is_like_for_like(gate):
    """Both sides carry the same cold overhead (sync, launch): only the candidate's excess counts,
    and it does not grow with the speedup."""
    for speedup in (1.2, 2.5, 5.5, 20.0):
        same_overhead = shape("sq192", speedup, extra_a=40e-6, extra_b=40e-6)
        v = gate.judge(report(same_overhead))
        assert v.accepted, v.reason


@pytest.mark.parametrize("field", ["extra_b", "extra_a", "extra_a_se", "wall_b", "wall_a"])
@pytest.mark.parametrize("value", [None, float("nan"), float("inf")])
def test_escape_check_fails_closed_without_probes(gate, field, value):
    s = shape("sq192", 2.0)
    setattr(s, field, value)
    v = gate.judge(report(s))
    assert not v.accepted and v.stage == "timing" and "integrity probes missing" in v.reason


def test_no_probes_fails_closed(gate):
    v = gate.judge(report(shape("sq192", 2.0, probes=0)))
    assert not v.accepted and "integrity probes missing" in v.reason


def test_wide_interval_is_undecided_not_regression(gate):
    """A/A on a loaded machine: x0.8 with an interval from x0.6 to x1.3 decides nothing."""
    noisy = shape("sq192", 0.8, noise=0.3, passes=6)
    v = gate.judge(report(noisy, stopped="time cap"))
    assert not v.accepted and v.stage == "undecided" and "undecided (noisy machine)" in v.reason
    assert "regression" not in v.reason.split(";")[0]


def test_wide_interval_around_a_gain_is_undecided(gate):
    v = gate.judge(report(shape("sq192", 1.5, noise=0.4, passes=6), stopped="time cap"))
    assert not v.accepted and v.stage == "undecided"


def test_regression_needs_the_whole_interval_below_the_allowance(gate):
    # x0.93 but the interval reaches above x0.95 = 1 - 0.05: maybe not a regression; its upper bound is
    # still below x1.01, so it is rejected as not faster, never called a regression
    v = gate.judge(report(shape("sq192", 0.93, noise=0.03), stopped="time cap"))
    assert 0.95 < v.ab.shapes[0].speedup_hi < 1.01, v.reason
    assert v.stage == "timing" and not v.accepted and v.reason.startswith("not measurably faster"), v.reason
    # the same shape beside a large gain elsewhere (the workload may be faster): undecided, not a regression
    v = gate.judge(report(shape("sq192", 0.93, noise=0.03), shape("wide", 1.6), stopped="time cap"))
    assert v.stage == "undecided" and not v.accepted and "sq192 may or may not regress" in v.reason, v.reason
    # the whole interval below x0.95: a regression
    v = gate.judge(report(shape("sq192", 0.90)))
    assert v.stage == "timing" and "regression beyond the allowance" in v.reason


def test_gain_with_one_shape_possibly_regressed_is_not_accepted(gate):
    v = gate.judge(report(shape("sq192", 1.5), shape("wide", 0.96, noise=0.015)))
    assert v.ab.shapes[1].speedup_lo < 0.95 < v.ab.shapes[1].speedup_hi, v.reason
    assert not v.accepted and v.stage == "undecided" and "wide" in v.reason


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1e-3])
def test_a_pass_time_not_finite_and_positive_decides_nothing(gate, bad):
    s = shape("sq192", 2.0)
    s.pass_b[3] = bad
    v = gate.judge(report(s))
    assert not v.accepted and v.stage in ("timing", "undecided"), v.reason


def test_a_speedup_not_finite_is_undecided_with_the_seconds_it_advises_as_data(gate, monkeypatch):
    """Defence in depth (the estimate clamps its figures): were a speedup still not finite, the verdict
    is undecided and its advised seconds are data as well as text (the tuner re-submits with them)."""
    s = shape("sq192", 2.0)
    ab = report(s)
    real = Gate.estimated

    def broken(self, ab):
        ab, crit = real(self, ab)
        ab.speedup = math.nan
        return ab, crit

    monkeypatch.setattr(Gate, "estimated", broken)
    v = gate.judge(ab)
    assert v.stage == "undecided" and "the speedup is not finite" in v.reason, v.reason
    assert v.decide_seconds is not None and f"--gate-seconds {v.decide_seconds}" in v.reason, v.reason


def test_time_below_the_physics_floor_is_rejected_as_impossible(gate):
    s = shape("sq192", 50.0)  # tb = 20 us
    s.floor_s = 100e-6
    v = gate.judge(report(s))
    assert not v.accepted and v.stage == "timing" and "faster than physics allows" in v.reason and "sq192" in v.reason


def test_floor_above_an_honest_time_changes_nothing(gate):
    s = shape("sq192", 1.5)
    s.floor_s = 1e-6
    assert gate.judge(report(s)).accepted


def test_best_much_slower_than_its_baseline_is_undecided(gate):
    s = shape("sq192", 3.0, ta=1e-3)
    s.baseline_a = 0.2e-3  # the best read 5x faster when it was accepted
    v = gate.judge(report(s))
    assert not v.accepted and v.stage == "undecided" and "best slower than its baseline" in v.reason
    s.baseline_a = 0.9e-3  # within the limit: decided as usual
    assert gate.judge(report(s)).accepted


def test_work_after_return_over_all_timed_calls_is_caught_below_the_probe_bound(gate):
    s = shape("sq192", 1.3, ta=2e-3)  # the probes see nothing
    s.after_return_a, s.after_return_b = 5e-6, 0.3e-3
    v = gate.judge(report(s))
    assert not v.accepted and "outside the timed region" in v.reason and "after return" in v.reason


def test_timing_that_left_out_a_bench_shape_is_rejected(gate):
    """A real decision must measure every bench shape (fail closed): a gain on some says nothing of the rest."""
    from types import SimpleNamespace

    from tools.build import BuildResult

    built, best = (BuildResult(ok=True, key=k, lib=f"/x/{k}.so", build_dir="/x") for k in ("cand", "best"))
    res = SimpleNamespace(ok=True, error=None, device=None,
                          ab=report(shape("sq192", 2.0)))
    v = gate._timed_verdict(res, built, best, None, 1, 2)
    assert not v.accepted and v.stage == "timing"
    assert "every bench shape" in v.reason and "wide" in v.reason
    res.ab = report(shape("sq192", 2.0), shape("wide", 2.0))
    assert gate._timed_verdict(res, built, best, None, 1, 2).accepted


def test_per_shape_times_are_the_estimate(gate):
    """The verdict's per-shape times are the mean per call of the very pass sums its speedups come from:
    a verdict that says faster never shows per-shape times that say no faster."""
    v = gate.judge(report(shape("sq192", 1.3), shape("wide", 1.1)))
    assert v.accepted, v.reason
    for s in v.ab.shapes:
        assert s.time_a == pytest.approx(sum(s.pass_a) / len(s.pass_a))
        assert s.speedup == pytest.approx(s.time_a / s.time_b)
    total_a = sum(s.weight * s.time_a for s in v.ab.shapes)
    total_b = sum(s.weight * s.time_b for s in v.ab.shapes)
    assert v.speedup == pytest.approx(total_a / total_b)


def test_figures_in_the_report_are_not_believed(gate):
    """The gate decides from the per-pass times alone: a report claiming x3 over passes that say x1 is not accepted."""
    s = shape("sq192", 1.0)
    s.speedup, s.speedup_lo, s.speedup_hi = 3.0, 2.9, 3.1
    r = report(s)
    r.speedup, r.speedup_lo, r.speedup_hi = 3.0, 2.9, 3.1
    v = gate.judge(r)
    assert not v.accepted and v.speedup == pytest.approx(1.0, abs=0.01), v.reason


def test_an_interval_wider_than_the_noise_limit_decides_nothing(gate):
    """The H200 A/A that was accepted at x1.857 [1.159, 2.975] after 20 pairs: its lower bound clears
    x1.01, but an interval that wide is noise, never an accept (nor a regression)."""
    for speedup in (1.857, 0.5):
        v = gate.judge(report(shape("sq192", speedup, noise=0.25, passes=5, seed=3)))
        assert not v.accepted and v.stage == "undecided" and "noise limit" in v.reason, v.reason


def test_fewer_than_min_passes_decide_nothing(gate):
    from tools.ab import MIN_PASSES

    v = gate.judge(report(shape("sq192", 2.0, passes=MIN_PASSES - 1), stopped="time cap"))
    assert not v.accepted and v.stage == "undecided" and f"fewer than {MIN_PASSES} passes" in v.reason, v.reason
    assert "re-submit the same change with --gate-seconds 2" in v.reason, v.reason  # 3 passes in 1 s: 4 need ~2 s
    assert v.decide_seconds == 2
    assert gate.judge(report(shape("sq192", 2.0, passes=MIN_PASSES))).accepted


def test_later_looks_at_the_same_best_need_more_evidence(gate):
    """Each timed look at one best spends from one budget: what the first look accepts, the 50th does not."""
    s = shape("sq192", 1.02, noise=0.004, passes=10, seed=1)
    first = gate.judge(report(s, look=1))
    assert first.accepted, first.reason
    later = gate.judge(report(s, look=50))
    assert not later.accepted and "look 50" in later.reason, later.reason
    assert later.ab.speedup_lo < first.ab.speedup_lo


def _probe_row(ta, extras_a, extras_b):
    """A shape whose probe figures are computed from raw probe extras exactly as tools/ab.py does."""
    from tools.ab import _low_quartile
    from tools.stats import robust_se_of_quartile

    s = shape("sq192", 1.2, ta=ta)
    s.extra_a, s.extra_b = _low_quartile(extras_a), _low_quartile(extras_b)
    s.extra_a_se = robust_se_of_quartile(extras_a)
    s.probes = min(len(extras_a), len(extras_b))
    return s


@pytest.mark.parametrize("ta, base, jitter", [(16e-6, 4e-6, 0.3e-6), (1e-3, 30e-6, 5e-6)])
def test_ten_percent_hidden_work_is_caught_at_both_scales(gate, ta, base, jitter):
    """16 us and 1 ms kernels, probe noise as measured (cold-probe extras a few us apart): hidden work
    of 10% of the best's time is over the allowance; an honest candidate's own draws are not."""
    rng = random.Random(int(ta * 1e9))
    probes = 16  # a decision's: PROBES_PER_PASS x passes
    for trial in range(20):
        a = [base + abs(rng.gauss(0, jitter)) for _ in range(probes)]
        honest = [base + abs(rng.gauss(0, jitter)) for _ in range(probes)]
        hidden = [x + 0.10 * ta for x in (base + abs(rng.gauss(0, jitter)) for _ in range(probes))]
        assert not gate._escaped(_probe_row(ta, a, honest)), (trial, gate.escape_allowance(_probe_row(ta, a, honest)))
        assert gate._escaped(_probe_row(ta, a, hidden)), (trial, gate.escape_allowance(_probe_row(ta, a, hidden)))
    # the allowance scales with the best's spread, not with a fixed 30 us + 25%
    assert gate.escape_allowance(_probe_row(ta, a, honest)) < 0.1 * ta


def test_the_timing_line_says_when_the_host_refused_the_pinning(gate):
    placed = report(shape("m", 1.5))
    assert "not pinned" not in gate.judge(placed).summary()
    refused = report(shape("m", 1.5)).model_copy(update={"placement_error": "CPU placement refused: [Errno 1] EPERM"})
    line = next(x for x in gate.judge(refused).summary().splitlines() if x.strip().startswith("timing:"))
    assert "pairs not pinned to one CPU (CPU placement refused: [Errno 1] EPERM)" in line
