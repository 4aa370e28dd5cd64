"""The gate's decision from paired timings (Gate.judge), on synthetic A/B reports."""

import math
from pathlib import Path

import pytest

from agent.gate import Gate
from tools.protocol import ABReport, ShapeAB

TASK = Path(__file__).resolve().parents[1] / "kernels" / "matmul_cpu"


@pytest.fixture(scope="module")
def gate():
    return Gate(TASK, "kernels/matmul_cpu")


def shape(name, speedup, lo, hi, ta=1e-3, extra_a=0.0, extra_b=0.0, ok=True, probes=10):
    tb = ta / speedup
    return ShapeAB(shape=name, weight=1.0, pairs=100, log_ratio_mean=0.0, log_ratio_se=0.001, speedup=speedup,
                   speedup_lo=lo, speedup_hi=hi, time_a=ta, time_b=tb, wall_a=ta + 20e-6, wall_b=tb + 20e-6,
                   extra_a=extra_a, extra_b=extra_b, idle_cpu_a=0.0, idle_cpu_b=0.0, probes=probes,
                   timed_outputs_ok=ok, timed_outputs_problem=None if ok else "set 0 output c: 7 wrong")


def report(*shapes, speedup, lo, hi, stopped="interval tight"):
    return ABReport(shapes=list(shapes), speedup=speedup, speedup_lo=lo, speedup_hi=hi, pairs=200, timing_seconds=1.0,
                    stopped_because=stopped)


def test_clear_gain_accepted(gate):
    v = gate.judge(report(shape("sq192", 1.05, 1.04, 1.06), shape("wide", 1.04, 1.03, 1.05), speedup=1.045, lo=1.035, hi=1.055))
    assert v.accepted and v.stage == "accepted"


def test_gain_whose_lower_bound_misses_min_gain_rejected(gate):
    v = gate.judge(report(shape("sq192", 1.012, 1.004, 1.02), shape("wide", 1.012, 1.004, 1.02), speedup=1.012, lo=1.006, hi=1.018))
    assert not v.accepted and v.stage == "timing" and "lower bound must exceed x1.010" in v.reason


def test_regression_on_one_shape_rejected_despite_overall_gain(gate):
    v = gate.judge(report(shape("sq192", 1.30, 1.28, 1.32), shape("wide", 0.93, 0.92, 0.94), speedup=1.10, lo=1.09, hi=1.11))
    assert not v.accepted and v.stage == "timing" and "wide" in v.reason and "allowance" in v.reason


def test_wrong_timed_outputs_rejected(gate):
    v = gate.judge(report(shape("sq192", 2.0, 1.9, 2.1, ok=False), shape("wide", 2.0, 1.9, 2.1), speedup=2.0, lo=1.9, hi=2.1))
    assert not v.accepted and "outputs of timed calls are wrong" in v.reason


def test_work_escaping_the_timed_region_rejected(gate):
    # the candidate's timer says 10x faster, but 0.95 ms per call happens outside what was timed
    escaped = shape("sq192", 10.0, 9.5, 10.5, ta=1e-3, extra_b=0.95e-3)
    v = gate.judge(report(escaped, shape("wide", 1.0, 0.99, 1.01), speedup=3.0, lo=2.9, hi=3.1))
    assert not v.accepted and "outside the timed region" in v.reason


def test_escape_check_is_like_for_like(gate):
    """Both sides carry the same cold overhead (sync, launch): only the candidate's excess counts,
    and it does not grow with the speedup."""
    for speedup in (1.2, 2.5, 5.5, 20.0):
        same_overhead = shape("sq192", speedup, speedup * 0.97, speedup * 1.03, extra_a=40e-6, extra_b=40e-6)
        v = gate.judge(report(same_overhead, speedup=speedup, lo=speedup * 0.97, hi=speedup * 1.03))
        assert v.accepted, v.reason


@pytest.mark.parametrize("field", ["extra_b", "extra_a", "wall_b", "time_b"])
@pytest.mark.parametrize("value", [None, float("nan"), float("inf")])
def test_escape_check_fails_closed_without_probes(gate, field, value):
    s = shape("sq192", 2.0, 1.9, 2.1)
    setattr(s, field, value)
    v = gate.judge(report(s, speedup=2.0, lo=1.9, hi=2.1))
    assert not v.accepted and v.stage == "timing" and "integrity probes missing" in v.reason


def test_no_probes_fails_closed(gate):
    v = gate.judge(report(shape("sq192", 2.0, 1.9, 2.1, probes=0), speedup=2.0, lo=1.9, hi=2.1))
    assert not v.accepted and "integrity probes missing" in v.reason


