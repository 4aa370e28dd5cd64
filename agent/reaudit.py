"""`kloop audit RUN|BRANCH`: today's gate over the commits a session's gate accepted.

Each commit of the session branch (`base..kloop/<run-id>`, oldest first) is judged again, against its
parent as the best, by the gate as it is now: scope of the commit's diff, static rules, build, audit
of what was built, check on fresh secret seeds (the task's adversarial check shapes included), and,
unless `--no-timing`, paired timing with its integrity layers (timed-output re-checks, physics floor,
escape/cold probes, the best against its recorded time), then, where the task declares one and
unless `--no-e2e`, its end-to-end training check (tools/e2e.py; whatever its `when`, and after `--no-timing`'s
check too: an audit is what runs before an export). A commit that fails any of these would now be rejected. The gain is re-judged with today's estimate (the workload's time ratio, tools/stats.py)
and counted apart: a commit whose gain does not hold here is one whose whole interval (at the gate's
first-look level, so an honest commit is flagged by noise at most that often) lies at or below
1 + min_gain, or whose shape regressed beyond its allowance: a statistics hole found later (a kernel
that moved work between calls, say) shows up in old runs too. A gain that is merely not reproduced
(an interval that straddles the threshold, or "undecided") is shown, never counted: the machine may
differ from the one that accepted it.

The run record, when there is one, gives the repository, the base commit, the task folder and the
gate's settings; a branch without its record is read from its commits' trailers (the oldest commit
carrying this run's `Kloop-Run` is the first one, its parent the base) and the task from the files
it changed (the nearest folder with a `task.toml` at the base). The commits are read with git and
judged in a temporary folder through the replay bench (agent/replay.py: the trusted task exported
from the base commit, each commit's diff applied on its parent's state); nothing is written to the
repository, its checkout, its branches or the run record.

A CUDA task on a machine without a GPU is audited up to what can run here (scope, static rules,
build, audit), and the report says that check and timing were not run.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, Field

from agent.gate import GateConfig, Verdict
from agent.trailers import parse_trailers
from agent.workspace import (WorkspaceError, commit_changes, commit_diff, commit_log, commit_parent, file_at,
                             find_repo, resolve_commit)

LAYERS = ("scope", "static", "build", "audit", "check", "timing", "e2e")
OK, FAIL, NOT_RUN = "ok", "FAIL", "not run"


class AuditInputError(Exception):
    """The run or branch cannot be audited as given (no such run, branch or base): bad input."""


class AuditRow(BaseModel):
    commit: str
    title: str
    attempt: int | None = None  # Kloop-Attempt of the commit (None: not made by the gate)
    gate_commit: bool = True  # carries kloop's evidence trailers
    recorded_speedup: float | None = None
    stages: dict[str, str] = Field(default_factory=dict)  # layer -> ok | FAIL | not run
    rejected: bool = False  # some layer of today's gate fails
    reason: str = ""  # why it would be rejected ('' when it would not)
    gain: str = "not timed"  # the speedup measured here, as text
    gain_reproduced: bool | None = None  # accepted by today's gate here; False: not faster; None: not timed/undecided
    gain_holds: bool | None = None  # False: the gain does not hold here (counted; see the module docstring)
    speedup: float | None = None
    speedup_lo: float | None = None
    speedup_hi: float | None = None
    verdict_stage: str = ""
    verdict_reason: str = ""
    e2e: str = ""  # the e2e check's summary line, when it ran (tools/e2e.summary)
    note: str = ""  # what was not run and why, a commit not made by the gate


class AuditReport(BaseModel):
    run_id: str
    branch: str
    repo: str
    base: str
    task_rel: str
    source: str  # "run record" or "branch trailers"
    upto: str = "timing"  # how far the gate ran: timing, check or audit
    not_run: str = ""  # why check/timing were not run, if they were not
    machine: str = ""
    rows: list[AuditRow] = Field(default_factory=list)

    @property
    def rejected(self) -> list[AuditRow]:
        return [r for r in self.rows if r.rejected]

    @property
    def gain_not_held(self) -> list[AuditRow]:
        return [r for r in self.rows if r.gain_holds is False]

    def summary(self) -> str:
        said = f"{len(self.rejected)} of {len(self.rows)} accepted commits would now be rejected"
        said += " by the layers run here" if self.not_run else ""
        if self.upto == "timing":
            said += f"; {len(self.gain_not_held)} whose gain does not hold here"
        return said


@dataclass
class AuditTarget:
    repo: Path
    branch: str
    base: str
    task_rel: str
    run_id: str
    gate_config: GateConfig
    source: str
    recorded: set[str] | None = None  # commits the run record says its gate accepted (None: no record)


# ---- what to audit -------------------------------------------------------------------------------

def target_from_run(run_dir: Path, repo: Path | None = None) -> AuditTarget:
    """A run record: its repository (or `repo`), branch, base commit, task folder and gate settings."""
    from agent.config import RunConfig, RunConfigError
    from agent.records import RecordError, RunRecord

    try:
        record = RunRecord.open(run_dir)
        info = record.info
        recorded = {e.commit for e in record.events() if e.kind == "committed"}
    except RecordError as exc:
        raise AuditInputError(str(exc)) from None
    try:
        gate = RunConfig.from_info(info, where=str(Path(run_dir) / "run.json")).gate
    except RunConfigError as exc:
        raise AuditInputError(str(exc)) from None
    root = Path(repo) if repo else Path(info.repo_root)
    repo_root = find_repo(root) if root.exists() else None
    if repo_root is None:
        raise AuditInputError(f"run {info.run_id}: its repository {root} is not a git repository here (pass --repo)")
    _need_commit(repo_root, info.branch, f"run {info.run_id}: its branch {info.branch!r} is not in {repo_root} (pass --repo)")
    _need_commit(repo_root, info.base_commit, f"run {info.run_id}: its base commit {info.base_commit[:12]} is not in {repo_root}")
    return AuditTarget(repo_root, info.branch, resolve_commit(repo_root, info.base_commit), info.task_rel,
                       info.run_id, gate, "run record", recorded)


def target_from_branch(repo: Path, branch: str, runs_roots: list[Path]) -> AuditTarget:
    """A session branch `kloop/<run-id>` in `repo`: from its run record when one of `runs_roots` holds
    it, else from the commits' trailers and the task folder they changed."""
    repo_root = find_repo(Path(repo)) if Path(repo).exists() else None
    if repo_root is None:
        raise AuditInputError(f"{repo} is not inside a git repository (pass --repo)")
    run_id = branch.removeprefix("kloop/")
    try:
        tip = resolve_commit(repo_root, branch)
    except WorkspaceError:
        # a shipped task's session branch lives in kloop's copy of the task (<runs>/_tasks/<name>), not in
        # the checkout it was started from: its record names that repository
        record = next((Path(r) / run_id for r in runs_roots if (Path(r) / run_id / "run.json").is_file()), None)
        if record is None:
            raise AuditInputError(f"no branch {branch!r} in {repo_root}, and no run record {run_id!r} in "
                                  + ", ".join(str(r) for r in runs_roots)) from None
        found = target_from_run(record)
        if found.branch != branch:
            raise AuditInputError(f"no branch {branch!r} in {repo_root} (run {run_id}'s record names {found.branch!r})")
        return found
    for root in runs_roots:
        if (Path(root) / run_id / "run.json").is_file():
            found = target_from_run(Path(root) / run_id, repo_root)
            if found.branch == branch:
                return found
    commits = commit_log(repo_root, tip)
    ours = [i for i, c in enumerate(commits) if _trailers(c.message).get("Kloop-Run") == run_id]
    if not ours:  # a branch renamed since: any commit the gate made
        ours = [i for i, c in enumerate(commits) if "Kloop-Attempt" in _trailers(c.message)]
    if not ours:
        raise AuditInputError(f"{branch} in {repo_root}: no run record found and no commit carries kloop's trailers "
                              "(Kloop-Run, Kloop-Attempt): cannot tell where the session started")
    first = commits[ours[0]]
    base = commit_parent(repo_root, first.sha)
    if base is None:
        raise AuditInputError(f"{branch}: its first kloop commit {first.sha[:12]} has no parent (no base to judge against)")
    task_rel = _task_folder(repo_root, base, commit_changes(repo_root, base, first.sha))
    if task_rel is None:
        raise AuditInputError(f"{branch}: no folder holding a task.toml at the base {base[:12]} contains the files "
                              f"its first kloop commit {first.sha[:12]} changed")
    return AuditTarget(repo_root, branch, base, task_rel, run_id, GateConfig(), "branch trailers")


