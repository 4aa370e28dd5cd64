"""The Messages API client: one streamed turn, retried, cached and priced.

`LLMClient.stream_turn` sends one request with the SDK's streaming helper and returns the final
assistant message as a `Turn` (content blocks ready to send back, stop reason, `Usage`). Retries
are ours, not the SDK's (`max_retries=0` there), so that every wait is observable (`on_retry`) and
bounded in total: 408/409/429/5xx/529, overloaded or api errors sent inside the event stream,
connection drops and timeouts, honouring `retry-after-ms` / `retry-after`.

Prompt caching: explicit `cache_control` breakpoints on the last system block, the last tool, the
task briefing (the first message) and the newest user message (so each turn reads the previous
turn's prefix from the cache). That is the API's maximum of four.

The API key is handed to the SDK and nowhere else: it is never an attribute of this module's
objects, never in a repr, never in a log line or an error message.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import anthropic
import httpx2

# Claude Opus 5.5: "start with Claude Opus 5.5 for most workloads ... long-running agentic coding"
# (platform.claude.com/docs/en/models, models overview).
DEFAULT_MODEL = "claude-opus-5-5"

EPHEMERAL = {"type": "ephemeral"}  # 5-minute cache, the default TTL


@dataclass(frozen=True)
class Price:
    """USD per million tokens, and the model's context window in tokens."""

    input: float
    output: float
    cache_write: float  # 5-minute cache writes (1.25x input)
    cache_write_1h: float  # 1-hour cache writes (2x input)
    cache_read: float  # cache hits and refreshes
    context_window: int = 200_000


