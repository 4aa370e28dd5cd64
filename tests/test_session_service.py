"""The pieces under `kloop mcp` and the shell session commands, fast: kloop's AGENTS.md/CLAUDE.md/
.mcp.json are never part of a change, the submit/work locks answer 'busy', the budgets (attempts,
hours, device seconds) are read from the record, and the client configuration printed is usable.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import git
import pytest

from agent.mcp_config import parse_hostport, print_config
from agent.mcp_server import BearerGate, ensure_token
from agent.policies.base import Budget
from agent.records import make_event
from agent.run_state import RunState
from agent.session_service import Busy, budget_stop, hold
from agent.workspace import AGENT_FILES, Workspace


def _repo(tmp: Path, extra: dict[str, str] | None = None) -> Path:
    repo = tmp / "repo"
    (repo / "task").mkdir(parents=True)
    (repo / "task" / "k.cpp").write_text("int x;\n")
    for name, text in (extra or {}).items():
        (repo / name).write_text(text)
    r = git.Repo.init(repo)
    with r.config_writer() as cw:
        cw.set_value("user", "name", "T")
        cw.set_value("user", "email", "t@example.invalid")
    r.git.add(A=True)
    r.index.commit("base")
    return repo


def test_agent_files_are_never_part_of_a_change(tmp_path):
    repo = _repo(tmp_path)
    ws = Workspace.create(repo / "task", "run1", worktrees_root=tmp_path / "wt")
    assert ws.agent_files == AGENT_FILES
    for name in AGENT_FILES:
        (ws.path / name).write_text("kloop's\n")
    assert ws.changed_paths() == [] and ws.diff() == ""
    git.Repo(ws.path).git.add("AGENTS.md")  # an agent stages it by hand: still not a change
    assert ws.changed_paths() == []
    (ws.task_path / "k.cpp").write_text("int y;\n")
    assert ws.changed_paths() == ["task/k.cpp"]
    sha = ws.commit("change")
    assert sorted(git.Repo(ws.path).commit(sha).stats.files) == ["task/k.cpp"]
    (ws.task_path / "k.cpp").write_text("int z;\n")
    ws.restore(sha)
    assert all((ws.path / n).read_text() == "kloop's\n" for n in AGENT_FILES)  # restore keeps them
    assert (ws.task_path / "k.cpp").read_text() == "int y;\n"


def test_a_repository_own_agents_md_stays_a_normal_file(tmp_path):
    repo = _repo(tmp_path, {"AGENTS.md": "the project's own\n"})
    ws = Workspace.create(repo / "task", "run2", worktrees_root=tmp_path / "wt")
    assert "AGENTS.md" not in ws.agent_files and "CLAUDE.md" in ws.agent_files
    (ws.path / "AGENTS.md").write_text("changed\n")
    assert ws.changed_paths() == ["AGENTS.md"]  # the gate's scope check will refuse it


def test_locks_one_submit_at_a_time(tmp_path):
    with hold(tmp_path, "submit"):
        with pytest.raises(Busy, match="one at a time"):
            with hold(tmp_path, "submit"):
                pass
        with pytest.raises(Busy, match="submit is being judged"):
            with hold(tmp_path, "edit_file"):
                pass
        with hold(tmp_path, "read_file"), hold(tmp_path, "status"):
            pass  # reading never waits
    with hold(tmp_path, "check"), hold(tmp_path, "edit_file"):
        pass  # tools share the work lock
    with hold(tmp_path, "submit"):
        pass  # free again


def _fake_session(budget: Budget, attempts: int = 0, device_s: float = 0.0, hours_ago: float = 0.0):
    now = datetime.now(timezone.utc)
    events = [make_event("session_started", t=now - timedelta(hours=hours_ago)),
              make_event("tool_call", name="bench", duration_s=device_s),
              make_event("tool_call", name="read_file", duration_s=1000.0)]
    for n in range(1, attempts + 1):
        events += [make_event("attempt_started", attempt=n, title=f"a{n}"),
                   make_event("verdict", attempt=n, accepted=False, reason="slower")]
    return SimpleNamespace(budget=budget, state=lambda: RunState.fold(events))


def test_budgets_from_the_record():
    assert budget_stop(_fake_session(Budget(max_attempts=3), attempts=2), "submit") is None
    assert "max_attempts" in budget_stop(_fake_session(Budget(max_attempts=3), attempts=3), "submit")
    assert budget_stop(_fake_session(Budget(max_attempts=3), attempts=3), "check") is None  # only submit spends attempts
    gpu = Budget(max_gpu_seconds=100)
    assert budget_stop(_fake_session(gpu, device_s=99.0), "bench") is None  # read_file's time is not device time
    assert "max_gpu_seconds" in budget_stop(_fake_session(gpu, device_s=100.0), "submit")
    assert budget_stop(_fake_session(gpu, device_s=100.0), "edit_file") is None
    assert "max_hours" in budget_stop(_fake_session(Budget(max_hours=1), hours_ago=1.01), "edit_file")


def test_print_config_and_token(tmp_path):
    text = print_config("kernels/softmax", None, "127.0.0.1", 8765)  # (run from the repository root, as pytest is)
    blocks, cur = [], []
    for line in text.splitlines():  # the JSON blocks between the comment lines
        if line.startswith("#"):
            if cur:
                blocks.append(json.loads("\n".join(cur)))
                cur = []
        elif line.strip():
            cur.append(line)
    if cur:
        blocks.append(json.loads("\n".join(cur)))
    stdio, http = (b["mcpServers"]["kloop"] for b in blocks)
    # a task that exists here is named by its absolute path: the snippet works from any folder
    assert stdio["type"] == "stdio" and stdio["args"][-2:] == ["mcp", str(Path("kernels/softmax").resolve())]
    assert http["url"] == "http://127.0.0.1:8765/mcp" and http["headers"]["Authorization"].startswith("Bearer ")
    token, new = ensure_token(tmp_path)
    assert new and len(token) >= 32 and (tmp_path / "mcp-token").stat().st_mode & 0o777 == 0o600
    assert ensure_token(tmp_path) == (token, False)
    assert parse_hostport("0.0.0.0:9000") == ("0.0.0.0", 9000)
    with pytest.raises(ValueError):
        parse_hostport("9000")


def test_bearer_gate_refuses_without_the_token():
    import anyio

    seen, refused = [], []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    gate = BearerGate(app, "s3cret-token", refused.append)

    async def request(headers):
        sent = []

        async def send(msg):
            sent.append(msg)

        await gate({"type": "http", "path": "/mcp", "method": "POST", "headers": headers, "client": ("1.2.3.4", 5)},
                   None, send)
        return sent[0]["status"] if sent else 200

    # 403, not 401: MCP clients answer a 401 with OAuth discovery (this server has none)
    assert anyio.run(request, []) == 403
    assert anyio.run(request, [(b"authorization", b"Bearer wrong")]) == 403
    assert anyio.run(request, [(b"authorization", b"Bearer s3cret-token")]) == 200
    assert seen == ["/mcp"] and [r["authorization_header"] for r in refused] == ["missing", "wrong"]
    assert "s3cret" not in json.dumps(refused) and "wrong" not in json.dumps([r["client"] for r in refused])


def test_two_processes_serving_one_session_agree(tmp_path, monkeypatch):
    """An MCP server and a shell command attached to the same run: one record with seqs 0, 1, 2, ...,
    and a change landed by one is the other's best (its revert goes there, not to a stale best)."""
    from agent.session_service import SessionService
    from tests.session_repo import make_repo

    task = make_repo(tmp_path)
    a = SessionService.start(task, "mcp", Budget(), runs_root=tmp_path / "runs")
    b = SessionService.attach(a.run_dir)
    for svc in (a, b, a, b):
        assert svc.call("history", {}).ok
    seqs = [e.seq for e in a.session.record.events()]
    assert seqs == list(range(len(seqs)))
    # b lands a change on the branch (as an accepted submit would); a follows it
    src = b.session.ws.task_path / "matmul.cpp"
    src.write_text(src.read_text() + "// landed elsewhere\n")
    landed = b.session.ws.commit("landed by another process")
    a.call("edit_file", {"path": "matmul.cpp", "old": "// landed elsewhere\n", "new": "// mine\n"})
    assert a.call("revert", {}).ok
    assert a.session.best_commit == landed and src.read_text().endswith("// landed elsewhere\n")
    assert a.call("status", {}).data["best_commit"] == landed


