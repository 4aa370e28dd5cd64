"""On the GPU: every shipped CUDA task builds, passes its check on every check shape, and times.

Run on the device machine: `python -m pytest -m gpu tests/gpu -s` (skipped without CUDA).
"""

from pathlib import Path

import pytest

from agent.gate import Candidate, Gate, GateConfig
from tools.task import load_task
from tools.build import build
from tools.evaluate import evaluate

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["softmax", "flash_attn_fwd", "paged_decode", "flash_attn_fwd_fp8", "flash_attn_bwd"])
def test_task_checks_and_times(name):
    task = load_task(KERNELS / name)
    report = evaluate(task, bench_seconds=0.3, comparators=True)
    assert report.build.ok, report.build.error_text()
    assert report.check is not None, report.check_error
    failing = [(s.shape, s.error, [o.model_dump() for o in s.outputs if not o.passed]) for s in report.check.failures()]
    assert report.check.passed, failing
    assert report.bench is not None, report.bench_error
    for s in report.bench.shapes:
        assert s.error is None, s.error
        assert s.kernel is not None and s.kernel.median > 0
    assert report.device is not None and report.device.kind == "cuda"


@pytest.mark.parametrize("knobs", [{"VEC": 8}, {"VEC": 8, "ONLINE": 1, "THREADS": 1024}, {"VEC": 2, "THREADS": 128}])
def test_softmax_knob_variants_pass(knobs):
    task = load_task(KERNELS / "softmax")
    report = evaluate(task, knobs, bench=False)
    assert report.check is not None and report.check.passed, report.check_error or report.check.failures()


def test_gate_on_gpu_accepts_a_real_gain_and_rejects_a_copy(tmp_path):
    """The gate's two verdicts on a real GPU: VEC=8 over the scalar baseline lands; the same code does not."""
    trusted = KERNELS / "softmax"
    gate = Gate(trusted, "kernels/softmax", GateConfig(max_seconds=3.0))
    best = build(gate.task)
    same = gate.evaluate(Candidate(trusted, ["kernels/softmax/softmax.cu"]), best)
    # the same code is never accepted: rejected as not faster, or (a short call's spread on the H200,
    # 2026-12-02: x0.70 [0.38, 1.28] on a 30 us shape) undecided, which is a rejection too; never at a
    # check or an integrity layer
    assert not same.accepted and same.stage in ("timing", "undecided"), same.summary()
    assert "wrong" not in same.reason and "escap" not in same.reason, same.summary()
    cand = tmp_path / "softmax"
    import shutil

    shutil.copytree(trusted, cand)
    gate.task.write_knob_settings(cand, {"VEC": 8})
    faster = gate.evaluate(Candidate(cand, ["kernels/softmax/knobs.toml"]), best)
    assert faster.accepted, faster.summary()
    assert faster.speedup_lo > 1.01
    print(faster.summary())


def test_gate_on_gpu_rejects_work_escaping_to_another_stream(tmp_path):
    """A softmax that launches on its own non-blocking stream looks almost free to events on the
    harness's stream; the gate's time-until-idle comparison catches it (static rules bypassed here)."""
    import shutil

    trusted = KERNELS / "softmax"
    gate = Gate(trusted, "kernels/softmax", GateConfig(max_seconds=3.0))
    best = build(gate.task)
    cand = tmp_path / "softmax"
    shutil.copytree(trusted, cand)
    src = cand / "softmax.cu"
    text = src.read_text()
    launch = "softmax_rows<<<dim3(static_cast<unsigned>(rows)), dim3(THREADS), 0, stream>>>(x, y, cols);"
    assert launch in text
    src.write_text(text.replace(launch, "static cudaStream_t side = nullptr;\n"
                                "    if (!side) cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);\n"
                                + launch.replace(", stream>>>", ", side>>>")))
    built = build(gate.task, src_root=cand)
    assert built.ok, built.error_text()
    v = gate.decide(built, best, check=None, check_seed=0)
    # two layers see it: the physics floor (events on the harness stream read far below the roofline)
    # and the cold probes (the device stays busy long after the events say the call ended)
    assert not v.accepted and v.stage == "timing", v.summary()
    assert "physics" in v.reason or "outside the timed stream" in v.reason, v.summary()
    assert v.ab is not None and any(gate._escaped(s) for s in v.ab.shapes), v.summary()
    print(v.summary())


def test_long_requests_hold_many_calls_and_decide_like_short_ones(tmp_path):
    """GateConfig.cuda_request_s: each timed request spans >= 10 ms of calls on distinct sets, so the judge's clock
    around it bounds the runner's events tightly (issue 20). The same code: not accepted, no integrity flag (the
    judge's clock beyond the reported times alike for both runners); VEC=8 over the baseline: accepted."""
    import shutil

    trusted = KERNELS / "softmax"
    gate = Gate(trusted, "kernels/softmax", GateConfig(max_seconds=3.0, cuda_request_s=10e-3, cuda_placement="current"))
    best = build(gate.task)
    same = gate.decide(best, best, check=None, check_seed=0)
    assert same.ab is not None and all(s.calls_per_sample > 1 for s in same.ab.shapes), same.summary()
    assert not same.accepted and gate.integrity_problem(same.ab) is None, same.summary()
    assert same.ab.placement_error is None and same.ab.placed_from_cpus > 1, same.ab  # both runners pinned per pair
    cand = tmp_path / "softmax"
    shutil.copytree(trusted, cand)
    gate.task.write_knob_settings(cand, {"VEC": 8})
    built = build(gate.task, src_root=cand)
    faster = gate.decide(built, best, check=None, check_seed=0)
    assert faster.accepted and faster.speedup_lo > 1.01, faster.summary()
    print(same.summary(), "\n", faster.summary(), "\n",
          [(s.shape, s.calls_per_sample, s.offclock_a, s.offclock_b) for s in faster.ab.shapes])
