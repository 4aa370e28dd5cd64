"""`kloop replay`: re-run a recorded session's attempts here and compare the verdicts.

The replay policy (agent/policies/replay.py) re-submits each recorded patch, in order, to a
`ReplayBench`: a scratch stand-in for a session, in a temporary folder, with a gate built from the
run's base commit. Each patch applies on the state the session had when it was made (the base plus
the attempts the session accepted before it). Recorded and replayed verdicts and speedups are shown
side by side with both machines. A recorded accept that no longer builds or passes correctness here
is a failed replay. Nothing is committed and nothing is written to the run record.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from agent import records as rec
from agent.config import RunConfig
from agent.gate import Candidate, Gate, GateConfig, Verdict
from agent.policies.base import Budget, PolicyFacade
from agent.policies.replay import ReplayPolicy, ReplayRow
from agent.workspace import apply_patch_to_folder, export_commit
from tools.agent_tools import SubmitInput, submit_tool
from tools.base import Tool, ToolBox, ToolInput, ToolResult
from tools.build import BuildResult, build
from tools.fmt import device_label
from tools.task import Task

__all__ = ["ReplayBench", "ReplayReport", "ReplayRow", "changed_paths", "replay"]

_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


class ReplayReport(BaseModel):
    run_id: str
    recorded_machine: str
    replay_machine: str = ""
    rows: list[ReplayRow] = []

    @property
    def ok(self) -> bool:
        """Every recorded verdict reproduced: no accept broken, none left undecided here, none flipped."""
        return not any(r.broken or r.flipped or r.unconfirmed for r in self.rows)

    @property
    def contradicted(self) -> bool:
        """A verdict this machine decided the other way, or an accept that is no longer correct here."""
        return any(r.broken or r.flipped for r in self.rows)

    def counts(self) -> dict[str, int]:
        rows = self.rows
        return {
            "attempts": len(rows),
            "agree": sum(1 for r in rows if not r.interrupted and r.agrees),
            "accepted -> rejected": sum(1 for r in rows if r.flipped and r.recorded_accepted),
            "rejected -> accepted": sum(1 for r in rows if r.flipped and not r.recorded_accepted),
            "no longer correct": sum(1 for r in rows if r.broken),
            "accepted, undecided here": sum(1 for r in rows if r.unconfirmed),
            "interrupted (not compared)": sum(1 for r in rows if r.interrupted),
        }


def changed_paths(patch: str) -> list[str]:
    paths = set()
    for a, b in _DIFF_PATH.findall(patch):
        paths.update(p for p in (a, b) if p != "/dev/null")
    return sorted(paths)


def _export(repo: Path, commit: str, subdir: str, dest: Path) -> Path:
    """The files of `subdir` at `commit`, written under dest/subdir (paths as in the repository)."""
    return export_commit(repo, commit, dest, subdir, keep_paths=True)


def _apply(state_root: Path, patch: str) -> str | None:
    return apply_patch_to_folder(state_root, patch)


# ---- the bench: a session stand-in the replay policy acts on through tools ------------------------

class PatchInput(ToolInput):
    patch: str = Field(description="A git diff against the current best, paths relative to the repository root.")


class NoInput(ToolInput):
    pass


class ReplayBench:
    """The base and the recorded path so far (`state`), one candidate on top of it, and the gate.

    Implements `tools.port.SessionPort` for the tools it offers: apply_patch, submit (judges, commits
    nothing), adopt (the candidate becomes the state) and revert (the candidate is dropped)."""

    def __init__(self, tmp: Path, repo: Path, info: rec.RunInfo | None, gate_config: GateConfig,
                 base_commit: str | None = None, task_rel: str | None = None):
        """The base and the task folder come from `info` (a run record), or are given (`kloop audit` of a
        branch without its record)."""
        base_commit = base_commit or info.base_commit
        task_rel = task_rel if task_rel is not None else info.task_rel
        self._tmp = tmp
        self._rel = task_rel
        self._trusted = _export(repo, base_commit, task_rel, tmp / "trusted")
        self._state = tmp / "state"
        _export(repo, base_commit, task_rel, self._state)
        self._gate = Gate(self._trusted, task_rel, gate_config)
        self._best: BuildResult = build(self._gate.task, src_root=self._in_task(self._state))
        # how far `submit` judges (Gate.evaluate's `upto`): "timing" (everything), "check" or "audit"
        self.upto = "timing"
        self._cand: Path | None = None
        self._changed: list[str] = []
        self._last: Verdict | None = None
        self._n = 0
        self.machine = ""  # where this replay measured (from the first verdict with a device)
        self.budget = Budget()
        self.notes_path = tmp / "notes.md"
        self.toolbox = ToolBox(context=self)
        self.toolbox.add(Tool("apply_patch", "Apply a recorded patch on the best (a fresh candidate).", PatchInput, _apply_patch_tool))
        self.toolbox.add(Tool("submit", "Judge the candidate with the gate (nothing is committed).", SubmitInput, submit_tool))
        self.toolbox.add(Tool("adopt", "Make the candidate the best, whatever the gate said (follow the recorded path).", NoInput, _adopt_tool))
        self.toolbox.add(Tool("revert", "Drop the candidate.", NoInput, _revert_tool))

    def _in_task(self, root: Path) -> Path:
        return root / self._rel if self._rel not in ("", ".") else root

    # -- SessionPort ---------------------------------------------------------------------------
    @property
    def task(self) -> Task:
        return self._gate.task

    @property
    def trusted_dir(self) -> Path:
        return self._trusted

    @property
    def files_root(self) -> Path:
        return self._in_task(self._cand or self._state)

    @property
    def device(self) -> dict | None:
        return None

    @property
    def gate(self) -> Gate:
        return self._gate

    @property
    def best_builds(self) -> bool:
        return self._best.ok

    def apply_patch(self, patch: str, changed: list[str] | None = None) -> str | None:
        """A fresh candidate: the state with `patch` applied. `changed` (default: the patch's paths) is
        what the gate's scope rule sees (`kloop audit` applies only the task folder's part of a commit
        and names every path the commit changed)."""
        self.revert()
        self._n += 1
        self._cand = self._tmp / f"cand{self._n:03d}"
        shutil.copytree(self._state, self._cand, symlinks=True)
        self._changed = list(changed) if changed is not None else changed_paths(patch)
        return _apply(self._cand, patch)

    def submit(self, title: str, rationale: str = "", knobs: dict[str, Any] | None = None,
               gate_seconds: float | None = None) -> Verdict:
        if not self._best.ok and self.upto == "timing":
            self._last = Verdict(accepted=False, stage="build", reason="the best does not build here")
            return self._last
        v = self._gate.evaluate(Candidate(self.files_root, self._changed), self._best, max_seconds=gate_seconds,
                                upto=self.upto)
        if v.device and not self.machine:
            self.machine = v.device.label() + (f"; {v.build.compiler}" if v.build else "")
        self._last = v
        return v

    def adopt(self) -> None:
        if self._cand is None:
            return
        shutil.rmtree(self._state)
        self._cand.rename(self._state)
        self._cand = None
        built = self._last.build if self._last is not None else None
        self._best = built if built is not None and built.ok else build(self._gate.task, src_root=self._in_task(self._state))

    def revert(self) -> str:
        if self._cand is not None:
            shutil.rmtree(self._cand, ignore_errors=True)
            self._cand = None
        self._last = None
        return "state"

    def ledger(self) -> str:
        return ""

    # -- what PolicyFacade asks of a session ---------------------------------------------------
    def system_prompt(self) -> str:
        return ""

    def briefing(self) -> str:
        return ""

    def memory(self) -> str:
        return ""

    def attempts_made(self) -> int:
        return self._n

    def events(self) -> list:
        return []  # a replay writes no record

    def stop_reason(self) -> str | None:
        return None

    def log(self, kind: str, **data: Any) -> None:
        pass  # a replay writes no run record


def _apply_patch_tool(ctx: ReplayBench, args: PatchInput) -> ToolResult:
    error = ctx.apply_patch(args.patch)
    if error:
        return ToolResult(ok=False, text=f"patch does not apply: {error}")
    return ToolResult(text="applied")


def _adopt_tool(ctx: ReplayBench, args: NoInput) -> ToolResult:
    ctx.adopt()
    return ToolResult(text="the candidate is the new best")


def _revert_tool(ctx: ReplayBench, args: NoInput) -> ToolResult:
    ctx.revert()
    return ToolResult(text="candidate dropped")


def replay(run_dir: Path, repo: Path | None = None, gate_config: GateConfig | None = None, on_row=None,
           gate_seconds: float | None = None) -> ReplayReport:
    record = rec.RunRecord.open(run_dir)
    info = record.info
    repo = Path(repo or info.repo_root)
    report = ReplayReport(run_id=info.run_id, recorded_machine=_machine(info.machine, info.versions))
    policy = ReplayPolicy.from_record(run_dir, on_row=on_row, gate_seconds=gate_seconds)
    with tempfile.TemporaryDirectory(prefix="kloop-replay-") as tmp:
        bench = ReplayBench(Path(tmp), repo, info, gate_config or RunConfig.from_info(info, where=str(Path(run_dir) / "run.json")).gate)
        policy.run(PolicyFacade(bench))
        report.replay_machine = bench.machine
    report.rows = policy.rows
    return report


def _machine(machine: dict, versions) -> str:
    compiler = getattr(versions, "compiler", None)
    return device_label(machine, clocks=False) + (f", {compiler}" if compiler else "")
