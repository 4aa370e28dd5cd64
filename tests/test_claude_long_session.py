"""A 40-turn `kloop optimize --agent claude` session, then `kloop resume`, against the loopback API.

The real CLI and SDK over HTTP (ANTHROPIC_BASE_URL). Every reply carries thinking blocks (some
empty, as Opus 5.5 sends them by default, some interleaved between text and tool calls), and the
fake server enforces the API's rules for them: a thinking block must come back byte for byte
after an unchanged prefix, and the last assistant turn must keep its thinking. The context passes
the clearing trigger halfway, so the API's own context editing clears old tool results (and the
50 KB write_file input) server-side, several times, while our history stays append-only.

After 25 turns the API is overloaded past `--retry-hours`: kloop exits 1 and says `kloop resume
RUN`. The resumed session counts the 25 turns and their cost against `--max-turns 40`, and stops
at turn 40. (One submit goes through the gate; its verdict is not asserted: timing on a loaded
machine is noise.) No request of either run is refused (400); the key is in no file the runs wrote.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agent.llm import DEFAULT_MODEL, Usage, cost_usd
from agent.policies.claude import MEMORY
from agent.records import RunRecord, list_runs
from tests.fake_anthropic import Fault, FakeAnthropic, Reply, _canon, text, thinking, tool_use
from tests.test_gate_session import make_repo

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-ant-test-long-0123456789SECRET"
USAGE = {"input_tokens": 900, "output_tokens": 120, "cache_creation_input_tokens": 2_000, "cache_read_input_tokens": 6_000}
BIG = "// padding\n" * 4_600  # ~50 KB
LIMIT = 12_000  # --context-limit: the fake counts 1,000 tokens per tool result in the prompt

pytestmark = pytest.mark.slow


def reply(n: int, *blocks, stop: str = "tool_use") -> Reply:
    return Reply(list(blocks), stop_reason=stop, usage=dict(USAGE))


def think(n: int, words: str | None = None):
    return thinking(f"turn {n}: {words}" if words is not None else "", f"sig-{n:02d}-{'x' * 40}")


def turn(n: int) -> Reply:
    """The scripted reply of turn n (1-based): cheap tools mostly, one edit and one submit."""
    if n == 1:
        return reply(n, think(n, "look around"), text("Let me look around."), tool_use("list_files", {}))
    if n == 2:
        return reply(n, think(n, "read the kernel"), tool_use("read_file", {"path": "matmul.cpp"}))
    if n == 3:  # a huge tool input, with an empty thinking block (display omitted)
        return reply(n, think(n), tool_use("write_file", {"path": "scratch.h", "content": BIG}))
    if n == 10:
        return reply(n, think(n, "i-k-j"), tool_use("edit_file", {"path": "matmul.cpp", "old": "#if LOOP_ORDER == 1",
                                                                   "new": "#if 1  // i-k-j"}))
    if n == 11:
        return reply(n, think(n, "submit"), tool_use("submit", {"title": "Walk B along rows (i-k-j)",
                                                                  "rationale": "Rows of B and C stream."}))
    if n % 4 == 0:  # interleaved: thinking, text, thinking, then the call
        return reply(n, think(n, "first thought"), text(f"Step {n}."), think(n + 100, "second thought"),
                     tool_use("notes", {"action": "append", "text": f"turn {n}: nothing new"}))
    if n % 4 == 1:
        return reply(n, think(n, "spec"), tool_use("read_file", {"path": "spec.py"}))
    if n % 4 == 2:
        return reply(n, think(n, "kernel again"), tool_use("read_file", {"path": "matmul.cpp"}))
    return reply(n, think(n), tool_use("history", {}))


def results_of(messages: list[dict]) -> int:
    return sum(1 for m in messages if m["role"] == "user" and isinstance(m["content"], list)
               for b in m["content"] if b.get("type") == "tool_result")


def cli(*args: str, api: FakeAnthropic) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC")}
    env.update(ANTHROPIC_API_KEY=KEY, ANTHROPIC_BASE_URL=api.base_url, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def check_append_only(requests: list) -> None:
    """Each request starts with the one before it: same system and tools, earlier messages unchanged
    (a retry repeats its request)."""
    bodies = [r.body for r in requests]
    for a, b in zip(bodies, bodies[1:]):
        assert _canon([a["system"], a["tools"]]) == _canon([b["system"], b["tools"]])
        assert _canon(b["messages"][: len(a["messages"])]) == _canon(a["messages"])


@pytest.mark.long
def test_forty_turns_with_clearing_then_resume(tmp_path):
    repo = make_repo(tmp_path, timeout_s=20)
    runs = tmp_path / "runs"
    first = [turn(n) for n in range(1, 26)] + [Fault(529), Fault(529)]
    with FakeAnthropic(first) as api:
        api.count_tokens = lambda body: 1_000 * results_of(body["messages"])
        proc = cli("optimize", str(repo / "kernels" / "matmul_cpu"), "--agent", "claude", "--runs-dir", str(runs),
                   "--max-turns", "40", "--max-cost", "50", "--gate-seconds", "1.5", "--context-limit", str(LIMIT),
                   "--retry-hours", "0.0003", "--effort", "high", "--max-tokens", "16000", api=api)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out
        (summary,) = list_runs(runs)
        # the hint works as printed: it names the --runs-dir the session was started with (issue 27)
        hint = f"kloop resume {summary.run_id} --runs-dir {shlex.quote(str(runs))}"
        assert hint in out and "the API gave up" in out and KEY not in out
        assert api.remaining == 0
        requests = list(api.requests)

        api.add(*[turn(n) for n in range(26, 41)], Reply([text("never sent")]))
        proc = cli("resume", summary.run_id, "--runs-dir", str(runs), api=api)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert api.remaining == 1  # max_turns stopped it at 40, counting the 25 of the first run
        resumed = api.requests[len(requests):]

    # nothing was refused: every thinking block came back as issued, after an unchanged prefix
    assert [r.status for r in requests] == [200] * 25 + [529, 529]
    assert [r.status for r in resumed] == [200] * 15
    check_append_only(requests[:25])
    check_append_only(resumed)
    last = requests[24].body
    assistants = [m for m in last["messages"] if m["role"] == "assistant"]
    assert len(assistants) == 24 and all(m["content"][0]["type"] == "thinking" for m in assistants)
    assert assistants[2]["content"][0] == think(3)  # the empty one, sent back as it came
    assert [b["type"] for b in assistants[3]["content"]] == ["thinking", "text", "thinking", "tool_use"]

    # the settings asked for, in every request; context editing through the beta
    for r in requests[:25] + resumed:
        body = r.body
        assert body["model"] == DEFAULT_MODEL and body["max_tokens"] == 16_000
        assert body["output_config"] == {"effort": "high"} and body["thinking"] == {"type": "adaptive"}
        assert "context-management-2025-06-27" in r.headers["anthropic-beta"]
        assert body["context_management"]["edits"][1]["trigger"] == {"type": "input_tokens", "value": LIMIT}

    # the API cleared old results (and the big input) server-side, several times; our copy kept them
    cleared = [r for r in requests[:25] if r.applied]
    assert len(cleared) >= 2
    seen_write = [b for m in cleared[0].seen if m["role"] == "assistant" for b in m["content"]
                  if b.get("type") == "tool_use" and b["name"] == "write_file"]
    sent_write = [b for m in cleared[0].body["messages"] if m["role"] == "assistant" for b in m["content"]
                  if b.get("type") == "tool_use" and b["name"] == "write_file"]
    assert seen_write[0]["input"] == {} and sent_write[0]["input"]["content"] == BIG
    memory = MEMORY.split("{memory}")[0]
    after = requests[requests.index(cleared[0]) + 1].body["messages"][-1]["content"][-1]
    assert after["type"] == "text" and after["text"].startswith(memory)

    record = RunRecord.open(runs / summary.run_id)
    events = record.events()
    turns = [e for e in events if e.kind == "llm_turn"]
    assert [e.turn for e in turns] == list(range(1, 41))
    assert {e.model for e in turns} == {DEFAULT_MODEL}
    per_turn = cost_usd(DEFAULT_MODEL, Usage(900, 120, 2_000, 0, 6_000))
    assert turns[24].total_cost_usd == pytest.approx(25 * per_turn, rel=1e-4)
    assert turns[-1].total_cost_usd == pytest.approx(40 * per_turn, rel=1e-4)  # the resumed run counted the first
    assert len([e for e in events if e.kind == "context_cleared"]) >= 2
    stops = [e for e in events if e.kind == "policy_stop"]
    assert stops[0].reason.startswith("api_error: overloaded") and stops[0].turns == 25
    assert stops[-1].reason == "max_turns" and stops[-1].turns == 40
    assert any("already spent" in e.text for e in events if e.kind == "note")
    assert len([e for e in events if e.kind == "verdict"]) == 1  # the submit met the gate (its verdict: noise-bound here)
    assert record.info.config["claude"]["effort"] == "high"

    for path in runs.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
