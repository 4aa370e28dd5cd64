"""The gate's pre-started judge (tools/judge_handle.JudgeStandby) and the per-stage seconds of a verdict.

A decision consumes the standby tree (judge + two runners, prepared and locked down, no library
loaded) and the gate starts the next one; processes stay single-use; nothing outlives the gate's
close or a killed session.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.gate import Candidate, Gate, GateConfig, Verdict
from tools.build import build
from tools.judge_handle import JudgeStandby, StandbySlot, _descendants, remove_stale_scratch, run_worker
from tools.runner import Runner, RunnerError

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "kernels" / "matmul_cpu"
CONFIG = GateConfig(max_seconds=0.5, min_pairs=5)
STAGES = ("scope", "build", "audit", "processes", "check", "timing", "sass")

pytestmark = pytest.mark.slow


def tree_pids(root: int | None = None, python_only: bool = False) -> set[int]:
    """Judge and runner processes below `root` (default: this process), with the bwrap, unshare and
    init processes around them (the sandbox, each runner's PID namespace) unless `python_only`."""
    out = set()
    for pid in _descendants(root or os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a in (b"tools.worker", b"tools.libhost") for a in argv):
            if not (python_only and (argv[0].endswith((b"bwrap", b"unshare")) or b"kloop-init" in argv)):
                out.add(pid)
    return out


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def wait_gone(pids: set[int], seconds: float = 15.0) -> set[int]:
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def wait_ready(standby: JudgeStandby, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not standby.ready():
        assert standby.alive(), f"the standby died: {standby.reader.text()[-2000:]}"
        assert time.monotonic() < deadline, "the standby never got ready"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A gate on matmul_cpu, its best (the base) and a candidate folder with a faster loop order."""
    gate = Gate(TASK, "kernels/matmul_cpu", CONFIG)
    best = build(gate.task)
    assert best.ok, best.error_text()
    cand = tmp_path_factory.mktemp("cand") / "matmul_cpu"
    shutil.copytree(TASK, cand)
    gate.task.write_knob_settings(cand, {"LOOP_ORDER": 1})
    yield gate, best, Candidate(cand, ["kernels/matmul_cpu/knobs.toml"])
    gate.close()


def test_decisions_report_their_stages_and_the_second_uses_the_warm_standby(setup):
    gate, best, cand = setup
    first = gate.evaluate(cand, best)
    assert first.stage_seconds and set(first.stage_seconds) == set(STAGES), first.stage_seconds
    assert first.judge in ("cold", "warming", "ready")
    assert abs(sum(first.stage_seconds.values()) - first.seconds) < 0.5, (first.stage_seconds, first.seconds)
    assert first.stages_line() in first.summary()
    # the record keeps them; a record written before they existed still loads
    figures = first.figures()
    assert figures["stage_seconds"] == first.stage_seconds and figures["judge"] == first.judge
    old = {k: v for k, v in figures.items() if k not in ("stage_seconds", "judge", "check_failures")}
    assert Verdict.model_validate(old).stage_seconds == {}

    standby = gate.standby._current
    assert standby is not None and standby.alive(), "no judge was started for the next decision"
    wait_ready(standby)
    pids = tree_pids(standby.proc.pid)
    assert len(tree_pids(standby.proc.pid, python_only=True)) == 3, "judge and two runners expected before any request"
    second = gate.evaluate(cand, best)
    assert second.judge == "ready", second.summary()
    assert second.check is not None and second.check.passed and second.ab is not None, second.summary()
    # single-use: the consumed tree is gone, a new one warms up for the next decision
    assert not wait_gone(pids), "the consumed judge or its runners outlived the decision"
    assert gate.standby._current is not None and gate.standby._current is not standby


def test_no_process_outlives_the_gate_close(setup):
    gate, best, cand = setup
    gate.standby.refill()
    standby = gate.standby._current
    wait_ready(standby)
    pids = tree_pids()
    assert len(tree_pids(python_only=True)) >= 3, "no standby processes found"
    gate.close()
    assert not wait_gone(pids), f"left running after close: {alive(pids)}"
    assert not standby.root.exists() and gate.standby._current is None


KILLED = r"""
import sys, time
from pathlib import Path
from agent.gate import Gate, GateConfig
gate = Gate(Path(sys.argv[1]), "kernels/matmul_cpu", GateConfig())
gate.standby.refill()
s = gate.standby._current
while not s.ready():
    time.sleep(0.1)
print(s.root, flush=True)
time.sleep(600)
"""


# The Ctrl-C case hung (no exit in 120 s after SIGINT) twice in full CI runs on 2026-12-03 and never
# alone, beside hogs or under -n 2 (cause not found): it runs with the `long` tests until it is.
@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.long)])
def test_no_orphans_after_a_killed_session(sig, tmp_path):
    """kill -9 (PR_SET_PDEATHSIG, bwrap --die-with-parent) and Ctrl-C (atexit) alike."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(TASK)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        root = Path(proc.stdout.readline().strip())
        assert root.name, "the session never reported its standby"
        pids = tree_pids(proc.pid)
        assert len(tree_pids(proc.pid, python_only=True)) == 3, pids
        proc.send_signal(sig)
        proc.wait(timeout=120)  # a bound on hanging, not a speed: Ctrl-C's atexit took over 30 s on a loaded 2-core box
        assert not wait_gone(pids), f"orphans after {sig.name}: {alive(pids)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGKILL:  # the folder goes at the next start, as a killed worker's does
        remove_stale_scratch()
    assert not root.exists()


def test_a_runner_never_loads_a_second_library(setup, tmp_path):
    gate, best, _ = setup
    r = Runner(tmp_path, "cand")
    try:
        r.prepare(gate.task.spec_path, "cpu", 120)
        r.request("load", 60, lib_path=best.lib)
        with pytest.raises(RunnerError, match="single-use"):
            r.request("load", 60, lib_path=best.lib)
    finally:
        r.close()


def test_standby_off_and_other_tasks_start_cold(setup, monkeypatch):
    gate, best, cand = setup
    monkeypatch.setenv("KLOOP_STANDBY", "off")
    off = Gate(TASK, "kernels/matmul_cpu", CONFIG)
    off.standby.refill()
    assert off.standby._current is None
    v = off.evaluate(cand, best)
    assert v.judge == "cold" and v.ab is not None and v.stage in ("accepted", "undecided"), v.summary()
    assert off.standby._current is None
    # a standby for another task folder is not used for this one (and is closed)
    monkeypatch.delenv("KLOOP_STANDBY")
    other = JudgeStandby(ROOT / "kernels" / "softmax")
    req = gate.ab_request(best.lib, best.lib, 1).model_copy(update={"kind": "probe", "libs": []})
    res = run_worker(req, timeout=120, standby=other)
    assert res.ok and res.standby == "cold", res.error
    assert other.closed and not other.root.exists()


@pytest.mark.long  # CI time (15 min on 2026-12-07): run with `-m long`
def test_trials_in_one_request_are_independent_decisions(setup):
    """The gate benchmark's path: one sandboxed judge, N timing-only decisions, each its own seed."""
    gate, best, _ = setup
    slot = StandbySlot(gate.trusted_dir)
    slot.refill()
    req = gate.ab_request(best.lib, best.lib, 7).model_copy(update={"trials": 3})
    res = run_worker(req, timeout=300, standby=slot.take())
    slot.close()
    assert res.ok, res.error
    assert res.standby in ("warming", "ready")
    assert len(res.trials) == 3 and len(res.trial_seconds) == 3 and res.ab == res.trials[0]
    assert len({t.speedup for t in res.trials}) == 3  # fresh seeds and sets: not one decision repeated
    # A/A: each trial a real measurement of two equal libraries. (Its false-accept rate is the gate
    # benchmark's to measure, bench/gate_cpu_trials.py in CI: with this test's 0.5 s of timing, two
    # test suites sharing 2 cores once made one of these trials read lo > x1.01.)
    assert all(0.9 < ab.speedup < 1.1 and ab.pairs >= CONFIG.min_pairs for ab in res.trials), res.trials


def test_the_libraries_are_read_only_in_the_sandbox(setup):
    """The gate copies both libraries into the tree's libs/ folder: outside every writable path, bound
    read-only, so neither runner can patch the other's code through the file; lockdown is asked for."""
    from tools.sandbox import LOCKDOWN_VAR, status

    standby = JudgeStandby(TASK)
    try:
        assert not standby.libs.is_relative_to(standby.scratch)
        if status().namespaces:
            args = standby.argv
            ro = [args[i + 1] for i, a in enumerate(args) if a == "--ro-bind"]
            rw = [args[i + 1] for i, a in enumerate(args) if a == "--bind"]
            assert str(standby.libs) in ro and not any(standby.libs.is_relative_to(w) for w in rw), args
            if status().seccomp:  # the runners install the filter before their library loads
                i = args.index(LOCKDOWN_VAR)
                assert args[i - 1] == "--setenv" and args[i + 1] == "1"
    finally:
        standby.close()
