"""A loopback Messages API for tests: POST /v1/messages, JSON or SSE, driven by a script.

Each request takes the next item of the script:

    Reply([text("hi"), tool_use("echo", {"text": "x"})], stop_reason="tool_use", usage={...})
    Reply([...], delay=2.0)                  # wait before answering (client timeouts)
    Reply([...], drop_after=3)               # SSE: send 3 events, then cut the connection
    Reply([...], error_after=2, error_type="overloaded_error")   # SSE: an `event: error` mid-stream
    Reply([...], drip=0.05, chunk=8)         # SSE: 8 bytes at a time, 50 ms apart (a slow server)
    Reply([...], stall_after=4)              # SSE: 4 events, then silence, the connection held open
    Reply([...], start_usage={...}, delta_usage={...})   # usage in message_start / message_delta
    Reply([...], count_input=True)           # usage.input_tokens: the server's count of what the model saw
    Fault(529) / Fault(429, headers={"retry-after-ms": "200"}) / Fault(500)
    Drop()                                   # close the connection without answering
    Hang()                                   # read the request, never answer, hold the connection
    SSE([("message_start", {...}), "garbage\n", ...], drip=..., chunk=..., stall_after=...)
                                             # any event stream: (name, data) pairs, data a dict
                                             # (sent as JSON) or a str (sent as is); or raw lines
    Raw(b"{not json", status=200, content_type="application/json")   # any body

`events(Reply(...))` gives a reply's events as the API would send them, for an `SSE` item to
send reordered, cut or garbled. Wherever the text `ECHO` ("{request_headers}") appears in what
the server sends (an error message, a text block, a raw body), it is replaced by the request's
headers, API key included, as JSON: a server that echoes what it was sent. `ECHO_AUTH`
("{request_auth}") is replaced by the credential header alone (`Bearer <key>` or the x-api-key).

A tool_use block may carry `partial_json="..."`: the raw input_json_delta text to stream instead
of the JSON of its input (a reply cut off at max_tokens in the middle of a tool call).

Every request is recorded (`server.requests`: path, lower-cased headers, parsed body). The server
also checks what the real API would reject (tool_use ids answered by the next user message, ids
repeated, inputs that are not objects, empty text blocks, more than four cache breakpoints, a 1-hour
cache breakpoint after a 5-minute one, empty messages, an unknown effort, a thinking budget not
below max_tokens, thinking turned off on a model where it is always on, two assistant messages in a
row) and answers 400 like the API would. With `context_window=N` a prompt of more than N tokens
(`count_tokens`, after context editing) is refused as the API does ("prompt is too long"). An
exhausted script answers 400 as well, so a runaway loop ends instead of hanging.

A request that ends with an assistant message (a paused turn sent back, the API's way to continue
one) gets a reply that continues that message: its thinking blocks are bound to the blocks of that
message before them, so the client sends it back as one assistant message, the paused part first.

The rules of thinking blocks (platform.claude.com/docs/en/build-with-claude/preserved-thinking/
prefix-checks) are enforced, content-addressed, across all requests the server saw:
- a thinking (or redacted_thinking) block sent back must be one the server issued, byte for byte
  (text and signature), else 400 "Invalid `signature` in `thinking` block";
- everything before it (system, tools, earlier messages, earlier blocks of its message; cache_control
  aside) must be what it was in the request that produced it, else 400 "The block is bound to a
  different conversation" (the API's message);
- the last assistant message, when it holds tool_use blocks of a reply that had thinking, must start
  with a thinking block, else 400 (the API's "Expected `thinking` or `redacted_thinking`"), unless
  that reply echoed the request headers (the client had to cut the key out, and with it the thinking).
Only `Reply` items issue thinking blocks; one sent in a raw `SSE` or `Raw` item and sent back is
refused as forged. `FakeAnthropic(validate=False)` turns every rule off.

Context editing (`context_management`, with the `context-management-2025-06-27` beta header, else
400): `clear_tool_uses_20250919` is applied to what the "model" sees when the prompt passes its
trigger (input tokens: `FakeAnthropic.count_tokens`, by default len(JSON)/4): the oldest tool
results but the `keep` newest become "[cleared]" (and their inputs {} with `clear_tool_inputs`),
if at least `clear_at_least` tokens go. What it did is in the response's `context_management`
(message_delta for a stream) and in `Recorded.seen` (the messages as edited) and `.applied`.

Use it as a context manager (`with FakeAnthropic(script) as api: api.base_url`) or through the
`fake_api` fixture (import it into the test module).
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable

import pytest

DEFAULT_USAGE = {
    "input_tokens": 100,
    "output_tokens": 10,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
ECHO = "{request_headers}"
ECHO_AUTH = "{request_auth}"
_ids = itertools.count(1)


def text(s: str) -> dict[str, Any]:
    return {"type": "text", "text": s}


def thinking(s: str, signature: str = "sig-fake") -> dict[str, Any]:
    return {"type": "thinking", "thinking": s, "signature": signature}


def tool_use(name: str, input: dict[str, Any] | None = None, id: str | None = None, partial_json: str | None = None):
    block = {"type": "tool_use", "id": id or f"toolu_fake_{next(_ids):04d}", "name": name, "input": input or {}}
    if partial_json is not None:
        block["partial_json"] = partial_json
    return block


@dataclass
class Reply:
    content: list[dict[str, Any]]
    stop_reason: str = "end_turn"
    usage: dict[str, Any] = field(default_factory=dict)
    delay: float = 0.0
    drop_after: int | None = None  # SSE events sent before the connection is cut
    error_after: int | None = None  # SSE events sent before an `event: error`
    error_type: str = "overloaded_error"
    model: str = "claude-fake"
    drip: float = 0.0  # SSE: seconds before each write
    chunk: int | None = None  # SSE: bytes per write (None: one event per write)
    stall_after: int | None = None  # SSE events sent before the server goes silent
    start_usage: dict[str, Any] | None = None  # message_start's usage (default: usage, 1 output token)
    delta_usage: dict[str, Any] | None = None  # message_delta's usage (default: the output tokens)
    context_management: dict[str, Any] | None = None  # what context editing did (set by the server)
    count_input: bool = False  # usage.input_tokens = the server's count of the prompt it saw (after editing)


@dataclass
class Fault:
    status: int = 529
    headers: dict[str, str] = field(default_factory=dict)
    message: str = "fake fault"
    error_type: str | None = None
    delay: float = 0.0


@dataclass
class Drop:
    """Close the connection without sending a response."""


@dataclass
class Hang:
    """Read the request and never answer (until the server stops)."""


@dataclass
class SSE:
    """Send these events as a 200 event stream, as they are (see the module docstring)."""

    events: Iterable[Any]
    drip: float = 0.0
    chunk: int | None = None
    stall_after: int | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Raw:
    body: bytes | str
    status: int = 200
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float
    seen: list[dict[str, Any]] | None = None  # the messages after context editing
    applied: list[dict[str, Any]] = field(default_factory=list)  # the context edits applied
    status: int | None = None  # what the server answered (None: no answer, a dropped connection)


THINKING = ("thinking", "redacted_thinking")
ALWAYS_THINKING = ("claude-opus-5-5", "claude-fable-5-1", "claude-fable-5-2", "claude-mythos-5-1", "claude-mythos-5-2")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
CONTEXT_BETA = "context-management-2025-06-27"
BOUND = ("messages.{i}.content.{j}: Invalid `signature` in `thinking` block. The block is bound to a different "
         "conversation. Remove the block, or set `thinking.block_binding.prefix_mismatch_behavior` to \"drop_block\".")
FORGED = "messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
UNTHOUGHT = ("messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found `{found}`. When "
             "`thinking` is enabled, a final `assistant` message must start with a thinking block (preceeding the "
             "lastmost set of `tool_use` and `tool_result` blocks). We recommend you include thinking blocks from "
             "previous turns.")


def _plain(value: Any) -> Any:
    """`value` without cache_control (a marker, not content: the prefix check ignores it)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _canon(value: Any) -> str:
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


