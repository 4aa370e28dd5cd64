"""One process per run: a live holder refuses a second resume, naming itself; a dead one's lock is
taken over with a note in the record."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes import commit_all
from agent.policies.base import Budget
from agent.records import RunRecord
from agent.runlock import HOLDER_FILE, RunLock, RunLocked, read_holder
from agent.session import Session

ROOT = Path(__file__).resolve().parents[1]

HOLD = """
import sys, time
from agent.runlock import RunLock
RunLock.take(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def hold_in_child(run_dir: Path) -> subprocess.Popen:
    """Another process holding the run's lock (as a running `kloop optimize` would)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_live_holder_refuses_and_its_death_frees_the_run(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    child = hold_in_child(run)
    try:
        with pytest.raises(RunLocked) as err:
            RunLock.take(run)
        msg = str(err.value)
        assert f"pid {child.pid} on {socket.gethostname()} since " in msg and "one process per run" in msg
        assert err.value.holder.pid == child.pid
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    lock, note = RunLock.take(run)  # the kernel dropped the dead holder's lock; its name was left
    try:
        assert note and f"pid {child.pid}" in note and "is gone" in note
        assert read_holder(run).pid == os.getpid()
    finally:
        lock.release()
    assert not (run / HOLDER_FILE).exists()


def test_stale_lock_of_dead_pid_is_taken_over(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    pid = dead_pid()
    (run / HOLDER_FILE).write_text(f'{{"pid": {pid}, "host": "{socket.gethostname()}", "since": "2026-12-01T07:00:00+00:00"}}')
    lock, note = RunLock.take(run)
    assert note == (f"took over the run's lock from pid {pid} on {socket.gethostname()} since 2026-12-01T07:00:00+00:00: "
                    "that process is gone")
    again, second = RunLock.take(run)  # re-entrant within this process, no new note
    assert again is lock and second is None
    lock.release()
    assert read_holder(run).pid == os.getpid()  # still held once
    lock.release()
    assert read_holder(run) is None
    lock.release()  # idempotent


def make_repo(tmp: Path) -> Path:
    repo = tmp / "userrepo"
    shutil.copytree(ROOT / "kernels" / "matmul_cpu", repo / "kernels" / "matmul_cpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (repo / ".gitignore").write_text("runs/\n")
    commit_all(repo)
    return repo


def test_second_resume_of_a_live_run_is_refused(tmp_path: Path):
    repo = make_repo(tmp_path)
    s = Session.start(repo / "kernels" / "matmul_cpu", "test", Budget(), runs_root=tmp_path / "runs")
    run_dir = s.record.dir
    assert read_holder(run_dir).pid == os.getpid()
    s.close()  # as if `kloop optimize` had ended
    assert read_holder(run_dir) is None
    events = len(RunRecord.open(run_dir).events())

    child = hold_in_child(run_dir)  # a live `kloop resume` of the same run
    try:
        with pytest.raises(RunLocked, match=f"pid {child.pid} on "):
            Session.resume(run_dir)
        cli = subprocess.run([sys.executable, "-m", "agent.cli", "resume", str(run_dir), "--runs-dir", str(tmp_path / "runs")],
                             capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert cli.returncode == 3, cli.stderr  # 'not run', as `kloop session resume` answers a held run
        assert f"pid {child.pid} on {socket.gethostname()} since" in " ".join(cli.stderr.split())
        assert "Traceback" not in cli.stderr
        assert len(RunRecord.open(run_dir).events()) == events  # the refused resume wrote nothing
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()

    resumed = Session.resume(run_dir)  # the holder died: its lock is taken over, with a note
    try:
        # the lock's notes alone: a host without bubblewrap also notes "sandbox unavailable" at each start
        notes = [e for e in resumed.events() if e.kind == "note" and "sandbox" not in e.data]
        assert len(notes) == 1 and f"pid {child.pid}" in notes[0].text and "is gone" in notes[0].text
        assert [e.kind for e in resumed.events() if not (e.kind == "note" and "sandbox" in e.data)][-1] == "session_started"
    finally:
        resumed.close()
