"""The Claude policy: the Messages API tool-use loop, in the open.

    system = the rules; first user message = the task briefing
    loop: stop if a budget is spent (or the next request's worst case would pass --max-cost)
          -> stream one turn -> log it -> run its tool calls through the ToolBox
          -> answer with tool_result blocks (is_error when a call failed) -> repeat

Stop reasons (the returned string): whatever `ctx.stop_reason()` says (hours, attempts, a signal),
'max_turns', 'max_cost', 'end_turn' (two turns in a row that end without a tool call), 'refusal',
'context_full', 'no_progress' (many turns in a row without a tool call: pauses, cut-off texts),
'api_error: <kind>: <message>' (see `agent.llm.LLMError`). Whatever the reason, the session keeps
the branch at best.

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
    DEFAULT_MODEL, EFFORTS, LLMClient, LLMError, Turn, Usage, cost_usd, estimate_tokens, price_for, worst_case_cost,
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
        clears old tool results (default 60% of the context window). `retry_hours`: how long, in all,
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
        self.context_limit = context_limit or int(0.6 * price.context_window)
        self.keep_tool_results = keep_tool_results
        self.max_tool_calls = max_tool_calls  # per turn
        self.timeout = timeout  # of the client made here: seconds without an answer
        self.retry_hours = retry_hours
        self.max_retry_wait_s = max_retry_wait_s
        self.long_tool_s = long_tool_s

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
                "context_limit": self.context_limit, "keep_tool_results": self.keep_tool_results,
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
        extra: dict[str, Any] = {}
        if self.thinking is not None:
            extra["thinking"] = self.thinking
        if self.effort is not None:
            extra["output_config"] = {"effort": self.effort}

        def log(kind: str, **data: Any) -> None:  # the one way out to the record: scrubbed
            ctx.log(kind, **client.scrub(data))

        def end(reason: str) -> str:
            reason = client.scrub(reason)
            log("policy_stop", reason=reason, turns=turn, cost_usd=round(spent, 6))
            return reason

        if before.turns:
            log("note", text=f"resumed: {before.turns} turns and ${before.cost_usd:.4f} already spent count "
                             "against this session's budgets", data={"source": "llm", **before.__dict__})
        while True:
            if reason := self._budget_stop(ctx, turn):
                return end(reason)
            ttl = "1h" if any(r > self.long_tool_s for r in rounds[-LONG_ROUNDS:]) else "5m"
            # the request's input: the previous turn's context, plus what was added since
            estimate = (last.total_input + last.output_tokens + estimate_tokens(messages[seen:]) if last else
                        estimate_tokens(system) + estimate_tokens(tools) + estimate_tokens(messages))
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
                log("llm_retry", turn=turn + 1, attempt=attempt, wait_s=round(wait, 3), error=error)

            try:
                t = client.stream_turn(system, tools, messages, self.max_tokens, on_retry=retried, prefix_ttl="1h",
                                       newest_ttl=ttl, context_management=self._context_management(tool_names, urgent),
                                       **extra)
            except LLMError as exc:
                return end(f"api_error: {exc}")  # `turn` counts the turns that happened
            turn += 1
            last, seen = t.usage, len(messages)
            last_cost = cost_usd(self.model, t.usage)  # billed as the model asked for; the reply's model is logged
            spent += last_cost
            log(
                "llm_turn", turn=turn, usage=t.usage.as_dict(), cost_usd=round(last_cost, 6),
                total_cost_usd=round(spent, 6), stop_reason=t.stop_reason, retries=t.retries, model=t.model[:100],
                tool_calls=[u["name"][:100] for u in t.tool_uses], text=t.text[:LOG_TEXT],
            )
            for note in t.notes:
                log("note", text=f"turn {turn}: {note}", data={"turn": turn, "source": "llm"})
            if t.content:
                messages.append({"role": "assistant", "content": t.content})  # exactly as it came
            if t.stop_reason == "refusal":
                return end("refusal")

            cleared = [e for e in t.applied_edits if e.get("type") == CLEAR_EDIT and _count(e, "cleared_tool_uses")]
            full = t.stop_reason == "model_context_window_exceeded"
            if full and urgent is not None and not cleared:
                return end("context_full")  # even clearing hard left no room
            urgent = t.usage.total_input + t.usage.output_tokens if full else None
            if cleared:  # the API dropped old results from what the model sees: say what was learned, next
                remind = True
                log("context_cleared", turn=turn, context_tokens=sum(_count(e, "cleared_input_tokens") for e in cleared),
                    cleared=sum(_count(e, "cleared_tool_uses") for e in cleared))

            stalled = 0 if t.tool_uses else stalled + 1
            if stalled >= MAX_STALLED:
                return end("no_progress")
            if t.stop_reason == "pause_turn" and not t.tool_uses:  # a paused long turn: send it back
                continue
            cut_off = t.stop_reason == "max_tokens" or full
            if t.tool_uses:
                idle = 0
                start = time.monotonic()
                reply = self._run_tools(ctx, log, turn, t, cut_off=cut_off and t.content[-1]["type"] == "tool_use")
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

    def _budget_stop(self, ctx: PolicyContext, turns: int) -> str | None:
        if reason := ctx.stop_reason():
            return reason
        budget = ctx.budget
        if budget.max_turns is not None and turns >= budget.max_turns:
            return "max_turns"
        return None

    def _run_tools(
        self, ctx: PolicyContext, log: Callable[..., None], turn: int, t: Turn, cut_off: bool
    ) -> list[dict[str, Any]]:
        """One tool_result per tool_use, in order. The last call, when `cut_off` (its input was
        truncated at max_tokens), is never run; nor are calls with an input that is not an object,
        those past `max_tool_calls`, those after one that changed the session state (submit/revert),
        and those after the session was told to stop."""
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
                res = ctx.toolbox.call(use["name"], use["input"])
                ok, text, event, data = res.ok, cap(res.text or "(no output)"), res.event, res.data
                if event:
                    held = f"{use['name']} changed the session state ({event}); re-plan from the new state"
            log(
                "tool_call", turn=turn, id=use["id"], name=use["name"][:100], input=_loggable(use["input"]), ok=ok,
                event=event, data=data, duration_s=round(time.monotonic() - start, 3), text=text[:LOG_TEXT],
            )
            result = {"type": "tool_result", "tool_use_id": use["id"], "content": text}
            if not ok:
                result["is_error"] = True
            results.append(result)
        return results


def _count(edit: dict[str, Any], key: str) -> int:
    v = edit.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _loggable(value: Any) -> Any:
    """A tool input for the run record: itself, or the start of its JSON when that is very long."""
    text = json.dumps(value)
    return value if len(text) <= LOG_INPUT else f"{text[:LOG_INPUT]}... [{len(text) - LOG_INPUT} more characters]"
