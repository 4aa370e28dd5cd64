"""The Messages API client: one streamed turn, checked, retried, cached and priced.

`LLMClient.stream_turn` sends one request through the SDK (its raw streaming response), reads
the server-sent events itself and returns the assistant message as a `Turn` (content blocks ready
to send back, stop reason, `Usage`). The server is not trusted: every response goes through one
check (`LLMClient._turn`) so that whatever it sends, the turn is either usable or a failed attempt.

- Events: unknown event types and non-SSE lines are skipped; an event out of place (a delta
  before its block, anything before message_start), unreadable JSON, a stream that ends before
  message_stop, a 200 that is not a message: the attempt failed (`malformed_response`), retried.
- Blocks: text, thinking, redacted thinking, server tool calls and their results are sent back as
  they came; blocks of unknown type are dropped, empty text blocks too (the API refuses them);
  a repeated tool_use id is dropped; a tool input that is not an object is replaced by {} and its
  call marked not to run (`Turn.rejected`). Each fix is said in `Turn.notes`.
- Usage: message_delta counts are totals and replace those of message_start; missing counts are
  0, impossible ones clamped (`read_usage`), so a cost is never negative. What one request can
  have cost is bounded (`usage_bound`: its input's UTF-8 size, since a token is at least a byte, and
  `max_tokens`); `bounded_usage` cuts a reported figure past that to the bound and says so.
- Time: `timeout` bounds silence (connecting, reading, or bytes that never make a whole event),
  `max_stream_s` one attempt, `max_delay` each wait between attempts (the server's `retry-after`
  too: a longer one is cut to it), `max_total_wait` all of them, `max_retries` attempts. A caller's
  `stop` hook is asked before each wait and every `WAIT_SLICE` seconds during it: a reason from it
  ends the wait at once (`Stopped`), so a signal or a budget never waits out an hour of retry-after.

Retries are ours, not the SDK's (`max_retries=0` there), so that every wait is observable
(`on_retry`) and bounded in total: 408/409/429/5xx/529, retryable errors sent inside the stream,
malformed responses, connection drops and timeouts, honouring `retry-after-ms` / `retry-after`
(seconds or an HTTP date). Authentication, permission, invalid requests, 404, 413: never retried.
The reason of an `LLMError` starts with its kind: `authentication: 401 authentication_error: ...`.

Prompt caching: explicit `cache_control` breakpoints on the last system block, the last tool, the
task briefing (the first message) and the newest user message (so each turn reads the previous
turn's prefix from the cache). That is the API's maximum of four. Each has a TTL, 5 minutes or 1
hour (`prefix_ttl`, `newest_ttl`; the policy chooses, see `agent.policies.claude`).

Context editing (`context_management`, a beta) goes through the beta endpoint with its header; what
the server cleared comes back in `Turn.applied_edits`. The request content is never edited here.

The API key is handed to the SDK and nowhere else: it is never an attribute of this module's
objects, never in a repr; `LLMClient.scrub` removes it from all that the server sends (a server
may echo request headers) and from every reason, before anything is logged or shown.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any, Callable, Iterable, Iterator

import anthropic
import httpx2

from tools.secrets import scrub_data

# Claude Opus 5.5: "For most workloads, start with Claude Opus 5.5" (platform.claude.com/docs/en/models/
# fable-5-1/overview; models/opus-5-5/overview: "for long-running agentic coding").
DEFAULT_MODEL = "claude-opus-5-5"

EPHEMERAL = {"type": "ephemeral"}  # 5-minute cache, the default TTL
EPHEMERAL_1H = {"type": "ephemeral", "ttl": "1h"}  # written at 2x input instead of 1.25x, lives an hour
CONTEXT_MANAGEMENT_BETA = "context-management-2025-06-27"  # the beta header context editing needs
INTERLEAVED_THINKING_BETA = "interleaved-thinking-2025-05-14"  # thinking between tool calls, budget mode
EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort


@dataclass(frozen=True)
class Price:
    """USD per million tokens, the model's context window and largest output, in tokens. `long`:
    the prices of a request whose prompt (cache reads and writes included) passes `long_above`
    tokens, for models priced in two bands (Claude Haiku 5.5)."""

    input: float
    output: float
    cache_write: float  # 5-minute cache writes (1.25x input)
    cache_write_1h: float  # 1-hour cache writes (2x input)
    cache_read: float  # cache hits and refreshes
    context_window: int = 200_000
    max_output: int = 64_000
    thinking: str = "adaptive"  # "always": adaptive and cannot be disabled; "adaptive"; "extended" (budget_tokens)
    long: Price | None = None
    long_above: int = 0

    def band(self, prompt_tokens: int) -> Price:
        return self.long if self.long is not None and prompt_tokens > self.long_above else self


# Sources (docs corpus, checked 2026-12-01): the pricing page (platform.claude.com/docs/en/about-claude/
# pricing, "Model pricing") and each model's overview page (platform.claude.com/docs/en/models/<model>/
# overview, "Pricing" / "Capabilities": context window, max output, thinking): Fable 5.2 $8/$40, writes
# $10/$16, reads $0.20; Opus 5.5 $4/$20, $5/$8, $0.20, thinking always on, default effort medium; Sonnet
# 5.5 $2/$10 with cache reads at $0.10 since 2026-10-07; Haiku 5.5 $0.10/$0.50 up to a 100k-token prompt,
# $0.50/$2.50 above (the Sonnet and Haiku 5.5 rows as pricing trackers read the live page in October
# 2026; the corpus's overview snapshot still shows Sonnet 5.5 reads at $0.20). Mythos shares Fable's
# prices (Fable 5 overview). Prices change: a model missing here is refused (see `price_for`) rather
# than priced at zero, since the cost budget depends on it.
_M = 1_000_000
_HAIKU_5_5_LONG = Price(0.50, 2.50, 0.625, 1.00, 0.05, _M, 128_000)
PRICES: dict[str, Price] = {
    "claude-fable-5-2": Price(8.00, 40.00, 10.00, 16.00, 0.20, _M, 128_000, "always"),
    "claude-mythos-5-2": Price(8.00, 40.00, 10.00, 16.00, 0.20, _M, 128_000, "always"),
    "claude-opus-5-5": Price(4.00, 20.00, 5.00, 8.00, 0.20, _M, 128_000, "always"),
    "claude-sonnet-5-5": Price(2.00, 10.00, 2.50, 4.00, 0.10, _M, 128_000),
    "claude-haiku-5-5": Price(0.10, 0.50, 0.125, 0.20, 0.01, _M, 128_000, long=_HAIKU_5_5_LONG, long_above=100_000),
    "claude-fable-5-1": Price(10.00, 50.00, 12.50, 20.00, 0.25, _M, 128_000, "always"),
    "claude-mythos-5-1": Price(10.00, 50.00, 12.50, 20.00, 0.25, _M, 128_000, "always"),
    "claude-fable-5": Price(10.00, 50.00, 12.50, 20.00, 1.00, _M, 128_000, "always"),
    "claude-mythos-5": Price(10.00, 50.00, 12.50, 20.00, 1.00, _M, 128_000, "always"),
    "claude-opus-5": Price(5.00, 25.00, 6.25, 10.00, 0.50, _M, 128_000),
    "claude-sonnet-5": Price(2.00, 10.00, 2.50, 4.00, 0.20, _M, 128_000),
    "claude-opus-4-8": Price(5.00, 25.00, 6.25, 10.00, 0.50, _M, 128_000),
    "claude-opus-4-7": Price(5.00, 25.00, 6.25, 10.00, 0.50, _M, 128_000),
    "claude-opus-4-6": Price(5.00, 25.00, 6.25, 10.00, 0.50, _M, 128_000),
    "claude-opus-4-5": Price(5.00, 25.00, 6.25, 10.00, 0.50, thinking="extended"),
    "claude-sonnet-4-6": Price(3.00, 15.00, 3.75, 6.00, 0.30, _M),
    "claude-sonnet-4-5": Price(3.00, 15.00, 3.75, 6.00, 0.30, thinking="extended"),
    "claude-haiku-4-5": Price(1.00, 5.00, 1.25, 2.00, 0.10, thinking="extended"),
}


def price_for(model: str) -> Price:
    """The price of `model`, or of its alias for a dated snapshot (`claude-haiku-4-5-20251001`)."""
    if model in PRICES:
        return PRICES[model]
    base = re.sub(r"-\d{8}$", "", model)
    if base in PRICES:
        return PRICES[base]
    raise KeyError(f"no price for model {model!r}; add it to agent.llm.PRICES (known: {', '.join(PRICES)})")


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0  # input not read from or written to the cache
    output_tokens: int = 0
    cache_write_tokens: int = 0  # written to the 5-minute cache
    cache_write_1h_tokens: int = 0  # written to the 1-hour cache
    cache_read_tokens: int = 0

    @property
    def total_input(self) -> int:
        """Every input token of the request: the size of the context the model saw."""
        return self.input_tokens + self.cache_write_tokens + self.cache_write_1h_tokens + self.cache_read_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def read_usage(u: Any) -> tuple[Usage, list[str]]:
    """Token counts from the API's `usage` object, and what was wrong with it. A missing or null
    count is 0; one that cannot be true (negative, not a number, past `MAX_USAGE_TOKENS`) is clamped
    into [0, MAX_USAGE_TOKENS], so that a cost is never negative nor absurd."""
    u = u if isinstance(u, dict) else {}
    problems = [] if u.get("input_tokens") is not None and u.get("output_tokens") is not None else [
        f"usage incomplete ({_short(u, 200) if u else 'missing'}): missing counts taken as 0"]

    def count(d: Any, key: str) -> int:
        v = d.get(key) if isinstance(d, dict) else None
        if v is None:
            return 0
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_USAGE_TOKENS
        if ok:
            return int(v)
        clamped = MAX_USAGE_TOKENS if isinstance(v, (int, float)) and v > MAX_USAGE_TOKENS else 0
        problems.append(f"usage {key}={_short(repr(v), 40)} cannot be true: counted as {clamped}")
        return clamped

    written = count(u, "cache_creation_input_tokens")
    written_1h = min(written, count(u.get("cache_creation"), "ephemeral_1h_input_tokens"))  # the TTL split
    usage = Usage(count(u, "input_tokens"), count(u, "output_tokens"), written - written_1h, written_1h,
                  count(u, "cache_read_input_tokens"))
    return usage, problems


CHARS_PER_TOKEN = 3.0  # fewer than the tokenizer's usual ~3.5-4 for code and English: estimates run high
# tokens the API adds around what we send (the tool-use system prompt, role and block framing): the
# hard bound on a request's input is its UTF-8 size plus this
FRAMING_TOKENS = 8_192


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def estimate_tokens(value: Any) -> int:
    """A high estimate of the tokens of request content (its JSON: 3 characters a token, where the
    tokenizer makes ~3.5-4 of code and English), for budgets and the context window: never the bill."""
    return int(len(_json(value)) / CHARS_PER_TOKEN) + 1


def max_input_tokens(value: Any) -> int:
    """The most input tokens request content can be: a token is at least one byte of its text, so
    its UTF-8 size (plus the API's framing) bounds it, whatever the text is."""
    return len(_json(value).encode("utf-8", "surrogatepass")) + FRAMING_TOKENS


def request_size(value: Any) -> tuple[int, int]:
    """(`estimate_tokens`, `max_input_tokens`) of request content, from one serialisation."""
    text = _json(value)
    return int(len(text) / CHARS_PER_TOKEN) + 1, len(text.encode("utf-8", "surrogatepass")) + FRAMING_TOKENS


def bounded_usage(usage: Usage, max_input: int, max_output: int) -> tuple[Usage, list[str]]:
    """`usage` with every input-side count at most `max_input` (the request's size bound, in all)
    and the output at most `max_output` (its max_tokens), and what was cut: a figure past what the
    request can have used is the API's fault, never spend."""
    problems = []
    if usage.output_tokens > max_output:
        problems.append(f"output_tokens={usage.output_tokens} past the request's max_tokens {max_output}")
    if usage.total_input > max_input:
        problems.append(f"{usage.total_input} input tokens (cache reads and writes included) past the request's "
                        f"size bound of {max_input}")
    if not problems:
        return usage, []
    left = max_input
    counts = {}
    for key in ("cache_write_1h_tokens", "cache_write_tokens", "input_tokens", "cache_read_tokens"):
        counts[key] = min(getattr(usage, key), left)  # dearest kinds first: what is booked errs high
        left -= counts[key]
    return Usage(counts["input_tokens"], min(usage.output_tokens, max_output), counts["cache_write_tokens"],
                 counts["cache_write_1h_tokens"], counts["cache_read_tokens"]), problems


def worst_case_cost(model: str, input_tokens: int, max_tokens: int, ttl: str = "1h", hour_tokens: int = 0) -> float:
    """The most one request can cost: every input token written to the cache (the dearest input
    rate it can meet), the first `hour_tokens` of them with the 1-hour TTL and the rest with `ttl`,
    and `max_tokens` of output."""
    p = price_for(model).band(input_tokens)
    rate = max(p.input, p.cache_write, p.cache_write_1h if ttl == "1h" else 0.0)
    hour = min(hour_tokens, input_tokens)
    hour_rate = max(p.input, p.cache_write, p.cache_write_1h)
    return (hour * hour_rate + (input_tokens - hour) * rate + max_tokens * p.output) / 1_000_000


def cost_usd(model: str, usage: Usage) -> float:
    p = price_for(model).band(usage.total_input)
    return (
        usage.input_tokens * p.input
        + usage.output_tokens * p.output
        + usage.cache_write_tokens * p.cache_write
        + usage.cache_write_1h_tokens * p.cache_write_1h
        + usage.cache_read_tokens * p.cache_read
    ) / 1_000_000


@dataclass
class Turn:
    """One assistant message, as the API returned it, checked (see `LLMClient._turn`)."""

    content: list[dict[str, Any]]  # blocks as request params: append {"role": "assistant", "content": ...}
    stop_reason: str | None
    usage: Usage
    model: str
    id: str = ""
    retries: int = 0  # attempts that failed before this one
    notes: list[str] = field(default_factory=list)  # what was odd about the response (worth a log line)
    rejected: dict[str, str] = field(default_factory=dict)  # tool_use id -> why that call must not run
    applied_edits: list[dict[str, Any]] = field(default_factory=list)  # what context editing cleared server-side

    @property
    def tool_uses(self) -> list[dict[str, Any]]:
        return [b for b in self.content if b.get("type") == "tool_use"]

    @property
    def text(self) -> str:
        return "\n".join(b["text"] for b in self.content if b.get("type") == "text")


class LLMError(Exception):
    """The request failed for good (not retryable, or retries spent). The message says why, first
    its kind (`authentication: ...`, `rate_limit: ...`, `malformed_response: ...`)."""


class Stopped(Exception):
    """A wait between attempts ended because the caller's `stop` hook gave a reason (a signal, a
    budget): `reason` is that reason, `detail` what was being waited for."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class _Failed(Exception):
    """One attempt failed: `kind` heads the reason, `retry` says whether another attempt may help,
    `after` is the server's retry-after in seconds."""

    def __init__(self, kind: str, detail: str, retry: bool = True, after: float | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.retry, self.after = kind, retry, after


def _malformed(detail: str) -> _Failed:
    return _Failed("malformed_response", detail)


# what an HTTP status, or the type of an `event: error` inside a 200 stream, is called in a reason
THINKING_TYPES = ("thinking", "redacted_thinking")
_STATUS_KINDS = {400: "invalid_request", 401: "authentication", 403: "authentication", 404: "not_found",
                 413: "request_too_large", 429: "rate_limit", 529: "overloaded"}
_ERROR_KINDS = {"invalid_request_error": "invalid_request", "authentication_error": "authentication",
                "permission_error": "authentication", "not_found_error": "not_found",
                "request_too_large": "request_too_large", "billing_error": "billing", "rate_limit_error": "rate_limit",
                "overloaded_error": "overloaded", "api_error": "server_error", "timeout_error": "timeout"}
_FINAL_KINDS = {"invalid_request", "authentication", "not_found", "request_too_large", "billing"}
_RETRYABLE_STATUS = {408, 409, 429}  # and every 5xx
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal",
                "model_context_window_exceeded"}
# the SSE events a message is made of; any other event (ping, new kinds) is skipped
_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
           "message_stop", "error"}