def _blocks(message: dict[str, Any]) -> list[Any]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content if isinstance(content, list) else []


def _thinking_key(block: dict[str, Any]) -> str:
    return _canon({k: block.get(k) for k in ("type", "thinking", "signature", "data")})


def _prefix(body: dict[str, Any], messages: list[Any], blocks: list[Any]) -> str:
    """What a thinking block is bound to: system, tools, the messages and blocks before it."""
    return _canon([body.get("system"), body.get("tools"), messages, blocks])


def _request_tokens(body: dict[str, Any]) -> int:
    return len(_canon([body.get("system"), body.get("tools"), body.get("messages")])) // 4


def _ttl_problems(body: dict[str, Any]) -> list[str]:
    """TTLs: "5m" or "1h", and never a 1h breakpoint after a 5m one (tools, system, messages)."""
    problems, seen_short = [], False
    blocks = [*(body.get("tools") or []), *(body.get("system") or [] if isinstance(body.get("system"), list) else [])]
    blocks += [b for m in body.get("messages", []) for b in _blocks(m)]
    for b in blocks:
        mark = b.get("cache_control") if isinstance(b, dict) else None
        if not isinstance(mark, dict):
            continue
        ttl = mark.get("ttl", "5m")
        if ttl not in ("5m", "1h"):
            problems.append(f"cache_control.ttl: Input should be '5m' or '1h' (got {ttl!r})")
        elif ttl == "1h" and seen_short:
            problems.append("a cache_control block with ttl='1h' cannot come after a cache_control block with ttl='5m'")
        seen_short = seen_short or ttl == "5m"
    return problems


