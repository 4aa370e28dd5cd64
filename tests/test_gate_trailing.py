"""The gate's bound on device work left running after the timed region (CUDA tasks), on synthetic reports.

The runner measures, on the device's clock, how long after each timed sample's end event every stream of
its context was idle (tools/libhost.py); the gate compares the candidate's median per call with the
best's, against a few robust standard errors of the best's own median (agent/gate.py `trail_allowance`)."""

import math
from pathlib import Path

import pytest

from agent.gate import Gate
from tests.test_gate_judge import report, shape

SOFTMAX = Path(__file__).resolve().parents[1] / "kernels" / "softmax"


@pytest.fixture(scope="module")
def gate():
    return Gate(SOFTMAX, "kernels/softmax")


def gpu_shape(name, speedup, ta, trail_a=6e-6, trail_b=6e-6, trail_a_se=0.05e-6, samples=200):
    s = shape(name, speedup, ta=ta)
    s.trail_a, s.trail_b, s.trail_a_se, s.trail_samples = trail_a, trail_b, trail_a_se, samples
    # the judge's clock around each request, the same for both sides (tests/test_gate_offclock.py varies it)
    s.offclock_a = s.offclock_b = 500e-6
    s.offclock_a_se = 5e-6
    return s


def test_the_same_trailing_time_is_accepted(gate):
    v = gate.judge(report(gpu_shape("65536x4096", 1.10, ta=459e-6)))
    assert v.accepted, v.reason


@pytest.mark.parametrize("ta", [16e-6, 459e-6, 1e-3])
def test_ten_percent_left_on_another_stream_is_caught_short_and_long(gate, ta):
    """10% of the best's call left running after the end event, per call: rejected on a 16 us and a 1 ms
    call alike (the judge-clock probes' allowance was ~22 us on a 5 us call and ~165 us on a 459 us one, H200).
    A 16 us call is timed 4 to a sample (50 us at least), so the 2 us floor a sample is 0.5 us a call."""
    left = gpu_shape("65536x4096", 1.10, ta=ta, trail_b=6e-6 + 0.10 * ta)
    left.calls_per_sample = max(1, math.ceil(50e-6 / ta))
    v = gate.judge(report(left))
    assert not v.accepted and v.stage == "timing", v.reason
    assert "device stayed busy" in v.reason and "65536x4096" in v.reason
    assert gate.trail_allowance(left) < 0.10 * ta


def test_the_allowance_follows_the_best_s_own_spread(gate):
    """A noisy best (wide spread of its own trailing times) widens the allowance; the candidate's spread
    never does (it is the candidate's to inflate)."""
    quiet = gpu_shape("65536x4096", 1.1, ta=459e-6, trail_a_se=0.05e-6)
    noisy = gpu_shape("65536x4096", 1.1, ta=459e-6, trail_a_se=5e-6)
    assert gate.trail_allowance(noisy) > gate.trail_allowance(quiet) + 4 * math.sqrt(2) * 4.9e-6
    # 40 us more: caught beside a quiet best, within the allowance of a noisy one
    for s, caught in ((quiet, True), (noisy, False)):
        s.trail_b = s.trail_a + 40e-6
        v = gate.judge(report(s))
        assert ("device stayed busy" in v.reason) == caught, v.reason


@pytest.mark.parametrize("field", ["trail_a", "trail_b", "trail_a_se"])
@pytest.mark.parametrize("value", [None, float("nan"), float("inf")])
def test_a_gpu_report_without_trailing_times_fails_closed(gate, field, value):
    s = gpu_shape("65536x4096", 2.0, ta=459e-6)
    setattr(s, field, value)
    v = gate.judge(report(s))
    assert not v.accepted and v.stage == "timing" and "not measured" in v.reason, v.reason


def test_no_trailing_samples_fails_closed(gate):
    v = gate.judge(report(gpu_shape("65536x4096", 2.0, ta=459e-6, samples=0)))
    assert not v.accepted and "not measured" in v.reason


def test_cpu_tasks_need_no_trailing_times():
    cpu = Gate(Path(__file__).resolve().parents[1] / "kernels" / "matmul_cpu", "kernels/matmul_cpu")
    v = cpu.judge(report(shape("sq192", 1.10)))
    assert v.accepted, v.reason


def test_the_absolute_floor_is_per_sample(gate):
    """Short calls are timed several to a sample and the trailing time is per call: the 2 us floor (the
    host's wake-up after a sync) is per sample, so it is a tenth of that per call of a 5 us call, 10 to a sample."""
    one = gpu_shape("65536x4096", 1.1, ta=5e-6, trail_a_se=0.01e-6)
    ten = gpu_shape("65536x4096", 1.1, ta=5e-6, trail_a_se=0.01e-6)
    ten.calls_per_sample = 10
    assert gate.trail_allowance(ten) < 0.6e-6 < 2e-6 < gate.trail_allowance(one)


def test_a_per_process_wake_up_offset_is_not_hidden_work(gate):
    """Two runners of the same build on the H200 read 17-27 us apart per 460 us call (their host woke later
    after the sync), with a tight spread within each: the 5% floor keeps that an A/A."""
    s = gpu_shape("65536x4096", 1.10, ta=463e-6, trail_a=56.1e-6, trail_b=83.0e-6, trail_a_se=2.2e-6)
    v = gate.judge(report(s))
    assert v.accepted, v.reason
