"""The CLI around a real session on the CPU task: crashes and hangs say which shape and call was
running, a worker over its memory limit is rejected saying so, Ctrl-C is acknowledged at once and
a second one stops now (worker killed, attempt recorded as interrupted, exit 130), `resume`
continues from the record (no second baseline or sweep, the interrupted setting offered again, a
summary), and a baseline that fails leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest

from agent.records import RunRecord
from tests.test_gate_session import ENTRY, make_repo
from tools.build import build
from tools.evaluate import run_bench, run_check
from tools.task import load_task

ROOT = Path(__file__).resolve().parents[1]
MATMUL = ROOT / "kernels" / "matmul_cpu"

pytestmark = pytest.mark.slow


def variant(tmp_path: Path, entry_extra: str, manifest_edits: dict[str, str] | None = None, head: str = "") -> Path:
    """A copy of the CPU task whose entry point starts with `entry_extra`."""
    task = tmp_path / "matmul_cpu"
    shutil.copytree(MATMUL, task)
    src = task / "matmul.cpp"
    text = src.read_text()
    assert ENTRY in text
    src.write_text(head + text.replace(ENTRY, ENTRY + "\n" + entry_extra, 1))
    manifest = task / "task.toml"
    m = manifest.read_text()
    for old, new in (manifest_edits or {}).items():
        assert old in m, old
        m = m.replace(old, new, 1)
    manifest.write_text(m)
    return task


def built(task_dir: Path):
    task = load_task(task_dir)
    result = build(task)
    assert result.ok, result.error_text()
    return task, result


def test_crash_in_check_names_shape_and_call(tmp_path):
    task, lib = built(variant(tmp_path, "  if (M == 65) { volatile int* p = nullptr; *p = 1; }"))
    res = run_check(task, lib.lib, seed=1)
    # the crash is a verdict on that shape and call (the judge survives its runner), not a lost worker
    assert res.ok and res.check is not None and not res.check.passed, res
    first = res.check.failures()[0]
    assert (first.shape, first.round) == ("ragged", 0) and "crashed (SIGSEGV)" in first.error, first
    # a NULL write, not a write into the (read-only) inputs: no hint without evidence, no empty tail
    assert "writes into its inputs" not in first.error and not first.error.rstrip().endswith("output tail:"), first.error
    from agent.gate import _describe_failure

    assert "shape ragged (call 0)" in _describe_failure(first)


def test_crash_in_timing_names_shape(tmp_path):
    """Passes its check (few calls), then crashes on a later call of a timed shape."""
    task, lib = built(variant(tmp_path, "  static int calls = 0;\n"
                                        "  if (M == 192 && ++calls > 6) { volatile int* p = nullptr; *p = 1; }"))
    assert run_check(task, lib.lib, seed=1).check.passed
    res = run_bench(task, lib.lib, comparators=False, seconds_per_shape=0.3)
    errors = {s.shape: s.error for s in res.bench.shapes} if res.bench else {"": res.error}
    assert "crashed (SIGSEGV)" in (errors.get("sq192") or ""), errors


def test_hang_names_shape_and_call(tmp_path):
    task, lib = built(variant(tmp_path, "  if (M == 17) for (volatile int spin = 1; spin;) {}",
                              {"timeout_s = 120": "timeout_s = 10"}))
    started = time.monotonic()
    res = run_check(task, lib.lib, seed=1)
    assert time.monotonic() - started < 60
    # a hang costs that shape's call (the runner's per-call deadline), and the rest of the check is not run
    assert res.ok and res.check is not None and not res.check.passed, res
    first = res.check.failures()[0]
    assert (first.shape, first.round) == ("odd", 0) and "timed out" in first.error, first


def test_worker_over_its_memory_limit_is_rejected_saying_so(tmp_path):
    """mallocs and touches 20 GiB in 256 MiB pieces, never checking for NULL: under a 2 GiB limit an
    allocation is refused and the worker dies; the reason names the memory limit."""
    grab = ("  if (M == 1) {\n"
            "    for (int piece = 0; piece < 80; ++piece) {\n"
            "      char* p = (char*)malloc((size_t)256 << 20);\n"
            "      memset(p, 1, (size_t)256 << 20);\n"
            "    }\n  }")
    task_dir = variant(tmp_path, grab, {"timeout_s = 120": "timeout_s = 120\nmemory_limit_gb = 2"},
                       head="#include <cstdlib>\n")
    task, lib = built(task_dir)
    assert task.memory_limit_bytes == 2 * 2**30
    res = run_check(task, lib.lib, seed=1)
    assert res.ok and res.check is not None and not res.check.passed, res
    first = res.check.failures()[0]
    assert first.shape == "one", first
    assert "memory limit of 2 GiB" in first.error and "memory_limit_gb" in first.error, first.error


def test_one_large_new_refused_names_the_memory_limit(tmp_path):
    """One `new` of 8 GiB under a 2 GiB limit throws std::bad_alloc before anything is resident: the
    runner dies of SIGABRT and the reason still names the limit (its output says bad_alloc)."""
    grab = "  static char* volatile keep;\n  if (M == 1) keep = new char[(size_t)8 << 30];  // volatile: not elided"
    task, lib = built(variant(tmp_path, grab, {"timeout_s = 120": "timeout_s = 120\nmemory_limit_gb = 2"}))
    res = run_check(task, lib.lib, seed=1)
    assert res.ok and res.check is not None and not res.check.passed, res
    first = res.check.failures()[0]
    assert "SIGABRT" in first.error and "memory limit of 2 GiB" in first.error and "bad_alloc" in first.error, first.error


# ---- Ctrl-C and resume ---------------------------------------------------------------------------

HANG_WHEN_IKJ = "#if LOOP_ORDER == 1\n  if (M == 1) for (volatile int spin = 1; spin;) {}\n#endif"


def hanging_repo(tmp_path: Path) -> Path:
    """The CPU task in a repository: the i-k-j knob (ranked fastest by the sweep, which times only
    bench shapes) hangs on the check shape `one`; the tile knob has one value (a 2-setting sweep)."""
    repo = make_repo(tmp_path, timeout_s=15)
    task = repo / "kernels" / "matmul_cpu"
    src = task / "matmul.cpp"
    src.write_text(src.read_text().replace(ENTRY, ENTRY + "\n" + HANG_WHEN_IKJ, 1))
    manifest = task / "task.toml"
    manifest.write_text(manifest.read_text().replace("values = [0, 16, 64]", "values = [0]"))
    r = git.Repo(repo)
    r.git.add(A=True)
    r.index.commit("hang with i-k-j on the smallest shape")
    return repo


def workers_of(pid: int) -> list[int]:
    """Worker processes started by the session `pid` (their scratch folder names it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if f"kloop-worker-{pid}-".encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


@pytest.mark.long
def test_ctrl_c_twice_stops_now_and_resume_continues_from_the_record(tmp_path):
    repo = hanging_repo(tmp_path)
    runs = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("ANTHROPIC_API_KEY", None)
    env.pop("ANTHROPIC_AUTH_TOKEN", None)
    cmd = [sys.executable, "-m", "agent.cli", "optimize", str(repo / "kernels" / "matmul_cpu"), "--agent", "tuner",
           "--runs-dir", str(runs), "--gate-seconds", "2"]
    log = open(tmp_path / "optimize.log", "w+")
    # its own process group, signalled whole: what a terminal's Ctrl-C does
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        run_dir = None
        while time.monotonic() < deadline:  # until attempt 1's check is running (and hanging)
            dirs = [d for d in runs.glob("2*") if (d / "run.json").is_file()] if runs.is_dir() else []
            if dirs:
                run_dir = dirs[0]
                if any(e.kind == "attempt_started" for e in RunRecord.open(run_dir).events()) and workers_of(proc.pid):
                    break
            assert proc.poll() is None, log.seek(0) or log.read()
            time.sleep(0.3)
        else:
            pytest.fail("attempt 1 never started: " + (log.seek(0) or log.read()))
        time.sleep(1.0)
        mark = log.tell()
        os.killpg(proc.pid, signal.SIGINT)
        acked = False
        for _ in range(50):  # the acknowledgement is immediate, not after the gate
            log.seek(mark)
            if "Ctrl-C again to stop now" in log.read():
                acked = True
                break
            time.sleep(0.1)
        assert acked, log.seek(0) or log.read()
        assert proc.poll() is None  # still waiting for the step to end
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert time.monotonic() - sent < 20
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    out = log.read()
    assert "Traceback" not in out, out
    assert "attempt 1: build ..." in out and "attempt 1: check ..." in out  # the gate's stages, live
    assert workers_of(proc.pid) == []  # the hanging worker was killed with the session
    events = RunRecord.open(run_dir).events()
    verdicts = [e for e in events if e.kind == "verdict"]
    assert len(verdicts) == 1 and not verdicts[0].accepted and verdicts[0].reason.startswith("interrupted")
    assert [e.reason for e in events if e.kind == "session_ended"] == ["interrupted"]
    interrupted_knobs = [e for e in events if e.kind == "attempt_started"][0].knobs
    assert interrupted_knobs.get("LOOP_ORDER") == 1

    # resume: no second baseline or sweep; the interrupted setting is submitted again; a summary
    res = subprocess.run([sys.executable, "-m", "agent.cli", "resume", run_dir.name[:18], "--runs-dir", str(runs),
                          "--max-attempts", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "the sweep is in the record" in out and "recorded figures are reused" in out, out
    assert "offered to the policy again" in out and "session ended" in out and "no accepted changes" in out, out
    events = RunRecord.open(run_dir).events()
    assert [e.kind for e in events].count("baseline") == 1
    assert len([e for e in events if e.kind == "note" and e.text == "tuner ranking"]) == 1
    attempts = [e for e in events if e.kind == "attempt_started"]
    assert len(attempts) == 2 and attempts[1].knobs == interrupted_knobs
    last = [e for e in events if e.kind == "verdict"][-1]
    assert not last.accepted and "timed out" in last.reason and "shape one" in last.reason, last.reason


def test_baseline_that_fails_leaves_no_branch_and_no_record(tmp_path):
    repo = make_repo(tmp_path)
    src = repo / "kernels" / "matmul_cpu" / "matmul.cpp"
    src.write_text(src.read_text().replace("for (int k = 0; k < K; ++k) acc +=", "for (int k = 0; k + 1 < K; ++k) acc +=", 1))
    r = git.Repo(repo)
    r.git.add(A=True)
    r.index.commit("wrong from the start")
    runs = tmp_path / "runs"
    res = subprocess.run([sys.executable, "-m", "agent.cli", "optimize", str(repo / "kernels" / "matmul_cpu"),
                          "--agent", "tuner", "--runs-dir", str(runs)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}, timeout=300)
    assert res.returncode == 1, res.stderr
    assert "does not pass its own gate" in res.stderr and "wrong results" in res.stderr
    assert "nothing was kept" in res.stderr and "Traceback" not in res.stderr
    assert [b.name for b in r.branches if b.name.startswith("kloop/")] == []
    assert [d for d in runs.iterdir() if d.name != "_worktrees"] == [] if runs.exists() else True
    assert not any((runs / "_worktrees").iterdir()) if (runs / "_worktrees").exists() else True
    assert len(r.git.worktree("list").splitlines()) == 1  # the user's checkout only


def test_resume_offers_an_interrupted_attempt_to_a_model_policy(tmp_path):
    """An attempt cut short (no verdict) is marked interrupted on resume; the resumed briefing puts
    its changes back in the worktree and says so; the repairs are listed."""
    from agent.policies.base import Budget
    from agent.session import Session

    repo = make_repo(tmp_path)
    s = Session.start(repo / "kernels" / "matmul_cpu", "claude", Budget(max_turns=10, max_cost_usd=2.0), runs_root=tmp_path / "runs")
    src = s.ws.task_path / "matmul.cpp"
    src.write_text(src.read_text().replace("float acc = 0.f;", "float acc = 0.0f;", 1))
    path = s.record.write_patch(1, s.ws.diff(against=s.best_commit))
    s.log("attempt_started", attempt=1, title="Spell the zero", patch=str(path.relative_to(s.record.dir)))
    s.log("llm_turn", turn=1, cost_usd=0.75)
    s.log("llm_turn", turn=2, cost_usd=0.5)
    s.ws.restore(s.best_commit)  # as a kill mid-gate leaves it, give or take the tree

    resumed = Session.resume(s.record.dir, budget=Budget(max_turns=10, max_cost_usd=2.0))
    assert any("marked attempt 1" in r and "interrupted" in r for r in resumed.repairs), resumed.repairs
    assert resumed.interrupted_attempt().number == 1
    assert resumed.spent_before.turns == 2 and resumed.spent_before.cost_usd == pytest.approx(1.25)
    # totals: the Claude policy sums turns and cost from the record itself
    assert resumed.budget.max_turns == 10 and resumed.budget.max_cost_usd == pytest.approx(2.0)
    text = resumed.briefing()
    assert "Attempt 1 ('Spell the zero') was interrupted" in text and "back in the worktree" in text
    assert resumed.ws.changed_paths(against=resumed.best_commit) == ["kernels/matmul_cpu/matmul.cpp"]
    assert "0.0f" in (resumed.ws.task_path / "matmul.cpp").read_text()


def test_hours_spent_before_a_resume_count(tmp_path):
    from datetime import timedelta

    from agent import records as rec
    from agent.policies.base import Budget
    from agent.session import Session

    repo = make_repo(tmp_path)
    s = Session.start(repo / "kernels" / "matmul_cpu", "tuner", Budget(), runs_root=tmp_path / "runs")
    started = s.events()[0].t
    s.record.append(rec.make_event("tool_call", name="build", t=started + timedelta(hours=1)))  # an hour of work
    s.close()
    resumed = Session.resume(s.record.dir, budget=Budget(max_hours=1.5, max_attempts=2))
    assert resumed.spent_before.hours_before == pytest.approx(1.0, abs=1e-3)
    assert resumed.budget.max_hours == 1.5 and resumed.stop_reason() is None  # a total, checked against all segments
    resumed.close()
    resumed = Session.resume(s.record.dir, budget=Budget(max_hours=1.0))
    assert resumed.stop_reason() == "max_hours"
    resumed.close()
