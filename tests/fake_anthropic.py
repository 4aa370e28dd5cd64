"""A loopback Messages API for tests: POST /v1/messages, JSON or SSE, driven by a script.

Each request takes the next item of the script:

    Reply([text("hi"), tool_use("echo", {"text": "x"})], stop_reason="tool_use", usage={...})
    Reply([...], delay=2.0)                  # wait before answering (client timeouts)
    Reply([...], drop_after=3)               # SSE: send 3 events, then cut the connection
    Reply([...], error_after=2, error_type="overloaded_error")   # SSE: an `event: error` mid-stream
    Reply([...], drip=0.05, chunk=8)         # SSE: 8 bytes at a time, 50 ms apart (a slow server)
    Reply([...], stall_after=4)              # SSE: 4 events, then silence, the connection held open
    Reply([...], start_usage={...}, delta_usage={...})   # usage in message_start / message_delta
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
repeated, inputs that are not objects, empty text blocks, more than four cache breakpoints, empty
messages) and answers 400 like the API would. An exhausted script answers 400 as well, so a
runaway loop ends instead of hanging.

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
    def __init__(self, script: list[Any] | tuple[Any, ...] = (), validate: bool = True) -> None:
        self.script: deque[Any] = deque(script)
        self.requests: list[Recorded] = []
        self.validate = validate
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.stopped = threading.Event()  # releases the handlers that hang

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
        auth = rec.headers.get("authorization") or rec.headers.get("x-api-key") or ""
        self._echo = {ECHO: json.dumps(rec.headers), ECHO_AUTH: auth}
        fake = self.server_fake
        item = fake._next(rec)
        try:
            if self.path.split("?")[0] != "/v1/messages":
                return self._error(404, f"fake: no route {self.path}")
            if item is None:
                return self._error(400, "fake: script exhausted")
            if fake.validate and (problems := request_problems(body)):
                return self._error(400, "; ".join(problems))
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
            if "{request_" in json.dumps(item.content):  # before the texts are split into deltas
                item = replace(item, content=json.loads(self._fill(json.dumps(item.content).encode())))
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
    yield "message_delta", {**delta, "usage": delta_usage}
    yield "message_stop", {"type": "message_stop"}


@pytest.fixture
def fake_api():
    """A started FakeAnthropic with an empty script: `fake_api.add(Reply(...))`."""
    with FakeAnthropic() as server:
        yield server