# delta type -> (the block field it extends, the delta field holding the piece)
_DELTAS = {"text_delta": ("text", "text"), "thinking_delta": ("thinking", "thinking"),
           "signature_delta": ("signature", "signature"), "input_json_delta": ("input", "partial_json")}

RetryHook = Callable[[int, float, str], None]  # (attempt number, seconds to wait, error)
StopHook = Callable[[float], "str | None"]  # (seconds of the wait still ahead) -> a reason to stop waiting now
WAIT_SLICE = 0.2  # seconds: how often a wait between attempts asks its stop hook


class LLMClient:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
        base_url: str | None = None,
        max_retries: int | None = 8,
        *,
        timeout: float = 600.0,
        max_stream_s: float = 1800.0,
        backoff_base: float = 1.0,
        max_delay: float = 60.0,
        max_total_wait: float = 600.0,
        on_retry: RetryHook | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`timeout`: seconds without progress (connecting, a byte, a whole stream event) before an
        attempt fails; `max_stream_s`: seconds one response body may take in all (a server that
        drips); `max_total_wait`: seconds of waiting between attempts, in all, before giving up (hours,
        for a long unattended run riding out an overload); `max_delay`: the longest single wait of our
        own backoff; `max_retries` None: as many attempts as `max_total_wait` allows."""
        self.model = model
        self.max_retries = max_retries
        self.timeout = timeout
        self.max_stream_s = max_stream_s
        self.backoff_base = backoff_base
        self.max_delay = max_delay
        self.max_total_wait = max_total_wait
        self.on_retry = on_retry
        self._sleep = sleep
        # api_key None -> ANTHROPIC_API_KEY; base_url None -> ANTHROPIC_BASE_URL (both read by the SDK)
        self._client = anthropic.Anthropic(api_key=api_key, base_url=base_url, max_retries=0, timeout=timeout)

    def __repr__(self) -> str:
        return f"LLMClient(model={self.model!r})"

    __str__ = __repr__

    def scrub(self, value: Any) -> Any:
        """`value` (a text, or JSON-like data) with the API key replaced by [redacted] wherever it
        appears. Applied to everything the server sends before anyone sees it, and by the policy to
        everything it logs."""
        secrets = [s for s in (self._client.api_key, self._client.auth_token) if isinstance(s, str) and len(s) >= 8]
        return scrub_data(value, secrets) if secrets else value  # literal values and simple encodings

    # -- one turn --------------------------------------------------------------------------------

    def stream_turn(
        self,
        system: str | list[dict[str, Any]],
        tools: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        max_tokens: int,
        *,
        cache: bool = True,
        prefix_ttl: str = "5m",
        newest_ttl: str = "5m",
        on_retry: RetryHook | None = None,
        stop: StopHook | None = None,
        **extra: Any,
    ) -> Turn:
        """Stream one assistant turn and return it whole. Whatever the server does, raises nothing
        but `LLMError`, once trying again cannot help or the retries are spent, or `Stopped`, when
        `stop` ends a wait between attempts (it is asked before and during each). `extra` holds more
        request parameters (thinking, output_config, context_management: the latter goes through
        the beta endpoint with its header). `prefix_ttl`/`newest_ttl`: the cache TTL ("5m" or "1h")
        of the breakpoints on the fixed prefix (tools, system, briefing) and on the newest message."""
        system_blocks = [{"type": "text", "text": system}] if isinstance(system, str) else list(system)
        system_blocks = [b for b in system_blocks if b.get("text")]
        if cache:
            system_blocks, tools, messages = with_cache_breakpoints(system_blocks, tools, messages, prefix_ttl, newest_ttl)
        params: dict[str, Any] = dict(model=self.model, max_tokens=max_tokens, messages=messages, **extra)
        if system_blocks:
            params["system"] = system_blocks
        if tools:
            params["tools"] = tools
        if not (self._client.api_key or self._client.auth_token):
            raise LLMError("authentication: no API key (set ANTHROPIC_API_KEY)")
        hook = on_retry or self.on_retry
        waited = 0.0
        attempt = 0
        while True:
            try:
                return self._attempt(params, attempt)
            except Exception as exc:  # noqa: BLE001 - every failure ends as a retry or an LLMError
                failed = self._failure(exc)
                reason = self._shown(str(failed))
                if not failed.retry:
                    raise LLMError(reason) from None
                if self.max_retries is not None and attempt >= self.max_retries:
                    raise LLMError(f"{reason} (gave up after {attempt + 1} attempts)") from None
                # exponential backoff with jitter, [0.5, 1) x base x 2^attempt, unless the server said;
                # either way never longer than max_delay (a server may ask for an hour, or forever)
                delay = failed.after
                if delay is None:
                    delay = min(self.max_delay, self.backoff_base * 2**attempt) * random.uniform(0.5, 1.0)
                elif delay > self.max_delay:
                    reason += f" (asked to wait {_short(f'{delay:g}', 20)} s; waiting at most {self.max_delay:g} s)"
                    delay = self.max_delay
                if waited + delay > self.max_total_wait:
                    raise LLMError(
                        f"{reason} (gave up: waiting {delay:.1f} s more would pass the "
                        f"{self.max_total_wait:.0f} s retry budget)"
                    ) from None
                if stop is not None and (why := stop(delay)):  # before anything is said of a wait
                    raise Stopped(why, f"a wait of {delay:.1f} s before retrying ({reason})") from None
                attempt += 1
                if hook is not None:
                    hook(attempt, delay, reason)
                self._wait(delay, stop, reason)
                waited += delay

    def _wait(self, seconds: float, stop: StopHook | None, reason: str) -> None:
        """Sleep `seconds`, in slices of WAIT_SLICE that ask `stop` (a signal handler that only sets
        a flag returns into the sleep: the slice is what notices it)."""
        if stop is None:
            self._sleep(seconds)
            return
        left = seconds
        while left > 0:
            self._sleep(min(WAIT_SLICE, left))
            left -= WAIT_SLICE
            if left > 0 and (why := stop(left)):
                raise Stopped(why, f"a wait before retrying, {left:.1f} s of {seconds:.1f} s still ahead ({reason})")

    def _attempt(self, params: dict[str, Any], attempt: int) -> Turn:
        """One request: the response read (an event stream, or a JSON message) and checked."""
        betas = [CONTEXT_MANAGEMENT_BETA] if params.get("context_management") else []
        if betas and _dict(params.get("thinking")).get("type") == "enabled":
            betas.append(INTERLEAVED_THINKING_BETA)  # thinking between tool calls (adaptive has it built in)
        if betas:  # beta parameters: the beta endpoint, with their headers
            create = self._client.beta.messages.with_streaming_response.create
            params = {**params, "betas": betas}
        else:
            create = self._client.messages.with_streaming_response.create
        with create(**params, stream=True) as response:
            body = self._body(response.http_response)
            if "text/event-stream" in response.headers.get("content-type", ""):
                message = _read_stream(_sse_events(body, self.timeout))
            else:  # not what we asked for; take it if it is a message
                message = _read_json(b"".join(body))
        return self._turn(message, attempt)

    def _body(self, response: httpx2.Response) -> Iterator[bytes]:
        """The response body, failing the attempt past `max_stream_s` or `MAX_RESPONSE_BYTES`."""
        start, size = time.monotonic(), 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if time.monotonic() - start > self.max_stream_s:
                raise _Failed("timeout", f"the response took more than {self.max_stream_s:g} s")
            if size > MAX_RESPONSE_BYTES:
                raise _malformed(f"the response is larger than {MAX_RESPONSE_BYTES} bytes")
            yield chunk

    def _turn(self, message: dict[str, Any], retries: int) -> Turn:
        """The one check of every response: blocks we send back must be valid requests, calls we
        run must be well formed, the usage must be countable. What is fixed is said in `notes`."""
        scrubbed = self.scrub(message)
        content: list[dict[str, Any]] = []
        notes: list[str] = []
        blocks = scrubbed.get("content") if isinstance(scrubbed, dict) else None
        if scrubbed != message and isinstance(blocks, list):
            # the key was in the turn and is cut out: a thinking block's signature no longer holds
            # for what follows it, so the turn's thinking goes (the docs' remedy for removed secrets)
            kept = [b for b in blocks if not (isinstance(b, dict) and b.get("type") in THINKING_TYPES)]
            if len(kept) < len(blocks):
                notes.append(f"dropped {len(blocks) - len(kept)} thinking blocks: the turn held the API key, "
                             "which was removed, so their signatures no longer hold")
                scrubbed = {**scrubbed, "content": kept}
        message = scrubbed
        rejected: dict[str, str] = {}
        seen: set[str] = set()
        blocks = message.get("content")
        if not isinstance(blocks, list):
            raise _malformed(f"content is {_short(blocks, 80)}, not a list of blocks")
        for b in blocks:
            kind = b.get("type") if isinstance(b, dict) else None
            if not isinstance(kind, str):
                raise _malformed(f"a content block without a type: {_short(b, 200)}")
            if kind == "text":
                if not isinstance(b.get("text"), str):
                    raise _malformed(f"a text block without text: {_short(b, 200)}")
                if not b["text"]:
                    continue  # the API refuses empty text blocks in a request
            elif kind == "tool_use":
                uid, name = b.get("id"), b.get("name")
                if not (isinstance(uid, str) and uid and isinstance(name, str) and name):
                    raise _malformed(f"a tool_use block without an id or a name: {_short(b, 200)}")
                if uid in seen:
                    notes.append(f"dropped a second tool_use block with the id {_short(uid, 80)}")
                    continue
                seen.add(uid)
                if not isinstance(b.get("input"), dict):  # the API only takes an object back
                    rejected[uid] = (f"error: the input of {_short(name, 80)} must be a JSON object, not "
                                     f"{_short(repr(b.get('input')), 80)}; the call was not run")
                    b = {**b, "input": {}}
            elif kind not in THINKING_TYPES and not kind.endswith(("_tool_use", "_tool_result")):
                # not one the API wants back (thinking, server and MCP tool calls and their results)
                notes.append(f"ignored a content block of unknown type {_short(repr(kind), 80)}")
                continue
            content.append(b)
        stop = message.get("stop_reason")
        if stop is not None and not isinstance(stop, str):
            stop = _short(stop, 80)
        if stop not in STOP_REASONS:
            notes.append(f"unknown stop_reason {_short(repr(stop), 80)}")
        usage, problems = read_usage(message.get("usage"))
        model, mid = message.get("model"), message.get("id")
        edits = _dict(message.get("context_management")).get("applied_edits")
        edits = [e for e in edits if isinstance(e, dict)] if isinstance(edits, list) else []
        return Turn(
            content=content, stop_reason=stop, usage=usage, retries=retries, notes=notes + problems, rejected=rejected,
            applied_edits=edits,
            model=model if isinstance(model, str) and model else self.model, id=mid if isinstance(mid, str) else "",
        )

    # -- failures --------------------------------------------------------------------------------

    def _failure(self, exc: Exception) -> _Failed:
        """What went wrong, and whether another attempt may help."""
        if isinstance(exc, _Failed):
            return exc
        if isinstance(exc, anthropic.APIStatusError):
            status, headers = exc.status_code, exc.response.headers
            kind = _STATUS_KINDS.get(status) or ("server_error" if status >= 500 else f"http_{status}")
            retry = (status in _RETRYABLE_STATUS or status >= 500) and headers.get("x-should-retry") != "false"
            what = exc.api_message or exc.body or exc.message
            return _Failed(kind, f"{status} {exc.type or 'error'}: {what}", retry, _retry_after(headers))
        if isinstance(exc, (anthropic.APITimeoutError, httpx2.TimeoutException)):
            return _Failed("timeout", f"no answer within {self.timeout:g} s")
        if isinstance(exc, (anthropic.APIConnectionError, httpx2.TransportError)):
            return _Failed("connection", f"{exc.__cause__ or exc}")
        if isinstance(exc, RecursionError):  # JSON nested too deep to read or scrub
            return _malformed(f"data nested too deep ({exc})")
        return _Failed("client_error", f"{type(exc).__name__}: {exc}", retry=False)  # ours; trying again won't help

    def _shown(self, text: str) -> str:
        """A reason fit to show: no key in it (scrubbed before it is cut), one line, not too long."""
        return _short(self.scrub(text), SHOWN_CHARS)


MAX_RESPONSE_BYTES = 64 * 2**20  # the API's largest answer is far smaller
MAX_USAGE_TOKENS = 10_000_000  # per count and turn: more than any context window and output
SHOWN_CHARS = 600  # of a server's text in a reason or a note


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _short(value: Any, limit: int) -> str:
    """One line of at most `limit` characters (and a count of the rest). Only for text already
    scrubbed: a key cut in two would not be found any more."""
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more characters]"


def _sse_events(chunks: Iterable[bytes], stall_s: float) -> Iterator[tuple[str | None, str]]:
    """(event name, data) of each server-sent event; lines that are not SSE fields are skipped.
    Fails the attempt when no whole event arrives for `stall_s` (a server that drips bytes)."""
    name, data, pending = None, [], []
    last = time.monotonic()
    for chunk in chunks:
        if time.monotonic() - last > stall_s:
            raise _Failed("timeout", f"no whole event within {stall_s:g} s")
        if b"\n" not in chunk:  # a long line in many chunks: join once, at its end
            pending.append(chunk)
            continue
        *lines, rest = b"".join([*pending, chunk]).split(b"\n")
        pending = [rest]
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:  # the end of an event
                if name is not None or data:
                    yield name, "\n".join(data)
                    last = time.monotonic()
                name, data = None, []
                continue
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)


def _read_stream(events: Iterable[tuple[str | None, str]]) -> dict[str, Any]:
    """The message that a stream of events builds, as a dict. Unknown events are skipped; any
    event out of place or unreadable fails the attempt (another may be whole)."""
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    pieces: dict[tuple[int, str], list[str]] = {}  # joined at the end: MBs come in many deltas
    usage: dict[str, Any] = {}
    for name, data in events:
        if name not in _EVENTS:
            continue
        try:
            event = json.loads(data)
        except ValueError:
            if name == "error":
                raise _Failed("stream_error", f"event: error: {data}") from None
            raise _malformed(f"a {name} event that is not JSON: {data}") from None
        try:
            if name == "error":
                error = _dict(event.get("error"))
                kind = _ERROR_KINDS.get(error.get("type"), "stream_error")
                detail = f"{error.get('type') or 'error'} in the event stream: {error.get('message') or event}"
                raise _Failed(kind, detail, retry=kind not in _FINAL_KINDS)
            if name == "message_start":
                if message is not None:
                    raise _malformed("a second message_start")
                message = dict(event["message"])
                usage = dict(_dict(message.get("usage")))
                continue
            if message is None:
                raise _malformed(f"{name} before message_start")
            if name == "message_stop":
                break
            if name == "content_block_start":
                index, block = event["index"], dict(event["content_block"])
                if type(index) is not int or index in blocks:
                    raise _malformed(f"content_block_start with the index {index!r} (again?)")
                blocks[index] = block
            elif name == "content_block_delta":
                index, delta = event["index"], event["delta"]
                if index not in blocks:
                    raise _malformed(f"content_block_delta for block {index!r} before its start")
                if delta["type"] in _DELTAS:
                    field_name, key = _DELTAS[delta["type"]]
                    if field_name not in blocks[index] or not isinstance(delta[key], str):
                        raise _malformed(f"a {delta['type']} for a {blocks[index].get('type')} block")
                    pieces.setdefault((index, field_name), []).append(delta[key])
                elif delta["type"] == "citations_delta":
                    blocks[index]["citations"] = [*(blocks[index].get("citations") or []), delta["citation"]]
            elif name == "message_delta":
                delta = _dict(event.get("delta"))
                message.update({k: delta[k] for k in ("stop_reason", "stop_sequence") if k in delta})
                # counts here are totals so far: they replace those of message_start, never add up
                usage.update({k: v for k, v in _dict(event.get("usage")).items() if v is not None})
                if event.get("context_management") is not None:  # what context editing cleared
                    message["context_management"] = event["context_management"]
        except (LookupError, TypeError, AttributeError, ValueError) as exc:
            raise _malformed(f"an unreadable {name} event ({type(exc).__name__}: {exc}): {data}") from None
    else:
        raise _malformed("the event stream ended before message_stop" if message else "no message in the response")
    for (index, field_name), parts in pieces.items():
        block, text = blocks[index], "".join(parts)
        if field_name != "input":
            block[field_name] = f"{block[field_name] or ''}{text}"
        elif text.strip():
            try:
                block["input"] = json.loads(text)
            except (ValueError, RecursionError):
                block["input"] = text  # not JSON (cut off?): the turn check refuses to run it
    return {**message, "content": [blocks[i] for i in sorted(blocks)], "usage": usage}


def _read_json(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        raise _malformed(f"a 200 response that is neither an event stream nor JSON: {body!r}") from None
    if isinstance(payload, dict) and payload.get("type") == "message":
        return payload
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):  # an error object with a 200
        kind = _ERROR_KINDS.get(error.get("type"), "server_error")
        raise _Failed(kind, f"{error.get('type')} in a 200 response: {error.get('message')}", kind not in _FINAL_KINDS)
    raise _malformed(f"a 200 response that is not a message: {payload!r}")


def _retry_after(headers: Any) -> float | None:
    """The wait the server asks for, in seconds: `retry-after-ms`, or `retry-after` in seconds or as
    an HTTP date. None (our own backoff) when absent, negative or unreadable."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / scale
        except ValueError:
            try:
                when = parsedate_to_datetime(value)
                when = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
                seconds = max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
            except (TypeError, ValueError, IndexError, OverflowError):
                continue
        if seconds >= 0:  # False for NaN
            return seconds
    return None


