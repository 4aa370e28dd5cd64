"""ClaudePolicy + LLMClient driven through the real anthropic SDK, over HTTP, against a fake API."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, however pytest was started

from agent.llm import PRICES, LLMClient, Usage, cost_usd, price_for, with_cache_breakpoints  # noqa: E402
from agent.policies.base import Budget  # noqa: E402
from agent.records import make_event  # noqa: E402
from agent.policies.claude import MEMORY, NUDGE, ClaudePolicy  # noqa: E402
from tests.fake_anthropic import Drop, Fault, Reply, _canon, fake_api, text, thinking, tool_use  # noqa: E402,F401
from tools.base import Tool, ToolBox, ToolInput, ToolResult  # noqa: E402

MODEL = "claude-opus-5-5"
KEY = "sk-ant-test-SECRET-7f3a9c"


# -- a small toolbox and a fake session context --------------------------------------------------


class EchoIn(ToolInput):
    text: str


class SlowIn(ToolInput):
    seconds: float = 0.2


class IntIn(ToolInput):
    n: int


class SubmitIn(ToolInput):
    title: str


@dataclass
class Calls:
    names: list[str] = field(default_factory=list)


def make_toolbox(calls: Calls, ctx_holder: dict[str, Any]) -> ToolBox:
    def echo(_, a: EchoIn) -> ToolResult:
        calls.names.append("echo")
        return ToolResult(text=f"echo: {a.text}")

    def slow(_, a: SlowIn) -> ToolResult:
        calls.names.append("slow")
        time.sleep(a.seconds)
        return ToolResult(text="slept")

    def needs_int(_, a: IntIn) -> ToolResult:
        calls.names.append("needs_int")
        return ToolResult(text=str(a.n * 2))

    def submit(_, a: SubmitIn) -> ToolResult:
        calls.names.append("submit")
        ctx_holder["ctx"].stop = ctx_holder.get("stop_after_submit")
        return ToolResult(text="rejected: no gain", event="rejected")

    box = ToolBox(context=None)
    box.add(Tool("echo", "Echo the text back.", EchoIn, echo))
    box.add(Tool("slow", "Sleep a while.", SlowIn, slow))
    box.add(Tool("needs_int", "Double an integer.", IntIn, needs_int))
    box.add(Tool("submit", "Submit the candidate to the gate.", SubmitIn, submit))
    return box


@dataclass
class FakeCtx:
    toolbox: ToolBox
    budget: Budget = field(default_factory=Budget)
    logs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    stop: str | None = None
    notes: str = "NOTES: BLOCK=128 was 3% slower; ATTEMPTS: #1 rejected"

    def system_prompt(self) -> str:
        return "You optimise GPU kernels. Act only through tools."

    def briefing(self) -> str:
        return "Task: make softmax faster on H200."

    def memory(self) -> str:
        return self.notes

    def attempts_made(self) -> int:
        return 0

    def log(self, kind: str, **data: Any) -> None:
        make_event(kind, **data)  # what the run record would take: a known kind, known fields
        json.dumps(data)  # the run record is JSON: every event must serialise
        self.logs.append((kind, data))

    deadline: float | None = None  # time.monotonic() at which the hours budget is spent (None: no budget)

    def stop_reason(self) -> str | None:
        if self.stop is None and self.deadline is not None and time.monotonic() >= self.deadline:
            return "max_hours"
        return self.stop

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def events(self, kind: str | None = None) -> list[Any]:
        """The data of the events of one kind; without a kind, the record's events (as Session.events)."""
        if kind is None:
            return [make_event(k, **d) for k, d in self.logs]
        return [d for k, d in self.logs if k == kind]


@pytest.fixture
def setup(fake_api):
    calls = Calls()
    holder: dict[str, Any] = {}
    ctx = FakeCtx(make_toolbox(calls, holder))
    holder["ctx"] = ctx

    def policy(**kw: Any) -> ClaudePolicy:
        client_kw = {k: kw.pop(k) for k in ("timeout", "max_retries", "max_total_wait", "max_delay") if k in kw}
        client = LLMClient(MODEL, api_key=KEY, base_url=fake_api.base_url, backoff_base=0.01, **client_kw)
        return ClaudePolicy(model=MODEL, max_tokens=kw.pop("max_tokens", 4096), client=client, **kw)

    return fake_api, ctx, calls, policy, holder


def done() -> list[Reply]:
    """Two end_turns in a row: the policy stops with 'end_turn'."""
    return [Reply([text("nothing more")]), Reply([text("done, really")])]


def sent_key(headers: dict[str, str]) -> str | None:
    """The key as the SDK sent it: `x-api-key`, or (SDK 2.x) `authorization: Bearer <key>`."""
    bearer = headers.get("authorization", "")
    return headers.get("x-api-key") or (bearer[len("Bearer "):] if bearer.startswith("Bearer ") else None)


def last_user(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body["messages"] if m["role"] == "user"][-1]["content"]


