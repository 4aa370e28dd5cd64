"""`kloop replay`: re-run a recorded session's attempts here and compare the verdicts.

Each recorded attempt's patch is applied, in order, on the state the session had when it was made
(the base plus the attempts the session accepted before it), and the gate runs again on this
machine. Recorded and replayed verdicts and speedups are shown side by side with both machines. A
recorded accept that no longer builds or passes correctness here is a failed replay.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel

from agent import records as rec
from agent.gate import Candidate, Gate, GateConfig
from agent.session import attempts_from_events
from agent.workspace import apply_patch_to_folder, export_commit
from tools.build import build

_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


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
    def broken(self) -> bool:
        """A recorded accept that no longer builds or passes its check here."""
        return bool(self.recorded_accepted) and self.replayed_stage in ("build", "check", "scope", "static", "patch")


class ReplayReport(BaseModel):
    run_id: str
    recorded_machine: str
    replay_machine: str = ""
    rows: list[ReplayRow] = []

    @property
    def ok(self) -> bool:
        return not any(r.broken for r in self.rows)


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


def replay(run_dir: Path, repo: Path | None = None, gate_config: GateConfig | None = None, on_row=None) -> ReplayReport:
    record = rec.RunRecord.open(run_dir)
    info = record.info
    repo = Path(repo or info.repo_root)
    attempts = attempts_from_events(record.events())
    report = ReplayReport(run_id=info.run_id, recorded_machine=_machine(info.machine, info.versions))
    with tempfile.TemporaryDirectory(prefix="kloop-replay-") as tmp:
        tmp = Path(tmp)
        trusted = _export(repo, info.base_commit, info.task_rel, tmp / "trusted")
        state_root = tmp / "state"
        state_task = _export(repo, info.base_commit, info.task_rel, state_root)
        gate = Gate(trusted, info.task_rel, gate_config or GateConfig(**(info.config or {}).get("gate", {})))
        best = build(gate.task, src_root=state_task)
        for a in attempts:
            row = ReplayRow(attempt=a.number, title=a.title, recorded_accepted=a.accepted,
                            recorded_speedup=a.figures.get("speedup"), recorded_reason=a.reason)
            patch = record.read_patch(a.number) if record.patch_path(a.number).is_file() else ""
            cand_build = None
            cand_root = tmp / f"cand{a.number:03d}"
            shutil.copytree(state_root, cand_root, symlinks=True)
            cand_task = cand_root / info.task_rel if info.task_rel not in ("", ".") else cand_root
            error = _apply(cand_root, patch)
            if error:
                row.replayed_accepted, row.replayed_stage, row.replayed_reason = False, "patch", f"patch does not apply: {error}"
            elif not best.ok:
                row.replayed_accepted, row.replayed_stage, row.replayed_reason = False, "build", "the best does not build here"
            else:
                v = gate.evaluate(Candidate(cand_task, changed_paths(patch)), best)
                row.replayed_accepted, row.replayed_stage, row.replayed_reason = v.accepted, v.stage, v.reason
                row.replayed_speedup, row.replayed_lo, row.replayed_hi = v.speedup, v.speedup_lo, v.speedup_hi
                if v.device and not report.replay_machine:
                    report.replay_machine = v.device.label() + (f"; {v.build.compiler}" if v.build else "")
                cand_build = v.build
            if a.accepted and not error:  # follow the recorded path
                shutil.rmtree(state_root)
                cand_root.rename(state_root)
                best = cand_build if cand_build is not None and cand_build.ok else build(gate.task, src_root=state_task)
            else:
                shutil.rmtree(cand_root, ignore_errors=True)
            report.rows.append(row)
            if on_row:
                on_row(row)
    return report


def _machine(machine: dict, versions) -> str:
    name = machine.get("name") or "unknown device"
    parts = [name]
    if machine.get("driver"):
        parts.append(f"driver {machine['driver']}")
    if getattr(versions, "compiler", None):
        parts.append(versions.compiler)
    return ", ".join(parts)
