"""The gate's decision from paired timings (Gate.judge), on synthetic A/B reports."""

from pathlib import Path

import pytest

from agent.gate import Gate
from tools.protocol import ABReport, ShapeAB

TASK = Path(__file__).resolve().parents[1] / "kernels" / "matmul_cpu"


@pytest.fixture(scope="module")
def gate():
    return Gate(TASK, "kernels/matmul_cpu")


def shape(name, speedup, lo, hi, ta=1e-3, wall_extra_a=20e-6, wall_extra_b=20e-6, ok=True):
    tb = ta / speedup
    return ShapeAB(shape=name, weight=1.0, pairs=100, log_ratio_mean=0.0, log_ratio_se=0.001, speedup=speedup,
                   speedup_lo=lo, speedup_hi=hi, time_a=ta, time_b=tb, wall_a=ta + wall_extra_a,
                   wall_b=tb + wall_extra_b, timed_outputs_ok=ok, timed_outputs_problem=None if ok else "set 0 output c: 7 wrong")


def report(*shapes, speedup, lo, hi):
    return ABReport(shapes=list(shapes), speedup=speedup, speedup_lo=lo, speedup_hi=hi, pairs=200, timing_seconds=1.0)


def test_clear_gain_accepted(gate):
    v = gate.judge(report(shape("sq192", 1.05, 1.04, 1.06), shape("wide", 1.04, 1.03, 1.05), speedup=1.045, lo=1.035, hi=1.055))
    assert v.accepted and v.stage == "accepted"


def test_gain_whose_lower_bound_misses_min_gain_rejected(gate):
    v = gate.judge(report(shape("sq192", 1.012, 1.004, 1.02), shape("wide", 1.012, 1.004, 1.02), speedup=1.012, lo=1.006, hi=1.018))
    assert not v.accepted and "lower bound must exceed x1.010" in v.reason


def test_regression_on_one_shape_rejected_despite_overall_gain(gate):
    v = gate.judge(report(shape("sq192", 1.30, 1.28, 1.32), shape("wide", 0.93, 0.92, 0.94), speedup=1.10, lo=1.09, hi=1.11))
    assert not v.accepted and "wide" in v.reason and "allowance" in v.reason


def test_wrong_timed_outputs_rejected(gate):
    v = gate.judge(report(shape("sq192", 2.0, 1.9, 2.1, ok=False), shape("wide", 2.0, 1.9, 2.1), speedup=2.0, lo=1.9, hi=2.1))
    assert not v.accepted and "outputs of timed calls are wrong" in v.reason


def test_work_escaping_the_timed_stream_rejected(gate):
    # the candidate's events say 10x faster, but the device stays busy long after the timed stream is done
    escaped = shape("sq192", 10.0, 9.5, 10.5, ta=1e-3, wall_extra_b=0.95e-3)
    v = gate.judge(report(escaped, shape("wide", 1.0, 0.99, 1.01), speedup=3.0, lo=2.9, hi=3.1))
    assert not v.accepted and "outside the timed stream" in v.reason