# -- the tool-use loop ----------------------------------------------------------------------------


def test_multi_turn_tool_use_conversation(setup):
    api, ctx, calls, policy, _ = setup
    t1 = tool_use("echo", {"text": "hello"})
    t2, t3 = tool_use("echo", {"text": "again"}), tool_use("needs_int", {"n": 21})
    api.add(
        Reply([thinking("plan: echo first"), text("Let me look."), t1], stop_reason="tool_use"),
        Reply([t2, t3], stop_reason="tool_use"),
        *done(),
    )
    assert policy().run(ctx) == "end_turn"
    assert calls.names == ["echo", "echo", "needs_int"]
    assert api.remaining == 0 and len(api.requests) == 4

    first = api.requests[0]
    assert first.path == "/v1/messages" and first.body["stream"] is True and first.body["model"] == MODEL
    assert sent_key(first.headers) == KEY
    assert [t["name"] for t in first.body["tools"]] == ["echo", "slow", "needs_int", "submit"]
    assert first.body["tools"][2]["input_schema"]["required"] == ["n"]
    # prompt caching: last system block, last tool, the briefing: the fixed prefix, for an hour
    hour = {"type": "ephemeral", "ttl": "1h"}
    assert first.body["system"][-1]["cache_control"] == hour
    assert first.body["tools"][-1]["cache_control"] == hour
    assert "cache_control" not in first.body["tools"][0]
    assert first.body["messages"][0]["content"][-1] == {
        "type": "text", "text": "Task: make softmax faster on H200.", "cache_control": hour
    }

    second = api.requests[1].body
    assistant = second["messages"][1]
    assert assistant["role"] == "assistant"
    assert assistant["content"][0] == {"type": "thinking", "thinking": "plan: echo first", "signature": "sig-fake"}
    results = last_user(second)
    assert [r["tool_use_id"] for r in results] == [t1["id"]]
    assert results[0]["content"] == "echo: hello" and "is_error" not in results[0]
    assert results[-1]["cache_control"] == {"type": "ephemeral"}  # the rolling breakpoint

    third = last_user(api.requests[2].body)
    assert [(r["tool_use_id"], r["content"]) for r in third] == [(t2["id"], "echo: again"), (t3["id"], "42")]
    assert last_user(api.requests[3].body)[-1]["text"] == NUDGE

    turns = ctx.events("llm_turn")
    assert [t["turn"] for t in turns] == [1, 2, 3, 4]
    assert [t["stop_reason"] for t in turns] == ["tool_use", "tool_use", "end_turn", "end_turn"]
    assert turns[0]["tool_calls"] == ["echo"] and turns[0]["text"] == "Let me look."
    assert [c["name"] for c in ctx.events("tool_call")] == ["echo", "echo", "needs_int"]
    (stop,) = ctx.events("policy_stop")
    assert stop == {"reason": "end_turn", "turns": 4, "cost_usd": pytest.approx(turns[-1]["total_cost_usd"])}


def test_tool_use_resets_the_end_turn_count(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Reply([text("hm")]), Reply([tool_use("echo", {"text": "x"})], stop_reason="tool_use"), *done())
    assert policy().run(ctx) == "end_turn"
    assert len(api.requests) == 4 and api.remaining == 0  # without the reset it would stop after 3


def test_invalid_tool_input_is_an_error_result(setup):
    api, ctx, calls, policy, _ = setup
    bad, unknown = tool_use("needs_int", {"n": "lots"}), tool_use("nope", {})
    api.add(Reply([bad, unknown], stop_reason="tool_use"), *done())
    assert policy().run(ctx) == "end_turn"
    assert calls.names == []
    results = last_user(api.requests[1].body)
    assert results[0]["is_error"] is True and "invalid input for needs_int" in results[0]["content"]
    assert results[1]["is_error"] is True and "no tool named 'nope'" in results[1]["content"]
    assert [c["ok"] for c in ctx.events("tool_call")] == [False, False]


def test_slow_tool_duration_is_logged(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Reply([tool_use("slow", {"seconds": 0.2})], stop_reason="tool_use"), *done())
    policy().run(ctx)
    assert ctx.events("tool_call")[0]["duration_s"] >= 0.2


def test_max_tokens_inside_a_tool_call_is_not_run(setup):
    api, ctx, calls, policy, _ = setup
    whole = tool_use("echo", {"text": "complete"})
    cut = tool_use("echo", {"text": "whole file"}, partial_json='{"text": "__global__ void softm')
    api.add(Reply([text("Two edits."), whole, cut], stop_reason="max_tokens"), *done())
    assert policy().run(ctx) == "end_turn"
    assert calls.names == ["echo"]  # the complete call ran, the cut one did not
    results = last_user(api.requests[1].body)
    assert results[0] == {"type": "tool_result", "tool_use_id": whole["id"], "content": "echo: complete"}
    assert results[1]["tool_use_id"] == cut["id"] and results[1]["is_error"] is True
    assert "cut off at max_tokens" in results[1]["content"] and "smaller edits" in results[1]["content"]