def _need_commit(repo: Path, rev: str, message: str) -> str:
    try:
        return resolve_commit(repo, rev)
    except WorkspaceError:
        raise AuditInputError(message) from None


def _trailers(message: str) -> dict[str, str]:
    return dict(parse_trailers(message))


def _task_folder(repo: Path, commit: str, paths: list[str]) -> str | None:
    """The nearest folder above one of `paths` that holds a task.toml in `commit` ('.' for the root)."""
    for path in paths:
        parts = path.split("/")[:-1]
        while True:
            folder = "/".join(parts)
            if file_at(repo, commit, f"{folder}/task.toml" if folder else "task.toml"):
                return folder or "."
            if not parts:
                break
            parts.pop()
    return None


# ---- judging ---------------------------------------------------------------------------------------

def runnable_upto(target: str, no_timing: bool) -> tuple[str, str]:
    """How far the gate can run here, and why not further ('' when as far as asked)."""
    if target in ("cuda", "triton"):
        from tools.device import gpu_available

        if not gpu_available():
            return "audit", "no CUDA GPU on this machine: check and timing were not run (scope, static rules, build and audit were)"
    if no_timing:
        return "check", "--no-timing: timing and its integrity layers were not run"
    return "timing", ""


def audit(target: AuditTarget, no_timing: bool = False, seconds: float | None = None,
          on_row: Callable[[AuditRow], None] | None = None, e2e: bool = True) -> AuditReport:
    """Today's gate over every commit of `base..branch`, each against its parent (see the module docstring)."""
    from agent.replay import ReplayBench, _export
    from tools.task import TaskError, load_task

    commits = commit_log(target.repo, f"{target.base}..{target.branch}")
    report = AuditReport(run_id=target.run_id, branch=target.branch, repo=str(target.repo), base=target.base,
                         task_rel=target.task_rel, source=target.source)
    with tempfile.TemporaryDirectory(prefix="kloop-audit-") as tmp:
        try:  # the trusted task, as of the base commit
            task = load_task(_export(target.repo, target.base, target.task_rel, Path(tmp) / "probe"))
        except (WorkspaceError, TaskError) as exc:
            raise AuditInputError(f"{target.branch}: the task at the base {target.base[:12]}: {exc}") from None
        upto, not_run = runnable_upto(task.target, no_timing)
        report.upto, report.not_run = upto, not_run
        config = target.gate_config.model_copy(update={
            "e2e": False,  # run below on every commit that passes, whatever the task's `when` says
            **({"max_seconds": seconds} if seconds is not None else {}),
            **({"standby": False} if upto != "timing" or not commits else {})})
        bench = ReplayBench(Path(tmp) / "bench", target.repo, None, config, base_commit=target.base, task_rel=target.task_rel)
        try:
            for c in commits:
                row = _audit_commit(bench, target, c, upto, e2e and task.manifest.e2e is not None)
                if not report.machine and row.verdict_stage and bench.machine:
                    report.machine = bench.machine
                report.rows.append(row)
                if on_row is not None:
                    on_row(row)
        finally:
            bench.gate.close()
    return report


