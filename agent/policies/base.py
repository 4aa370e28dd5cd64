"""What a policy is given, and what it must do: act only through tools until told to stop.

A policy proposes (edits, builds, submits); the gate, behind the `submit` tool, decides. Policies
never commit, never see the gate's seed, and never reach the workspace except through tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tools.base import ToolBox


@dataclass
class Budget:
    max_turns: int | None = None
    max_cost_usd: float | None = None
    max_hours: float | None = None
    max_attempts: int | None = None
    # seconds spent in the tools that occupy the device (check, bench, sweep, profile, the gate)
    max_gpu_seconds: float | None = None


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

    def log(self, kind: str, **data: Any) -> None:
        """Append an event to the run record (write-ahead; flushed before returning)."""

    def stop_reason(self) -> str | None:
        """Why the session must stop now (budget of hours or attempts spent, a signal), else None."""


class Policy(Protocol):
    name: str

    def run(self, ctx: PolicyContext) -> str:
        """Work until done or stopped; return the reason it ended (e.g. 'max_turns', 'end_turn')."""