def test_max_tokens_in_text_asks_to_continue(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Reply([text("A long explanation that")], stop_reason="max_tokens"), *done())
    assert policy().run(ctx) == "end_turn"
    assert "cut off at max_tokens" in last_user(api.requests[1].body)[0]["text"]


def test_pause_turn_is_sent_back_to_continue(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Reply([text("Still searching...")], stop_reason="pause_turn"), *done())
    assert policy().run(ctx) == "end_turn"
    resent = api.requests[1].body["messages"]
    assert len(resent) == 2 and resent[-1] == {"role": "assistant", "content": [text("Still searching...")]}


def test_refusal_stops_cleanly(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Reply([text("I can't help with that.")], stop_reason="refusal"))
    assert policy().run(ctx) == "refusal"
    assert ctx.events("policy_stop")[0]["reason"] == "refusal"


def test_a_state_changing_tool_ends_the_turn(setup):
    api, ctx, calls, policy, _ = setup
    both = [tool_use("submit", {"title": "t"}), tool_use("echo", {"text": "x"})]
    api.add(Reply(both, stop_reason="tool_use"), *done())
    policy().run(ctx)
    assert calls.names == ["submit"]
    results = last_user(api.requests[1].body)
    assert results[1]["is_error"] is True and "changed the session state (rejected)" in results[1]["content"]


# -- budgets --------------------------------------------------------------------------------------


def test_max_turns(setup):
    api, ctx, calls, policy, _ = setup
    ctx.budget = Budget(max_turns=2)
    api.add(*[Reply([tool_use("echo", {"text": str(i)})], stop_reason="tool_use") for i in range(5)])
    assert policy().run(ctx) == "max_turns"
    assert len(api.requests) == 2 and calls.names == ["echo", "echo"]


def test_max_cost_stops_before_a_request_whose_worst_case_would_pass_it(setup):
    api, ctx, calls, policy, _ = setup
    usage = {"input_tokens": 5_000, "output_tokens": 1_000}  # $0.02 + $0.02 = $0.04 a turn on Opus 5.5
    # worst case of the next request: ~6,000 input tokens all written to the cache ($5/MTok) + 4,096
    # output ($20/MTok) = ~$0.112; after 3 turns ($0.12) that would pass $0.20. (5,000 input tokens is
    # within what these small requests can hold: their size plus the API's framing.)
    ctx.budget = Budget(max_cost_usd=0.20)
    api.add(*[Reply([tool_use("echo", {"text": "x"})], stop_reason="tool_use", usage=usage) for _ in range(6)])
    assert policy().run(ctx) == "max_cost"
    assert len(api.requests) == 3 and api.remaining == 3  # the fourth request was never sent
    assert ctx.events("policy_stop")[0]["cost_usd"] == pytest.approx(0.12)
    (note,) = [n for n in ctx.events("note") if "not sent" in n["text"]]
    assert 0.12 + note["data"]["worst_usd"] > 0.20 and note["data"]["input_estimate"] >= 6_000
    est, hour = note["data"]["input_estimate"], note["data"]["hour_tokens"]  # the fixed prefix: 1-hour writes
    assert 0 < hour < 2_000 and note["data"]["worst_usd"] == pytest.approx((hour * 8 + (est - hour) * 5 + 4096 * 20) / 1e6)
    assert not [n for n in ctx.events("note") if "fault" in n["data"]]


def test_a_first_request_that_could_pass_max_cost_is_not_sent(setup):
    api, ctx, calls, policy, _ = setup
    ctx.budget = Budget(max_cost_usd=0.05)  # 4,096 output tokens alone may cost $0.08 on Opus 5.5
    api.add(*done())
    assert policy().run(ctx) == "max_cost"
    assert api.requests == [] and ctx.events("llm_turn") == []


def test_budgets_count_what_a_resumed_session_already_spent(setup):
    api, ctx, calls, policy, _ = setup
    # the record of the first run: 3 turns, $1.40 spent (as Session.events() gives them back)
    ctx.logs += [("llm_turn", {"turn": n, "cost_usd": c, "model": MODEL}) for n, c in ((1, 0.5), (2, 0.5), (3, 0.4))]
    ctx.budget = Budget(max_turns=5, max_cost_usd=1.55)
    usage = {"input_tokens": 1_000, "output_tokens": 100}  # $0.006 a turn
    api.add(*[Reply([tool_use("echo", {"text": str(i)})], stop_reason="tool_use", usage=usage) for i in range(4)])
    assert policy().run(ctx) == "max_turns"
    assert len(api.requests) == 2  # turns 4 and 5 of 5
    turns = ctx.events("llm_turn")[3:]
    assert [t["turn"] for t in turns] == [4, 5]
    assert turns[-1]["total_cost_usd"] == pytest.approx(1.4 + 2 * 0.006)
    assert ctx.events("policy_stop")[0] == {"reason": "max_turns", "turns": 5, "cost_usd": pytest.approx(1.412)}
    assert "already spent" in ctx.events("note")[0]["text"]

    # the cost already spent counts too: $1.412 + a worst case of ~$0.09 passes $1.45
    ctx.logs = [(k, d) for k, d in ctx.logs if k == "llm_turn"]
    ctx.budget = Budget(max_cost_usd=1.45)
    api.add(Reply([text("never sent")]))
    assert policy().run(ctx) == "max_cost" and len(api.requests) == 2