def _audit_commit(bench, target: AuditTarget, c, upto: str, e2e: bool = False) -> AuditRow:
    trailers = _trailers(c.message)
    attempt = trailers.get("Kloop-Attempt")
    row = AuditRow(commit=c.sha, title=c.summary, attempt=int(attempt) if attempt and attempt.isdigit() else None,
                   gate_commit="Kloop-Attempt" in trailers, recorded_speedup=_float(trailers.get("Kloop-Speedup")))
    notes = [] if row.gate_commit else ["no kloop trailers: this commit was not made by the gate"]
    if target.recorded is not None and c.sha not in target.recorded:
        notes.append("the run record has no accepted verdict committed as this commit")
    parent = commit_parent(target.repo, c.sha) or target.base
    changed = commit_changes(target.repo, parent, c.sha)
    # the task folder's part of the commit is applied; the scope rule sees every path it changed
    error = bench.apply_patch(commit_diff(target.repo, parent, c.sha, target.task_rel), changed)
    if error:  # the state follows the branch, so this means a history the audit cannot follow
        row.stages = dict.fromkeys(LAYERS, NOT_RUN)
        row.rejected, row.reason = True, f"its diff does not apply on its parent's task folder: {error.strip()[:300]}"
        bench.revert()
        return row
    used = upto  # what was not run everywhere is said once (AuditReport.not_run), not on every row
    if used == "timing" and not bench.best_builds:
        used = "check"
        notes.append("the parent does not build here: timing not run")
    bench.upto = used
    v = bench.submit(c.summary)
    _classify(row, v, bench.gate, used)
    # after the check at least (with --no-timing too: export runs that way, and the e2e check is what a
    # kernel inside every per-call tolerance that still biases training meets)
    if e2e and not row.rejected and used in ("check", "timing") and v.build is not None and v.build.ok and v.build.lib:
        _e2e(row, bench.gate, v.build.lib)
    row.note = "; ".join(notes)
    bench.adopt()  # the next commit is judged against this one, as on the branch
    return row


