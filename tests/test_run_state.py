"""The run record read once (agent/run_state.py): budgets are totals for the run counted one way,
whoever asks (the session between steps, the shell/MCP service before each tool, `kloop status`)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from agent import records as rec
from agent.policies.base import Budget
from agent.run_state import RunState, budget_stop
from agent.session import Session
from agent.session_service import SessionService, budget_stop as service_budget_stop, status_data
from tests.session_repo import make_repo

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)


def ev(kind: str, minutes_ago: float, **data):
    return rec.make_event(kind, t=NOW - timedelta(minutes=minutes_ago), **data)


def test_hours_count_segments_once_and_the_open_one_up_to_now():
    events = [ev("session_started", 180), ev("tool_call", 170, name="check", duration_s=30.0),
              # killed here; 2 h later a resume repairs (not counted), then starts its own segment
              ev("restored", 50, to="abc"), ev("session_started", 50, resumed=True),
              ev("tool_call", 40, name="read_file", duration_s=1000.0), ev("llm_turn", 39, turn=1, cost_usd=0.25)]
    s = RunState.fold(events)
    assert s.segments == 2 and s.ended is None
    assert s.hours_before == pytest.approx(21 / 60)  # 10 min before the kill, 11 recorded since the resume
    assert s.hours_used(NOW) == pytest.approx(60 / 60)  # 10 min + the open segment's 50
    assert (s.gpu_seconds, s.turns, s.cost_usd) == (30.0, 1, 0.25)  # read_file is not device time
    assert budget_stop(Budget(max_hours=1.1), s, "check", now=NOW) is None
    assert budget_stop(Budget(max_hours=1.0), s, "check", now=NOW).startswith("max_hours")
    assert budget_stop(Budget(max_turns=1), s, now=NOW).startswith("max_turns")
    assert budget_stop(Budget(max_cost_usd=0.25), s, now=NOW).startswith("max_cost")
    assert budget_stop(Budget(max_gpu_seconds=30), s, "edit_file", now=NOW) is None  # only device tools
    assert budget_stop(Budget(max_gpu_seconds=30), s, "bench", now=NOW).startswith("max_gpu_seconds")
    ended = RunState.fold([*events, ev("session_ended", 20, reason="end_turn")])
    assert ended.ended == "end_turn" and ended.hours_used(NOW + timedelta(hours=5)) == pytest.approx(40 / 60)


def test_an_interrupted_attempt_does_not_use_up_an_attempt():
    events = [ev("session_started", 10), ev("attempt_started", 9, attempt=1, title="a"),
              ev("verdict", 8, attempt=1, accepted=False, reason="interrupted: the session stopped during evaluation",
                 figures={"stage": "interrupted"}),
              ev("attempt_started", 7, attempt=2, title="b"),
              ev("verdict", 6, attempt=2, accepted=False, reason="check failed", figures={"stage": "check"}),
              ev("attempt_started", 5, attempt=3, title="c")]
    s = RunState.fold(events)
    assert [a.verdict for a in s.attempts] == ["interrupted", "rejected", "pending"]
    assert s.attempts_used == 1 and s.next_number == 4 and s.pending.number == 3
    assert budget_stop(Budget(max_attempts=2), s, "submit", now=NOW) is None
    assert budget_stop(Budget(max_attempts=1), s, "submit", now=NOW).startswith("max_attempts")
    assert budget_stop(Budget(max_attempts=1), s, "check", now=NOW) is None  # only submit spends attempts


def _shift_record(run_dir: Path, minutes: float) -> None:
    """Move every recorded time `minutes` into the past (as if the session had started then)."""
    path = run_dir / rec.EVENTS
    lines = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        d["t"] = (datetime.fromisoformat(d["t"]) - timedelta(minutes=minutes)).isoformat()
        lines.append(json.dumps(d))
    path.write_text("\n".join(lines) + "\n")
    info = json.loads((run_dir / rec.RUN_JSON).read_text())
    info["started_at"] = (datetime.fromisoformat(info["started_at"]) - timedelta(minutes=minutes)).isoformat()
    (run_dir / rec.RUN_JSON).write_text(json.dumps(info))


@pytest.fixture(scope="module")
def shell_run(tmp_path_factory):
    """A shell session (`kloop session start --max-hours 1`) whose record is 36 minutes old."""
    tmp = tmp_path_factory.mktemp("hours")
    s = Session.start(make_repo(tmp), "cli", Budget(max_hours=1, max_attempts=1), runs_root=tmp / "runs")
    run_dir = s.record.dir
    s.close()
    _shift_record(run_dir, 36)
    return run_dir


def test_a_shell_session_36_minutes_into_one_hour_may_go_on(shell_run):
    """The repro: Session.open took the hours already used off the budget and budget_stop then set
    the wall time since the start against that reduced budget: refused at 36 minutes of 60."""
    # the agent worked all along: each shell command logs its tool call (the last a minute ago)
    rec.RunRecord.open(shell_run).append(rec.make_event("tool_call", name="read_file",
                                                        t=datetime.now(timezone.utc) - timedelta(minutes=1)))
    service = SessionService.attach(shell_run)  # the next shell command
    try:
        assert service_budget_stop(service.session, "check") is None
        assert service.session.budget.max_hours == 1  # the run's total, not what was left at open
        assert service.session.stop_reason() is None
        d = status_data(service.session)
        assert d["used"]["hours"] == pytest.approx(0.6, abs=0.05) and d["left"]["hours"] == pytest.approx(0.4, abs=0.05)
    finally:
        service.close()


def test_an_attempt_cut_off_by_a_kill_is_offered_again_within_max_attempts(shell_run):
    """kill -9 mid-gate (attempt_started, no verdict): the resume marks it interrupted and offers it
    again; with --max-attempts 1 the session may still submit it (it ended 'max_attempts' before)."""
    held = Session.open(shell_run)
    held.log("attempt_started", attempt=1, title="cut off", knobs={})
    held.close()  # the process died here
    resumed = Session.resume(shell_run, Budget(max_attempts=1))
    try:
        assert resumed.interrupted_attempt() is not None and resumed.interrupted_attempt().number == 1
        assert resumed.stop_reason() is None
        assert service_budget_stop(resumed, "submit") is None
    finally:
        resumed.close()


def test_session_commands_read_the_trusted_manifest_and_revert_restores_it(shell_run):
    """An invalid task.toml in the worktree (the agent broke it) does not brick the session: status and
    revert read runs/<id>/trusted/, and revert puts the manifest back."""
    import subprocess
    import sys

    from tests.session_repo import ROOT

    info = rec.RunRecord.open(shell_run).info
    manifest = Path(info.worktree) / info.task_rel / "task.toml"
    good = manifest.read_text()
    manifest.write_text(good.replace("timeout_s = 60", 'timeout_s = "soon"'))
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}

    def kloop(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agent.cli", *args, "--run", str(shell_run)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    status = kloop("status")
    assert status.returncode == 0 and "invalid manifest" not in status.stderr, status.stderr
    reverted = kloop("revert")
    assert reverted.returncode == 0, reverted.stderr
    assert manifest.read_text() == good


def test_output_into_a_pipe_is_not_wrapped_at_80_columns(tmp_path):
    import os
    import subprocess
    import sys

    from tests.session_repo import ROOT

    runs = tmp_path / ("a-runs-folder-with-a-long-name-" * 4)
    runs.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "agent.cli", "show", "nothere", "--runs-dir", str(runs)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and str(runs) in res.stderr, res.stderr


def test_a_runs_folder_that_cannot_be_written_is_a_usage_error(tmp_path):
    """exit 2 naming the folder, not 'internal error: OSError' exit 1 (here: a file where a folder
    should be; a read-only folder takes the same path: the probe file cannot be created)."""
    import os
    import subprocess
    import sys

    from tests.session_repo import ROOT

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    runs = blocker / "runs"
    res = subprocess.run([sys.executable, "-m", "agent.cli", "session", "start", "kernels/matmul_cpu", "--runs-dir", str(runs)],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and f"the runs folder {runs} cannot be written" in res.stderr, res.stderr
    assert "internal error" not in res.stderr


def test_resume_warns_once_and_show_says_interrupted(shell_run):
    """After the kill above: `kloop show` calls the cut-off attempt interrupted (not rejected), and a
    resume says what isolates kernels once (the session's note is not printed a second time)."""
    import os
    import subprocess
    import sys

    from tests.session_repo import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}

    def kloop(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    show = kloop("show", str(shell_run))
    assert show.returncode == 0 and "interrupted" in show.stdout and "rejected" not in show.stdout, show.stdout
    resumed = kloop("session", "resume", str(shell_run))
    assert resumed.returncode == 0, resumed.stderr
    said = resumed.stderr.count("no sandbox") + resumed.stderr.count("sandbox UNAVAILABLE") + resumed.stderr.count("sandbox  ")
    assert said == 1, resumed.stderr


def test_the_session_leaves_the_sandbox_warning_to_the_front_end(shell_run, capfd, caplog):
    """`kloop optimize`/`resume` print the warning (agent/cli.py `_print_sandbox`); the session itself
    used to log it as well, so it appeared twice. It records the note and prints nothing."""
    from tools.sandbox import status

    resumed = Session.resume(shell_run)
    resumed.close()
    assert "sandbox" not in capfd.readouterr().err
    assert not [r for r in caplog.records if "sandbox" in r.getMessage()]  # a log warning reached stderr too
    if not status().available:
        assert [e for e in resumed.events() if e.kind == "note" and "sandbox" in e.data]