def test_session_stop_reason_is_returned(setup):
    api, ctx, calls, policy, holder = setup
    ctx.stop = "max_hours"
    assert policy().run(ctx) == "max_hours" and api.requests == []

    ctx.stop = None
    holder["stop_after_submit"] = "max_attempts"  # the submit spends the last attempt
    api.add(Reply([tool_use("submit", {"title": "t"})], stop_reason="tool_use"))
    assert policy().run(ctx) == "max_attempts"
    assert len(api.requests) == 1


# -- usage and cost -------------------------------------------------------------------------------


def test_cost_accounting_matches_the_price_table(setup):
    api, ctx, calls, policy, _ = setup
    u1 = {"input_tokens": 1_200, "output_tokens": 800, "cache_creation_input_tokens": 5_000}
    u2 = {"input_tokens": 300, "output_tokens": 150, "cache_creation_input_tokens": 700,
          "cache_read_input_tokens": 6_000}
    u3 = {"input_tokens": 50, "output_tokens": 20, "cache_creation_input_tokens": 400, "cache_read_input_tokens": 7_000,
          "cache_creation": {"ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 300}}
    api.add(Reply([tool_use("echo", {"text": "x"})], stop_reason="tool_use", usage=u1), Reply([text("a")], usage=u2),
            Reply([text("b")], usage=u3))
    policy().run(ctx)
    p = PRICES[MODEL]
    assert (p.input, p.output, p.cache_write, p.cache_write_1h, p.cache_read) == (4.0, 20.0, 5.0, 8.0, 0.2)

    def expected(u: dict[str, Any], w1h: int = 0) -> float:
        w5 = u["cache_creation_input_tokens"] - w1h
        return (u["input_tokens"] * p.input + u["output_tokens"] * p.output + w5 * p.cache_write
                + w1h * p.cache_write_1h + u.get("cache_read_input_tokens", 0) * p.cache_read) / 1e6

    turns = ctx.events("llm_turn")
    assert [t["cost_usd"] for t in turns] == pytest.approx([expected(u1), expected(u2), expected(u3, 300)])
    assert turns[-1]["total_cost_usd"] == pytest.approx(expected(u1) + expected(u2) + expected(u3, 300))
    assert turns[0]["usage"] == {"input_tokens": 1_200, "output_tokens": 800, "cache_write_tokens": 5_000,
                                 "cache_write_1h_tokens": 0, "cache_read_tokens": 0}
    assert turns[2]["usage"]["cache_write_1h_tokens"] == 300 and turns[2]["usage"]["cache_write_tokens"] == 100


def test_price_lookup():
    assert price_for("claude-haiku-4-5-20251001") == PRICES["claude-haiku-4-5"]
    assert price_for("claude-opus-5-5") != price_for("claude-opus-5")
    with pytest.raises(KeyError):
        price_for("claude-sonnet-9")
    with pytest.raises(KeyError):
        ClaudePolicy(model="claude-sonnet-9")
    u = Usage(1, 2, 3, 4, 5) + Usage(1, 1, 1, 1, 1)
    assert u == Usage(2, 3, 4, 5, 6) and u.total_input == 2 + 4 + 5 + 6
    assert cost_usd("claude-sonnet-5-5", Usage(input_tokens=1_000_000)) == pytest.approx(2.0)


def test_cache_breakpoints_never_exceed_four():
    system = [{"type": "text", "text": "s"}]
    tools = [{"name": "a"}, {"name": "b"}]
    msgs = [{"role": "user", "content": "brief"}, {"role": "assistant", "content": [text("x")]},
            {"role": "user", "content": [text("y")]}]
    s, t, m = with_cache_breakpoints(system, tools, msgs)
    marked = [b for b in s + t + m[0]["content"] + m[2]["content"] if "cache_control" in b]
    assert len(marked) == 4
    assert "cache_control" not in system[0] and msgs[0]["content"] == "brief"  # inputs untouched


# -- retries --------------------------------------------------------------------------------------


def test_529_then_success(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Fault(529), *done())
    assert policy().run(ctx) == "end_turn"
    assert len(api.requests) == 3
    (retry,) = ctx.events("llm_retry")
    assert retry["attempt"] == 1 and retry["error"].startswith("overloaded: 529 overloaded_error")
    assert ctx.events("llm_turn")[0]["retries"] == 1


def test_429_retry_after_ms_is_honoured(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Fault(429, headers={"retry-after-ms": "200"}), *done())
    assert policy().run(ctx) == "end_turn"
    gap = api.requests[1].at - api.requests[0].at
    assert 0.2 <= gap < 1.0
    assert ctx.events("llm_retry")[0]["wait_s"] == 0.2


def test_429_retry_after_seconds_is_honoured(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Fault(429, headers={"retry-after": "1"}), *done())
    assert policy().run(ctx) == "end_turn"
    assert api.requests[1].at - api.requests[0].at >= 0.95


def test_retry_wait_is_bounded(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Fault(429, headers={"retry-after": "3600"}))
    start = time.monotonic()
    reason = policy(max_total_wait=5).run(ctx)
    assert time.monotonic() - start < 2
    assert reason.startswith("api_error: rate_limit: 429 rate_limit_error") and "retry budget" in reason


def test_a_retry_after_past_retry_max_wait_waits_only_that_long(setup):
    """A 429 asking for an hour, with --retry-max-wait 0.3 s (the client's max_delay) and an hour of
    retry budget: the wait is cut to 0.3 s and the session goes on (issue 27)."""
    api, ctx, calls, policy, _ = setup
    api.add(Fault(429, headers={"retry-after": "3600"}), *done())
    start = time.monotonic()
    assert policy(max_total_wait=3600, max_delay=0.3).run(ctx) == "end_turn"
    assert time.monotonic() - start < 10 and len(api.requests) == 3
    (retry,) = ctx.events("llm_retry")
    assert retry["wait_s"] == 0.3 and "asked to wait 3600 s; waiting at most 0.3 s" in retry["error"]
    assert 0.3 <= api.requests[1].at - api.requests[0].at < 3


def test_a_second_stop_says_what_it_cut_off(setup):
    """A second Ctrl-C (StopNow, a KeyboardInterrupt) during a tool call: the record says what was
    running (the tool call, not an evaluation), and the stop goes on (issue 27)."""
    api, ctx, calls, policy, _ = setup

    def stop_now(_, a):
        raise KeyboardInterrupt("stopped now (SIGINT)")

    ctx.toolbox.add(Tool("hang", "A tool the user stops.", SlowIn, stop_now))
    api.add(Reply([tool_use("hang", {})], stop_reason="tool_use"))
    p = policy()
    with pytest.raises(KeyboardInterrupt):
        p.run(ctx)
    (note,) = [n for n in ctx.events("note") if n["data"].get("stopped")]
    assert note["data"]["stopped"] == "the tool call hang of turn 1" and "was cut off" in note["text"]
    assert p.doing == "the tool call hang of turn 1"  # what the CLI's 'stopped now' line names


def test_a_retry_after_past_max_hours_ends_at_once_as_max_hours(setup):
    """A 429 asking for an hour with 36 s left under --max-hours (0.01) and a --retry-max-wait of
    two hours: the wait is never begun; the session stops as max_hours, saying why."""
    api, ctx, calls, policy, _ = setup
    ctx.budget, ctx.deadline = Budget(max_hours=0.01), time.monotonic() + 36
    api.add(Fault(429, headers={"retry-after": "3600"}), *done())
    start = time.monotonic()
    reason = policy(max_total_wait=6 * 3600, max_delay=7200).run(ctx)
    assert time.monotonic() - start < 10  # not 3600 s, nor the 36 s left
    assert reason == "max_hours" and len(api.requests) == 1 and ctx.events("llm_retry") == []
    (note,) = ctx.events("note")
    assert note["data"]["wait_stopped"] == "max_hours" and "a wait of 3600.0 s" in note["text"]


def test_a_stop_during_a_retry_wait_ends_it_at_once(setup):
    """The first Ctrl-C (the session's flag) ends a wait at its next slice, recorded with its reason."""
    api, ctx, calls, policy, _ = setup
    api.add(Fault(529, headers={"retry-after": "600"}), *done())
    import threading
    timer = threading.Timer(0.5, lambda: setattr(ctx, "stop", "interrupted"))
    timer.start()
    start = time.monotonic()
    reason = policy(max_total_wait=3600, max_delay=900).run(ctx)
    assert time.monotonic() - start < 10 and reason == "interrupted"
    assert len(ctx.events("llm_retry")) == 1 and len(api.requests) == 1
    assert [n["data"]["wait_stopped"] for n in ctx.events("note")] == ["interrupted"]
    assert "s still ahead" in ctx.events("note")[0]["text"]


def test_retries_are_limited(setup):
    api, ctx, calls, policy, _ = setup
    api.add(*[Fault(500) for _ in range(3)])
    reason = policy(max_retries=2).run(ctx)
    assert reason.startswith("api_error: server_error: 500 api_error") and "after 3 attempts" in reason
    assert len(api.requests) == 3


def test_non_retryable_error_stops_without_traceback(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Fault(400, message="messages.0: bad request"))
    reason = policy().run(ctx)
    assert reason == "api_error: invalid_request: 400 invalid_request_error: messages.0: bad request"
    assert "Traceback" not in reason and len(api.requests) == 1


@pytest.mark.parametrize(
    "fault",
    [
        Drop(),  # connection closed before any response
        Reply([text("part")], drop_after=3),  # connection cut mid-stream
        Reply([text("part")], error_after=2, error_type="overloaded_error"),  # `event: error` mid-stream
        Reply([text("late")], delay=1.5),  # slower than the client's timeout
    ],
    ids=["drop", "drop-mid-stream", "overloaded-event", "timeout"],
)
def test_transient_failures_are_retried(setup, fault):
    api, ctx, calls, policy, _ = setup
    api.add(fault, *done())
    assert policy(timeout=0.5).run(ctx) == "end_turn"
    assert len(ctx.events("llm_retry")) == 1 and len(ctx.events("llm_turn")) == 2


# -- context --------------------------------------------------------------------------------------


def results_of(messages: list[dict[str, Any]]) -> list[str]:
    return [b["content"] for m in messages if m["role"] == "user" and isinstance(m["content"], list)
            for b in m["content"] if b.get("type") == "tool_result"]


def test_old_tool_results_are_cleared_by_the_api_and_memory_reinjected(setup):
    api, ctx, calls, policy, _ = setup
    api.count_tokens = lambda body: 1_000 * len(results_of(body["messages"]))  # 1,000 tokens a result
    ids = [tool_use("echo", {"text": f"r{i}" + "x" * 2_000}) for i in range(4)]
    api.add(*[Reply([thinking(f"step {i}", f"sig-{i}"), u], stop_reason="tool_use") for i, u in enumerate(ids)],
            *done())
    assert policy(context_limit=1_500, keep_tool_results=1).run(ctx) == "end_turn"
    assert api.remaining == 0 and len(api.requests) == 6
    for r in api.requests:  # the API's own context editing, asked for in every request
        assert "context-management-2025-06-27" in r.headers["anthropic-beta"]
        thinking_edit, clear = r.body["context_management"]["edits"]
        assert thinking_edit == {"type": "clear_thinking_20251015", "keep": "all"}
        assert clear["type"] == "clear_tool_uses_20250919" and clear["trigger"] == {"type": "input_tokens", "value": 1_500}
        assert clear["keep"] == {"type": "tool_uses", "value": 1}
        assert r.body["thinking"] == {"type": "adaptive"}
    assert api.requests[1].applied == []  # one result: under the trigger
    (edit,) = api.requests[2].applied
    assert edit["cleared_tool_uses"] == 1 and edit["cleared_input_tokens"] > 500
    # the model saw the old result cleared; our history still holds it, unchanged
    assert [r[:6] for r in results_of(api.requests[2].seen)] == ["[clear", "echo: "]
    assert [r[:8] for r in results_of(api.requests[2].body["messages"])] == ["echo: r0", "echo: r1"]
    # the response said so: the next message ends with what was learned
    note = last_user(api.requests[3].body)[-1]
    assert note["type"] == "text" and note["text"] == MEMORY.format(memory=ctx.notes)
    assert ctx.events("context_cleared")[0] == {"turn": 3, "context_tokens": edit["cleared_input_tokens"], "cleared": 1}
    # append-only: every request starts with the previous one, thinking blocks and all (cache_control aside)
    for a, b in zip(api.bodies, api.bodies[1:]):
        assert _canon(b["messages"][: len(a["messages"])]) == _canon(a["messages"])
        assert _canon([b["system"], b["tools"]]) == _canon([a["system"], a["tools"]])
    assert api.requests[1].body["messages"][1]["content"][0] == thinking("step 0", "sig-0")
    # the briefing is never cleared
    assert api.requests[5].body["messages"][0]["content"][0]["text"] == "Task: make softmax faster on H200."


def test_context_window_exceeded_clears_harder_or_stops(setup):
    api, ctx, calls, policy, _ = setup
    full = {"input_tokens": 45_000, "output_tokens": 100}  # near the 50k window; the requests can hold that much
    api.add(Reply([tool_use("echo", {"text": "B" * 60_000})], stop_reason="tool_use"),
            Reply([text("...")], stop_reason="model_context_window_exceeded", usage=full), *done())
    assert policy(context_window=50_000).run(ctx) == "end_turn"
    normal = api.requests[1].body["context_management"]["edits"][1]
    assert normal["trigger"]["value"] == 30_000 and normal["keep"]["value"] == 3  # 60% of the window
    harder = api.requests[2].body["context_management"]["edits"][1]
    assert harder["trigger"]["value"] == 22_550 and harder["keep"]["value"] == 1
    assert api.requests[3].body["context_management"]["edits"][1]["trigger"]["value"] == 30_000  # back to normal
    assert not [n for n in ctx.events("note") if "fault" in n["data"]]

    api.add(Reply([tool_use("echo", {"text": "B" * 60_000})], stop_reason="tool_use"),
            *[Reply([text("...")], stop_reason="model_context_window_exceeded", usage=full)] * 2)
    assert policy(context_window=50_000).run(ctx) == "context_full"  # clearing harder cleared nothing


def test_thinking_effort_and_max_tokens_are_sent_as_asked(setup):
    api, ctx, calls, policy, _ = setup
    api.add(*done())
    policy(effort="high", thinking=2_048).run(ctx)
    body = api.requests[0].body
    assert body["output_config"] == {"effort": "high"} and body["max_tokens"] == 4096
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2_048}
    assert api.requests[0].headers["anthropic-beta"].split(",") == ["context-management-2025-06-27",
                                                                     "interleaved-thinking-2025-05-14"]
    with pytest.raises(ValueError, match="cannot be turned off"):
        policy(thinking="off")  # Opus 5.5 always thinks
    with pytest.raises(ValueError, match="effort"):
        policy(effort="extreme")
    with pytest.raises(ValueError, match="max_tokens"):
        ClaudePolicy(model=MODEL, max_tokens=200_000)
    with pytest.raises(ValueError, match="budget"):
        policy(thinking=8_192)  # not below max_tokens
    assert ClaudePolicy(model="claude-opus-5", thinking="off").thinking == {"type": "disabled"}
    assert ClaudePolicy(model="claude-haiku-4-5").thinking is None  # no adaptive thinking there


def test_the_model_of_each_turn_is_recorded(setup):
    api, ctx, calls, policy, _ = setup
    api.add(*done())
    policy().run(ctx)
    assert [t["model"] for t in ctx.events("llm_turn")] == [MODEL, MODEL]  # the fake answers as the model asked


def test_long_tool_rounds_move_the_cache_to_the_1h_ttl(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Reply([tool_use("echo", {"text": "quick"})], stop_reason="tool_use"),
            Reply([tool_use("slow", {"seconds": 0.3})], stop_reason="tool_use"),
            Reply([tool_use("echo", {"text": "after"})], stop_reason="tool_use"), *done())
    assert policy(long_tool_s=0.2).run(ctx) == "end_turn"
    ttl = [(r.body["system"][-1]["cache_control"], last_user(r.body)[-1]["cache_control"]) for r in api.requests[1:]]
    five, hour = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
    assert ttl[0] == (hour, five)  # after a quick round: the newest breakpoint for 5 minutes
    assert ttl[1] == (hour, hour) and ttl[2] == (hour, hour)  # after the slow one (and while it is recent)
    assert {_canon(r.body["tools"]) for r in api.requests} == {_canon(api.requests[0].body["tools"])}
    assert {json.dumps(r.body["tools"]) for r in api.requests} == {json.dumps(api.requests[0].body["tools"])}


# -- the key ------------------------------------------------------------------------------------


def test_api_key_is_sent_but_never_logged_or_shown(setup):
    api, ctx, calls, policy, _ = setup
    api.add(Reply([tool_use("echo", {"text": "x"})], stop_reason="tool_use"), Fault(401, message="invalid x-api-key"))
    p = policy()
    reason = p.run(ctx)
    assert reason.startswith("api_error: authentication: 401 authentication_error")
    assert all(sent_key(r.headers) == KEY for r in api.requests)
    shown = [json.dumps(ctx.logs), reason, repr(p), str(p), repr(p.client), str(p.client), repr(vars(p))]
    assert not any(KEY in s for s in shown)
    assert not any(KEY in json.dumps(r.body) for r in api.requests)


# -- the fake itself ----------------------------------------------------------------------------


def test_fake_answers_plain_json_too(fake_api):
    fake_api.add(Reply([text("hi"), tool_use("echo", {"text": "x"}, id="toolu_1")], stop_reason="tool_use"))
    client = anthropic.Anthropic(api_key=KEY, base_url=fake_api.base_url, max_retries=0)
    msg = client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert msg.stop_reason == "tool_use" and msg.content[1].input == {"text": "x"}
    assert fake_api.requests[0].body.get("stream") in (None, False)


def test_fake_rejects_what_the_api_would(fake_api):
    client = anthropic.Anthropic(api_key=KEY, base_url=fake_api.base_url, max_retries=0)
    fake_api.add(Reply([text("never sent")]))
    dangling = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "echo", "input": {}}]},
                {"role": "user", "content": "no result"}]
    with pytest.raises(anthropic.BadRequestError, match="need tool_result"):
        client.messages.create(model=MODEL, max_tokens=10, messages=dangling)