def _classify(row: AuditRow, v: Verdict, gate, upto: str) -> None:
    """Which of today's layers pass, and the first that fails."""
    stages = dict.fromkeys(LAYERS, NOT_RUN)
    row.verdict_stage, row.verdict_reason = v.stage, v.reason
    failed, reason = None, v.reason
    order = list(LAYERS)

    def upto_layer(name: str) -> None:
        for layer in order[:order.index(name)]:
            stages[layer] = OK
        stages[name] = FAIL

    if v.stage in ("scope", "static", "check"):
        failed = v.stage
    elif v.stage == "build":
        failed = "audit" if v.build is not None and v.build.ok else "build"
    elif v.stage == "partial":
        for layer in order[:order.index("check" if upto == "check" else "audit") + 1]:
            stages[layer] = OK
    elif v.stage == "interrupted":
        failed = "check"
    else:  # timing, undecided, accepted: the check passed; the integrity layers first, the gain apart
        problem = gate.integrity_problem(v.ab) if v.ab is not None else ("timing", v.reason)
        if problem is not None:
            failed, reason = "timing", problem[1]
        else:
            for layer in order[:order.index("timing") + 1]:
                stages[layer] = OK
            _gain(row, v)
    if failed is not None:
        upto_layer(failed)
        row.rejected, row.reason = True, reason
    row.stages = stages


def _e2e(row: AuditRow, gate, lib: str) -> None:
    """The task's e2e training check of the commit's build (a fresh judge and seed)."""
    from tools.e2e import summary

    res, _ = gate.run_e2e(lib)
    if res.e2e is None:
        row.stages["e2e"], row.e2e = FAIL, f"did not complete: {res.error}"
    else:
        row.stages["e2e"], row.e2e = (OK if res.e2e.passed else FAIL), summary(res.e2e)
    if row.stages["e2e"] == FAIL:
        row.rejected, row.reason = True, f"e2e: {row.e2e}"


def _gain(row: AuditRow, v: Verdict) -> None:
    """The gain as today's estimate sees it: holds (accepted), does not hold (counted: the whole
    interval at or below 1 + min_gain, or a regression), or not reproduced / undecided (shown only)."""
    row.speedup, row.speedup_lo, row.speedup_hi = v.speedup, v.speedup_lo, v.speedup_hi
    measured = f"x{_n(v.speedup)} [{_n(v.speedup_lo)}, {_n(v.speedup_hi)}]"
    recorded = f"; recorded x{row.recorded_speedup:.3f}" if row.recorded_speedup else ""
    needed = 1 + (v.min_gain or 0.0)
    below = isinstance(v.speedup_hi, (int, float)) and v.speedup_hi <= needed
    if v.accepted:
        row.gain, row.gain_reproduced, row.gain_holds = measured + recorded, True, True
    elif v.stage == "undecided":
        row.gain, row.gain_reproduced = f"undecided (noisy machine): {measured}{recorded}", None
    elif v.reason.startswith("regression beyond"):
        row.gain, row.gain_reproduced, row.gain_holds = f"gain does not hold: a regression ({measured}){recorded}", False, False
    elif below:
        row.gain, row.gain_reproduced, row.gain_holds = (
            f"gain does not hold: the whole interval at or below x{needed:.3f} ({measured}){recorded}", False, False)
    else:
        row.gain, row.gain_reproduced = f"gain not reproduced ({measured}){recorded}", False


def _n(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "?"


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None