def test_wide_interval_is_undecided_not_regression(gate):
    """A/A on a loaded machine: x0.8 with an interval from x0.6 to x1.3 decides nothing."""
    noisy = shape("sq192", 0.8, 0.6, 1.3)
    v = gate.judge(report(noisy, speedup=0.8, lo=0.6, hi=1.3, stopped="time cap"))
    assert not v.accepted and v.stage == "undecided" and "undecided (noisy machine)" in v.reason
    assert "regression" not in v.reason.split(";")[0]


def test_wide_interval_around_a_gain_is_undecided(gate):
    v = gate.judge(report(shape("sq192", 1.5, 0.9, 2.5), speedup=1.5, lo=0.9, hi=2.5, stopped="time cap"))
    assert not v.accepted and v.stage == "undecided"


def test_regression_needs_the_whole_interval_below_the_allowance(gate):
    # x0.90 but the interval reaches x0.97 > 1 - 0.05: maybe not a regression -> undecided
    v = gate.judge(report(shape("sq192", 0.90, 0.83, 0.97), speedup=0.9, lo=0.83, hi=0.97, stopped="time cap"))
    assert v.stage == "undecided" and not v.accepted
    # the whole interval below x0.95: a regression
    v = gate.judge(report(shape("sq192", 0.90, 0.88, 0.92), speedup=0.9, lo=0.88, hi=0.92))
    assert v.stage == "timing" and "regression beyond the allowance" in v.reason


def test_gain_with_one_shape_possibly_regressed_is_not_accepted(gate):
    v = gate.judge(report(shape("sq192", 1.5, 1.45, 1.55), shape("wide", 0.96, 0.90, 1.02), speedup=1.2, lo=1.15, hi=1.25))
    assert not v.accepted and v.stage == "undecided" and "wide" in v.reason


def test_non_finite_speedup_is_undecided(gate):
    v = gate.judge(report(shape("sq192", 1.0, 0.99, 1.01), speedup=math.nan, lo=math.nan, hi=math.nan))
    assert not v.accepted and v.stage == "undecided"


def test_time_below_the_physics_floor_is_rejected_as_impossible(gate):
    s = shape("sq192", 50.0, 48.0, 52.0)  # tb = 20 us
    s.floor_s = 100e-6
    v = gate.judge(report(s, speedup=50.0, lo=48.0, hi=52.0))
    assert not v.accepted and v.stage == "timing" and "faster than physics allows" in v.reason and "sq192" in v.reason


def test_floor_above_an_honest_time_changes_nothing(gate):
    s = shape("sq192", 1.5, 1.45, 1.55)
    s.floor_s = 1e-6
    assert gate.judge(report(s, speedup=1.5, lo=1.45, hi=1.55)).accepted


def test_best_much_slower_than_its_baseline_is_undecided(gate):
    s = shape("sq192", 3.0, 2.9, 3.1, ta=1e-3)
    s.baseline_a = 0.2e-3  # the best read 5x faster when it was accepted
    v = gate.judge(report(s, speedup=3.0, lo=2.9, hi=3.1))
    assert not v.accepted and v.stage == "undecided" and "best slower than its baseline" in v.reason
    s.baseline_a = 0.9e-3  # within the limit: decided as usual
    assert gate.judge(report(s, speedup=3.0, lo=2.9, hi=3.1)).accepted


def test_work_after_return_over_all_timed_calls_is_caught_below_the_probe_bound(gate):
    s = shape("sq192", 1.3, 1.25, 1.35, ta=2e-3, extra_b=0.3e-3)  # probes alone: under 0.25 x 2 ms
    s.after_return_a, s.after_return_b = 5e-6, 0.3e-3
    v = gate.judge(report(s, speedup=1.3, lo=1.25, hi=1.35))
    assert not v.accepted and "outside the timed region" in v.reason and "after return" in v.reason


def test_timing_that_left_out_a_bench_shape_is_rejected(gate):
    """A real decision must measure every bench shape (fail closed): a gain on some says nothing of the rest."""
    from types import SimpleNamespace

    from tools.build import BuildResult

    built, best = (BuildResult(ok=True, key=k, lib=f"/x/{k}.so", build_dir="/x") for k in ("cand", "best"))
    res = SimpleNamespace(ok=True, error=None, device=None,
                          ab=report(shape("sq192", 2.0, 1.9, 2.1), speedup=2.0, lo=1.9, hi=2.1))
    v = gate._timed_verdict(res, built, best, None, 1, 2)
    assert not v.accepted and v.stage == "timing"
    assert "every bench shape" in v.reason and "wide" in v.reason
    res.ab = report(shape("sq192", 2.0, 1.9, 2.1), shape("wide", 2.0, 1.9, 2.1), speedup=2.0, lo=1.9, hi=2.1)
    assert gate._timed_verdict(res, built, best, None, 1, 2).accepted
