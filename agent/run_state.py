"""The run record read once: `RunState.fold(events)` -> attempts, best, baseline, budget spent,
interrupted work; and `budget_stop`, the one answer to "may this tool run now, and if not why".

records.py is the one writer of events.jsonl; this is the one reader of what it says. The session,
the shell/MCP service, the views, `kloop show/runs` and the policies all ask this module, so a
budget is counted one way wherever it is enforced or shown.

Budgets are totals for the run, over all its segments (a segment: one `session_started` to the
next, or to its `session_ended`):
- hours: each closed segment's span (its start to its last event, without what a later resume
  logged while repairing, so the time between a kill and a resume does not count), plus, while
  the last segment is open (no `session_ended`), the time since its start. A shell or MCP session
  is one open segment from `kloop session start` to `kloop session end`, however many processes
  serve it.
- attempts: those the gate decided. An attempt whose evaluation was cut off (kill -9, Ctrl-C
  twice) is recorded as interrupted and offered again; it does not use up `max_attempts`.
- turns and API cost: the `llm_turn` events; device seconds: the device tools' `tool_call` events.

Events are matched by `kind` (not by class), so this module imports nothing from agent/ and any
object with the recorded fields folds the same (records.py builds its run summaries with it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable

# tools that occupy the device (`max_gpu_seconds` counts their time)
DEVICE_TOOLS = frozenset({"check", "bench", "sweep", "profile", "submit"})
INTERRUPTED_PREFIX = "interrupted"
# what a resume logs while repairing, before its own session_started (not part of the segment before)
_REPAIR_KINDS = frozenset({"restored", "committed", "note"})


@dataclass
class Attempt:
    """One submission as the record tells it."""

    number: int
    title: str
    rationale: str = ""
    knobs: dict[str, Any] = field(default_factory=dict)
    accepted: bool | None = None  # None: no verdict yet (being judged, or cut off by a kill)
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    commit: str | None = None
    gate_seconds: float | None = None  # the timing cap asked for this decision (None: the session's)
    best_commit: str | None = None  # the best it was judged against (None: not recorded, older runs)

    @property
    def interrupted(self) -> bool:
        """Its evaluation was cut off (recorded as such by a repair or a Ctrl-C twice)."""
        return self.accepted is False and (self.reason.startswith(INTERRUPTED_PREFIX)
                                           or self.figures.get("stage") == INTERRUPTED_PREFIX)

    @property
    def decided(self) -> bool:
        """The gate decided it (accepted or rejected on its merits): it used up an attempt."""
        return self.accepted is not None and not self.interrupted

    @property
    def verdict(self) -> str:
        if self.accepted is None:
            return "pending"
        if self.interrupted:
            return "interrupted"
        return "accepted" if self.accepted else "rejected"


def _real_positive(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v > 0 and v != float("inf") else None


@dataclass
class RunState:
    attempts: list[Attempt] = field(default_factory=list)
    baseline: dict[str, Any] | None = None  # the last recorded baseline's figures
    turns: int = 0
    cost_usd: float = 0.0
    gpu_seconds: float = 0.0
    hours_closed: float = 0.0  # the segments before the last one (or all of them, once ended)
    open_since: datetime | None = None  # the last segment's start while it has no session_ended
    last_segment_hours: float = 0.0  # the last segment's span so far (start to its last event)
    segments: int = 0
    ended: str | None = None  # the reason of the last session_ended, while no session started since
    last_event_at: datetime | None = None

    @classmethod
    def fold(cls, events: Iterable[Any]) -> "RunState":
        s = cls()
        by_no: dict[int, Attempt] = {}
        segments: list[list[Any]] = []
        for ev in events:
            kind = getattr(ev, "kind", None)
            s.last_event_at = getattr(ev, "t", s.last_event_at)
            if kind == "session_started":
                segments.append([ev])
                s.ended = None
            elif segments:
                segments[-1].append(ev)
            if kind == "session_ended":
                s.ended = ev.reason
            elif kind == "attempt_started":
                by_no[ev.attempt] = Attempt(ev.attempt, ev.title, ev.rationale, dict(ev.knobs),
                                            gate_seconds=getattr(ev, "gate_seconds", None),
                                            best_commit=getattr(ev, "best_commit", None))
            elif kind == "verdict" and ev.attempt in by_no:
                a = by_no[ev.attempt]
                a.accepted, a.reason, a.figures = ev.accepted, ev.reason, dict(ev.figures)
            elif kind == "committed" and ev.attempt in by_no:
                by_no[ev.attempt].commit = ev.commit
            elif kind == "baseline":
                s.baseline = dict(ev.figures)
            elif kind == "llm_turn":
                s.turns += 1
                s.cost_usd += float(getattr(ev, "cost_usd", 0.0) or 0.0)
            elif kind == "tool_call" and ev.name in DEVICE_TOOLS:
                s.gpu_seconds += float(getattr(ev, "duration_s", 0.0) or 0.0)
        s.attempts = [by_no[k] for k in sorted(by_no)]
        s.segments = len(segments)
        for i, seg in enumerate(segments):
            last = i + 1 == len(segments)
            if not last:
                while len(seg) > 1 and _repair_event(seg[-1]):
                    seg.pop()
            span = (max(e.t for e in seg) - seg[0].t).total_seconds() / 3600
            if last:
                s.last_segment_hours = span
                if s.ended is None:
                    s.open_since = seg[0].t
                    continue
            s.hours_closed += span
        return s

    # ---- what was spent -------------------------------------------------------------------------
    def hours_used(self, now: datetime | None = None) -> float:
        """Wall hours of the run's segments; the open one counts up to `now`."""
        if self.open_since is None:
            return self.hours_closed
        now = now or datetime.now(timezone.utc)
        return self.hours_closed + max(self.last_segment_hours, (now - self.open_since).total_seconds() / 3600)

    @property
    def hours_before(self) -> float:
        """Hours the recorded segments spanned, up to their last events (what a resume finds spent)."""
        return self.hours_closed + (self.last_segment_hours if self.open_since is not None else 0.0)

    @property
    def attempts_used(self) -> int:
        """Attempts that count against `max_attempts`: those the gate decided."""
        return sum(1 for a in self.attempts if a.decided)

    @property
    def next_number(self) -> int:
        return len(self.attempts) + 1

    @property
    def accepted(self) -> list[Attempt]:
        return [a for a in self.attempts if a.accepted]

    @property
    def best_speedup(self) -> float:
        """Speedup of the best over the base: the product of the accepted steps."""
        total = 1.0
        for a in self.accepted:
            sp = _real_positive(a.figures.get("speedup"))
            if sp is not None:
                total *= sp
        return total

    @property
    def pending(self) -> Attempt | None:
        """The attempt being judged (or cut off before its verdict), if any."""
        last = self.attempts[-1] if self.attempts else None
        return last if last is not None and last.accepted is None else None

    @property
    def interrupted(self) -> Attempt | None:
        """The last attempt when a stop cut its evaluation short (offered again on resume)."""
        last = self.attempts[-1] if self.attempts else None
        return last if last is not None and last.interrupted else None