def _settings_problems(body: dict[str, Any]) -> list[str]:
    problems = []
    effort = (body.get("output_config") or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        problems.append(f"output_config.effort: Input should be {', '.join(map(repr, EFFORTS))}")
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            problems.append(f"thinking.type: Input should be 'enabled', 'adaptive' or 'disabled' (got {kind!r})")
        if kind == "enabled" and not (1024 <= (thinking.get("budget_tokens") or 0) < (body.get("max_tokens") or 0)):
            problems.append("thinking.budget_tokens: must be >= 1024 and less than max_tokens")
        if kind == "disabled" and body.get("model") in ALWAYS_THINKING:
            problems.append(f"thinking: {body.get('model')} does not support disabling thinking")
    return problems


def thinking_on(body: dict[str, Any]) -> bool:
    thinking = body.get("thinking")
    if thinking is None:
        return body.get("model") in ALWAYS_THINKING
    return thinking.get("type") in ("enabled", "adaptive")


# -- what the real API would refuse ------------------------------------------------------------


def request_problems(body: dict[str, Any]) -> list[str]:
    problems = []
    messages = body.get("messages", [])
    marks = 0

    def count(blocks: Any) -> int:
        return sum(1 for b in blocks if isinstance(b, dict) and "cache_control" in b) if isinstance(blocks, list) else 0

    marks += count(body.get("system")) + count(body.get("tools"))
    for i, m in enumerate(messages):
        content = m.get("content")
        marks += count(content)
        if not content:
            problems.append(f"messages.{i}: empty content")
        if any(b.get("type") == "text" and not b.get("text") for b in (content if isinstance(content, list) else [])):
            problems.append(f"messages.{i}: text content blocks must be non-empty")
        if m.get("role") == "assistant" and i and messages[i - 1].get("role") == "assistant":
            problems.append(f"messages.{i}: two assistant messages in a row (a paused turn is continued as the last "
                            "assistant message, not followed by another)")
        if m.get("role") != "assistant" or not isinstance(content, list):
            continue
        ids = [b["id"] for b in content if b.get("type") == "tool_use"]
        if len(set(ids)) != len(ids):
            problems.append(f"messages.{i}: tool_use ids must be unique")
        if any(not isinstance(b.get("input"), dict) for b in content if b.get("type") == "tool_use"):
            problems.append(f"messages.{i}: tool_use input must be an object")
        if not ids or i == len(messages) - 1:
            continue
        nxt = messages[i + 1]
        blocks = nxt.get("content") if isinstance(nxt.get("content"), list) else []
        results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        if nxt.get("role") != "user" or sorted(results) != sorted(ids):
            problems.append(f"messages.{i + 1}: tool_use ids {ids} need tool_result blocks, got {results}")
        leading = [b.get("type") for b in blocks][: len(results)]
        if any(t != "tool_result" for t in leading):
            problems.append(f"messages.{i + 1}: tool_result blocks must come first")
    if marks > 4:
        problems.append(f"a maximum of 4 blocks with cache_control may be provided. Found {marks}.")
    return problems


# -- the server -------------------------------------------------------------------------------


class FakeAnthropic:
    def __init__(self, script: list[Any] | tuple[Any, ...] = (), validate: bool = True,
                 context_window: int | None = None) -> None:
        self.script: deque[Any] = deque(script)
        self.context_window = context_window  # tokens (count_tokens, after context editing); None: no limit
        self.requests: list[Recorded] = []
        self.validate = validate
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.stopped = threading.Event()  # releases the handlers that hang
        # thinking blocks issued: key (text + signature) -> the prefixes they were produced after
        self.issued: dict[str, set[str]] = {}
        self.thought: dict[str, bool] = {}  # tool_use id -> whether its reply had thinking blocks
        self.echoed: set[str] = set()  # tool_use ids of replies that echoed the request headers
        self.count_tokens = _request_tokens  # the prompt size context editing compares with its trigger

    # lifecycle
    def start(self) -> FakeAnthropic:
        fake = self

        class Handler(_Handler):
            server_fake = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fake-anthropic", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._server is not None, "server not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, *items: Any) -> None:
        with self._lock:
            self.script.extend(items)

    @property
    def remaining(self) -> int:
        return len(self.script)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests]

    def _next(self, rec: Recorded) -> Any:
        with self._lock:
            self.requests.append(rec)
            return self.script.popleft() if self.script else None

    # -- the stateful rules: thinking blocks and context editing ---------------------------------

    def binding_problems(self, body: dict[str, Any]) -> list[str]:
        """Thinking blocks sent back must be ours, unchanged, after an unchanged prefix (see the
        module docstring)."""
        messages = body.get("messages") or []
        problems = []
        with self._lock:
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or m.get("role") != "assistant":
                    continue
                blocks = _blocks(m)
                for j, b in enumerate(blocks):
                    if not (isinstance(b, dict) and b.get("type") in THINKING):
                        continue
                    prefixes = self.issued.get(_thinking_key(b))
                    if prefixes is None:
                        problems.append(FORGED.format(i=i, j=j))
                    elif _prefix(body, messages[:i], blocks[:j]) not in prefixes:
                        problems.append(BOUND.format(i=i, j=j))
                    if problems:
                        return problems[:1]
            last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                       default=None)
            if last is not None and thinking_on(body):
                blocks = _blocks(messages[last])
                ids = [b.get("id") for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
                had = any(self.thought.get(u) for u in ids) and not any(u in self.echoed for u in ids)
                first = blocks[0].get("type") if blocks and isinstance(blocks[0], dict) else None
                if had and first not in THINKING:
                    problems.append(UNTHOUGHT.format(i=last, found=first))
        return problems

    def issue(self, body: dict[str, Any], content: list[dict[str, Any]], echoed: bool) -> None:
        """Remember what a reply's thinking blocks are bound to (the request as sent, and the blocks
        before them in the reply as the client will rebuild it)."""
        messages = body.get("messages") or []
        rebuilt = [_rebuilt(b) for b in content]
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            # the request ends with an assistant message (a paused turn sent back): the reply continues
            # it, so its blocks are bound to that message's blocks as they come before them in it
            prior = [_rebuilt(b) for b in _blocks(messages[-1])]
            messages, rebuilt = messages[:-1], [*prior, *rebuilt]
        with self._lock:
            had = any(b.get("type") in THINKING for b in rebuilt)
            for j, b in enumerate(rebuilt):
                if b.get("type") in THINKING:
                    self.issued.setdefault(_thinking_key(b), set()).add(_prefix(body, messages, rebuilt[:j]))
                elif b.get("type") == "tool_use":
                    self.thought[b["id"]] = had
                    if echoed:
                        self.echoed.add(b["id"])

    def edit_context(self, rec: Recorded) -> list[str]:
        """Apply `context_management` to what the model sees; problems if the request is refused."""
        body = rec.body
        config = body.get("context_management")
        if config is None:
            return []
        if CONTEXT_BETA not in rec.headers.get("anthropic-beta", ""):
            return ["context_management: Extra inputs are not permitted (beta header context-management-2025-06-27 "
                    "missing)"]
        edits = config.get("edits") if isinstance(config, dict) else None
        if not isinstance(edits, list):
            return ["context_management.edits: Field required"]
        kinds = [e.get("type") if isinstance(e, dict) else None for e in edits]
        for k in kinds:
            if k not in ("clear_tool_uses_20250919", "clear_thinking_20251015"):
                return [f"context_management.edits: unknown edit type {k!r}"]
        if "clear_thinking_20251015" in kinds:
            if kinds[0] != "clear_thinking_20251015":
                return ["context_management.edits: clear_thinking_20251015 must be the first edit"]
            if not thinking_on(body):
                return ["context_management.edits: clear_thinking_20251015 requires thinking to be enabled"]
        messages = json.loads(json.dumps(body.get("messages") or []))
        tokens = self.count_tokens(body)
        for edit in edits:
            if edit["type"] != "clear_tool_uses_20250919":
                continue
            trigger = (edit.get("trigger") or {}).get("value", 100_000)
            keep = (edit.get("keep") or {}).get("value", 3)
            at_least = (edit.get("clear_at_least") or {}).get("value", 0)
            if tokens <= trigger:
                continue
            uses = {b["id"]: b for m in messages if m.get("role") == "assistant" for b in _blocks(m)
                    if isinstance(b, dict) and b.get("type") == "tool_use"}
            results = [b for m in messages if m.get("role") == "user" for b in _blocks(m)
                       if isinstance(b, dict) and b.get("type") == "tool_result" and b.get("content") != "[cleared]"]
            old = results[: max(0, len(results) - keep)]
            inputs = edit.get("clear_tool_inputs")
            freed = 0
            for r in old:
                freed += len(_canon(r.get("content"))) // 4
                use = uses.get(r.get("tool_use_id"))
                if use is not None and (inputs is True or (isinstance(inputs, list) and use.get("name") in inputs)):
                    freed += len(_canon(use.get("input"))) // 4
            if not old or freed < at_least:
                continue
            for r in old:
                r["content"] = "[cleared]"
                use = uses.get(r.get("tool_use_id"))
                if use is not None and (inputs is True or (isinstance(inputs, list) and use.get("name") in inputs)):
                    use["input"] = {}
            rec.applied.append({"type": "clear_tool_uses_20250919", "cleared_tool_uses": len(old),
                                "cleared_input_tokens": freed})
            tokens -= freed
        rec.seen = messages
        return []


class _Handler(BaseHTTPRequestHandler):
    server_fake: FakeAnthropic
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass

    def do_POST(self) -> None:  # noqa: N802
        self.close_connection = True
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {"_raw": raw.decode("utf-8", "replace")}
        rec = Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic())
        self._rec = rec
        auth = rec.headers.get("authorization") or rec.headers.get("x-api-key") or ""
        self._echo = {ECHO: json.dumps(rec.headers), ECHO_AUTH: auth}
        fake = self.server_fake
        item = fake._next(rec)
        try:
            if self.path.split("?")[0] != "/v1/messages":
                return self._error(404, f"fake: no route {self.path}")
            if item is None:
                return self._error(400, "fake: script exhausted")
            if fake.validate and (problems := request_problems(body) + _ttl_problems(body)
                                  + _settings_problems(body) + fake.binding_problems(body) + fake.edit_context(rec)):
                return self._error(400, "; ".join(problems))
            tokens = fake.count_tokens(body if rec.seen is None else {**body, "messages": rec.seen})  # what the model sees
            if fake.context_window is not None and tokens > fake.context_window:
                return self._error(400, f"prompt is too long: {tokens} tokens > {fake.context_window} maximum")
            if isinstance(item, Reply) and item.count_input:
                item = replace(item, usage={**item.usage, "input_tokens": tokens})
            if isinstance(item, Drop):
                return self._drop()
            if isinstance(item, Hang):
                return self._hang()
            time.sleep(getattr(item, "delay", 0.0))
            if isinstance(item, Fault):
                return self._error(item.status, item.message, item.headers, item.error_type)
            if isinstance(item, Raw):
                body_bytes = item.body.encode() if isinstance(item.body, str) else item.body
                return self._send(item.status, body_bytes, {"content-type": item.content_type, **item.headers})
            if isinstance(item, SSE):
                return self._sse(map(_encode, item.events), item.drip, item.chunk, item.stall_after, item.headers)
            echoed = "{request_" in json.dumps(item.content)
            if echoed:  # before the texts are split into deltas
                item = replace(item, content=json.loads(self._fill(json.dumps(item.content).encode())))
            if fake.validate:
                fake.issue(body, item.content, echoed)
            if rec.seen is not None or body.get("context_management") is not None:
                item = replace(item, context_management={"applied_edits": rec.applied})
            if body.get("stream"):
                pieces = [_encode(e) for e in events(item, body)]
                if item.error_after is not None:
                    error = {"type": "error", "error": {"type": item.error_type, "message": "fake"}}
                    pieces = [*pieces[: item.error_after], _encode(("error", error))]
                if item.drop_after is not None:
                    pieces = [*pieces[: item.drop_after], None]  # None: cut the connection there
                return self._sse(pieces, item.drip, item.chunk, item.stall_after)
            return self._json(200, _message(item, body))
        except (BrokenPipeError, ConnectionResetError):  # the client went away (its timeout)
            pass

    # responses
    def _json(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), {"content-type": "application/json", **(headers or {})})

    def _send(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        data = self._fill(data)
        self._rec.status = status
        self.send_response(status)
        self.send_header("content-length", str(len(data)))
        self.send_header("request-id", f"req_fake_{next(_ids)}")
        self.send_header("connection", "close")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _fill(self, data: bytes) -> bytes:
        for marker, value in self._echo.items():
            data = data.replace(marker.encode(), json.dumps(value)[1:-1].encode())  # fit inside a JSON string
        return data

    def _hang(self) -> None:
        self.server_fake.stopped.wait(60)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None, kind: str | None = None):
        kind = kind or ERROR_TYPES.get(status, "api_error")
        self._json(status, {"type": "error", "error": {"type": kind, "message": message}}, headers)

    def _drop(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.connection.close()

    def _sse(self, pieces: Iterable[bytes | None], drip: float, chunk: int | None, stall_after: int | None,
             headers: dict[str, str] | None = None) -> None:
        self._rec.status = 200
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.send_header("request-id", f"req_fake_{next(_ids)}")
        self.send_header("connection", "close")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        for n, piece in enumerate(pieces):
            if piece is None:
                return self._drop()  # no terminating chunk: the client sees a broken body
            if stall_after is not None and n >= stall_after:
                return self._hang()
            piece = self._fill(piece)
            step = chunk or len(piece) or 1
            for k in range(0, len(piece), step):
                time.sleep(drip)
                self._chunk(piece[k : k + step])
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def _usage(item: Reply) -> dict[str, Any]:
    return {**DEFAULT_USAGE, **item.usage}


def _final_block(block: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in block.items() if k != "partial_json"}


def _rebuilt(block: dict[str, Any]) -> dict[str, Any]:
    """A block as the client rebuilds it from the stream (a cut-off tool input is unreadable: {})."""
    cut = block.get("type") == "tool_use" and "partial_json" in block
    block = _final_block(block)
    return {**block, "input": {}} if cut else block


def _message(item: Reply, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"msg_fake_{next(_ids)}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model") or item.model,
        "content": [_final_block(b) for b in item.content],
        "stop_reason": item.stop_reason,
        "stop_sequence": None,
        "usage": _usage(item),
        **({"context_management": item.context_management} if item.context_management is not None else {}),
    }


