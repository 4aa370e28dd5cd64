"""On the GPU: the Triton tasks through the same gate. Their cubins (built ahead of time, no GPU needed)
load in a sandboxed runner through the CUDA driver; the baselines pass every check shape and time
beside their comparators; the Triton cheats of kind "check" are rejected at the check; the same code
is not "faster"; a tuner session on rmsnorm_triton lands a gated commit.

Run on the device machine: `bash bench/device_triton.sh` (one device call, < 600 s: provisioning, the
knob builds, the CPU-side Triton tests, `kloop eval` of both tasks and the CUDA attention, then this file).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.gate import Candidate, Gate, GateConfig
from tests.triton_cheats import TR_CHEATS, candidates, kind_of
from tools.build import build
from tools.evaluate import evaluate
from tools.task import load_task

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")]


def _table(report) -> str:
    from tools.fmt import fmt_time

    lines = [f"{report.task} on {report.device.name if report.device else '?'}:"]
    for s in report.bench.shapes:
        comps = ", ".join(f"{n} {fmt_time(t.median)}" for n, t in s.comparators.items())
        errs = "; ".join(f"{n}: {e[:80]}" for n, e in s.comparator_errors.items())
        lines.append(f"  {s.shape}: {fmt_time(s.kernel.median)}  [{comps}]" + (f"  ({errs})" if errs else ""))
    return "\n".join(lines)


@pytest.mark.parametrize("name", ["rmsnorm_triton", "flash_attn_fwd_triton"])
def test_triton_task_checks_and_times_beside_its_comparators(name):
    """The Triton baselines through the runner (bench/device_triton.sh evaluates the CUDA attention beside)."""
    task = load_task(KERNELS / name)
    report = evaluate(task, bench_seconds=0.2, comparators=True)
    assert report.build.ok, report.build.error_text()
    assert report.audit is not None and report.audit.ok, report.audit_error or report.audit.reason()
    assert report.check is not None, report.check_error
    failing = [(s.shape, s.error, [o.model_dump() for o in s.outputs if not o.passed]) for s in report.check.failures()]
    assert report.check.passed, failing
    assert report.bench is not None, report.bench_error
    for s in report.bench.shapes:
        assert s.error is None, s.error
        assert s.kernel is not None and s.kernel.median > 0
        assert s.comparators, s.comparator_errors  # torch eager / SDPA at least
    print("\n" + _table(report))


@pytest.mark.parametrize("knobs", [{"BLOCK_M": 128, "NUM_WARPS": 8}, {"BLOCK_N": 32, "NUM_STAGES": 1},
                                   {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_WARPS": 8, "NUM_STAGES": 3}])
def test_flash_attn_triton_knob_settings_pass(knobs):
    task = load_task(KERNELS / "flash_attn_fwd_triton")
    report = evaluate(task, knobs, bench=False)
    if not report.build.ok:  # a setting whose shared memory does not fit is refused at the build, by name
        assert "shared memory" in report.build.error_text(), report.build.error_text()
        return
    assert report.check is not None and report.check.passed, report.check_error or report.check.failures()


@pytest.fixture(scope="module")
def rms_gate(tmp_path_factory):
    trusted = tmp_path_factory.mktemp("trusted") / "rmsnorm_triton"
    shutil.copytree(KERNELS / "rmsnorm_triton", trusted)
    gate = Gate(trusted, "kernels/rmsnorm_triton", GateConfig(max_seconds=3.0))
    yield gate, build(gate.task)
    gate.close()


@pytest.mark.parametrize("cheat", [p.stem for p in TR_CHEATS if kind_of(p)[0] == "check"])
def test_triton_check_kinds_rejected_at_the_check(rms_gate, cheat, tmp_path):
    gate, best = rms_gate
    cand = candidates(gate, tmp_path, [p for p in TR_CHEATS if p.stem == cheat])[cheat]
    v = gate.evaluate(cand, best)
    assert not v.accepted and v.stage == "check", v.summary()
    print(f"\n{cheat}: {v.reason[:300]}")


def test_gate_rejects_the_same_triton_code_and_accepts_nothing_unproven(rms_gate, tmp_path):
    gate, best = rms_gate
    cand = tmp_path / "rmsnorm_triton"
    shutil.copytree(gate.trusted_dir, cand)
    (cand / "rmsnorm.py").write_text((cand / "rmsnorm.py").read_text() + "\n# a comment: the same code\n")
    v = gate.evaluate(Candidate(cand, ["kernels/rmsnorm_triton/rmsnorm.py"]), best)
    # the same code is never accepted: rejected as not faster, or (a short call's spread on the H200,
    # 2026-12-02: x0.70 [0.38, 1.28] on a 30 us shape) undecided, which is a rejection too; never at a
    # check or an integrity layer
    assert not v.accepted and v.stage in ("timing", "undecided"), v.summary()
    assert "wrong" not in v.reason and "escap" not in v.reason, v.summary()


def test_tuner_session_on_rmsnorm_triton_lands_a_gated_commit(tmp_path):
    import git
    from rich.console import Console

    from agent.policies.base import Budget
    from agent.policies.tuner import TunerPolicy
    from agent.session import Session
    from agent.trailers import parse_trailers
    from tests.fakes import make_repo

    repo = make_repo(tmp_path, task=KERNELS / "rmsnorm_triton")
    session = Session.start(repo / "kernels" / "rmsnorm_triton", "tuner", Budget(max_attempts=3),
                            runs_root=tmp_path / "runs", gate_config=GateConfig(max_seconds=3.0))
    try:
        # all 32 settings (BLOCK x NUM_WARPS x ROW_IN_REGISTERS) at 0.15 s per shape, 8 to a judge: 148 s
        # with 30 settings on the H200 (2026-12-03), where the knobs of 2026-12-02 (no ROW_IN_REGISTERS)
        # were at best ~1% faster than the defaults and every gated attempt was "undecided"; with
        # ROW_IN_REGISTERS the geometric-mean ranking put a noisy 48 us shape's luck first and its pick
        # read x1.005 in the gate (the sweep now ranks by the gate's workload time)
        log = tmp_path / "tuner.log"
        with open(log, "w") as out:
            reason = session.run(TunerPolicy(trials=32, seconds_per_shape=0.15, seed=1, console=Console(file=out, width=160)))
        print("\n" + log.read_text()[-6000:])  # the ranking and each attempt, for the device log
        accepted = [a for a in session.attempts() if a.accepted]
        assert accepted, (reason, [a.reason for a in session.attempts()])
        tip = git.Repo(repo).commit(session.record.info.branch)
        trailers = dict(parse_trailers(tip.message))
        assert "Kloop-Knobs" in trailers and "Kloop-Speedup" in trailers, trailers
        print(f"\ntuner on rmsnorm_triton: {reason}; landed {trailers['Kloop-Knobs']} at {trailers['Kloop-Speedup']}")
    finally:
        session.close()