def _repair_event(ev: Any) -> bool:
    kind = getattr(ev, "kind", None)
    return kind in _REPAIR_KINDS or (kind == "verdict" and ev.reason.startswith("interrupted: the session stopped"))


def budget_stop(budget: Any, state: RunState, tool: str | None = None, now: datetime | None = None) -> str | None:
    """Why `tool` may not run now, a budget being spent (None: it may). `tool=None` asks whether the
    session may go on at all (what a policy is told between steps): hours, turns and cost, attempts.
    Attempts stop only `submit` (and the session); device seconds only the device tools."""
    b = budget
    if b.max_hours is not None:
        used = state.hours_used(now)
        if used >= b.max_hours:
            return f"max_hours: {used:.2f} of {b.max_hours:g} h are used"
    if b.max_turns is not None and state.turns >= b.max_turns:
        return f"max_turns: {state.turns} of {b.max_turns} model turns are used"
    if b.max_cost_usd is not None and state.cost_usd >= b.max_cost_usd:
        return f"max_cost: ${state.cost_usd:.4f} of ${b.max_cost_usd:g} is spent"
    if (tool is None or tool == "submit") and b.max_attempts is not None and state.attempts_used >= b.max_attempts:
        return f"max_attempts: all {b.max_attempts} attempts are used"
    if tool in DEVICE_TOOLS and b.max_gpu_seconds is not None and state.gpu_seconds >= b.max_gpu_seconds:
        return f"max_gpu_seconds: {state.gpu_seconds:.0f} of {b.max_gpu_seconds:g} device seconds are used"
    return None


def stop_code(reason: str | None) -> str | None:
    """The short reason (`max_hours`, ...) of a `budget_stop` answer, as a session's end records it."""
    return None if reason is None else reason.split(":", 1)[0]
