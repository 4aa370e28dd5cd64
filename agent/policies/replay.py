"""The replay policy: re-submit a recorded session's patches, in order, and compare the verdicts.

For each recorded attempt it applies the recorded patch (`apply_patch`), submits it (`submit`) and
notes the gate's answer beside the recorded one. Then it follows the recorded path, not this gate's:
an attempt accepted when it was recorded becomes the new best (`adopt`), any other is dropped
(`revert`), so that each later patch applies to the state it was made on. The replay bench
(agent/replay.py) supplies these tools; its `submit` judges and commits nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from pydantic import BaseModel

from agent.policies.base import PolicyContext

# a recorded accept that fails at one of these stages no longer builds or is no longer correct here
BROKEN_STAGES = ("build", "check", "scope", "static", "patch")


class ReplayRow(BaseModel):
    attempt: int
    title: str
    recorded_accepted: bool | None
    recorded_speedup: float | None = None
    recorded_reason: str = ""
    replayed_accepted: bool | None = None
    replayed_stage: str | None = None
    replayed_speedup: float | None = None
    replayed_lo: float | None = None
    replayed_hi: float | None = None
    replayed_reason: str = ""

    @property
    def agrees(self) -> bool:
        return self.recorded_accepted == self.replayed_accepted

    @property
    def interrupted(self) -> bool:
        """Recorded without a real verdict (the session stopped mid-gate): nothing to compare."""
        return self.recorded_accepted is None or (
            self.recorded_accepted is False and self.recorded_reason.startswith("interrupted"))

    @property
    def undecided(self) -> bool:
        """Recorded as undecided (the interval too wide, or the best far off its record): a rejection that
        claimed nothing either way, so its replay may decide either way without contradicting it."""
        return self.recorded_accepted is False and self.recorded_reason.startswith("undecided")

    @property
    def replayed_undecided(self) -> bool:
        """Undecided here (the interval wider than the noise limit, or the best far off its record): this
        machine could neither confirm nor contradict the recorded verdict."""
        return self.replayed_accepted is False and self.replayed_reason.startswith("undecided")

    @property
    def flipped(self) -> bool:
        """The verdict changed either way (accepted -> rejected, or a decided rejection -> accepted), both
        sides decided."""
        return not self.interrupted and not self.undecided and not self.replayed_undecided and not self.agrees

    @property
    def unconfirmed(self) -> bool:
        """A recorded accept that this machine could not decide: not a flip, not a confirmation."""
        return bool(self.recorded_accepted) and self.replayed_undecided and not self.broken

    @property
    def broken(self) -> bool:
        """A recorded accept that no longer builds or passes its check here."""
        return bool(self.recorded_accepted) and self.replayed_stage in BROKEN_STAGES


class RecordedAttempt(BaseModel):
    number: int
    title: str
    rationale: str = ""
    accepted: bool | None = None
    speedup: float | None = None
    reason: str = ""
    patch: str = ""
    gate_seconds: float | None = None  # the timing cap the recorded decision ran with, when one was asked for


class ReplayPolicy:
    name = "replay"

    def __init__(self, attempts: list[RecordedAttempt], on_row: Callable[[ReplayRow], None] | None = None,
                 gate_seconds: float | None = None):
        self.attempts = attempts
        self.on_row = on_row
        self.gate_seconds = gate_seconds  # overrides every recorded timing cap (a noisy machine needs longer)
        self.rows: list[ReplayRow] = []

    @classmethod
    def from_record(cls, run_dir: Path, on_row: Callable[[ReplayRow], None] | None = None,
                    gate_seconds: float | None = None) -> "ReplayPolicy":
        from agent import records as rec
        from agent.run_state import RunState

        record = rec.RunRecord.open(run_dir)
        attempts = [RecordedAttempt(number=a.number, title=a.title, rationale=a.rationale, accepted=a.accepted,
                                    speedup=a.figures.get("speedup"), reason=a.reason,
                                    patch=record.read_patch(a.number) if record.patch_path(a.number).is_file() else "",
                                    gate_seconds=a.gate_seconds)
                    for a in RunState.fold(record.events()).attempts]
        return cls(attempts, on_row=on_row, gate_seconds=gate_seconds)

    def run(self, ctx: PolicyContext) -> str:
        for a in self.attempts:
            if stop := ctx.stop_reason():
                return stop
            row = ReplayRow(attempt=a.number, title=a.title, recorded_accepted=a.accepted,
                            recorded_speedup=a.speedup, recorded_reason=a.reason)
            applied = ctx.toolbox.call("apply_patch", {"patch": a.patch})
            if not applied.ok:
                row.replayed_accepted, row.replayed_stage, row.replayed_reason = False, "patch", applied.text
                ctx.toolbox.call("revert", {})
            else:
                title = a.title if len(a.title) >= 3 else f"attempt {a.number}: {a.title}"
                args = {"title": title[:200], "rationale": a.rationale[:4000]}
                if self.gate_seconds or a.gate_seconds:
                    args["gate_seconds"] = self.gate_seconds or a.gate_seconds
                res = ctx.toolbox.call("submit", args)
                v = res.data or {}
                row.replayed_accepted, row.replayed_stage = v.get("accepted", False), v.get("stage", "error")
                row.replayed_reason = v.get("reason", res.text)
                row.replayed_speedup, row.replayed_lo, row.replayed_hi = v.get("speedup"), v.get("speedup_lo"), v.get("speedup_hi")
                # follow the recorded path, whatever this gate said: later patches were made on it
                ctx.toolbox.call("adopt" if a.accepted else "revert", {})
            self.rows.append(row)
            if self.on_row:
                self.on_row(row)
        return f"replayed {len(self.rows)} attempts"