def test_a_spent_budget_refuses_before_anything_runs(tmp_path):
    from agent.session_service import SessionService
    from tests.session_repo import make_repo

    task = make_repo(tmp_path)
    svc = SessionService.start(task, "cli", Budget(max_attempts=0, max_gpu_seconds=0), runs_root=tmp_path / "runs")
    try:
        for tool, why in (("submit", "max_attempts"), ("check", "max_gpu_seconds")):
            res = svc.call(tool, {"title": "anything"} if tool == "submit" else {})
            assert not res.ok and res.event == "budget" and why in res.text, res.text
        assert svc.call("read_file", {"path": "matmul.cpp"}).ok  # reading is never budgeted
        assert svc.session.attempts_made() == 0 and svc.session.best_build is None  # no gate, no baseline
        assert svc.call("status", {}).data["left"]["attempts"] == 0
    finally:
        svc.close()


def test_a_cli_run_driven_over_mcp_names_its_client(tmp_path):
    """A run started by `kloop session start` (policy cli) and driven by Claude Code through the
    worktree's .mcp.json: its views said `policy cli` only. The client's name/version go into run.json
    (once, however often it calls) and the views show it; the policy stays what started the run."""
    from agent.records import RunRecord
    from agent.run_view import load_view, run_rows
    from agent.session_service import SessionService
    from tests.session_repo import make_repo

    task = make_repo(tmp_path)
    svc = SessionService.start(task, "cli", Budget(), runs_root=tmp_path / "runs")
    try:
        for _ in range(3):
            svc.set_client("claude-code", "2.1.332")
        info = RunRecord.open(svc.run_dir).info
        assert info.policy == "cli" and [(c.name, c.version) for c in info.clients] == [("claude-code", "2.1.332")]
        assert load_view(svc.run_dir).driven_by == "claude-code 2.1.332 (over MCP)"
        (row,) = run_rows(tmp_path / "runs")
        assert row.driven_by == "claude-code 2.1.332 (over MCP)" and row.state.startswith("live (pid")
        # the terminal says the same: `kloop runs` and `kloop show` (they said "policy cli" and "open (resume it)")
        from typer.testing import CliRunner

        from agent.cli import app

        wide = {"COLUMNS": "400"}
        runs = CliRunner().invoke(app, ["runs", "--runs-dir", str(tmp_path / "runs")], env=wide)
        assert runs.exit_code == 0 and "claude-code 2.1.332 (over MCP)" in runs.output and "live (pid" in runs.output, runs.output
        shown = CliRunner().invoke(app, ["show", str(svc.run_dir)], env=wide)
        assert shown.exit_code == 0 and "driven by claude-code 2.1.332 (over MCP)" in shown.output, shown.output
        assert "live (pid" in shown.output, shown.output
    finally:
        svc.close()


def test_shell_commands_beside_the_process_that_holds_the_run(tmp_path):
    """While an MCP server (here: this process) holds the run, a shell command that acts is refused
    with exit 3 naming the holder; `kloop status` still reads the session."""
    import os
    import subprocess
    import sys

    from agent.session_service import SessionService
    from tests.session_repo import ROOT, make_repo

    task = make_repo(tmp_path)
    svc = SessionService.start(task, "mcp", Budget(), runs_root=tmp_path / "runs")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KLOOP_RUNS": str(tmp_path / "runs")}
    try:
        def kloop(*args):
            return subprocess.run([sys.executable, "-m", "agent.cli", *args, "--run", str(svc.run_dir)],
                                  env=env, capture_output=True, text=True, timeout=300)

        acted = kloop("revert")
        assert acted.returncode == 3 and "in use by" in acted.stderr and f"pid {os.getpid()}" in acted.stderr
        read = kloop("status", "--json")
        assert read.returncode == 0, read.stderr
        assert json.loads(read.stdout)["data"]["run"] == svc.session.record.info.run_id
        assert not [e for e in svc.session.record.events() if e.kind == "tool_call"]  # the reader wrote nothing
    finally:
        svc.close()