def with_cache_breakpoints(
    system: list[dict[str, Any]], tools: list[dict[str, Any]], messages: list[dict[str, Any]],
    prefix_ttl: str = "5m", newest_ttl: str = "5m",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Copies of the request parts with cache_control on the last system block, the last tool, the
    first message (the task briefing) and the newest user message. The inputs are not modified.

    Only `cache_control` is added: the content itself stays byte for byte what was sent before (a
    thinking block's signature binds everything before it). The API wants a longer TTL never after
    a shorter one (tools, system, then messages), so the newest breakpoint is never longer-lived
    than the prefix's."""
    if newest_ttl == "1h":
        prefix_ttl = "1h"
    prefix_mark = EPHEMERAL_1H if prefix_ttl == "1h" else EPHEMERAL
    newest_mark = EPHEMERAL_1H if newest_ttl == "1h" else EPHEMERAL

    def mark_last(blocks: list[Any], mark: dict[str, str]) -> list[Any]:
        if not blocks or not isinstance(blocks[-1], dict):
            return list(blocks)
        return [*blocks[:-1], {**blocks[-1], "cache_control": mark}]

    def mark_message(message: dict[str, Any], mark: dict[str, str]) -> dict[str, Any]:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        return {**message, "content": mark_last(content, mark)}

    messages = list(messages)
    if messages:
        messages[0] = mark_message(messages[0], prefix_mark)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
    if last_user > 0:
        messages[last_user] = mark_message(messages[last_user], newest_mark)
    return mark_last(system, prefix_mark), mark_last(tools, prefix_mark), messages
