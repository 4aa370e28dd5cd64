"""A whole `kloop optimize --agent claude` session on the CPU task, against the loopback Messages API.

The real CLI and the real SDK, over HTTP: the scripted agent lists, reads, edits, builds, checks,
survives a 529, a 429 with retry-after, a tool call cut off by max_tokens, an invalid tool input and
a check that times out, submits, and the session ends with one accepted commit. Cost matches the
scripted usage; the API key appears in no file the run wrote and in no commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import git
import pytest

from agent.llm import DEFAULT_MODEL, Usage, cost_usd
from agent.records import RunRecord, list_runs
from agent.trailers import parse_trailers
from tests.fake_anthropic import Fault, FakeAnthropic, Reply, text, tool_use
from tests.test_gate_session import make_repo

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-ant-test-0123456789abcdefSECRET"
USAGE = {"input_tokens": 1200, "output_tokens": 150, "cache_creation_input_tokens": 3000, "cache_read_input_tokens": 800}
HANG = "  for (volatile int spin = 1; spin;) {}\n  return 0;\n}"

pytestmark = pytest.mark.slow


def reply(*blocks, stop="tool_use", usage=USAGE):
    return Reply(list(blocks), stop_reason=stop, usage=dict(usage))


def script():
    return [
        reply(text("Let me look around."), tool_use("list_files", {})),
        reply(tool_use("read_file", {"path": "matmul.cpp"})),
        Fault(529),
        reply(tool_use("edit_file", {"path": "matmul.cpp", "old": "#if LOOP_ORDER == 1", "new": "#if 1  // i-k-j"})),
        reply(tool_use("build", {})),
        reply(tool_use("edit_file", {"path": "matmul.cpp"}, partial_json='{"path": "matmul.cpp", "old": "acc'), stop="max_tokens"),
        reply(tool_use("check", {"shapes": "all of them"})),  # invalid: not a list
        Fault(429, headers={"retry-after-ms": "150"}),
        reply(tool_use("check", {})),
        reply(tool_use("notes", {"action": "append", "text": "ikj: check passes; submit"})),
        reply(tool_use("edit_file", {"path": "matmul.cpp", "old": "  return 0;\n}", "new": HANG})),
        reply(tool_use("check", {"shapes": ["one"]})),  # hangs: the worker's timeout ends it
        reply(tool_use("revert", {})),
        reply(tool_use("edit_file", {"path": "matmul.cpp", "old": "#if LOOP_ORDER == 1", "new": "#if 1  // i-k-j"})),
        reply(tool_use("submit", {"title": "Walk B along rows (i-k-j)", "rationale": "The inner loop streams rows of B and C."})),
        reply(text("Accepted. Nothing else to try."), stop="end_turn"),
        reply(text("Done."), stop="end_turn"),
    ]


@pytest.mark.long
def test_claude_session_end_to_end(tmp_path):
    repo = make_repo(tmp_path, timeout_s=20)  # a loaded machine needs room; the hung check costs this long
    runs = tmp_path / "runs"
    with FakeAnthropic(script()) as api:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC")}
        env.update(ANTHROPIC_API_KEY=KEY, ANTHROPIC_BASE_URL=api.base_url, PYTHONPATH=str(ROOT), COLUMNS="200")
        proc = subprocess.run(
            [sys.executable, "-m", "agent.cli", "optimize", str(repo / "kernels" / "matmul_cpu"), "--agent", "claude",
             "--runs-dir", str(runs), "--max-turns", "40", "--max-cost", "50", "--gate-seconds", "4"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        requests = api.requests
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert KEY not in out
    # every request carried the key; the retries happened
    assert all(KEY in (r.headers.get("x-api-key", "") + r.headers.get("authorization", "")) for r in requests)
    assert len(requests) == len(script())

    (summary,) = list_runs(runs)
    assert summary.attempts == 1 and summary.accepted == 1 and summary.ended
    record = RunRecord.open(runs / summary.run_id)
    events = record.events()
    tool_calls = [e for e in events if e.kind == "tool_call"]
    names = [e.name for e in tool_calls]
    for name in ("list_files", "read_file", "edit_file", "build", "check", "notes", "revert", "submit"):
        assert name in names
    invalid = [e for e in tool_calls if e.name == "check" and not e.ok]
    assert any("shapes" in e.text for e in invalid)  # the invalid input, answered with an error
    assert any("timed out" in e.text for e in invalid)  # the hung check
    # the edit cut off by max_tokens was answered with an error, never run
    edits = [e for e in tool_calls if e.name == "edit_file"]
    assert [e.ok for e in edits] == [True, False, True, True]
    assert "cut off" in edits[1].text

    # cost accounting matches the scripted usage
    turns = [e for e in events if e.kind == "llm_turn"]
    assert len(turns) == len([s for s in script() if isinstance(s, Reply)])
    scripted = Usage(USAGE["input_tokens"], USAGE["output_tokens"], USAGE["cache_creation_input_tokens"], 0, USAGE["cache_read_input_tokens"])
    expected = cost_usd(DEFAULT_MODEL, scripted) * len(turns)
    assert sum(e.cost_usd for e in turns) == pytest.approx(expected, rel=1e-4)  # logged rounded to 1e-6 USD

    # one accepted commit with its evidence on the session branch; the user's branch untouched
    user = git.Repo(repo)
    branch = record.info.branch
    commits = list(user.iter_commits(f"{record.info.base_commit}..{branch}"))
    assert len(commits) == 1
    trailers = dict(parse_trailers(commits[0].message))
    assert float(trailers["Kloop-Speedup"]) > 1.01 and commits[0].summary == "Walk B along rows (i-k-j)"
    assert user.head.commit.hexsha == record.info.base_commit and not user.is_dirty(untracked_files=True)

    # the key is in no file the run wrote, and in no commit
    for path in runs.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    assert KEY not in commits[0].message
    assert "ikj: check passes" in (runs / summary.run_id / "notes.md").read_text()


def test_worker_environment_has_no_secrets():
    from tools.sandbox import scrubbed_env

    env = scrubbed_env({"ANTHROPIC_API_KEY": KEY, "ANTHROPIC_BASE_URL": "http://x", "GITHUB_TOKEN": "t",
                        "AWS_SECRET_ACCESS_KEY": "s", "DB_PASSWORD": "p", "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0"})
    assert set(env) >= {"PATH", "CUDA_VISIBLE_DEVICES", "PYTHONPATH"}
    assert not {"ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"} & set(env)