def test_fake_enforces_the_thinking_block_rules(fake_api):
    """What the real API refuses with thinking on, the fake refuses too: a regression fails a test."""
    client = anthropic.Anthropic(api_key=KEY, base_url=fake_api.base_url, max_retries=0)
    a1 = [thinking("plan a", "sig-a"), tool_use("echo", {"text": "1"}, id="toolu_a")]
    a2 = [thinking("plan b", "sig-b"), text("next"), tool_use("echo", {"text": "2"}, id="toolu_b")]
    fake_api.add(Reply(a1, stop_reason="tool_use"), Reply(a2, stop_reason="tool_use"), *[Reply([text("ok")])] * 6)
    system = [{"type": "text", "text": "rules"}]

    def send(messages: list[dict[str, Any]], system: list[dict[str, Any]] = system) -> Any:
        return client.messages.create(model=MODEL, max_tokens=10, system=system, messages=messages,
                                      thinking={"type": "adaptive"})

    def result(uid: str, content: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uid, "content": content}]}

    m0 = {"role": "user", "content": [text("brief")]}
    send([m0])
    send([m0, {"role": "assistant", "content": a1}, result("toolu_a", "r1")])
    good = [m0, {"role": "assistant", "content": a1}, result("toolu_a", "r1"), {"role": "assistant", "content": a2},
            result("toolu_b", "r2")]
    send([{**m, "content": [{**b, "cache_control": {"type": "ephemeral"}} for b in m["content"]]}
          if m["role"] == "user" else m for m in good])  # moving cache breakpoints is no change
    bad = {
        "bound to a different conversation": [*good[:2], result("toolu_a", "[cleared]"), *good[3:]],  # edited in place
        "Invalid `signature`": [m0, {"role": "assistant", "content": [thinking("plan A", "sig-a"), a1[1]]}, *good[2:]],
        "must start with a thinking block": [*good[:3], {"role": "assistant", "content": a2[1:]}, good[4]],
    }
    for words, messages in bad.items():
        with pytest.raises(anthropic.BadRequestError, match=words) as err:
            send(messages)
        assert err.value.body["error"]["type"] == "invalid_request_error"  # the API's error shape
    with pytest.raises(anthropic.BadRequestError, match="bound to a different conversation"):
        send(good, system=[{"type": "text", "text": "rules, rewritten"}])  # system is in every block's prefix
    send(good[:3])  # dropping a whole turn at the end is a new request, not an edit: fine
    assert [r.status for r in fake_api.requests] == [200, 200, 200, 400, 400, 400, 400, 200]


