"""What a policy is given, and what it must do: act only through tools until told to stop.

A policy proposes (edits, builds, submits); the gate, behind the `submit` tool, decides. Policies
never commit, never see the gate's seed, and never reach the workspace except through tools: a
policy's `run` receives a `PolicyFacade`, never the session.

The facade is a seam, not a sandbox: code in this process can always dig (gc, frames). What it
guarantees is that no public attribute path leads from it to the gate, the workspace, the run
record or a seed, and that a policy can only write its own kinds of events to the record (never a
verdict or a commit). Untrusted agents run outside the process (MCP, the CLI) and get less.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from tools.base import ToolBox


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class Budget:
    max_turns: int | None = None
    max_cost_usd: float | None = None
    max_hours: float | None = None
    max_attempts: int | None = None
    # seconds spent in the tools that occupy the device (check, bench, sweep, profile, the gate)
    max_gpu_seconds: float | None = None


# the events a policy may append to the run record; the session alone writes the others
# (attempt_started, verdict, committed, restored, baseline, session_started/ended)
POLICY_EVENTS = frozenset({"note", "tool_call", "llm_turn", "llm_retry", "context_cleared", "policy_stop"})


class PolicyContext(Protocol):
    toolbox: ToolBox
    budget: Budget

    def system_prompt(self) -> str:
        """The rules of the game (prompts/system.md), same for every task."""

    def briefing(self) -> str:
        """The task briefing: task, GPU, roofline per bench shape, baseline figures, knobs, files."""

    def memory(self) -> str:
        """The agent's notes and the attempt ledger, re-injected when old context is cleared."""

    def attempts_made(self) -> int:
        ...

    def attempts(self) -> list:
        """The attempts so far with their verdicts (what was tried, what landed, what was interrupted)."""

    def events(self) -> list:
        """The run record's events so far (what a resumed policy already spent)."""

    def log(self, kind: str, **data: Any) -> None:
        """Append an event to the run record (write-ahead; flushed before returning)."""

    def stop_reason(self) -> str | None:
        """Why the session must stop now (budget of hours or attempts spent, a signal), else None."""

    def seconds_left(self) -> float | None:
        """Wall seconds left under the hours budget (None: none): no wait should outlast it."""


class PolicyFacade:
    """The `PolicyContext` a session hands its policy: tools, budget, briefing, memory, log, stop reason."""

    __slots__ = ("_session",)

    def __init__(self, session: Any) -> None:
        object.__setattr__(self, "_session", session)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the policy facade is read-only ({name!r})")

    def __repr__(self) -> str:
        return "PolicyFacade(toolbox, budget, system_prompt, briefing, memory, attempts_made, attempts, events, log, stop_reason, seconds_left)"

    @property
    def toolbox(self) -> ToolBox:
        """The agent tools, bound to the session port (never to the session itself)."""
        return self._session.toolbox

    @property
    def budget(self) -> Budget:
        return dataclasses.replace(self._session.budget)  # a copy: the policy cannot widen its budget

    def system_prompt(self) -> str:
        return self._session.system_prompt()

    def briefing(self) -> str:
        return self._session.briefing()

    def memory(self) -> str:
        return self._session.memory()

    def attempts_made(self) -> int:
        return self._session.attempts_made()

    def attempts(self) -> list:
        return self._session.attempts()  # rebuilt from the record on each call: a copy the policy may keep

    def events(self) -> list:
        """The run record's events so far, as read from disk (e.g. turns and cost already spent before a
        resume); past verdicts only: the gate draws a seed when it judges, never before."""
        return self._session.events()

    def stop_reason(self) -> str | None:
        return self._session.stop_reason()

    def seconds_left(self) -> float | None:
        return self._session.seconds_left()

    def log(self, kind: str, **data: Any) -> None:
        if kind not in POLICY_EVENTS:
            raise PermissionError(f"a policy may not log {kind!r} events (only {', '.join(sorted(POLICY_EVENTS))})")
        self._session.log(kind, **data)


class Policy(Protocol):
    name: str

    def run(self, ctx: PolicyContext) -> str:
        """Work until done or stopped; return the reason it ended (e.g. 'max_turns', 'end_turn')."""
