"""The gate's bound on a CUDA runner's reported times by the judge's own clock, on synthetic reports.

On CUDA the runner times its calls with events in its own process, where a candidate's host code could
make them lie. The judge times every request on its own clock; what that exceeds the reported times by
(the pipe, the flush, the spin, the sync: the same work for any library) is compared like for like with
the best's (agent/gate.py `offclock_allowance`): a runner whose events under-report reads more, one that
skips the work of its requests reads less. A coarse bound: the judge's clock jitters by ~100 us a request. Also: the cold probes' own calls are bounded on CUDA as on the CPU."""

import math
from pathlib import Path

import pytest

from agent.gate import Gate
from tests.test_gate_judge import report, shape
from tests.test_gate_trailing import gpu_shape

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gate():
    return Gate(ROOT / "kernels" / "softmax", "kernels/softmax")


def clocked(ta, offclock_a=95e-6, offclock_b=95e-6, se=0.3e-6, speedup=1.10, k=1):
    s = gpu_shape("65536x4096", speedup, ta=ta)
    s.offclock_a, s.offclock_b, s.offclock_a_se, s.calls_per_sample = offclock_a, offclock_b, se, k
    return s


def test_the_same_time_beyond_the_reported_is_accepted(gate):
    v = gate.judge(report(clocked(459e-6)))
    assert v.accepted, v.reason


@pytest.mark.parametrize("ta", [459e-6, 1e-3, 5e-3])
def test_a_runner_reporting_half_its_time_is_caught(gate, ta):
    """Events that read half the truth (a x2 "gain"): the judge's clock still sees the whole request, so the
    time beyond the reported grows by half the true time per call. Rejected, naming both figures."""
    true_b = ta / 1.10
    s = clocked(ta, offclock_b=95e-6 + 0.5 * true_b, speedup=1.10 / 0.5)
    v = gate.judge(report(s))
    assert not v.accepted and v.stage == "timing", v.reason
    assert "disagree with the judge's clock" in v.reason and "under-reported" in v.reason


def test_two_runners_115_us_apart_are_not_flagged(gate):
    """On the H100 (2026-12-07) the judge's wall beyond the reported times read 437-615 us a request and two
    runners of one build up to 115 us apart on a 0.49 ms call: the floor keeps such an A/A clean. The price:
    a 5% under-report (25 us here) is inside it; the bound catches gross lies only."""
    s = clocked(492e-6, offclock_a=544e-6, offclock_b=429e-6, se=10.6e-6)
    assert gate.judge(report(s)).accepted
    s.offclock_b = s.offclock_a + 0.05 * 492e-6
    assert gate.judge(report(s)).accepted


def test_a_runner_that_skips_all_its_request_work_is_caught(gate):
    """A runner that answers with no flush, spin or sync (its request a quarter of the best's time beyond the
    reported) reads far less on the judge's clock."""
    v = gate.judge(report(clocked(459e-6, offclock_a=500e-6, offclock_b=120e-6)))
    assert not v.accepted and v.stage == "timing" and "judge's clock" in v.reason, v.reason


def test_the_allowance_follows_the_best_s_spread_not_the_candidate_s(gate):
    quiet, noisy = clocked(459e-6, se=0.3e-6), clocked(459e-6, se=20e-6)
    assert gate.offclock_allowance(noisy) > gate.offclock_allowance(quiet) + 4 * math.sqrt(2) * 19.6e-6
    for s, caught in ((quiet, True), (noisy, False)):
        s.offclock_b = s.offclock_a + 200e-6
        v = gate.judge(report(s))
        assert ("judge's clock" in v.reason) == caught, v.reason


@pytest.mark.parametrize("field", ["offclock_a", "offclock_b", "offclock_a_se"])
@pytest.mark.parametrize("value", [None, float("nan"), float("inf")])
def test_a_clock_that_was_not_read_fails_closed(gate, field, value):
    s = clocked(459e-6, speedup=2.0)
    setattr(s, field, value)
    v = gate.judge(report(s))
    assert not v.accepted and v.stage == "timing" and "not measured" in v.reason, v.reason