def test_fake_checks_context_editing_and_cache_ttls(fake_api):
    client = anthropic.Anthropic(api_key=KEY, base_url=fake_api.base_url, max_retries=0)
    fake_api.add(*[Reply([text("ok")])] * 5)
    msgs = [{"role": "user", "content": "hi"}]
    edits = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    with pytest.raises(anthropic.BadRequestError, match="beta header"):
        client.messages.create(model=MODEL, max_tokens=10, messages=msgs, extra_body={"context_management": edits})
    reply = client.beta.messages.create(model=MODEL, max_tokens=10, messages=msgs, context_management=edits,
                                        betas=["context-management-2025-06-27"])
    assert reply.context_management.applied_edits == []
    late = {"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015", "keep": "all"}]}
    with pytest.raises(anthropic.BadRequestError, match="must be the first"):
        client.beta.messages.create(model=MODEL, max_tokens=10, messages=msgs, context_management=late,
                                    betas=["context-management-2025-06-27"])
    hour, five = {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral"}
    with pytest.raises(anthropic.BadRequestError, match="ttl='1h' cannot come after"):
        client.messages.create(model=MODEL, max_tokens=10, system=[{"type": "text", "text": "s", "cache_control": five}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": hour}]}])
    with pytest.raises(anthropic.BadRequestError, match="disabling thinking"):
        client.messages.create(model=MODEL, max_tokens=10, messages=msgs, thinking={"type": "disabled"})


def test_long_overloads_are_ridden_out_within_retry_hours(setup, monkeypatch):
    api, ctx, calls, policy, _ = setup
    p = ClaudePolicy(model=MODEL, retry_hours=6, max_retry_wait_s=900)
    made = p._client()  # the client a long unattended run gets
    assert (made.max_retries, made.max_total_wait, made.max_delay) == (None, 6 * 3600, 900)
    slept: list[float] = []
    client = LLMClient(MODEL, api_key=KEY, base_url=api.base_url, max_retries=None, max_total_wait=6 * 3600,
                       max_delay=900, sleep=slept.append)  # waits recorded (in their slices), not slept
    api.add(*[Fault(529)] * 20, *done())  # more than the default 8 retries
    assert ClaudePolicy(model=MODEL, max_tokens=4096, client=client).run(ctx) == "end_turn"
    waits = [e["wait_s"] for e in ctx.events("llm_retry")]
    assert len(waits) == 20 and max(waits) <= 900 and sum(waits) <= 6 * 3600
    assert sum(slept) == pytest.approx(sum(waits), abs=0.01 * len(waits))  # each wait slept whole, in slices
    assert max(slept) <= 0.2  # slices that notice a stop
    assert waits[12] > waits[2]  # exponential, with jitter, capped per wait
    assert [e["attempt"] for e in ctx.events("llm_retry")] == list(range(1, 21))
