"""Long CUDA timed requests (GateConfig.cuda_request_s, issue 20): the judge's clock around a request bounds what
the runner's events report only as tightly as the request's own cost (the runner's Python, pipe, spin, syncs) is
small beside its calls, so a request may hold many calls, each on its own input set. What runs without a GPU:
how many calls a request takes, the memory its sets may use, and that the setting reaches the judge."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.gate import Gate, GateConfig
from tools.protocol import WorkerRequest
from tools.timing import CALLS_CAP, SET_MEMORY_CAP, calibrate, calls_per_sample, set_memory_cap

ROOT = Path(__file__).resolve().parents[1]


def test_a_long_request_holds_as_many_calls_as_fill_it_up_to_the_cap():
    # a 300 us call: one to a short sample, 34 to a 10 ms request; a 1 ms call: 10
    assert calls_per_sample(300e-6) == 1
    assert calls_per_sample(300e-6, short_s=10e-3) == 34
    assert calls_per_sample(1e-3, short_s=10e-3) == 10
    assert calls_per_sample(5e-6, short_s=10e-3) == CALLS_CAP
    # the calibration times single calls on distinct sets and keeps the fastest
    seen = []
    k, single = calibrate(lambda i: seen.append(i) or (40e-6 if i == 1 else 90e-6), 10e-3)
    assert (k, single, seen) == (CALLS_CAP, 40e-6, [0, 1, 2])


def test_the_sets_memory_grows_only_for_long_cuda_requests():
    assert set_memory_cap("cpu") == SET_MEMORY_CAP["cpu"]
    assert set_memory_cap("cpu", long_requests=True) == SET_MEMORY_CAP["cpu"]
    # short CUDA samples keep the fixed cap, without asking the device anything (no GPU here)
    assert set_memory_cap("cuda") == SET_MEMORY_CAP["cuda"]


def test_a_request_length_outside_its_range_is_refused_by_name():
    base = dict(kind="ab", task_dir="/nonexistent")
    assert WorkerRequest(**base, cuda_request_s=0.01).cuda_request_s == 0.01
    for bad in (0.0, -1e-3, 1.0):
        with pytest.raises(ValidationError, match="cuda_request_s"):
            WorkerRequest(**base, cuda_request_s=bad)


def test_the_gate_config_reaches_the_judges_request():
    gate = Gate(ROOT / "kernels" / "softmax", task_rel="softmax",
                config=GateConfig(cuda_request_s=0.01, cuda_placement="current"))
    req = gate.ab_request("best.so", "cand.so", seed=3)
    assert (req.cuda_request_s, req.cuda_placement) == (0.01, "current")
    default = Gate(ROOT / "kernels" / "softmax", task_rel="softmax").ab_request("best.so", "cand.so", seed=3)
    assert (default.cuda_request_s, default.cuda_placement) == (GateConfig().cuda_request_s, GateConfig().cuda_placement)


def test_a_benchmarks_settings_are_validated_by_name():
    cfg = GateConfig(max_seconds=2.0).with_settings(["cuda_request_s=10e-3", "cuda_placement=current"])
    assert (cfg.max_seconds, cfg.cuda_request_s, cfg.cuda_placement) == (2.0, 0.01, "current")
    with pytest.raises(ValueError, match="cuda_request_ms"):
        GateConfig().with_settings(["cuda_request_ms=10"])  # no such field: named, with the ones there are
    with pytest.raises(ValueError, match="cuda_placement"):
        GateConfig().with_settings(["cuda_placement=always"])
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        GateConfig().with_settings(["cuda_request_s"])


def test_the_offclock_floor_is_per_request_so_a_long_request_bounds_a_smaller_lie():
    from tools.protocol import ShapeAB

    gate = Gate(ROOT / "kernels" / "softmax", task_rel="softmax")

    def shape(k):
        return ShapeAB(shape="s", weight=1.0, pairs=10, speedup=1.0, speedup_lo=1.0, speedup_hi=1.0, time_a=300e-6,
                       time_b=300e-6, offclock_a=20e-6, offclock_b=20e-6, offclock_a_se=0.0, calls_per_sample=k)

    one, thirty = gate.offclock_allowance(shape(1)), gate.offclock_allowance(shape(30))
    assert one == pytest.approx(max(GateConfig().offclock_abs_floor_s, GateConfig().offclock_rel_floor * 300e-6))
    assert thirty == pytest.approx(one / 30)
    # a runner reporting 5% less than its 300 us calls: inside the one-call floor, outside the 30-call one
    lie = 0.05 * 300e-6
    assert lie < one and lie > thirty


def test_the_sets_memory_for_long_requests_is_a_fifth_of_the_device_at_most_half_what_is_free(monkeypatch):
    import torch

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * gib, 140 * gib))
    assert set_memory_cap("cuda", long_requests=True) == 28 * gib  # a fifth of 140
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 140 * gib))
    assert set_memory_cap("cuda", long_requests=True) == 15 * gib  # half of what is free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * gib, 80 * gib))
    assert set_memory_cap("cuda", long_requests=True) == SET_MEMORY_CAP["cuda"]  # never below the usual cap
    assert set_memory_cap("cuda") == SET_MEMORY_CAP["cuda"]


class _FakeRunner:
    """What RemoteLib asks of a runner, recorded: a CUDA runner's reply without a GPU."""

    freeze = False

    def __init__(self):
        self.requests = []

    def cpu_ns(self):
        return 0

    def request(self, op, timeout, fds=(), keep_running=False, **kw):
        self.requests.append((op, kw))
        return {"times": [1e-3], "trailing": [0.0]}


def test_a_timed_cuda_request_asks_for_a_shorter_spin_only_when_told(monkeypatch):
    import torch

    from tools.remote import RemoteLib

    runner = _FakeRunner()
    lib = RemoteLib(runner, arena=None, device=torch.device("cuda"), timer=None, call_timeout=5.0)
    monkeypatch.setattr(lib, "_flush_device", lambda: None)
    monkeypatch.setattr(lib, "_settle", lambda: None)
    keys = [("s", i) for i in range(8)]
    lib.sample(keys, [])  # the default: the spin covers every call of the request
    lib.sample(keys, [], spin_calls=4)  # a long request: the first 4 calls' enqueue only
    (op1, kw1), (op2, kw2) = runner.requests
    assert (op1, op2) == ("run", "run") and kw1["calls"] == kw2["calls"] == keys
    assert kw1["spin"] and kw2["spin"] and "spin_calls" not in kw1 and kw2["spin_calls"] == 4
