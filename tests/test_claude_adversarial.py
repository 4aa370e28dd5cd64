"""ClaudePolicy + LLMClient against a Messages API that misbehaves, over HTTP, through the real SDK.

Whatever the server does, the policy must not crash or hang, must end with a clear reason, must
keep the conversation valid (the fake answers 400 to what the real API would refuse), must count
cost once and never below zero, and must never let the API key reach the logs, a reason, an
exception or a repr, even when the server echoes it back.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
import traceback
from email.utils import format_datetime
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, however pytest was started

import agent.llm as llm  # noqa: E402
from agent.llm import MAX_USAGE_TOKENS, PRICES, LLMClient, LLMError  # noqa: E402
from agent.policies.base import Budget  # noqa: E402
from agent.policies.claude import NUDGE, ClaudePolicy  # noqa: E402
from tests.fake_anthropic import (  # noqa: E402,F401
    ECHO, ECHO_AUTH, SSE, Drop, Fault, Hang, Raw, Reply, _canon, events, fake_api, text, thinking, tool_use,
)
from tests.test_claude_policy import KEY, MODEL, Calls, FakeCtx, done, last_user, make_toolbox  # noqa: E402

P = PRICES[MODEL]


@pytest.fixture
def setup(fake_api):
    calls = Calls()
    holder: dict[str, Any] = {}
    ctx = FakeCtx(make_toolbox(calls, holder))
    holder["ctx"] = ctx

    def policy(timeout: float = 2.0, max_retries: int = 2, max_stream_s: float = 30.0, max_total_wait: float = 30.0,
               **kw: Any) -> ClaudePolicy:
        client = LLMClient(MODEL, api_key=KEY, base_url=fake_api.base_url, backoff_base=0.01, timeout=timeout,
                           max_retries=max_retries, max_stream_s=max_stream_s, max_total_wait=max_total_wait)
        return ClaudePolicy(model=MODEL, max_tokens=kw.pop("max_tokens", 4096), client=client, **kw)

    return fake_api, ctx, calls, policy


def key_nowhere(ctx: FakeCtx, *shown: Any) -> bool:
    return all(KEY not in s for s in [json.dumps(ctx.logs), *map(str, shown), *map(repr, shown)])


def notes(ctx: FakeCtx) -> str:
    return " | ".join(n["text"] for n in ctx.events("note"))


def reply_events(*blocks: dict[str, Any], stop: str = "end_turn") -> list[tuple[str, dict[str, Any]]]:
    return events(Reply(list(blocks), stop_reason=stop))


# -- malformed responses ----------------------------------------------------------------------------


def test_invalid_json_with_200_is_retried_then_gives_up_cleanly(setup):
    api, ctx, calls, policy = setup
    api.add(Raw(b'{"type": "message", "content": [tru'), *done())
    assert policy().run(ctx) == "end_turn"
    assert ctx.events("llm_retry")[0]["error"].startswith("malformed_response: a 200 response that is neither")

    api.add(*[Raw(b"<html>502 Bad Gateway</html>", content_type="text/html")] * 3)
    reason = policy(max_retries=2).run(ctx)
    assert reason.startswith("api_error: malformed_response: ") and "gave up after 3 attempts" in reason


def test_a_json_message_instead_of_a_stream_is_taken(setup):
    api, ctx, calls, policy = setup
    message = {"type": "message", "id": "msg_1", "role": "assistant", "model": MODEL, "stop_reason": "tool_use",
               "content": [tool_use("echo", {"text": "plain"}, id="toolu_json")],
               "usage": {"input_tokens": 10, "output_tokens": 5}}
    api.add(Raw(json.dumps(message)), *done())
    assert policy().run(ctx) == "end_turn" and calls.names == ["echo"]


def test_garbage_lines_and_unknown_events_are_skipped(setup):
    api, ctx, calls, policy = setup
    ev = reply_events(text("Hello there"), tool_use("echo", {"text": "hi"}, id="toolu_g"), stop="tool_use")
    garbage = [
        "this is not a field\n\n", ": a comment\n\n", "data: {not json, and no event name}\n\n",
        ("brand_new_event", "{{{ not json"), ("content_block_flash", {"type": "content_block_flash", "index": 0}),
        "id: 7\nretry: 10\n\n", b"event: ping\ndata: \xff\xfe\n\n",
    ]
    mixed = [ev[0], *garbage[:4], *ev[1:5], *garbage[4:], *ev[5:]]
    api.add(SSE(mixed), *done())
    assert policy().run(ctx) == "end_turn"
    assert ctx.events("llm_turn")[0]["text"] == "Hello there" and calls.names == ["echo"]
    assert ctx.events("llm_retry") == []


def _no_stop(ev):
    return ev[:-1]


def _delta_first(ev):
    return [ev[0], ev[2 + 1], ev[2], *ev[4:]]  # content_block_delta before its content_block_start


def _no_start(ev):
    return ev[1:]


def _twice_started(ev):
    return [ev[0], ev[0], *ev[1:]]


def _bad_json(ev):
    return [*ev[:3], ("content_block_delta", '{"type": "content_block_delta", "index": 0, "delta": {"ty'), *ev[4:]]


def _wrong_delta(ev):
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{}"}}
    return [*ev[:3], ("content_block_delta", delta), *ev[4:]]


def _index_not_int(ev):
    start = {**ev[2][1], "index": "0"}
    return [*ev[:2], ("content_block_start", start), *ev[3:]]


@pytest.mark.parametrize(
    "garble", [_no_stop, _delta_first, _no_start, _twice_started, _bad_json, _wrong_delta, _index_not_int],
)
def test_a_broken_stream_is_retried_then_ends_cleanly(setup, garble):
    api, ctx, calls, policy = setup
    ev = reply_events(text("a reply in two pieces"))
    assert [e[0] for e in ev[:4]] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    api.add(SSE(garble(ev)), *done())
    assert policy().run(ctx) == "end_turn"
    (retry,) = ctx.events("llm_retry")
    assert retry["error"].startswith("malformed_response: ")

    api.add(*[SSE(garble(ev))] * 3)
    reason = policy(max_retries=2).run(ctx)
    assert reason.startswith("api_error: malformed_response: ") and "gave up after 3 attempts" in reason


def test_stream_errors_unknown_types_are_retried_known_final_ones_are_not(setup):
    api, ctx, calls, policy = setup
    api.add(Reply([text("x")], error_after=2, error_type="something_went_sideways"), *done())
    assert policy().run(ctx) == "end_turn"
    assert ctx.events("llm_retry")[0]["error"].startswith("stream_error: something_went_sideways in the event stream")

    api.add(Reply([text("x")], error_after=2, error_type="authentication_error"), *done())
    reason = policy().run(ctx)
    assert reason.startswith("api_error: authentication: authentication_error in the event stream")
    assert api.remaining == 2  # not retried

    api.add(SSE([reply_events(text("x"))[0], ("error", "<<not json>>")]), *done())
    assert policy().run(ctx) == "end_turn"


@pytest.mark.parametrize(
    "start_usage, delta_usage",
    [({}, {}), ({"input_tokens": None, "output_tokens": None}, {"output_tokens": None}), (None, None)],
    ids=["missing", "null-fields", "null-objects"],
)
def test_usage_missing_or_null_counts_zero_and_is_noted(setup, start_usage, delta_usage):
    api, ctx, calls, policy = setup
    ev = reply_events(text("free?"))
    ev[0][1]["message"]["usage"] = start_usage
    ev[-2] = ("message_delta", {**ev[-2][1], "usage": delta_usage})
    api.add(SSE(ev), Reply([text("b")]))
    assert policy().run(ctx) == "end_turn"
    first = ctx.events("llm_turn")[0]
    assert first["cost_usd"] == 0 and set(first["usage"].values()) == {0}
    assert "usage incomplete" in notes(ctx)


@pytest.mark.parametrize("stop", [None, "something_new", "model_context_window_exceeded_v2"])
def test_null_or_unknown_stop_reason_is_treated_as_end_of_turn(setup, stop):
    api, ctx, calls, policy = setup
    api.add(Reply([text("hm")], stop_reason=stop), Reply([tool_use("echo", {"text": "y"})], stop_reason=stop),
            Reply([text("bye")], stop_reason=stop), Reply([text("bye")], stop_reason=stop))
    assert policy().run(ctx) == "end_turn"
    assert calls.names == ["echo"]  # calls run whatever the stop reason says
    assert last_user(api.requests[1].body)[-1]["text"] == NUDGE
    assert f"unknown stop_reason {stop!r}" in notes(ctx)
    assert [t["stop_reason"] for t in ctx.events("llm_turn")] == [stop] * 4


def test_content_blocks_of_other_types_are_sent_back_or_dropped(setup):
    api, ctx, calls, policy = setup
    server_call = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "h200"}}
    server_result = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1",
                     "content": [{"type": "web_search_result", "url": "https://x", "title": "t",
                                  "encrypted_content": "abc"}]}
    redacted = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}
    invented = {"type": "hologram", "payload": {"x": 1}}
    mcp = {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "lookup", "server_name": "s", "input": {}}
    call = tool_use("echo", {"text": "z"}, id="toolu_mix")
    api.add(Reply([thinking("hmm"), redacted, server_call, server_result, invented, mcp, text("Found it."), call],
                  stop_reason="tool_use"), *done())
    assert policy().run(ctx) == "end_turn"
    assert calls.names == ["echo"]  # only our own tool_use is run
    sent_back = api.requests[1].body["messages"][1]["content"]
    assert [b["type"] for b in sent_back] == ["thinking", "redacted_thinking", "server_tool_use",
                                              "web_search_tool_result", "mcp_tool_use", "text", "tool_use"]
    assert sent_back[1] == redacted and sent_back[2] == server_call and sent_back[3] == server_result
    assert "unknown type 'hologram'" in notes(ctx)
    assert ctx.events("llm_turn")[0]["text"] == "Found it."


def test_data_nested_too_deep_is_a_malformed_response(setup):
    api, ctx, calls, policy = setup
    deep = {"type": "hologram", "payload": json.loads("[" * 900 + "]" * 900)}
    api.add(Reply([deep, text("deep")]), *done())
    assert policy().run(ctx) == "end_turn"
    assert ctx.events("llm_retry")[0]["error"].startswith("malformed_response: data nested too deep")


def test_empty_text_blocks_and_empty_turns_keep_the_conversation_valid(setup):
    api, ctx, calls, policy = setup
    api.add(Reply([text(""), tool_use("echo", {"text": "e"})], stop_reason="tool_use"),
            Reply([], stop_reason="end_turn"),
            Reply([text("")]))
    assert policy().run(ctx) == "end_turn"
    assert len(api.requests) == 3  # the fake refuses an empty text block: none was sent back


def test_pause_turn_forever_ends_as_no_progress(setup):
    api, ctx, calls, policy = setup
    api.add(*[Reply([text("searching")], stop_reason="pause_turn") for _ in range(12)])
    assert policy().run(ctx) == "no_progress"
    assert len(api.requests) == 10
    assert [m["role"] for m in api.requests[-1].body["messages"]] == ["user", "assistant"]  # one turn, continued


def test_paused_turns_are_continued_in_place(setup):
    """The API's rule for a paused turn: send its content back as the last assistant message and let
    the model continue it; the continuation belongs to the same message (its thinking is bound to the
    paused blocks before it). Never two assistant messages in a row."""
    api, ctx, calls, policy = setup
    call = tool_use("echo", {"text": "after the pauses"})
    api.add(Reply([thinking("look", "sig-p1"), text("Searching...")], stop_reason="pause_turn"),
            Reply([thinking("more", "sig-p2"), text("Still searching...")], stop_reason="pause_turn"),
            Reply([thinking("found", "sig-p3"), call], stop_reason="tool_use"), *done())
    assert policy().run(ctx) == "end_turn"
    assert calls.names == ["echo"] and all(r.status == 200 for r in api.requests)
    roles = [[m["role"] for m in r.body["messages"]] for r in api.requests]
    assert roles[:4] == [["user"], ["user", "assistant"], ["user", "assistant"], ["user", "assistant", "user"]]
    turn = api.requests[3].body["messages"][1]["content"]
    assert [b.get("signature") or b["type"] for b in turn] == ["sig-p1", "text", "sig-p2", "text", "sig-p3", "tool_use"]
    assert last_user(api.requests[3].body)[0]["tool_use_id"] == call["id"]


def test_an_empty_paused_turn_is_not_paid_twice(setup):
    api, ctx, calls, policy = setup
    api.add(*[Reply([], stop_reason="pause_turn") for _ in range(10)])
    assert policy().run(ctx) == "no_progress"
    assert len(api.requests) == 1 and len(ctx.events("llm_turn")) == 1  # the same request is not sent again
    assert "an empty paused turn" in notes(ctx)


# -- tool calls ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, shown",
    [
        (tool_use("echo", [1, 2]), "not [1, 2]"),
        (tool_use("echo", "just a string"), "not 'just a string'"),
        (tool_use("echo", partial_json="null"), "not None"),
        (tool_use("echo", partial_json='{"text": "x", '), "not '{\"text\": \"x\","),  # not JSON, and not cut off
        (tool_use("echo", partial_json="[" * 50_000), "not '[[[["),  # nested past the parser's depth
    ],
    ids=["list", "string", "null", "broken-json", "deep"],
)
def test_tool_input_that_is_not_an_object_is_answered_not_run(setup, call, shown):
    api, ctx, calls, policy = setup
    api.add(Reply([text("try"), call, tool_use("echo", {"text": "ok"})], stop_reason="tool_use"), *done())
    assert policy().run(ctx) == "end_turn"
    assert calls.names == ["echo"]  # only the well-formed call
    results = last_user(api.requests[1].body)
    assert results[0]["is_error"] is True and shown in results[0]["content"] and "not run" in results[0]["content"]
    assert results[1]["content"] == "echo: ok"
    assert api.requests[1].body["messages"][1]["content"][1]["input"] == {}  # an object goes back to the API


def test_unknown_tool_names_are_answered(setup):
    api, ctx, calls, policy = setup
    api.add(Reply([tool_use("rm_rf", {}), tool_use("x" * 100_000, {})], stop_reason="tool_use"), *done())
    assert policy().run(ctx) == "end_turn"
    results = last_user(api.requests[1].body)
    assert all(r["is_error"] for r in results) and "no tool named 'rm_rf'" in results[0]["content"]
    assert len(results[1]["content"]) < 13_000 and len(json.dumps(ctx.logs)) < 50_000


def test_enormous_tool_input_and_text(setup):
    api, ctx, calls, policy = setup
    big, huge = "A" * 1_000_000, "H" * 3_000_000  # ~333k tokens of text; an input of ~1M, more than the window
    api.add(Reply([text(big), tool_use("echo", {"text": huge})], stop_reason="tool_use"), *done())
    start = time.monotonic()
    assert policy().run(ctx) == "end_turn"
    assert time.monotonic() - start < 10
    assert calls.names == []  # refused before it entered the conversation: not run
    result = last_user(api.requests[1].body)[0]
    assert result["is_error"] is True and "more than the" in result["content"] and "context window" in result["content"]
    sent = api.requests[1].body["messages"][1]["content"]
    assert sent[0]["text"] == big and sent[1]["input"] == {}  # the text as it came; the input not kept
    assert "refused a" in notes(ctx)
    assert len(json.dumps(ctx.logs)) < 200_000  # the record keeps the start of it


def test_enormous_tool_input_in_many_small_deltas_is_read_in_linear_time(setup):
    api, ctx, calls, policy = setup
    raw = json.dumps({"text": "C" * 2_000_000})
    ev = reply_events(tool_use("echo", {}, id="toolu_many"), stop="tool_use")
    deltas = [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "input_json_delta", "partial_json": raw[k : k + 500]}})
              for k in range(0, len(raw), 500)]  # 4,000 deltas
    api.add(SSE([*ev[:3], *deltas, *ev[-3:]]), *done())
    start = time.monotonic()
    assert policy().run(ctx) == "end_turn"
    assert time.monotonic() - start < 10 and calls.names == ["echo"]
    assert api.requests[1].body["messages"][1]["content"][0]["input"] == {"text": "C" * 2_000_000}


def test_duplicate_tool_use_ids_keep_the_first(setup):
    api, ctx, calls, policy = setup
    api.add(Reply([tool_use("echo", {"text": "1"}, id="toolu_dup"), tool_use("echo", {"text": "2"}, id="toolu_dup")],
                  stop_reason="tool_use"), *done())
    assert policy().run(ctx) == "end_turn"
    assert calls.names == ["echo"]
    assert [r["tool_use_id"] for r in last_user(api.requests[1].body)] == ["toolu_dup"]
    assert "second tool_use block with the id toolu_dup" in notes(ctx)


def test_hundreds_of_tool_calls_in_one_turn_are_capped(setup):
    api, ctx, calls, policy = setup
    uses = [tool_use("echo", {"text": str(i)}) for i in range(300)]
    api.add(Reply(uses, stop_reason="tool_use"), *done())
    assert policy(max_tool_calls=5).run(ctx) == "end_turn"
    assert calls.names == ["echo"] * 5
    results = last_user(api.requests[1].body)  # every call answered: the fake would refuse otherwise
    assert [r["tool_use_id"] for r in results] == [u["id"] for u in uses]
    assert all(r["is_error"] and "only the first 5 tool calls" in r["content"] for r in results[5:])


# -- HTTP -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status, kind",
    [(401, "authentication"), (403, "authentication"), (400, "invalid_request"), (404, "not_found"),
     (413, "request_too_large"), (402, "http_402")],
)
def test_errors_that_retrying_cannot_fix_end_at_once(setup, status, kind):
    api, ctx, calls, policy = setup
    api.add(Fault(status, message="nope", headers={"x-should-retry": "true", "retry-after": "0"}), *done())
    reason = policy(max_retries=8).run(ctx)
    assert reason.startswith(f"api_error: {kind}: {status} ") and reason.endswith("nope")
    assert len(api.requests) == 1 and ctx.events("llm_retry") == []


@pytest.mark.parametrize("status", [429, 529, 500, 503])
def test_transient_errors_forever_end_when_the_retries_are_spent(setup, status):
    api, ctx, calls, policy = setup
    api.add(*[Fault(status)] * 20)
    start = time.monotonic()
    reason = policy(max_retries=4).run(ctx)
    assert time.monotonic() - start < 5
    assert reason.startswith("api_error: ") and "gave up after 5 attempts" in reason
    assert len(api.requests) == 5


def test_transient_errors_forever_end_when_the_wait_budget_is_spent(setup):
    api, ctx, calls, policy = setup
    api.add(*[Fault(529, headers={"retry-after-ms": "150"})] * 20)
    start = time.monotonic()
    reason = policy(max_retries=100, max_total_wait=0.5).run(ctx)
    assert time.monotonic() - start < 2
    assert reason.startswith("api_error: overloaded: 529") and "0 s retry budget" in reason
    assert len(api.requests) == 4  # waits of 0.15 s: a fourth would pass 0.5 s


def _http_date(seconds: float) -> str:
    return format_datetime(datetime.now(timezone.utc) + timedelta(seconds=seconds), usegmt=True)


@pytest.mark.parametrize(
    "headers, low, high",
    [
        ({"retry-after": "-30"}, 0, 0.05),  # negative: ignored, our backoff
        ({"retry-after": "soon, maybe"}, 0, 0.05),
        ({"retry-after": "nan"}, 0, 0.05),
        ({"retry-after-ms": "abc", "retry-after": "0.2"}, 0.2, 0.2),
        ({"retry-after": "in 2 s"}, 0.5, 2.0),  # an HTTP date, a second or two away (made below)
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0, 0),  # a date in the past: now
    ],
    ids=["negative", "words", "nan", "ms-unreadable", "http-date", "past-date"],
)
def test_retry_after_in_odd_forms(setup, headers, low, high):
    api, ctx, calls, policy = setup
    headers = {k: _http_date(2) if v == "in 2 s" else v for k, v in headers.items()}
    api.add(Fault(429, headers=headers), *done())
    assert policy().run(ctx) == "end_turn"
    (retry,) = ctx.events("llm_retry")
    assert low <= retry["wait_s"] <= high


# the date is made in the test, not at collection: a parameter id that holds the time differs between
# pytest-xdist workers that collect a second apart, and the run stops ("Different tests were collected")
@pytest.mark.parametrize("after", ["3600", "1e300", "inf", "a year from now"])
def test_absurd_retry_after_gives_up_at_once(setup, after):
    api, ctx, calls, policy = setup
    after = _http_date(86_400 * 365) if after == "a year from now" else after
    api.add(Fault(529, headers={"retry-after": after}))
    start = time.monotonic()
    reason = policy(max_total_wait=30).run(ctx)  # each wait is cut to max_delay (60 s): past the 30 s budget
    assert time.monotonic() - start < 1
    assert reason.startswith("api_error: overloaded: 529") and "retry budget" in reason
    assert "waiting at most 60 s" in reason


def test_a_server_that_never_answers_times_out(setup):
    api, ctx, calls, policy = setup
    api.add(Hang(), *done())
    start = time.monotonic()
    assert policy(timeout=0.3).run(ctx) == "end_turn"
    assert time.monotonic() - start < 3
    assert ctx.events("llm_retry")[0]["error"] == "timeout: no answer within 0.3 s"

    api.add(Hang(), Hang(), Hang())
    start = time.monotonic()
    reason = policy(timeout=0.3, max_retries=2).run(ctx)
    assert reason == "api_error: timeout: no answer within 0.3 s (gave up after 3 attempts)"
    assert time.monotonic() - start < 3


def test_a_stream_that_stalls_midway_times_out(setup):
    api, ctx, calls, policy = setup
    api.add(Reply([text("half of it")], stall_after=4), *done())
    start = time.monotonic()
    assert policy(timeout=0.3).run(ctx) == "end_turn"
    assert time.monotonic() - start < 3
    assert ctx.events("llm_retry")[0]["error"].startswith("timeout: ")


def test_a_slow_but_steady_stream_is_read(setup):
    api, ctx, calls, policy = setup
    api.add(Reply([text("slowly " * 20), tool_use("echo", {"text": "drip"})], stop_reason="tool_use", drip=0.002,
                  chunk=24), *done())
    assert policy(timeout=0.5).run(ctx) == "end_turn"
    assert ctx.events("llm_retry") == [] and calls.names == ["echo"]


def test_a_drip_that_never_completes_an_event_times_out(setup):
    api, ctx, calls, policy = setup
    api.add(Reply([text("x")], drip=0.02, chunk=1), *done())  # a byte every 20 ms: no event within 0.3 s
    start = time.monotonic()
    assert policy(timeout=0.3).run(ctx) == "end_turn"
    assert time.monotonic() - start < 3
    assert ctx.events("llm_retry")[0]["error"] == "timeout: no whole event within 0.3 s"


def test_a_stream_that_never_ends_hits_the_attempt_deadline(setup):
    api, ctx, calls, policy = setup
    start_event = reply_events(text("x"))[0]
    pings = iter(lambda: ("ping", {"type": "ping"}), None)  # forever, each a whole event
    api.add(SSE([start_event, *[("ping", {"type": "ping"})] * 3], drip=0.01),  # ends without message_stop
            SSE(itertools.chain([start_event], pings), drip=0.05))
    start = time.monotonic()
    reason = policy(timeout=0.3, max_stream_s=0.8, max_retries=1).run(ctx)
    assert time.monotonic() - start < 4
    assert reason == "api_error: timeout: the response took more than 0.8 s (gave up after 2 attempts)"
    assert ctx.events("llm_retry")[0]["error"] == "malformed_response: the event stream ended before message_stop"


def test_a_response_too_large_is_refused(setup, monkeypatch):
    api, ctx, calls, policy = setup
    monkeypatch.setattr(llm, "MAX_RESPONSE_BYTES", 50_000)
    api.add(Reply([text("B" * 100_000)]), *done())
    assert policy().run(ctx) == "end_turn"
    assert "larger than 50000 bytes" in ctx.events("llm_retry")[0]["error"]


def test_connection_drops_forever_end_cleanly(setup):
    api, ctx, calls, policy = setup
    api.add(Drop(), Reply([text("x")], drop_after=3), Drop())
    reason = policy(max_retries=2).run(ctx)
    assert reason.startswith("api_error: connection: ") and "after 3 attempts" in reason


def test_no_api_key_ends_with_authentication(setup, monkeypatch):
    api, ctx, calls, policy = setup
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    client = LLMClient(MODEL, base_url=api.base_url)
    reason = ClaudePolicy(model=MODEL, client=client).run(ctx)
    assert reason == "api_error: authentication: no API key (set ANTHROPIC_API_KEY)"
    assert api.requests == []


# -- the key -------------------------------------------------------------------------------------------


def test_key_echoed_in_errors_is_scrubbed(setup):
    api, ctx, calls, policy = setup
    api.add(Fault(529, message=f"overloaded; you sent {ECHO}"), Reply([text("x")], error_after=2, error_type=ECHO),
            Raw(f'{{"type": "error", "error": {{"type": "api_error", "message": "{ECHO}"}}}}'),
            Fault(401, message=f"bad credentials: {ECHO}"))
    p = policy(max_retries=5)
    reason = p.run(ctx)
    assert reason.startswith("api_error: authentication: 401") and "[redacted]" in reason
    assert "x-stainless-lang" in reason  # the echo did arrive; only the key is gone
    errors = [r["error"] for r in ctx.events("llm_retry")]
    assert len(errors) == 3 and all("[redacted]" in e for e in errors)
    assert key_nowhere(ctx, reason, p, p.client, vars(p))


def test_key_echoed_in_assistant_text_and_tool_input_is_scrubbed(setup):
    api, ctx, calls, policy = setup
    api.add(Reply([thinking(f"they sent {ECHO}"), text(f"Your headers: {ECHO}"), tool_use("echo", {"text": ECHO})],
                  stop_reason="tool_use"), *done())
    assert policy().run(ctx) == "end_turn"
    assert calls.names == ["echo"]
    assert "[redacted]" in ctx.events("llm_turn")[0]["text"] and "[redacted]" in ctx.events("tool_call")[0]["text"]
    assert key_nowhere(ctx)
    assert all(KEY not in json.dumps(r.body) for r in api.requests)  # nor does the agent repeat it


def test_key_where_a_reason_is_cut_is_scrubbed_before_the_cut(fake_api):
    client = LLMClient(MODEL, api_key=KEY, base_url=fake_api.base_url, max_retries=0)
    start = reply_events(text("x"))[0]
    for pad in range(0, 700, 8):  # cuts at every place in and around the key, whatever the limit
        fake_api.add(SSE([start, ("content_block_delta", "x" * pad + ECHO_AUTH + " and more")]),
                     Fault(500, message="y" * pad + ECHO_AUTH + " and more"))
        for _ in range(2):
            with pytest.raises(LLMError) as info:
                client.stream_turn("s", [], [{"role": "user", "content": "hi"}], 10)
            assert KEY[:8] not in str(info.value)  # not even the start of it


def test_llm_error_shows_no_key(fake_api):
    fake_api.add(Fault(400, message=f"echo: {ECHO} " + "x" * 5_000))
    client = LLMClient(MODEL, api_key=KEY, base_url=fake_api.base_url, max_retries=0)
    with pytest.raises(LLMError) as info:
        client.stream_turn("s", [], [{"role": "user", "content": "hi"}], 10)
    shown = "".join(traceback.format_exception(info.value))
    assert "[redacted]" in shown and KEY not in shown and KEY not in repr(info.value)
    assert len(str(info.value)) < 1_000  # a long server message is cut (after scrubbing)


# -- cost ------------------------------------------------------------------------------------------------


def test_usage_in_message_start_and_delta_is_counted_once(setup):
    api, ctx, calls, policy = setup
    start = {"input_tokens": 1_000, "output_tokens": 1, "cache_read_input_tokens": 500,
             "cache_creation_input_tokens": 200}
    total = {**start, "output_tokens": 400}  # message_delta: totals so far, input repeated
    only_output = {"output_tokens": 300}  # message_delta: the output count alone
    api.add(Reply([text("a")], start_usage=start, delta_usage=total),
            Reply([text("b")], start_usage=start, delta_usage=only_output))
    assert policy().run(ctx) == "end_turn"
    turns = ctx.events("llm_turn")
    expected = [(1_000 * P.input + n * P.output + 500 * P.cache_read + 200 * P.cache_write) / 1e6 for n in (400, 300)]
    assert [t["cost_usd"] for t in turns] == pytest.approx(expected, abs=1e-6)
    assert turns[0]["usage"] == {"input_tokens": 1_000, "output_tokens": 400, "cache_write_tokens": 200,
                                 "cache_write_1h_tokens": 0, "cache_read_tokens": 500}


def test_negative_and_absurd_usage_is_clamped(setup):
    api, ctx, calls, policy = setup
    weird = {"input_tokens": -5_000, "output_tokens": 10**30, "cache_read_input_tokens": "lots",
             "cache_creation_input_tokens": float("nan"), "cache_creation": {"ephemeral_1h_input_tokens": -1}}
    api.add(Reply([tool_use("echo", {"text": "y"})], stop_reason="tool_use", usage={"input_tokens": True}),
            Reply([tool_use("echo", {"text": "x"})], stop_reason="tool_use", usage=weird),
            Reply([tool_use("echo", {"text": "z"})], stop_reason="tool_use"), *done())
    ctx.budget = Budget(max_cost_usd=5)
    assert policy().run(ctx) == "end_turn"  # the absurd output count is the API's fault: booked at max_tokens
    first, turn = ctx.events("llm_turn")[:2]
    assert first["usage"]["input_tokens"] == 0 and "input_tokens=True" in notes(ctx)
    assert turn["usage"] == {"input_tokens": 0, "output_tokens": 4096, "cache_write_tokens": 0,
                             "cache_write_1h_tokens": 0, "cache_read_tokens": 0}
    assert turn["cost_usd"] == pytest.approx(4096 * P.output / 1e6) and turn["cost_usd"] > 0
    said = notes(ctx)
    for field in ("input_tokens=-5000", "output_tokens=1000000000000000000000000000000",
                  "cache_read_input_tokens='lots'", "cache_creation_input_tokens=nan"):
        assert field in said
    (fault,) = [n for n in ctx.events("note") if n["data"].get("fault") == "usage"]
    assert fault["data"]["turn"] == 2 and fault["data"]["reported"]["output_tokens"] == MAX_USAGE_TOKENS


def test_usage_past_what_a_request_can_hold_is_a_fault_not_spend(setup):
    """10M tokens reported for a request of a few KB: the turn is booked at what the request can
    have cost (its size and max_tokens), the session goes on, and the run says the API was at fault."""
    api, ctx, calls, policy = setup
    absurd = {"input_tokens": 2_000_000, "cache_creation_input_tokens": 8_000_000, "output_tokens": 10}
    api.add(Reply([tool_use("echo", {"text": "a"})], stop_reason="tool_use", usage=absurd), *done())
    ctx.budget = Budget(max_cost_usd=5)  # $292 at the reported figures
    assert policy().run(ctx) == "end_turn"
    assert calls.names == ["echo"] and len(api.requests) == 3
    first = ctx.events("llm_turn")[0]
    booked = sum(first["usage"][k] for k in ("input_tokens", "cache_write_tokens", "cache_write_1h_tokens",
                                             "cache_read_tokens"))
    assert booked <= llm.max_input_tokens([ctx.system_prompt(), [], api.requests[0].body["messages"]]) + 50_000
    assert first["cost_usd"] < 0.2 and ctx.events("policy_stop")[0]["cost_usd"] < 0.3
    (fault,) = [n for n in ctx.events("note") if n["data"].get("fault") == "usage"]
    assert fault["data"]["turn"] == 1 and "API fault" in fault["text"] and "10000000 input tokens" in fault["text"]
    assert fault["data"]["reported"]["cache_write_tokens"] == 8_000_000


def test_negative_usage_never_makes_cost_negative(setup):
    api, ctx, calls, policy = setup
    api.add(Reply([text("a")], usage={"input_tokens": -10**9, "output_tokens": -1}), Reply([text("b")]))
    assert policy().run(ctx) == "end_turn"
    costs = [t["cost_usd"] for t in ctx.events("llm_turn")]
    assert costs[0] == 0 and costs[1] > 0 and ctx.events("policy_stop")[0]["cost_usd"] == costs[1]


# -- the context window -------------------------------------------------------------------------------


def test_a_request_that_cannot_fit_the_window_is_not_sent(setup):
    """Texts (never cleared) grow past a 60k-token window: the request that cannot fit is never sent
    (the fake refuses a prompt past its window with a 400, as the API does), and the session ends as
    context_full, not as an API error nor as max_cost."""
    api, ctx, calls, policy = setup
    api.context_window = 60_000
    api.add(*[Reply([text(f"{i}: " + "T" * 45_000), tool_use("echo", {"text": str(i)})], stop_reason="tool_use")
              for i in range(8)])
    ctx.budget = Budget(max_cost_usd=5)
    assert policy(context_window=60_000).run(ctx) == "context_full"
    assert all(r.status == 200 for r in api.requests) and 2 <= len(api.requests) < 8
    (note,) = [n for n in ctx.events("note") if n["text"].startswith("not sent")]
    assert note["data"]["floor"] + 4096 > 60_000 and "cannot fit" in note["text"]


def test_context_editing_makes_room_before_the_window_is_given_up(setup):
    """Old tool results (clearable by the API) fill the window: the request goes out with the hard
    clearing (keep one call), and the session goes on."""
    api, ctx, calls, policy = setup
    api.context_window = 40_000
    api.add(*[Reply([tool_use("echo", {"text": "R" * 11_000})], stop_reason="tool_use", count_input=True)
              for _ in range(5)], *done())
    api.count_tokens = lambda body: len(_canon([body.get("system"), body.get("tools"), body.get("messages")])) // 3
    assert policy(context_window=40_000, context_limit=30_000).run(ctx) == "end_turn"
    assert all(r.status == 200 for r in api.requests)
    edits = [r.body["context_management"]["edits"][-1] for r in api.requests]
    assert any(e["keep"]["value"] == 1 for e in edits)  # cleared hard when the full history would not fit
    assert any(r.applied for r in api.requests)  # and the fake's context editing did clear


def test_a_prompt_too_long_from_the_api_ends_as_context_full(setup):
    api, ctx, calls, policy = setup
    api.add(Fault(400, message="prompt is too long: 1750000 tokens > 1000000 maximum"))
    assert policy().run(ctx) == "context_full"
    assert "too long for the context window" in notes(ctx)


def test_a_tool_result_that_would_not_fit_is_refused(setup):
    api, ctx, calls, policy = setup
    api.count_tokens = lambda body: len(_canon([body.get("system"), body.get("tools"), body.get("messages")])) // 2
    api.context_window = 9_000  # a tokenizer denser than our estimate: 2 characters a token
    api.add(Reply([tool_use("echo", {"text": "E" * 11_900})], stop_reason="tool_use"), *done())
    assert policy(context_window=9_000, max_tokens=2048).run(ctx) == "end_turn"
    assert calls.names == ["echo"] and all(r.status == 200 for r in api.requests)
    result = last_user(api.requests[1].body)[0]
    assert result["is_error"] is True and "the result of echo is about" in result["content"]
    assert (tc := ctx.events("tool_call")[0])["ok"] is False and "not kept" in tc["text"]
