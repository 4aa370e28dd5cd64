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


def test_a_long_request_holds_calls_up_to_its_own_cap_not_the_short_samples():
    # a 300 us call: one to a short sample, 34 to a 10 ms request
    assert calls_per_sample(300e-6) == 1
    assert calls_per_sample(300e-6, cap=256, short_s=10e-3) == 34
    # a 5 us call: the short samples stop at CALLS_CAP, a long request at its own cap
    assert calls_per_sample(5e-6, short_s=10e-3) == CALLS_CAP
    assert calls_per_sample(5e-6, cap=256, short_s=10e-3) == 256
    # the calibration passes the cap on, and times single calls on distinct sets
    seen = []
    k, single = calibrate(lambda i: seen.append(i) or 40e-6, 10e-3, cap=256)
    assert (k, single, seen) == (250, 40e-6, [0, 1, 2])


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