# Source: Anthropic's pricing page (platform.claude.com/docs/en/about-claude/pricing, "Model
# pricing") and each model's overview page (platform.claude.com/docs/<lang>/models/<model>/overview,
# "Pricing": Opus 5.5, Sonnet 5.5, Opus 5, Sonnet 5), as stored in the docs corpus; checked for this
# module's first version. Prices change: a model missing here is refused (see `price_for`) rather
# than priced at zero, since the cost budget depends on it.
_M = 1_000_000
PRICES: dict[str, Price] = {
    "claude-opus-5-5": Price(4.00, 20.00, 5.00, 8.00, 0.20, _M),
    "claude-sonnet-5-5": Price(2.00, 10.00, 2.50, 4.00, 0.20, _M),
    "claude-fable-5-1": Price(10.00, 50.00, 12.50, 20.00, 0.25, _M),
    "claude-fable-5": Price(10.00, 50.00, 12.50, 20.00, 1.00, _M),
    "claude-opus-5": Price(5.00, 25.00, 6.25, 10.00, 0.50, _M),
    "claude-sonnet-5": Price(2.00, 10.00, 2.50, 4.00, 0.20, _M),
    "claude-opus-4-8": Price(5.00, 25.00, 6.25, 10.00, 0.50, _M),
    "claude-opus-4-7": Price(5.00, 25.00, 6.25, 10.00, 0.50, _M),
    "claude-opus-4-6": Price(5.00, 25.00, 6.25, 10.00, 0.50, _M),
    "claude-opus-4-5": Price(5.00, 25.00, 6.25, 10.00, 0.50),
    "claude-sonnet-4-6": Price(3.00, 15.00, 3.75, 6.00, 0.30, _M),
    "claude-sonnet-4-5": Price(3.00, 15.00, 3.75, 6.00, 0.30),
    "claude-haiku-4-5": Price(1.00, 5.00, 1.25, 2.00, 0.10),
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

    @classmethod
    def from_api(cls, u: Any) -> Usage:
        written = u.cache_creation_input_tokens or 0
        split = getattr(u, "cache_creation", None)  # the TTL breakdown, when the API sends it
        written_1h = min(written, (split.ephemeral_1h_input_tokens or 0) if split is not None else 0)
        return cls(
            u.input_tokens or 0, u.output_tokens or 0, written - written_1h, written_1h, u.cache_read_input_tokens or 0
        )


def cost_usd(model: str, usage: Usage) -> float:
    p = price_for(model)
    return (
        usage.input_tokens * p.input
        + usage.output_tokens * p.output
        + usage.cache_write_tokens * p.cache_write
        + usage.cache_write_1h_tokens * p.cache_write_1h
        + usage.cache_read_tokens * p.cache_read
    ) / 1_000_000


@dataclass
class Turn:
    """One assistant message, as the API returned it."""

    content: list[dict[str, Any]]  # blocks as request params: append {"role": "assistant", "content": ...}
    stop_reason: str | None
    usage: Usage
    model: str
    id: str = ""
    retries: int = 0  # attempts that failed before this one

    @property
    def tool_uses(self) -> list[dict[str, Any]]:
        return [b for b in self.content if b.get("type") == "tool_use"]

    @property
    def text(self) -> str:
        return "\n".join(b["text"] for b in self.content if b.get("type") == "text")


class LLMError(Exception):
    """The request failed for good (not retryable, or retries spent). The message says why."""


class _IncompleteStream(Exception):
    pass


# error types the API may send inside a 200 event stream that are worth another try
_RETRYABLE_STREAM_ERRORS = {"overloaded_error", "api_error", "rate_limit_error", "timeout_error"}
_RETRYABLE_STATUS = {408, 409, 429}

RetryHook = Callable[[int, float, str], None]  # (attempt number, seconds to wait, error)


def _block_param(block: Any) -> dict[str, Any]:
    """A response content block as it must be sent back (thinking blocks and signatures intact)."""
    return block.to_dict(mode="json", exclude_none=True)


class LLMClient:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        api_key: str | None = None,
        base_url: str | None = None,
        max_retries: int = 8,
        *,
        timeout: float = 600.0,
        backoff_base: float = 1.0,
        max_delay: float = 60.0,
        max_total_wait: float = 600.0,
        on_retry: RetryHook | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.model = model
        self.max_retries = max_retries
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

    # -- one turn --------------------------------------------------------------------------------

    def stream_turn(
        self,
        system: str | list[dict[str, Any]],
        tools: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        max_tokens: int,
        *,
        cache: bool = True,
        on_retry: RetryHook | None = None,
        **extra: Any,
    ) -> Turn:
        """Stream one assistant turn and return it whole. Raises `LLMError` once retries are spent."""
        system_blocks = [{"type": "text", "text": system}] if isinstance(system, str) else list(system)
        system_blocks = [b for b in system_blocks if b.get("text")]
        if cache:
            system_blocks, tools, messages = with_cache_breakpoints(system_blocks, tools, messages)
        params: dict[str, Any] = dict(model=self.model, max_tokens=max_tokens, messages=messages, **extra)
        if system_blocks:
            params["system"] = system_blocks
        if tools:
            params["tools"] = tools
        hook = on_retry or self.on_retry
        waited = 0.0
        attempt = 0
        while True:
            try:
                with self._client.messages.stream(**params) as stream:
                    message = stream.get_final_message()
                if message.stop_reason is None:
                    raise _IncompleteStream("the event stream ended before message_stop")
                return Turn(
                    content=[_block_param(b) for b in message.content],
                    stop_reason=message.stop_reason,
                    usage=Usage.from_api(message.usage),
                    model=message.model or self.model,
                    id=message.id or "",
                    retries=attempt,
                )
            except Exception as exc:  # noqa: BLE001 - classified below; anything unknown is final
                reason = self._describe(exc)
                delay = self._retry_delay(exc, attempt)
                if delay is None:
                    raise LLMError(reason) from None
                if attempt >= self.max_retries:
                    raise LLMError(f"{reason} (gave up after {attempt + 1} attempts)") from None
                if waited + delay > self.max_total_wait:
                    raise LLMError(
                        f"{reason} (gave up: waiting {delay:.1f} s more would pass the "
                        f"{self.max_total_wait:.0f} s retry budget)"
                    ) from None
                attempt += 1
                if hook is not None:
                    hook(attempt, delay, reason)
                self._sleep(delay)
                waited += delay

    # -- retries ---------------------------------------------------------------------------------

    def _retry_delay(self, exc: Exception, attempt: int) -> float | None:
        """Seconds to wait before trying again, or None when trying again cannot help."""
        if isinstance(exc, anthropic.APIStatusError):
            headers = exc.response.headers
            hint = headers.get("x-should-retry")
            status = exc.status_code
            if hint == "false":
                return None
            retryable = (
                hint == "true"
                or status in _RETRYABLE_STATUS
                or status >= 500
                or (status == 200 and exc.type in _RETRYABLE_STREAM_ERRORS)  # `event: error` mid-stream
            )
            if not retryable:
                return None
            after = _retry_after(headers)
            if after is not None:
                return after
        elif not isinstance(exc, (anthropic.APIConnectionError, httpx2.TransportError, _IncompleteStream)):
            return None
        # exponential backoff with jitter: [0.5, 1) x base x 2^attempt, capped
        return min(self.max_delay, self.backoff_base * 2**attempt) * random.uniform(0.5, 1.0)

    def _describe(self, exc: Exception) -> str:
        if isinstance(exc, anthropic.APIStatusError):
            what = exc.api_message or str(exc)
            text = f"{exc.status_code} {exc.type or 'error'}: {what}"
        elif isinstance(exc, anthropic.APITimeoutError):
            text = "request timed out"
        elif isinstance(exc, anthropic.APIConnectionError):
            cause = exc.__cause__
            text = f"connection error: {cause or exc}"
        else:
            text = f"{type(exc).__name__}: {exc}"
        return self._redact(text)

    def _redact(self, text: str) -> str:
        key = getattr(self._client, "api_key", None)
        return text.replace(key, "[redacted]") if key and len(key) >= 8 else text


def _retry_after(headers: Any) -> float | None:
    """`retry-after-ms` (milliseconds) or `retry-after` (seconds); HTTP dates are not honoured."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) / scale)
        except ValueError:
            continue
    return None


def with_cache_breakpoints(
    system: list[dict[str, Any]], tools: list[dict[str, Any]], messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Copies of the request parts with cache_control on the last system block, the last tool, the
    first message (the task briefing) and the newest user message. The inputs are not modified."""

    def mark_last(blocks: list[Any]) -> list[Any]:
        if not blocks or not isinstance(blocks[-1], dict):
            return list(blocks)
        return [*blocks[:-1], {**blocks[-1], "cache_control": EPHEMERAL}]

    def mark_message(message: dict[str, Any]) -> dict[str, Any]:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        return {**message, "content": mark_last(content)}

    messages = list(messages)
    if messages:
        messages[0] = mark_message(messages[0])
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=0)
    if last_user > 0:
        messages[last_user] = mark_message(messages[last_user])
    return mark_last(system), mark_last(tools), messages
