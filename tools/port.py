"""The session port: all that the agent-facing tools (tools/files.py, tools/agent_tools.py) may use of a session.

A session (agent/session.py) or a replay bench implements it; the tools never see the gate, the
workspace or the run record, only this narrow surface. Defined here, on the ground floor, so that
`tools/` depends on nothing in `agent/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tools.task import Task


class SubmitRefused(Exception):
    """A submission the session refuses before any gate stage runs (no attempt is spent), e.g. the
    identical change already judged slower or not faster against the same best; the message says why."""


class Outcome(Protocol):
    """What `submit` answers (the gate's verdict, as far as a tool reads it)."""

    accepted: bool
    stage: str
    reason: str
    speedup: float | None
    speedup_lo: float | None
    speedup_hi: float | None

    def summary(self) -> str:
        """The verdict for the agent: decision, reason, timings, where measured."""


@runtime_checkable
class SessionPort(Protocol):
    @property
    def task(self) -> Task:
        """The trusted task (manifest and spec as of the run's base commit)."""

    @property
    def trusted_dir(self) -> Path:
        """The trusted task folder: harness runs take the spec and reference from here."""

    @property
    def files_root(self) -> Path:
        """The candidate's task folder: what the file tools read and write, what builds compile."""

    @property
    def notes_path(self) -> Path:
        """The agent's notebook (kept across turns)."""

    @property
    def device(self) -> dict | None:
        """The measured device of the baseline (name, driver...), for roofline floors; None before it."""

    def submit(self, title: str, rationale: str = "", knobs: dict[str, Any] | None = None,
               gate_seconds: float | None = None) -> Outcome:
        """Hand the current sources (and knob settings) to the gate; it alone decides. `gate_seconds`:
        this decision's timing cap (default: the session's). SubmitRefused: not judged, no attempt spent."""

    def revert(self) -> str:
        """Restore the candidate folder to the best version; returns its commit."""

    def ledger(self) -> str:
        """One line per attempt so far (verdict, speedup, reason)."""


@runtime_checkable
class BatchPort(SessionPort, Protocol):
    """A session that can judge several candidates against one best (agent/session.py `submit_batch`)."""

    def submit_batch(self, items: list[dict[str, Any]], gate_seconds: float | None = None) -> list:
        """Each item ({title, rationale, knobs}) is the current sources with its knob settings, judged against
        the same best (in parallel where the session has judges for it); the fastest accepted one is
        committed, the other accepted ones are recorded as superseded. Per item: its Outcome, or a string
        saying why it was refused without judging."""
