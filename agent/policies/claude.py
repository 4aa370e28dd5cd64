"""The Claude policy: the Messages API tool-use loop, in the open.

    system = the rules; first user message = the task briefing
    loop: stop if a budget is spent (or the next request's worst case would pass --max-cost)
          -> stream one turn -> log it -> run its tool calls through the ToolBox
          -> answer with tool_result blocks (is_error when a call failed) -> repeat

Stop reasons (the returned string): whatever `ctx.stop_reason()` says (hours, attempts, a signal),
'max_turns', 'max_cost', 'end_turn' (two turns in a row that end without a tool call), 'refusal',
'context_full', 'no_progress' (many turns in a row without a tool call: pauses, cut-off texts; or
an empty paused turn), 'max_hours' (also when a retry wait would outlast the hours left),
'api_error: <kind>: <message>' (see `agent.llm.LLMError`). Whatever the reason, the session keeps
the branch at best.

Limits held against a hostile or broken API:
- Waits: every wait between API attempts is at most `max_retry_wait_s` (a `retry-after` too) and is
  never begun when it would outlast `ctx.seconds_left()` (--max-hours): the session stops as
  'max_hours' instead. It sleeps in slices that ask `ctx.stop_reason()`, so the first Ctrl-C or
  SIGTERM ends it at once ('interrupted', with a note saying what wait it ended).
- The context window (`context_window`, default the model's from `agent.llm.PRICES`): before each
  request its input is estimated (below); it must leave `max_tokens` of room. If not, the request
  goes with the hardest context editing (keep one call) when clearing old tool results can make the
  room, and else it is never sent ('context_full': `kloop resume` starts a fresh conversation from
  the notes and the ledger). A 400 "prompt is too long" ends the same way. A tool input or result
  that would not fit in the room left is refused: the call is answered with an error and the input
  goes back as {} (nothing is bound to it yet: a thinking block binds only what comes before it).
- The estimate: the API's count of the previous request (usage, after its context editing) plus 3
  characters a token for what was added since; on the first request 3 characters a token of all of
  it. Never below what no context edit can free, never above the hard bound (next).
- Usage: a request cannot have used more input tokens than the UTF-8 bytes of what it sent (plus
  the API's framing, `agent.llm.max_input_tokens`) nor more output than `max_tokens`; a reported
  figure past that is an API fault (a note with `fault: usage`, shown in the run and live), and the
  turn is booked at the bound.
- Paused turns (`pause_turn`): the paused content goes back as the last assistant message, and the
  model's continuation is added to that same message (never a second assistant message in a row).
  An empty paused turn is not sent again (the same request would be paid twice): 'no_progress'.

The server is not trusted (see `agent.llm`): a turn arrives checked, with notes on what was odd
(logged as 'note' events). At most `max_tool_calls` calls of one turn are run; the others, and
calls whose input was not an object, are answered with an error result, so that every tool_use
has its tool_result. Everything logged goes through `LLMClient.scrub` (no API key), and a tool
input is logged whole only up to `LOG_INPUT` characters of JSON.

The conversation is append-only. With thinking on (always, on current Opus and Fable models), each
thinking block's signature binds everything before it (system, tools, earlier messages): the API
answers 400 when any of it changed ("prefix check", platform.claude.com/docs/en/build-with-claude/
preserved-thinking/prefix-checks). So every assistant turn goes back exactly as it came, thinking
blocks included (empty ones too), system and tools are built once, and every update (a nudge, the
memory) is a new block at the end. Nothing already sent is ever edited here:

- Context: old tool results are cleared by the API itself (context editing, `clear_tool_uses_20250919`
  with the beta header), server-side, once the prompt passes `context_limit` tokens, keeping the
  newest `keep_tool_results` calls. The client keeps the full history (the docs: "you don't need to
  sync your client state with the edited version"). When the response says results were cleared,
  the agent's memory (notes and attempt ledger, `ctx.memory()`) is appended to the next message, so
  nothing learned is lost. With thinking on, `clear_thinking_20251015` keeps all thinking (the
  cache stays valid). A turn that hits the context window makes the next request clear harder
  (keep one call, a trigger at half the context); if that clears nothing, the session ends
  ('context_full').
- Huge tool inputs (a 50 KB write_file) cannot be trimmed in our history once sent: the tool_use
  sits in an assistant turn that later thinking blocks are bound to. They stay (read from the cache
  at a tenth of the input price or less), and the same context edit clears them server-side with
  their results (`clear_tool_inputs` for write_file/edit_file). The run record keeps at most
  `LOG_INPUT` characters of each.

Caching: breakpoints on tools, system, briefing and the newest message (see `agent.llm`). The
fixed prefix (tools, system, briefing) always has the 1-hour TTL: it is written once (at 2x input
instead of 1.25x, a few cents) and read all session long, across any long tool call, and its bytes,
cache_control included, never change. A turn whose tool calls (a gate, a sweep, a profile) outlast
the 5-minute cache makes the next request rewrite the whole conversation; so once a tool round of
the last `LONG_ROUNDS` took longer than `long_tool_s`, the newest breakpoint uses the 1-hour TTL too
(it pays when the next turn comes after 5 minutes more than 3 times in 5, and long tool calls come
in runs: a sweep, a profile, submits). Short rounds keep 5 minutes there, the cheaper write. (The
API wants no 1-hour breakpoint after a 5-minute one: the prefix comes first.)

Budgets survive `resume`: turns and cost already spent are summed from the record's `llm_turn`
events (`ctx.events()`; a context without it starts from zero), attempts are the session's own. A
resumed session starts a new conversation (briefing plus memory): no thinking block of the old one
is sent again. Before each request its worst case (an estimate of its input tokens, all written to
the cache at the rate of their TTL, plus `max_tokens` of output; never less than the last turn's
cost) must fit in what is left of `max_cost_usd`; else the request is not sent ('max_cost'). The
model of each turn is in its `llm_turn` event.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from agent.llm import (
    DEFAULT_MODEL, EFFORTS, THINKING_TYPES, LLMClient, LLMError, Stopped, Turn, Usage, bounded_usage, cost_usd, estimate_tokens,
    price_for, request_size, worst_case_cost,
)
from agent.policies.base import PolicyContext
from agent.run_state import RunState
from tools.base import cap

NUDGE = (
    "You ended your turn without calling a tool. Continue with the most promising next idea and act on "
    "it with the tools. If you are confident nothing more can be gained, reply with a short summary and "
    "no tool call: the session will then end."
)
CUT_OFF_CALL = (
    "error: this tool call was cut off at max_tokens, so its input is incomplete; it was NOT run. "
    "Send smaller edits: one region of a file per call."
)
CUT_OFF_TEXT = "Your reply was cut off at max_tokens. Continue, in smaller steps."
MEMORY = (
    "[context] Older tool results were cleared to keep the context small. What you have learned so far "
    "(your notes and the attempt ledger):\n\n{memory}"
)
LOG_TEXT = 2_000  # characters of assistant text / tool output kept in the run record per event
LOG_INPUT = 64_000  # characters of a tool input's JSON kept in the run record (whole below that)
MAX_STALLED = 10  # turns in a row without a tool call, whatever their stop reason
BIG_INPUT_TOOLS = ("write_file", "edit_file")  # whose inputs context editing clears with their results
LONG_ROUNDS = 3  # tool rounds looked back on to choose the cache TTL
CLEAR_EDIT = "clear_tool_uses_20250919"


@dataclass
class Spent:
    """What the session's record says was already spent on the API (before this run of the policy)."""

    turns: int = 0
    cost_usd: float = 0.0