def test_a_cuda_report_without_the_judge_clock_fails_closed(gate):
    """Only fresh reports are judged (`kloop audit` and replay re-time): a CUDA C++ report without the figures
    is a judge that did not measure them, not an old record."""
    s = gpu_shape("65536x4096", 1.10, ta=459e-6)
    s.offclock_a = s.offclock_b = s.offclock_a_se = None
    v = gate.judge(report(s))
    assert not v.accepted and "judge's clock" in v.reason and "not measured" in v.reason, v.reason


def test_triton_tasks_have_no_candidate_host_code_to_lie(gate):
    """A Triton task's launch is kloop's own code (tools/triton_launch.py): the bound is not applied there,
    where the runner's spin follows its measured enqueue and differs by runner."""
    triton = Gate(ROOT / "kernels" / "rmsnorm_triton", "kernels/rmsnorm_triton")
    s = clocked(20e-6, offclock_b=95e-6 + 1e-3)
    assert abs(s.offclock_b - s.offclock_a) > gate.offclock_allowance(s)  # a CUDA C++ task would reject it
    s.shape = triton.task.bench_shapes[0].name
    v = triton.judge(report(s))
    assert "judge's clock" not in (v.reason or ""), v.reason


def test_a_cuda_probe_call_doing_work_of_its_own_is_caught(gate):
    """A cold probe's call is charged to no sample; on CUDA its events are bounded like the CPU's CPU time: a
    kernel that spends 3 ms in every probe (tables built, work the timed calls then skip) is rejected."""
    s = clocked(459e-6)
    s.probe_call_a, s.probe_call_b = 470e-6, 3e-3
    v = gate.judge(report(s))
    assert not v.accepted and v.stage == "timing" and "untimed calls" in v.reason, v.reason
    s.probe_call_b = 480e-6  # a cold call as slow as the best's: nothing
    assert gate.judge(report(s)).accepted


def test_host_set_up_a_timed_call_hides_under_its_spin_is_allowed_in_a_probe(gate):
    """A probe has no spin before its start event, so its events hold the host's enqueue too; a timed call of one
    hides up to tools/timing.hold_seconds(1) of it. A faster 5 us kernel with 12 us more host set-up a call
    (descriptors made per call) is not work in untimed calls; 100 us more is."""
    pytest.importorskip("torch")
    from tools.timing import hold_seconds

    assert gate.config.untimed_call_gpu_host_s == pytest.approx(hold_seconds(1))
    s = clocked(5e-6, speedup=1.10)
    s.probe_call_a, s.probe_call_b = 10e-6, 22e-6
    assert gate.judge(report(s)).accepted
    s.probe_call_b = 110e-6
    v = gate.judge(report(s))
    assert not v.accepted and "untimed calls" in v.reason and "host enqueue" in v.reason, v.reason


def test_the_gate_benchmark_counts_what_an_under_report_would_show(gate):
    """bench/gate_bench.py replays A/A trials as a lying runner would have made them: each sample's time beyond
    the reported grows by u x the true time (the A/A trial's own time). On steady 1 ms
    trials 50% is caught, 5% and 10% are not, the unshifted A/A is not flagged; trials without the
    judge-clock figures (CPU tasks) count for nothing."""
    from tests.script_module import load_script

    gb = load_script("bench/gate_bench.py")
    steady = {"offclock_a": 500e-6, "offclock_b": 510e-6, "offclock_a_se": 2e-6, "time_a": 1e-3, "time_b": 1e-3,
              "calls_per_sample": 1}
    cpu = {"offclock_a": None, "offclock_b": None, "offclock_a_se": None, "time_a": 1e-3, "time_b": 1e-3}
    out = gb.under_report_catches(gate, [steady] * 5 + [cpu])
    assert out["trials"] == 5 and out["flagged_unshifted"] == 0
    assert out["caught"]["0.5"] == 5 and out["caught"]["0.1"] == 0 and out["caught"]["0.05"] == 0
