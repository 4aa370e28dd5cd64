"""The Claude policy: the Messages API tool-use loop, in the open.

    system = the rules; first user message = the task briefing
    loop: stop if a budget is spent -> stream one turn -> log it -> run its tool calls through the
          ToolBox -> answer with tool_result blocks (is_error when a call failed) -> repeat

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

Context: when the last turn's context passes `context_limit` tokens, the results of all but the
newest `keep_tool_results` tool calls are replaced by a stub, and the agent's memory (notes and
attempt ledger, `ctx.memory()`) is re-sent, so that nothing learned is lost. We clear on our side
rather than with the API's context-editing beta so that the request stays small too and the memory
is re-injected at the very moment results disappear.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from agent.llm import DEFAULT_MODEL, LLMClient, LLMError, Turn, cost_usd, price_for
from agent.policies.base import PolicyContext
from tools.base import cap

CLEARED = "[cleared; see memory]"
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


class ClaudePolicy:
    name = "claude"

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        max_tokens: int = 32_000,
        client: LLMClient | None = None,
        *,
        context_limit: int | None = None,
        keep_tool_results: int = 3,
        max_tool_calls: int = 16,
        timeout: float = 600.0,
    ) -> None:
        price = price_for(model)  # an unknown model fails here, not after an hour of unpriced turns
        self.model = model
        self.max_tokens = max_tokens
        self.client = client
        self.context_limit = context_limit or int(0.6 * price.context_window)
        self.keep_tool_results = keep_tool_results
        self.max_tool_calls = max_tool_calls  # per turn
        self.timeout = timeout  # of the client made here: seconds without an answer

    def __repr__(self) -> str:
        return f"ClaudePolicy(model={self.model!r}, max_tokens={self.max_tokens})"

    # -- the loop --------------------------------------------------------------------------------

    def run(self, ctx: PolicyContext) -> str:
        client = self.client or LLMClient(self.model, timeout=self.timeout)
        system, tools = ctx.system_prompt(), ctx.toolbox.schemas()
        messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": ctx.briefing()}]}]
        turn, spent, last_cost, idle, stalled = 0, 0.0, 0.0, 0, 0

        def log(kind: str, **data: Any) -> None:  # the one way out to the record: scrubbed
            ctx.log(kind, **client.scrub(data))

        def end(reason: str) -> str:
            reason = client.scrub(reason)
            log("policy_stop", reason=reason, turns=turn, cost_usd=round(spent, 6))
            return reason

        while True:
            if reason := self._budget_stop(ctx, turn, spent, last_cost):
                return end(reason)
            turn += 1

            def retried(attempt: int, wait: float, error: str) -> None:
                log("llm_retry", turn=turn, attempt=attempt, wait_s=round(wait, 3), error=error)

            try:
                t = client.stream_turn(system, tools, messages, self.max_tokens, on_retry=retried)
            except LLMError as exc:
                return end(f"api_error: {exc}")
            last_cost = cost_usd(self.model, t.usage)
            spent += last_cost
            log(
                "llm_turn", turn=turn, usage=t.usage.as_dict(), cost_usd=round(last_cost, 6),
                total_cost_usd=round(spent, 6), stop_reason=t.stop_reason, retries=t.retries,
                tool_calls=[u["name"][:100] for u in t.tool_uses], text=t.text[:LOG_TEXT],
            )
            for note in t.notes:
                log("note", text=f"turn {turn}: {note}", data={"turn": turn, "source": "llm"})
            if t.content:
                messages.append({"role": "assistant", "content": t.content})
            if t.stop_reason == "refusal":
                return end("refusal")

            stalled = 0 if t.tool_uses else stalled + 1
            if stalled >= MAX_STALLED:
                return end("no_progress")
            if t.stop_reason == "pause_turn" and not t.tool_uses:  # a paused long turn: send it back
                continue
            full = t.stop_reason == "model_context_window_exceeded"
            cut_off = t.stop_reason == "max_tokens" or full
            if t.tool_uses:
                idle = 0
                reply = self._run_tools(ctx, log, turn, t, cut_off=cut_off and t.content[-1]["type"] == "tool_use")
            elif cut_off:
                reply = [{"type": "text", "text": CUT_OFF_TEXT}]
            else:  # end_turn, stop_sequence, and stop reasons we do not know
                idle += 1
                if idle >= 2:
                    return end("end_turn")
                reply = [{"type": "text", "text": NUDGE}]
            messages.append({"role": "user", "content": reply})

            context = t.usage.total_input + t.usage.output_tokens
            if full or context > self.context_limit:
                # the results just produced (in `reply`) are kept: the model has not seen them yet
                cleared = clear_tool_results(messages[:-1], keep=0 if full else self.keep_tool_results)
                if cleared:
                    reply.append({"type": "text", "text": MEMORY.format(memory=ctx.memory())})
                    log("context_cleared", turn=turn, context_tokens=context, cleared=cleared)
                elif full:
                    return end("context_full")

    # -- pieces ----------------------------------------------------------------------------------

    def _budget_stop(self, ctx: PolicyContext, turns: int, spent: float, last_cost: float) -> str | None:
        if reason := ctx.stop_reason():
            return reason
        budget = ctx.budget
        if budget.max_turns is not None and turns >= budget.max_turns:
            return "max_turns"
        # never start a turn expected (at the last turn's cost) to end past the budget
        if budget.max_cost_usd is not None and spent + last_cost > budget.max_cost_usd:
            return "max_cost"
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


def clear_tool_results(messages: list[dict[str, Any]], keep: int) -> int:
    """Replace the content of all but the newest `keep` tool results with a stub; return how many."""
    blocks = [
        b
        for m in messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]
    cleared = 0
    for b in blocks[: max(0, len(blocks) - keep)]:
        if b.get("content") != CLEARED:
            b["content"] = CLEARED
            cleared += 1
    return cleared


def _loggable(value: Any) -> Any:
    """A tool input for the run record: itself, or the start of its JSON when that is very long."""
    text = json.dumps(value)
    return value if len(text) <= LOG_INPUT else f"{text[:LOG_INPUT]}... [{len(text) - LOG_INPUT} more characters]"
