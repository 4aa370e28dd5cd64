"""`kloop optimize --agent claude` stopping where it must, through the real CLI and SDK over HTTP (issue 27).

One session on the CPU task (its baseline shared by both steps):
1. The model's first turn holds more text than the `--context-window` allows: the next request is
   never sent (the fake refuses a prompt past its window with a 400, as the API does); the session
   ends as `context_full`, exit 0, and prints how to continue: a command that works as printed
   (`--runs-dir`, quoted paths).
2. That printed command, run as printed, resumes with a fresh conversation (the briefing alone). Its
   first request meets a 429 that asks for an hour; a SIGTERM during that wait ends it at once (the
   wait is sliced; the first signal is enough): exit 130, the record says the wait was ended and why,
   and the message does not claim an evaluation was killed.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.records import RunRecord, list_runs
from tests.fake_anthropic import Fault, FakeAnthropic, Reply, text, tool_use
from tests.fakes import make_repo

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-ant-test-stops-0123456789SECRET"
WINDOW = 30_000

pytestmark = pytest.mark.slow


def kloop(args: list[str], api: FakeAnthropic, **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC", "KLOOP_RUNS"))}
    env.update(ANTHROPIC_API_KEY=KEY, ANTHROPIC_BASE_URL=api.base_url, PYTHONPATH=str(ROOT), COLUMNS="80")
    return subprocess.Popen([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def printed(out: str, after: str) -> list[str]:
    """The command printed after `after` (up to the end of its line or a ';'), as argv."""
    line = out[out.index(after) + len(after):].splitlines()[0].split(";")[0]
    argv = shlex.split(line.strip())
    assert argv[0] == "kloop", line
    return argv[1:]


@pytest.mark.long
def test_context_full_then_resume_as_printed_then_sigterm_ends_a_retry_wait(tmp_path):
    (tmp_path / "with space").mkdir()
    repo = make_repo(tmp_path / "with space", timeout_s=90)  # a path the printed command must quote; room for load
    runs = tmp_path / "with space" / "my runs"
    wall = "W" * (3 * WINDOW + 3_000)  # more text than the whole window: it can never be cleared
    with FakeAnthropic([Reply([text(wall), tool_use("list_files", {})], stop_reason="tool_use")],
                       context_window=WINDOW) as api:
        proc = kloop(["optimize", str(repo / "kernels" / "matmul_cpu"), "--agent", "claude", "--runs-dir", str(runs),
                      "--max-turns", "10", "--max-cost", "5", "--max-tokens", "4096",
                      "--context-window", str(WINDOW)], api)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        assert len(api.requests) == 1 and all(r.status == 200 for r in api.requests)  # the too-big one never sent
        assert "session ended: context_full" in out and "max_cost" not in out
        (summary,) = list_runs(runs)
        events = RunRecord.open(runs / summary.run_id).events()
        assert [e.reason for e in events if e.kind == "policy_stop"] == ["context_full"]
        assert any(e.kind == "note" and e.text.startswith("not sent") for e in events)

        # 2. the printed command, as printed (from the repository root: not where the runs are)
        argv = printed(out, "continue: ")
        assert argv[:2] == ["resume", summary.run_id] and argv[2:] == ["--runs-dir", str(runs)]
        api.add(Fault(429, headers={"retry-after": "3600"}, message="slow down"))
        proc = kloop(argv, api)
        record = runs / summary.run_id / "events.jsonl"
        deadline = time.monotonic() + 300
        while '"llm_retry"' not in record.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.5)  # inside the wait (sliced every 0.2 s)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - sent
        first = api.requests[1].body["messages"]
    assert proc.returncode == 130, out
    assert took < 30, (took, out)  # not the hour asked for, nor the 300 s --retry-max-wait allows
    assert len(first) == 1 and wall not in json.dumps(first)  # a fresh conversation: the briefing only
    events = RunRecord.open(runs / summary.run_id).events()
    stops = [e for e in events if e.kind == "note" and e.data.get("wait_stopped")]
    assert [e.data["wait_stopped"] for e in stops] == ["interrupted"] and "slow down" in stops[0].text
    assert [e.reason for e in events if e.kind == "session_ended"][-1] == "interrupted"
    assert "evaluation was killed" not in out and "wait ended" in out
    assert KEY not in out