def spent_so_far(ctx: PolicyContext) -> Spent:
    """Turns and cost of the `llm_turn` events already in the record (a resumed session)."""
    events = getattr(ctx, "events", None)
    if not callable(events):
        return Spent()
    state = RunState.fold(events())
    return Spent(state.turns, state.cost_usd)


class ClaudePolicy:
    name = "claude"

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        max_tokens: int = 32_000,
        client: LLMClient | None = None,
        *,
        effort: str | None = None,
        thinking: str | int | None = None,
        context_limit: int | None = None,
        context_window: int | None = None,
        keep_tool_results: int = 3,
        max_tool_calls: int = 16,
        timeout: float = 600.0,
        retry_hours: float | None = None,
        max_retry_wait_s: float = 300.0,
        long_tool_s: float = 270.0,
    ) -> None:
        """`effort`: output_config.effort (low, medium, high, xhigh, max; None: the model's default).
        `thinking`: "adaptive" (the default where the model has it), "off", or a budget in tokens
        (extended thinking with budget_tokens). `context_limit`: prompt tokens past which the API
        clears old tool results (default 60% of the context window). `context_window`: the model's
        context window in tokens (default: the model's, from `agent.llm.PRICES`); a request that
        cannot fit in it with `max_tokens` of output is never sent. `retry_hours`: how long, in all,
        to wait out overloads and rate limits before giving up (default 10 minutes), each wait at
        most `max_retry_wait_s`. `long_tool_s`: a tool round longer than this moves the cache to the
        1-hour TTL."""
        price = price_for(model)  # an unknown model fails here, not after an hour of unpriced turns
        if not 1 <= max_tokens <= price.max_output:
            raise ValueError(f"max_tokens {max_tokens}: {model} takes 1 to {price.max_output}")
        if effort is not None and effort not in EFFORTS:
            raise ValueError(f"effort {effort!r}: expected one of {', '.join(EFFORTS)}")
        self.model = model
        self.max_tokens = max_tokens
        self.effort = effort
        self.thinking = self._thinking_param(model, price.thinking, thinking, max_tokens)
        self.client = client
        window = price.context_window
        if context_window is not None and not max_tokens < context_window <= window:
            raise ValueError(f"context_window {context_window}: must be more than max_tokens ({max_tokens}) and at most "
                             f"{model}'s {window}")
        self.context_window = context_window or window
        self.context_limit = context_limit or int(0.6 * self.context_window)
        self.keep_tool_results = keep_tool_results
        self.max_tool_calls = max_tool_calls  # per turn
        self.timeout = timeout  # of the client made here: seconds without an answer
        self.retry_hours = retry_hours
        self.max_retry_wait_s = max_retry_wait_s
        self.long_tool_s = long_tool_s
        self.doing: str | None = None  # what the loop is doing now (what a second Ctrl-C cuts off), for people

    def __repr__(self) -> str:
        return f"ClaudePolicy(model={self.model!r}, max_tokens={self.max_tokens}, effort={self.effort!r})"

    @staticmethod
    def _thinking_param(model: str, kind: str, thinking: str | int | None, max_tokens: int) -> dict[str, Any] | None:
        """The request's `thinking` parameter (None: not sent)."""
        if thinking is None or thinking == "adaptive":
            return {"type": "adaptive"} if kind != "extended" else None
        if thinking == "off":
            if kind == "always":
                raise ValueError(f"thinking cannot be turned off on {model} (adaptive thinking is always on)")
            return {"type": "disabled"}
        if isinstance(thinking, int) and not isinstance(thinking, bool):
            if not 1024 <= thinking < max_tokens:
                raise ValueError(f"thinking budget {thinking}: must be at least 1024 and below max_tokens ({max_tokens})")
            return {"type": "enabled", "budget_tokens": thinking}
        raise ValueError(f"thinking {thinking!r}: expected 'adaptive', 'off' or a budget in tokens")

    @property
    def thinking_on(self) -> bool:
        return self.thinking is not None and self.thinking.get("type") in ("adaptive", "enabled")

    def settings(self) -> dict[str, Any]:
        """What the run record keeps of this policy's configuration (run.json's config)."""
        return {"model": self.model, "max_tokens": self.max_tokens, "effort": self.effort, "thinking": self.thinking,
                "context_limit": self.context_limit, "context_window": self.context_window,
                "keep_tool_results": self.keep_tool_results,
                "retry_hours": self.retry_hours, "max_retry_wait_s": self.max_retry_wait_s}

    def _client(self) -> LLMClient:
        if self.client is not None:
            return self.client
        wait = {} if self.retry_hours is None else {"max_total_wait": self.retry_hours * 3600, "max_retries": None}
        return LLMClient(self.model, timeout=self.timeout, max_delay=self.max_retry_wait_s, **wait)

    def _context_management(self, tool_names: list[str], urgent: int | None) -> dict[str, Any]:
        """The context edits the API applies server-side. `urgent`: the context (tokens) of a turn
        that hit the window: clear down to one call, from half of it."""
        trigger = self.context_limit if urgent is None else max(1, min(self.context_limit, urgent // 2))
        clear: dict[str, Any] = {
            "type": CLEAR_EDIT,
            "trigger": {"type": "input_tokens", "value": trigger},
            "keep": {"type": "tool_uses", "value": self.keep_tool_results if urgent is None else 1},
            # each clearing rewrites the cache from there: clear enough to be worth it
            "clear_at_least": {"type": "input_tokens", "value": max(1, trigger // 10 if urgent is None else 1)},
        }
        big = [n for n in BIG_INPUT_TOOLS if n in tool_names]
        if big:
            clear["clear_tool_inputs"] = big
        edits = [{"type": "clear_thinking_20251015", "keep": "all"}] if self.thinking_on else []
        return {"edits": [*edits, clear]}

    # -- the loop --------------------------------------------------------------------------------

    def run(self, ctx: PolicyContext) -> str:
        try:
            return self._loop(ctx)
        except KeyboardInterrupt:  # a second Ctrl-C: say what it cut off, then let it stop the session
            if self.doing:
                ctx.log("note", text=f"stopped now: {self.doing} was cut off", data={"source": "llm", "stopped": self.doing})
            raise

    def _loop(self, ctx: PolicyContext) -> str:
        client = self._client()
        system, tools = ctx.system_prompt(), ctx.toolbox.schemas()  # built once: the prefix never changes
        tool_names = [t["name"] for t in tools]
        messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": ctx.briefing()}]}]
        fixed = estimate_tokens(system) + estimate_tokens(tools) + estimate_tokens(messages)  # the 1-hour prefix
        before = spent_so_far(ctx)
        turn, spent = before.turns, before.cost_usd
        idle, stalled = 0, 0
        last: Usage | None = None  # the previous turn's usage, and how many messages it saw
        last_cost = 0.0
        seen = 0
        rounds: list[float] = []  # seconds each tool round took
        urgent: int | None = None  # set after a turn hit the context window
        remind = False  # the API cleared old results: the memory goes into the next message
        paused = False  # the last message is a paused assistant turn: the next turn continues it
        room = self.context_window - self.max_tokens  # the most input a request may have
        extra: dict[str, Any] = {}
        if self.thinking is not None:
            extra["thinking"] = self.thinking
        if self.effort is not None:
            extra["output_config"] = {"effort": self.effort}
        seconds_left = getattr(ctx, "seconds_left", None)  # a context without it has no deadline to tell

        def log(kind: str, **data: Any) -> None:  # the one way out to the record: scrubbed
            ctx.log(kind, **client.scrub(data))

        def end(reason: str) -> str:
            reason = client.scrub(reason)
            self.doing = None
            log("policy_stop", reason=reason, turns=turn, cost_usd=round(spent, 6))
            return reason

        def stop_waiting(ahead: float) -> str | None:
            """Why a wait between API attempts must end now: a stop, or a wait past --max-hours."""
            if reason := ctx.stop_reason():
                return reason
            left = seconds_left() if callable(seconds_left) else None
            return "max_hours" if left is not None and ahead >= left else None

        if before.turns:
            log("note", text=f"resumed: {before.turns} turns and ${before.cost_usd:.4f} already spent count "
                             "against this session's budgets", data={"source": "llm", **before.__dict__})
        while True:
            if reason := self._budget_stop(ctx, turn):
                return end(reason)
            ttl = "1h" if any(r > self.long_tool_s for r in rounds[-LONG_ROUNDS:]) else "5m"
            # the request's input: our own high estimate of all of it (3 characters a token) until the
            # API has counted a request, then the previous turn's context as the API counted it (what
            # context editing left) plus our estimate of what was added since; never more than the hard
            # bound of its size (a token is at least a byte), nor less than what no context edit frees
            full, bound = request_size([system, tools, messages])
            floor = _floor(full, messages)  # what no context edit can free: a count below it is not believed
            estimate = full if last is None else max(floor, min(bound, last.total_input + last.output_tokens
                                                                 + estimate_tokens(messages[seen:])))
            if estimate > room:  # too big for the window: only the API's context editing can make room
                if floor > room:
                    log("note", text=f"not sent: the next request is about {estimate} tokens of input, and at least "
                                     f"{floor} once every old tool result is cleared; with {self.max_tokens} of output "
                                     f"it cannot fit in the {self.context_window}-token context window",
                        data={"source": "llm", "turn": turn + 1, "input_estimate": estimate, "floor": floor,
                              "context_window": self.context_window, "max_tokens": self.max_tokens})
                    return end("context_full")
                urgent = max(urgent or 0, estimate)  # clear down to the newest call
            # and never less than the last turn cost (an estimate is only as good as its inputs)
            worst = max(worst_case_cost(self.model, estimate, self.max_tokens, ttl, fixed), last_cost)
            budget = ctx.budget.max_cost_usd
            if budget is not None and spent + worst > budget:
                log("note", text=f"not sent: the next request could cost up to ${worst:.4f} (about {estimate} input "
                                 f"tokens and {self.max_tokens} output), past the ${budget:.2f} budget with "
                                 f"${spent:.4f} spent", data={"source": "llm", "worst_usd": round(worst, 6),
                                                              "input_estimate": estimate, "hour_tokens": fixed,
                                                              "spent_usd": round(spent, 6)})
                return end("max_cost")

            def retried(attempt: int, wait: float, error: str) -> None:
                self.doing = f"a wait of {wait:.1f} s before retrying the API request of turn {turn + 1}"
                log("llm_retry", turn=turn + 1, attempt=attempt, wait_s=round(wait, 3), error=error)

            self.doing = f"the API request of turn {turn + 1}"
            try:
                t = client.stream_turn(system, tools, messages, self.max_tokens, on_retry=retried, prefix_ttl="1h",
                                       newest_ttl=ttl, context_management=self._context_management(tool_names, urgent),
                                       stop=stop_waiting, **extra)
            except Stopped as exc:  # a stop, or the deadline, ended a wait: nothing was sent since
                log("note", text=f"turn {turn + 1}: {exc.detail}: ended ({exc.reason})",
                    data={"source": "llm", "turn": turn + 1, "wait_stopped": exc.reason})
                return end(exc.reason)
            except LLMError as exc:
                if str(exc).startswith("invalid_request:") and "prompt is too long" in str(exc):
                    # the API's own check of the window (its count is above our estimate): the same end
                    log("note", text=f"turn {turn + 1}: the API refused the request as too long for the context "
                                     f"window: {exc}", data={"source": "llm", "turn": turn + 1})
                    return end("context_full")
                return end(f"api_error: {exc}")  # `turn` counts the turns that happened
            turn += 1
            # what a request can have used is bounded by its size and max_tokens: past that, the API's fault
            usage, faults = bounded_usage(t.usage, bound, self.max_tokens)
            last, seen = usage, len(messages)
            last_cost = cost_usd(self.model, usage)  # billed as the model asked for; the reply's model is logged
            spent += last_cost
            log(
                "llm_turn", turn=turn, usage=usage.as_dict(), cost_usd=round(last_cost, 6),
                total_cost_usd=round(spent, 6), stop_reason=t.stop_reason, retries=t.retries, model=t.model[:100],
                tool_calls=[u["name"][:100] for u in t.tool_uses], text=t.text[:LOG_TEXT],
            )
            for fault in faults:
                log("note", text=f"turn {turn}: API fault: usage {fault}; booked at the bound, not as reported",
                    data={"turn": turn, "source": "llm", "fault": "usage", "reported": t.usage.as_dict(),
                          "booked": usage.as_dict()})
            for note in t.notes:
                log("note", text=f"turn {turn}: {note}", data={"turn": turn, "source": "llm"})
            if t.stop_reason == "pause_turn" and not t.content:  # the same request again would be paid again
                log("note", text=f"turn {turn}: an empty paused turn; not sent again", data={"turn": turn, "source": "llm"})
                return end("no_progress")
            # the room this turn's calls and their results have: what no context edit can free is taken
            left = self._fit_inputs(log, turn, t, room - _floor(estimate_tokens([system, tools, messages]), messages))
            if t.content:  # exactly as it came (but inputs refused above); a paused turn is continued in place
                if paused:
                    messages[-1] = {"role": "assistant", "content": [*messages[-1]["content"], *t.content]}
                else:
                    messages.append({"role": "assistant", "content": t.content})
            paused = t.stop_reason == "pause_turn" and not t.tool_uses
            if t.stop_reason == "refusal":
                return end("refusal")

            cleared = [e for e in t.applied_edits if e.get("type") == CLEAR_EDIT and _count(e, "cleared_tool_uses")]
            full_window = t.stop_reason == "model_context_window_exceeded"
            if full_window and urgent is not None and not cleared:
                return end("context_full")  # even clearing hard left no room
            urgent = usage.total_input + usage.output_tokens if full_window else None
            if cleared:  # the API dropped old results from what the model sees: say what was learned, next
                remind = True
                log("context_cleared", turn=turn, context_tokens=sum(_count(e, "cleared_input_tokens") for e in cleared),
                    cleared=sum(_count(e, "cleared_tool_uses") for e in cleared))

            stalled = 0 if t.tool_uses else stalled + 1
            if stalled >= MAX_STALLED:
                return end("no_progress")
            if paused:  # a paused long turn: send it back as the last assistant message, to be continued
                continue
            cut_off = t.stop_reason == "max_tokens" or full_window
            if t.tool_uses:
                idle = 0
                start = time.monotonic()
                reply = self._run_tools(ctx, log, turn, t, cut_off=cut_off and t.content[-1]["type"] == "tool_use",
                                        room=left)
                rounds.append(time.monotonic() - start)
            elif cut_off:
                reply = [{"type": "text", "text": CUT_OFF_TEXT}]
            else:  # end_turn, stop_sequence, and stop reasons we do not know
                idle += 1
                if idle >= 2:
                    return end("end_turn")
                reply = [{"type": "text", "text": NUDGE}]
            if remind:  # at the end of the next message we send (never in one already sent)
                reply.append({"type": "text", "text": MEMORY.format(memory=ctx.memory())})
                remind = False
            messages.append({"role": "user", "content": reply})

    # -- pieces ----------------------------------------------------------------------------------

    def _fit_inputs(self, log: Callable[..., None], turn: int, t: Turn, left: int) -> int:
        """Refuse each tool input of `t` too big for the room `left` in the context window (tokens):
        its call is answered with an error, not run, and the input is sent back as {} (nothing bound
        to it yet: a thinking block binds only what comes before it, and none follows it in the turn).
        Returns the room left for the tool results."""
        left -= estimate_tokens([b for b in t.content if b.get("type") != "tool_use"])
        content = list(t.content)
        for k, b in enumerate(content):
            if b.get("type") != "tool_use" or b["id"] in t.rejected:
                continue
            size = estimate_tokens(b["input"])
            if size <= left:
                left -= size
                continue
            if any(c.get("type") in THINKING_TYPES for c in content[k + 1:]):
                log("note", text=f"turn {turn}: the input of {b['name'][:100]} (about {size} tokens) does not fit in the "
                                 f"{max(left, 0)} tokens left of the context window, but a thinking block after it is "
                                 "bound to it: it stays", data={"turn": turn, "source": "llm"})
                continue
            t.rejected[b["id"]] = (
                f"error: the input of {b['name'][:100]} is about {size} tokens, more than the {max(left, 0)} tokens left "
                f"for it in the {self.context_window}-token context window; it was not run and was not kept. Send "
                "smaller pieces (one region of a file per edit_file call).")
            content[k] = {**b, "input": {}}
            log("note", text=f"turn {turn}: refused a {size}-token input of {b['name'][:100]}: it would not fit in the "
                             "context window", data={"turn": turn, "source": "llm", "refused_input_tokens": size})
        t.content = content
        return left

    def _budget_stop(self, ctx: PolicyContext, turns: int) -> str | None:
        if reason := ctx.stop_reason():
            return reason
        budget = ctx.budget
        if budget.max_turns is not None and turns >= budget.max_turns:
            return "max_turns"
        return None

    def _run_tools(
        self, ctx: PolicyContext, log: Callable[..., None], turn: int, t: Turn, cut_off: bool, room: int | None = None
    ) -> list[dict[str, Any]]:
        """One tool_result per tool_use, in order. The last call, when `cut_off` (its input was
        truncated at max_tokens), is never run; nor are calls with an input that is not an object
        (or too big for the context window), those past `max_tool_calls`, those after one that
        changed the session state (submit/revert), and those after the session was told to stop. A
        result bigger than the `room` left in the context window (tokens) is answered with an error
        instead of itself."""
        uses = t.tool_uses
        results, held = [], None
        for i, use in enumerate(uses):
            start = time.monotonic()
            if held is None and (stop := ctx.stop_reason()):
                held = f"the session is stopping ({stop})"
            if held is None and i >= self.max_tool_calls:
                held = f"only the first {self.max_tool_calls} tool calls of a turn are run; send fewer at a time"
            if cut_off and i == len(uses) - 1:
                ok, text, event, data = False, CUT_OFF_CALL, None, None
            elif use["id"] in t.rejected:
                ok, text, event, data = False, t.rejected[use["id"]], None, None
            elif held:
                ok, text, event, data = False, f"not run: {held}", None, None
            else:
                self.doing = f"the tool call {use['name'][:100]} of turn {turn}"
                res = ctx.toolbox.call(use["name"], use["input"])
                ok, text, event, data = res.ok, cap(res.text or "(no output)"), res.event, res.data
                if event:
                    held = f"{use['name']} changed the session state ({event}); re-plan from the new state"
            if room is not None:
                size = estimate_tokens(text)
                if size > room:
                    text, ok = (f"error: the result of {use['name'][:100]} is about {size} tokens, more than the "
                                f"{max(room, 0)} tokens left for it in the {self.context_window}-token context window; "
                                "it was not kept. Ask for less (a smaller file region, fewer shapes)."), False
                    size = estimate_tokens(text)
                room -= size
            log(
                "tool_call", turn=turn, id=use["id"], name=use["name"][:100], input=_loggable(use["input"]), ok=ok,
                event=event, data=data, duration_s=round(time.monotonic() - start, 3), text=text[:LOG_TEXT],
            )
            result = {"type": "tool_result", "tool_use_id": use["id"], "content": text}
            if not ok:
                result["is_error"] = True
            results.append(result)
        return results


def _floor(estimate: int, messages: list[dict[str, Any]]) -> int:
    """The smallest the prompt of `estimate` tokens can be made by the API's context editing at its
    hardest (`keep` one call): every tool result but the newest cleared, and every write/edit input
    but the newest (`clear_tool_inputs`). Thinking, text and the briefing are never cleared."""
    results = [b for m in messages if m["role"] == "user" and isinstance(m["content"], list) for b in m["content"]
               if b.get("type") == "tool_result"]
    inputs = [b for m in messages if m["role"] == "assistant" for b in m["content"]
              if b.get("type") == "tool_use" and b.get("name") in BIG_INPUT_TOOLS]
    freed = sum(estimate_tokens(b.get("content", "")) for b in results[:-1])
    freed += sum(estimate_tokens(b.get("input", {})) for b in inputs[:-1])
    return max(0, estimate - freed)


def _count(edit: dict[str, Any], key: str) -> int:
    v = edit.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _loggable(value: Any) -> Any:
    """A tool input for the run record: itself, or the start of its JSON when that is very long."""
    text = json.dumps(value)
    return value if len(text) <= LOG_INPUT else f"{text[:LOG_INPUT]}... [{len(text) - LOG_INPUT} more characters]"