def _encode(event: Any) -> bytes:
    """One SSE event: (name, data) with data a dict (as JSON) or a str (as is); or raw text/bytes."""
    if isinstance(event, bytes):
        return event
    if isinstance(event, str):
        return event.encode()
    name, data = event
    data = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {name}\n" if name is not None else "").encode() + f"data: {data}\n\n".encode()


def events(item: Reply, body: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The SSE events of one reply, in the API's order."""
    return list(_events(item, body or {}))


def _events(item: Reply, body: dict[str, Any]):
    usage = _usage(item)
    start_usage = {**usage, "output_tokens": 1} if item.start_usage is None else item.start_usage
    start = {**_message(item, body), "content": [], "stop_reason": None, "usage": start_usage}
    yield "message_start", {"type": "message_start", "message": start}
    yield "ping", {"type": "ping"}
    for i, block in enumerate(item.content):
        kind = block["type"]
        if kind == "text":
            start_block = {**block, "text": ""}
            yield "content_block_start", {"type": "content_block_start", "index": i, "content_block": start_block}
            s = block["text"]
            for piece in (s[: len(s) // 2], s[len(s) // 2 :]):
                if piece:
                    delta = {"type": "text_delta", "text": piece}
                    yield "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
        elif kind == "thinking":
            start_block = {"type": "thinking", "thinking": "", "signature": ""}
            yield "content_block_start", {"type": "content_block_start", "index": i, "content_block": start_block}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
            yield "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
            delta = {"type": "signature_delta", "signature": block["signature"]}
            yield "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
        elif kind == "tool_use":
            start_block = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            yield "content_block_start", {"type": "content_block_start", "index": i, "content_block": start_block}
            raw = block.get("partial_json")
            raw = json.dumps(block["input"]) if raw is None else raw
            step = max(1, len(raw) // 3)
            for k in range(0, len(raw), step):
                delta = {"type": "input_json_delta", "partial_json": raw[k : k + step]}
                yield "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}
        else:
            yield "content_block_start", {"type": "content_block_start", "index": i, "content_block": block}
        yield "content_block_stop", {"type": "content_block_stop", "index": i}
    delta = {"type": "message_delta", "delta": {"stop_reason": item.stop_reason, "stop_sequence": None}}
    delta_usage = {"output_tokens": usage["output_tokens"]} if item.delta_usage is None else item.delta_usage
    cm = {"context_management": item.context_management} if item.context_management is not None else {}
    yield "message_delta", {**delta, "usage": delta_usage, **cm}
    yield "message_stop", {"type": "message_stop"}


@pytest.fixture
def fake_api():
    """A started FakeAnthropic with an empty script: `fake_api.add(Reply(...))`."""
    with FakeAnthropic() as server:
        yield server
