"""One optimisation session: a worktree on its own branch, a run record, the gate, and a policy.

Only `submit` moves the branch, and only when the gate accepts. Every step is recorded before it
takes effect (write-ahead): `attempt_started` (with the patch on disk) before the gate runs,
`verdict` before the commit, `committed` after it. `resume` reads the record back and repairs
whatever a kill left half-done, without losing an accepted commit or landing an unaccepted one.
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import records as rec
from agent.config import RunConfig, RunConfigError
from agent.gate import Candidate, Gate, GateConfig, Verdict
from agent.policies.base import Budget, PolicyFacade
from tools.task import KNOBS_FILE, Task, load_task
from agent.trailers import format_commit_message, parse_trailers, trailer_key
from agent.locations import WORKTREES, default_runs_root, is_shipped_task, prepare_runs_root, task_repo_for
from agent.run_state import Attempt, RunState, budget_stop, stop_code
from agent.runlock import RunLock
from agent.workspace import Workspace, WorkspaceError
from tools.agent_tools import session_toolbox
from tools.base import ToolBox
from tools.build import BuildResult, code_digest
from tools.fmt import device_label, fmt_ms, fmt_num, kernel_names, real
from tools.knob_edits import knob_define_edits, knob_edit_advice, knob_edit_note
from tools.port import SubmitRefused
from tools.sandbox import SandboxStatus, SandboxUnavailable, require as require_sandbox_here, status as sandbox_status


class SessionError(Exception):
    pass


class StopNow(KeyboardInterrupt):
    """A second Ctrl-C (or SIGTERM after a first): stop at once; the running worker is killed."""


INTERRUPTED = "interrupted"
INTERRUPT_ACK = "stopping after the current step; Ctrl-C again to stop now"


@dataclass
class StageEvent:
    """Live progress from inside one gate evaluation (not recorded: the verdict holds the figures)."""

    stage: str  # build, check, timing
    state: str  # started, finished
    attempt: int | None = None  # None: the baseline
    ok: bool | None = None
    seconds: float | None = None
    kind: str = "stage"


def accepts_since_e2e(attempts: list[Attempt]) -> int:
    """Accepted attempts since the last one whose verdict ran the e2e check."""
    n = 0
    for a in attempts:
        if a.accepted and a.figures.get("e2e"):
            n = 0
        elif a.accepted:
            n += 1
    return n


def judged_against(attempts: list[Attempt], base_commit: str) -> dict[int, str]:
    """attempt number -> the best it was judged against (recorded, or for older runs: the last
    accepted commit before it, from the base)."""
    best_at: dict[int, str] = {}
    best = base_commit
    for a in attempts:
        best_at[a.number] = a.best_commit or best
        if a.accepted and a.commit:
            best = a.commit
    return best_at


def timed_looks(events: list, best_commit: str, base_commit: str) -> int:
    """How many timed decisions the run record holds against `best_commit`: each one spent from that
    best's error budget (tools/stats.look_alpha), whatever process made it (the loop, `kloop submit`,
    MCP, a resumed run). A decision is timed once its timing started (its verdict has a timing seed),
    whatever it concluded. (Read through RunState.)"""
    attempts = RunState.fold(events).attempts
    best_at = judged_against(attempts, base_commit)
    return sum(1 for a in attempts if best_at[a.number] == best_commit and a.figures.get("timing_seed") is not None)


def recorded_best_times(events: list, commit: str, base_commit: str) -> dict[str, float]:
    """The per-shape seconds per call `commit` had by the gate's own method (paired, flushed timing): the
    accepted verdict committed as it (the candidate's times there), else the first timed decision
    judged against it (the best's times there). {} when the record has none. The gate compares the best's
    time in every later decision with these (sabotage of the best), in whichever process decides.
    Never the quick bench's medians: another method (other sample sizes, calls per sample, input sets),
    whose 13 us shape on the H200 read far faster than the gate's paired time of the same build, so
    every decision against a baseline was called "best slower than its baseline" (2026-12-03)."""
    attempts = RunState.fold(events).attempts
    for a in attempts:
        if a.accepted and a.commit == commit:
            return _shape_times(a.figures, "time_b")
    best_at = judged_against(attempts, base_commit)
    for a in attempts:
        if best_at[a.number] == commit and a.figures.get("timing_seed") is not None:
            times = _shape_times(a.figures, "time_a")
            if times:
                return times
    return {}


def _shape_times(figures: dict, side: str) -> dict[str, float]:
    shapes = (figures.get("ab") or {}).get("shapes") or []
    return {str(s["shape"]): float(s[side]) for s in shapes
            if isinstance(s, dict) and s.get("shape") and isinstance(s.get(side), (int, float)) and s[side] > 0}


def _sandbox_status(required: bool) -> SandboxStatus:
    """What isolates untrusted code on this host; SessionError when it is required and missing."""
    if required:
        try:
            return require_sandbox_here()
        except SandboxUnavailable as exc:
            raise SessionError(str(exc)) from None
    return sandbox_status()


def _versions(compiler: str | None, device=None) -> rec.Versions:
    import platform

    import torch

    from agent import __version__

    return rec.Versions(kloop=__version__, python=platform.python_version(), torch=torch.__version__,
                        compiler=compiler, driver=getattr(device, "driver", None), cuda=getattr(device, "cuda_runtime", None))


class Session:
    """The state of a session and the context its policy and tools act through."""

    def __init__(self, record: rec.RunRecord, ws: Workspace, gate: Gate, budget: Budget, gate_config: GateConfig):
        self.record = record
        self.ws = ws
        self.gate = gate
        self.budget = budget
        self.gate_config = gate_config
        # the manifest and spec are the base commit's (runs/<id>/trusted/), never the worktree's: an
        # agent that breaks its task.toml can still run every session command, revert included
        self.trusted_task: Task = gate.task
        self.notes_path = record.dir / "notes.md"
        self.best_commit = ws.head()
        self.best_build: BuildResult | None = None
        self.baseline: dict[str, Any] = {}
        self.port = SessionTools(self)
        self.toolbox: ToolBox = session_toolbox(self.port)  # every agent tool, bound to the port
        self.started = time.monotonic()
        self.interrupted: str | None = None
        self.killed: str | None = None  # the evaluation a second Ctrl-C killed (None: none was running)
        self.on_event = None  # called with each event after it is recorded (live progress display)
        self.on_interrupt = None  # called with the acknowledgement of a first Ctrl-C (else: stderr)
        self.repairs: list[str] = []  # what `repair` fixed after a kill, for people
        self.spent_before = RunState()  # the record as it was when this process attached (resume: what was spent)
        self.current_attempt: int | None = None
        self._build_shown: int | None = None  # the attempt whose build progress was shown (submit's pre-build)
        self.discarded = False  # the run was removed whole (its baseline failed)
        gate.on_stage = self._on_stage
        gate.accepts_since_e2e = accepts_since_e2e(self.attempts())  # `every:N` counts across a resume
        self.lock: RunLock | None = None  # one process per run: held from start/resume to the end of run()
        self.sandbox: SandboxStatus | None = None  # what isolates untrusted code here (known once opened)
        self.pool = None  # agent/parallel.py JudgePool for submit_batch (None: the session's own gate, serially)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def start(cls, task_path: Path, policy: str, budget: Budget, runs_root: Path | None = None,
              allow_dirty: bool = False, config: dict | None = None, gate_config: GateConfig | None = None) -> "Session":
        task = load_task(task_path)
        gate_config = gate_config or GateConfig()
        sandbox = _sandbox_status(gate_config.require_sandbox)  # before anything is created
        run_config = RunConfig(policy=policy, options={k: v for k, v in (config or {}).items() if v is not None},
                               budget=budget, gate=gate_config)
        runs_root = prepare_runs_root(runs_root or default_runs_root(task.root))
        if is_shipped_task(task.root):  # kloop's own files are never the session's repository
            task = load_task(task_repo_for(task.root, runs_root))
        run_id = rec.new_run_id(task.name)
        run_dir = runs_root / run_id
        ws = Workspace.create(task.root, run_id, worktrees_root=runs_root / WORKTREES, allow_dirty=allow_dirty)
        info = rec.RunInfo(
            run_id=run_id, task=task.name, task_rel=ws.task_rel, task_path=task.root, policy=policy,
            config=run_config.to_record(),
            base_commit=ws.base_commit, branch=ws.branch, repo_root=ws.repo_root, worktree=ws.path,
            versions=_versions(None), sandbox=sandbox.as_dict(),
        )
        record = rec.RunRecord.create(runs_root, info)
        lock, _ = RunLock.take(record.dir)
        try:
            trusted = run_dir / "trusted"
            ws.export_tree(ws.base_commit, trusted, subdir=None if ws.task_rel == "." else ws.task_rel)
            session = cls(record, ws, Gate(trusted, ws.task_rel, gate_config), budget, gate_config)
            session.lock = lock
            session.log("session_started")
            session._say_sandbox(sandbox)
        except BaseException:
            lock.release()
            raise
        return session

    @classmethod
    def open(cls, run_dir: Path, budget: Budget | None = None, lock: bool = True,
             require_sandbox: bool = False) -> "Session":
        """Attach to a recorded session as it is: nothing is repaired, restored or logged (but a note
        when a dead holder's lock was taken over). The shell's session commands attach once per
        command and must keep the agent's edits. With `lock` the run's lock is taken (RunLocked when
        another live process holds it); without it, the session is for reading only."""
        record = rec.RunRecord.open(run_dir)
        held, note = RunLock.take(record.dir) if lock else (None, None)
        try:
            info = record.info
            ws = Workspace.open(info.repo_root, info.run_id, Path(info.worktree).parent, info.task_rel, info.base_commit)
            try:
                run_config = RunConfig.from_info(info, where=str(record.dir / "run.json"))
            except RunConfigError as exc:
                raise SessionError(str(exc)) from None
            gate_config = run_config.gate
            if require_sandbox:
                gate_config = gate_config.model_copy(update={"require_sandbox": True})
            sandbox = _sandbox_status(gate_config.require_sandbox)
            total = budget or run_config.budget
            session = cls(record, ws, Gate(record.dir / "trusted", ws.task_rel, gate_config), total, gate_config)
            session.spent_before = RunState.fold(record.events())  # budgets are totals for the run: run_state.py
            session.lock = held
            session.sandbox = sandbox
            if note:
                session.log("note", text=note, data={"lock": "taken over"})
        except BaseException:
            if held is not None:
                held.release()
            raise
        return session

    @classmethod
    def resume(cls, run_dir: Path, budget: Budget | None = None, require_sandbox: bool = False) -> "Session":
        session = cls.open(run_dir, budget, require_sandbox=require_sandbox)
        try:
            session.repair()
            session.log("session_started", resumed=True)
            session._say_sandbox(session.sandbox)
            if budget is not None:
                session.log("note", text="budget on resume (totals for the run)", data={"budget": session.budget.__dict__})
        except BaseException:
            session.close()
            raise
        return session

    def close(self) -> None:
        """Stop the gate's pre-started judge and release the run's lock (run() does at its end); the
        session must not be used after."""
        self.gate.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _say_sandbox(self, sandbox: SandboxStatus) -> None:
        """Where untrusted code will run without isolation: a note in the record. The warning to people
        is the front end's, once (agent/cli.py `_print_sandbox`: optimize, resume, the session commands)."""
        if not sandbox.available:
            self.log("note", text=sandbox.line(), data={"sandbox": sandbox.as_dict()})

    # ---- record --------------------------------------------------------------------------------
    def log(self, kind: str, **data: Any) -> None:
        event = self.record.append(rec.make_event(kind, **data))
        if self.on_event is not None:
            self.on_event(event)

    def events(self) -> list:
        return self.record.events()

    def state(self) -> RunState:
        """The record folded (agent/run_state.py): attempts, best, baseline, budgets spent."""
        return RunState.fold(self.events())

    def attempts(self) -> list[Attempt]:
        return self.state().attempts

    def attempts_made(self) -> int:
        """Attempts started (interrupted ones included): the next one is number attempts_made() + 1."""
        return len(self.attempts())

    def repair(self, keep_edits: bool = False) -> None:
        """Bring the worktree and the record into agreement after a kill (see the module docstring).
        With `keep_edits`, uncommitted edits survive unless something had to be repaired."""
        attempts = self.attempts()
        repaired = False
        accepted = {a.number: a for a in attempts if a.accepted}
        # 1. commits on the branch must each carry an accepted attempt; anything else is cut off
        commits = self.ws.commits_since_base()
        keep = self.ws.base_commit
        for sha, message in commits:
            number = dict(parse_trailers(message)).get("Kloop-Attempt")
            if number is None or int(number) not in accepted:
                break
            keep = sha
            a = accepted[int(number)]
            if a.commit is None:  # killed between the commit and its record
                self.log("committed", attempt=a.number, commit=sha)
                a.commit = sha
                self.repairs.append(f"recorded commit {sha[:10]} of accepted attempt {a.number} (killed before its record)")
        if keep != self.ws.head():
            shas = [c for c, _ in commits]
            cut = shas[shas.index(keep) + 1:] if keep in shas else shas
            self.ws.reset_branch(keep)
            self.repairs.append(f"cut {len(cut)} commit(s) no accepted verdict stands behind: {', '.join(c[:10] for c in cut)}")
            repaired = True
        self.best_commit = keep
        # 2. an accepted verdict whose commit never happened: land it now (the gate already decided)
        for a in attempts:
            if a.accepted and a.commit is None:
                self.ws.restore(self.best_commit)
                self.ws.apply_patch(self.record.read_patch(a.number))
                sha = self.ws.commit(self._message(a.title, a.rationale, a.figures, a.number))
                self.log("committed", attempt=a.number, commit=sha)
                self.best_commit = sha
                self.repairs.append(f"landed accepted attempt {a.number} as commit {sha[:10]} (killed before its commit)")
                repaired = True
        # 3. an attempt with no verdict was cut off mid-gate: recorded as interrupted (it is offered
        # again and does not use up an attempt: run_state.Attempt.decided)
        for a in attempts:
            if a.accepted is None:
                self.log("verdict", attempt=a.number, accepted=False, reason="interrupted: the session stopped during evaluation",
                         figures={"stage": "interrupted"})
                self.repairs.append(f"marked attempt {a.number} ({a.title}) as interrupted: it had no verdict")
                repaired = True
        if repaired or not keep_edits:
            self.ws.restore(self.best_commit)
            self.log("restored", to=self.best_commit)

    # ---- baseline ------------------------------------------------------------------------------
    def recorded_baseline(self) -> dict[str, Any] | None:
        return self.state().baseline

    def reuse_baseline(self) -> bool:
        """On resume: take the recorded baseline figures and rebuild the best from the branch (no
        check, no timing: the gate already passed it). False when there is nothing to reuse."""
        figures = self.recorded_baseline()
        if figures is None:
            return False
        self._on_stage("build", "started")
        started = time.monotonic()
        built = self.gate.build(Candidate(self.ws.task_path, []))
        self._on_stage("build", "finished", ok=built.ok, seconds=time.monotonic() - started)
        if not built.ok:
            return False
        self.best_build, self.baseline = built, figures
        self.repairs.append(f"reused the recorded baseline; rebuilt the best ({self.best_commit[:10]}) without re-timing")
        return True

    def establish_baseline(self, task_dir: Path | None = None) -> Verdict:
        """Build and check the best (the base, or the last accepted commit on resume), as found in
        `task_dir` (default: the worktree's task folder, which must then hold no edits)."""
        verdict = self.gate.evaluate(Candidate(task_dir or self.ws.task_path, []), best=None)
        if task_dir is None:
            self.task_folder()  # the worktree vanished meanwhile: WorkspaceError, nothing recorded or discarded
        if not verdict.accepted:
            raise SessionError(f"the starting point does not pass its own gate: {verdict.reason}")
        self.best_build = verdict.build
        figures = {"build": verdict.build.model_dump(mode="json", include={"kernels", "compiler", "knobs", "key"}),
                   "device": verdict.device.model_dump(mode="json") if verdict.device else None,
                   "sass": verdict.sass}
        try:
            from tools.evaluate import run_bench

            self._on_stage("timing", "started")
            res = run_bench(self.trusted_task, verdict.build.lib, comparators=True, seconds_per_shape=0.5,
                            trusted_dir=self.gate.trusted_dir, standby=self.gate.standby.take())
            self.gate.standby.refill()  # for the first submit
            if res.bench:
                figures["bench"] = res.bench.model_dump(mode="json")
        except Exception as exc:  # the baseline timing only informs the briefing
            figures["bench_error"] = str(exc)
        self.baseline = figures
        info = self.record.info
        info.versions = _versions(verdict.build.compiler, verdict.device)
        info.baseline_pending = None  # measured now (it may have waited for the device)
        if verdict.device:
            info.gpu = verdict.device.name if verdict.device.kind == "cuda" else None
            info.machine = verdict.device.model_dump(mode="json")
        self.record.write_info(info)
        self.log("baseline", commit=self.best_commit, figures=figures)
        return verdict

    # ---- the two actions that change the branch --------------------------------------------------
    def submit(self, title: str, rationale: str = "", knobs: dict[str, Any] | None = None,
               gate_seconds: float | None = None) -> Verdict:
        """Judge the worktree against the best. `gate_seconds`: this decision's timing cap (recorded in
        the attempt). SubmitRefused (nothing recorded, no attempt spent) for no change at all, for a change
        whose only out-of-scope paths are new files (kept, with the edit), and for the identical change the
        gate already found not faster, or slower, against this same best."""
        if self.best_build is None:
            self.establish_baseline()
        number = self.attempts_made() + 1
        knobs_file = self.ws.task_path / KNOBS_FILE
        knobs_before = knobs_file.read_bytes() if knobs_file.is_file() else None
        if knobs:  # validated by the gate against the trusted manifest (TaskError: nothing is recorded)
            self.gate.write_knobs(self.ws.task_path, knobs)
        patch = self.ws.diff(against=self.best_commit)
        changed = self.ws.changed_paths(against=self.best_commit)
        prebuilt = time.monotonic()
        self.current_attempt = number  # progress lines name the attempt being prepared
        try:
            digest = self._code_digest(patch, changed)
        finally:
            self.current_attempt = None
        prebuild_s = time.monotonic() - prebuilt  # the gate's build below is then a cache hit
        if not patch.strip() and not changed:
            why = ("nothing changed against the best: the worktree is the best version, so there is nothing to "
                   "judge; refused without an attempt. Edit an editable file, or pass knob settings (kloop submit "
                   "--knob NAME=VALUE; MCP: knobs=...)")
        else:
            why = self.stray_files_refusal(changed) or self.already_judged(patch, digest)
        if why:
            if knobs:  # the knob settings written above go back to what they were
                knobs_file.unlink(missing_ok=True) if knobs_before is None else knobs_file.write_bytes(knobs_before)
            self.log("note", text=f"submit refused without timing: {why}", data={"refused": title[:200]})
            raise SubmitRefused(why)
        patch_path = self.record.write_patch(number, patch)
        self.log("attempt_started", attempt=number, title=title, rationale=rationale,
                 patch=str(patch_path.relative_to(self.record.dir)), knobs=knobs or {},
                 gate_seconds=gate_seconds, best_commit=self.best_commit)
        verdict = self._evaluate_or_record_interrupt(number, changed, gate_seconds)
        if verdict.build is not None and "build" in verdict.stage_seconds:  # the compile happened before the gate's clock
            verdict.stage_seconds["build"] = round(verdict.stage_seconds["build"] + prebuild_s, 3)
            verdict.seconds = round(verdict.seconds + prebuild_s, 2)
        if edits := knob_define_edits(patch, self.gate.task.manifest.knobs):  # that part of the change did nothing
            verdict = verdict.model_copy(update={"reason": f"{verdict.reason.rstrip('.')}. {knob_edit_note(edits)}"})
        figures = verdict.figures() | ({"code_digest": digest} if digest else {})
        self.log("verdict", attempt=number, accepted=verdict.accepted, reason=verdict.reason, figures=figures)
        if verdict.accepted:
            sha = self.ws.commit(self._message(title, rationale, verdict.figures(), number))
            self.log("committed", attempt=number, commit=sha)
            self.best_commit, self.best_build = sha, verdict.build
        else:
            self.ws.restore(self.best_commit)
            self.log("restored", to=self.best_commit, attempt=number)
        return verdict

    def submit_batch(self, items: list[dict[str, Any]], gate_seconds: float | None = None) -> list[Verdict | str]:
        """Several candidates (each the current sources with its own knob settings: `title`, `rationale`,
        `knobs`) judged against the SAME best, in parallel when the session has a judge pool
        (agent/parallel.py), one after the other otherwise. Each is an attempt, recorded ahead
        (`attempt_started`, best_commit = this best). Of those the gate accepts, the fastest (highest
        speedup, then lower bound) is committed; the others are recorded as `superseded` (judged faster than
        a best that is no longer the best: not committed, as the branch must stay a chain in which each commit
        was proven faster than its parent). A job whose worker died or never answered is `interrupted`.
        Returns, per item, its verdict or the reason it was refused without judging (no attempt spent)."""
        from agent.parallel import JudgeJob, LocalPool, task_files

        if self.best_build is None:
            self.establish_baseline()
        if self.budget.max_attempts is not None:  # budgets are totals: enforced before work is handed out
            items = items[:max(0, self.budget.max_attempts - self.attempts_made())]
        knobs_file = self.ws.task_path / KNOBS_FILE
        knobs_before = knobs_file.read_bytes() if knobs_file.is_file() else None
        out: list[Verdict | str | None] = [None] * len(items)
        jobs: list[JudgeJob] = []
        meta: dict[int, tuple[int, dict]] = {}
        best = self.best_commit
        events = self.events()
        looks = timed_looks(events, best, self.record.info.base_commit)
        best_times = recorded_best_times(events, best, self.record.info.base_commit)
        try:
            for i, item in enumerate(items):
                knobs = item.get("knobs") or {}
                if knobs:
                    self.gate.write_knobs(self.ws.task_path, knobs)
                patch = self.ws.diff(against=best)
                changed = self.ws.changed_paths(against=best)
                if why := self.stray_files_refusal(changed) or self.already_judged(patch):
                    out[i] = why
                    self.log("note", text=f"submit refused without timing: {why}", data={"refused": item["title"][:200]})
                else:
                    number = self.attempts_made() + 1
                    patch_path = self.record.write_patch(number, patch)
                    self.log("attempt_started", attempt=number, title=item["title"], rationale=item.get("rationale", ""),
                             patch=str(patch_path.relative_to(self.record.dir)), knobs=knobs,
                             gate_seconds=gate_seconds, best_commit=best)
                    # each job is a look of its own at this best: the batch spends the budget as many times
                    jobs.append(JudgeJob(number, task_files(self.ws.task_path), changed, look=looks + 1 + len(jobs),
                                         best_times=best_times))
                    meta[number] = (i, item)
                knobs_file.unlink(missing_ok=True) if knobs_before is None else knobs_file.write_bytes(knobs_before)
        finally:
            knobs_file.unlink(missing_ok=True) if knobs_before is None else knobs_file.write_bytes(knobs_before)
        pool = self.pool or LocalPool(self.gate, lambda: self.best_build)
        best_files = task_files(self.ws.task_path) if jobs else {}
        results = pool.judge(jobs, best_files, gate_seconds) if jobs else []
        accepted = [r for r in results if r.verdict is not None and r.verdict.accepted]
        winner = max(accepted, key=lambda r: (r.verdict.speedup or 0, r.verdict.speedup_lo or 0), default=None)
        for r in results:  # every verdict but the winner's first: the winner's commit is the last move
            if r is winner:
                continue
            if r.verdict is None:
                self.log("verdict", attempt=r.number, accepted=False, reason=f"interrupted: {r.problem}",
                         figures={"stage": "interrupted"}, worker=r.worker)
            elif r.verdict.accepted:
                figures = r.verdict.figures() | {"stage": "superseded"}
                self.log("verdict", attempt=r.number, accepted=False, figures=figures, worker=r.worker, reason=(
                    f"superseded: {r.verdict.reason} against {best[:10]}, judged at the same time as attempt "
                    f"{winner.number} (x{winner.verdict.speedup:.4f}), which was committed; submit it again to judge "
                    "it against the new best"))
            else:
                self.log("verdict", attempt=r.number, accepted=False, reason=r.verdict.reason,
                         figures=r.verdict.figures(), worker=r.worker)
            out[meta[r.number][0]] = r.verdict
        if winner is not None:
            _, item = meta[winner.number]
            v = winner.verdict
            self.log("verdict", attempt=winner.number, accepted=True, reason=v.reason, figures=v.figures(), worker=winner.worker)
            self.ws.restore(best)
            if item.get("knobs"):
                self.gate.write_knobs(self.ws.task_path, item["knobs"])
            sha = self.ws.commit(self._message(item["title"], item.get("rationale", ""), v.figures(), winner.number))
            self.log("committed", attempt=winner.number, commit=sha)
            self.best_commit = sha
            # the best as built here (a cache hit when the worker shares this machine's build cache)
            self.best_build = self.gate.build(Candidate(self.ws.task_path, []))
            out[meta[winner.number][0]] = v
        else:
            self.ws.restore(best)
            self.log("restored", to=best)
        return [o if o is not None else "not judged" for o in out]

    def _code_digest(self, patch: str, changed: list[str]) -> str | None:
        """The digest of the library the worktree builds to (tools.build.code_digest; the build is
        the gate's own and cached, so its evaluation reuses it), or None when it does not build."""
        if not patch.strip():
            return None
        try:
            cand = Candidate(self.ws.task_path, changed)
            if self.gate.out_of_scope(cand) or self.gate.static_hits(cand):
                return None  # the gate rejects (and records) it before any build
            started = time.monotonic()
            self._on_stage("build", "started")
            built = self.gate.build(cand)
            self._on_stage("build", "finished", ok=built.ok, seconds=time.monotonic() - started)
            self._build_shown = self.current_attempt  # the gate's own (cached) build of it is not shown again
            return code_digest(built.lib) if built.ok and built.lib else None
        except Exception:  # anything wrong with the build is the gate's to report
            return None

    def stray_files_refusal(self, changed: list[str]) -> str | None:
        """Why a change whose only scope fault is new files outside the editable globs (notes, an editor's
        backup) is refused before the gate: judged, it would be rejected at scope and the worktree reverted,
        losing the edit for a file that was never part of it. Edits to read-only files are judged (and
        rejected, recorded): that is a change to what the gate trusts, not a stray file."""
        outside = self.gate.paths_out_of_scope(changed, self.ws.task_path)
        if not outside:
            return None
        wanted = set(outside)  # filtered here, not passed to git: a path is data, never a pathspec
        added = {c.path for c in self.ws.changes(against=self.best_commit)
                 if c.path in wanted and c.status == "A" and not c.is_symlink and not c.is_submodule}
        if set(outside) - added:
            return None
        shown = ", ".join(sorted(added)[:8]) + (f" and {len(added) - 8} more" if len(added) > 8 else "")
        globs = ", ".join(self.gate.task.manifest.editable)
        return (f"new files outside the editable globs ({globs}): {shown}. The gate would reject the change at "
                "scope and revert the worktree, so it is refused before any stage, without an attempt, and "
                "nothing was reverted: delete or move those files out of the worktree, then submit again")

    def already_judged(self, patch: str, digest: str | None = None) -> str | None:
        """Why this change must not be timed again (None: it may be judged): an earlier attempt against
        the same best, with the identical patch or building to the identical code (`digest`: a comment
        or whitespace apart), was rejected as not faster or as a regression. Timing it again until one
        run passes is optional stopping (every timed look spends from the best's error budget, and this one
        would only buy noise). After
        'undecided' a re-submit (with a longer gate) is allowed. A change that builds to the best's own
        code is refused too: timing it could only ever accept noise."""
        if not patch.strip():
            return None
        best_lib = self.best_build.lib if self.best_build is not None and getattr(self.best_build, "ok", False) else None
        if digest is not None and best_lib and Path(best_lib).is_file() and code_digest(best_lib) == digest:
            if edits := knob_define_edits(patch, self.gate.task.manifest.knobs):
                return knob_edit_advice(edits)
            return (f"this change builds to the same code as the best ({self.best_commit[:10]}): a comment or "
                    "whitespace apart, there is nothing to time (a timing could only ever accept noise), so it is "
                    "refused without timing and costs no attempt. Change the code, or revert")
        best_at = judged_against(self.attempts(), self.record.info.base_commit)
        for a in reversed(self.attempts()):
            if a.accepted is not False or best_at[a.number] != self.best_commit:
                continue
            stage = a.figures.get("stage")
            slower = a.reason.startswith("regression beyond")
            if stage != "timing" or not (slower or a.reason.startswith("not measurably faster")):
                continue
            path = self.record.patch_path(a.number)
            same_code = digest is not None and a.figures.get("code_digest") == digest
            if same_code or (path.is_file() and self.record.read_patch(a.number) == patch):
                what = "a regression" if slower else "not measurably faster"
                change = "this exact change" if not same_code else "a change that builds to this same code"
                return (f"attempt {a.number} ({a.title!r}) already submitted {change} against this same best "
                        f"({self.best_commit[:10]}) and the gate found it {what}: {a.reason[:300]}. Timing the "
                        "identical change again until one run passes would be optional stopping (the gate's bound "
                        "would no longer hold), so it is refused without timing and costs no attempt. Change the "
                        "code, or revert")
        return None

    def _evaluate_or_record_interrupt(self, number: int, changed: list[str], gate_seconds: float | None = None) -> Verdict:
        """The gate's verdict; a second Ctrl-C mid-gate (the worker already killed) records the
        attempt as interrupted and returns the tree to best before the stop goes on."""
        self.current_attempt = number
        events = self.events()
        # the record, not this process's memory: a `kloop submit` or MCP process sees the same best times and looks
        if self.best_build is not None and self.best_build.lib:
            self.gate.remember_times(self.best_build.lib, recorded_best_times(events, self.best_commit,
                                                                                self.record.info.base_commit))
        look = 1 + timed_looks(events, self.best_commit, self.record.info.base_commit)
        try:
            return self.gate.evaluate(Candidate(self.ws.task_path, changed), self.best_build, max_seconds=gate_seconds,
                                      look=look)
        except KeyboardInterrupt:
            self.killed = f"the gate's evaluation of attempt {number}"  # what a second Ctrl-C stopped, for people
            self.log("verdict", attempt=number, accepted=False, figures={"stage": INTERRUPTED},
                     reason="interrupted: stopped by the user during evaluation (Ctrl-C twice)")
            self.ws.restore(self.best_commit)
            self.log("restored", to=self.best_commit, attempt=number)
            raise
        finally:
            self.current_attempt = self._build_shown = None

    def _on_stage(self, stage: str, state: str, ok: bool | None = None, seconds: float | None = None) -> None:
        if stage == "build" and self.current_attempt is not None and self._build_shown == self.current_attempt:
            return
        if self.on_event is not None:
            self.on_event(StageEvent(stage, state, self.current_attempt, ok, None if seconds is None else round(seconds, 2)))

    def interrupted_attempt(self) -> Attempt | None:
        """The last attempt when a stop cut its evaluation short (offered again on resume)."""
        return self.state().interrupted

    def task_folder(self) -> Path:
        """The worktree's task folder; WorkspaceError when it is gone (nothing may be built, timed or
        ranked from missing files and recorded as the candidate's failure)."""
        path = self.ws.task_path
        if not path.is_dir():
            self.ws.verify("read the candidate")  # names what is wrong and the way on
            raise WorkspaceError(f"the task folder {path} of the session worktree is gone; `kloop resume` recreates it")
        return path

    def revert(self) -> str:
        self.ws.restore(self.best_commit)
        self.log("restored", to=self.best_commit)
        return self.best_commit

    # ---- what the policy is told ---------------------------------------------------------------
    def stop_reason(self) -> str | None:
        if self.interrupted:
            return self.interrupted
        return stop_code(budget_stop(self.budget, self.state()))

    def seconds_left(self) -> float | None:
        """Wall seconds left under --max-hours (None: no such budget): a policy caps its waits by it."""
        b = self.budget
        return None if b.max_hours is None else b.max_hours * 3600 - (time.monotonic() - self.started)

    def system_prompt(self) -> str:
        from agent.briefing import system_prompt

        return system_prompt(self)

    def briefing(self) -> str:
        """The task briefing; a resumed session also says where things stand (notes, attempts)."""
        from agent.briefing import briefing

        text = briefing(self)
        if self.attempts_made() or self.notes_path.is_file():
            text += "\n\n## Where things stand (this session was resumed)\n\n" + self.memory()
            offered = self.offer_interrupted()
            if offered:
                text += "\n\n" + offered
        return text

    def offer_interrupted(self) -> str | None:
        """Put an interrupted attempt's changes back in the worktree (from attempts/NNN.patch) and say
        so; None when there is none or it no longer applies. Only a policy that edits files is told."""
        a = self.interrupted_attempt()
        if a is None or not self.record.patch_path(a.number).is_file():
            return None
        patch = self.record.read_patch(a.number)
        if not patch.strip() or self.ws.changed_paths(against=self.best_commit):
            return None
        try:
            self.ws.apply_patch(patch)
        except Exception:  # the best moved on since: just say what it was
            self.ws.restore(self.best_commit)
            return (f"Attempt {a.number} ({a.title!r}) was interrupted before the gate decided; its patch no longer "
                    "applies to the best.")
        return (f"Attempt {a.number} ({a.title!r}) was interrupted before the gate decided. Its changes are back in "
                "the worktree: submit them to have them judged (or revert to drop them).")

    def memory(self) -> str:
        from agent.briefing import memory

        return memory(self)

    def ledger(self) -> str:
        """One line per attempt so far (the history tool's answer)."""
        from agent.briefing import ledger

        return ledger(self)

    # ---- running -------------------------------------------------------------------------------
    def facade(self) -> PolicyFacade:
        """What a policy is given: tools, budget, briefing, memory, log, stop reason; never the session."""
        return PolicyFacade(self)

    def run(self, policy) -> str:
        """Run `policy` to the end; the branch is left at best whatever happens.

        A first Ctrl-C (or SIGTERM) is acknowledged at once and stops after the current step; a
        second one stops now: the running worker's process group is killed, the attempt is recorded
        as interrupted and StopNow (a KeyboardInterrupt) propagates after `session_ended`. A fresh
        run whose baseline fails leaves nothing behind (no branch, no worktree, no record)."""
        previous = self._install_signal_handlers()
        reason = "error"
        try:
            if self.best_build is None and not self.reuse_baseline():
                self._baseline_or_discard()
            # a Ctrl-C during the baseline stops here: the baseline was the current step (a newcomer's
            # run once went on into the tuner's sweep and stopped 45 s later)
            reason = self.interrupted or policy.run(self.facade()) or "done"
        except SessionError as exc:
            reason = f"error: {exc}"
            raise
        except KeyboardInterrupt:
            reason = self.interrupted = INTERRUPTED
            raise
        finally:
            try:
                if not self.discarded:
                    try:
                        self.ws.restore(self.best_commit)
                        self.ws.remove()  # the branch holds the result; `resume` recreates the worktree
                    finally:
                        self.log("session_ended", reason=self.interrupted or reason)
            finally:
                self.close()
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        return self.interrupted or reason

    def _install_signal_handlers(self) -> dict:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}  # signals reach only the main thread; a session run elsewhere is stopped by its owner
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def on_signal(signum, _frame):
            if self.interrupted is None:
                self.interrupted = INTERRUPTED
                (self.on_interrupt or _print_stderr)(INTERRUPT_ACK)
                return
            raise StopNow(f"stopped now ({signal.Signals(signum).name})")

        for sig in previous:
            signal.signal(sig, on_signal)
        return previous

    def _baseline_or_discard(self) -> None:
        """The baseline of a run; when a fresh run's starting point fails its own gate, the run is
        removed whole (worktree, branch, record) and SessionError says why."""
        try:
            self.establish_baseline()
        except SessionError as exc:
            if self.attempts_made() or any(getattr(e, "resumed", False) for e in self.events()):
                raise
            self.discard()
            raise SessionError(f"{exc}\nnothing was kept: the run's branch, worktree and record were removed") from None

    def discard(self) -> None:
        """Remove every trace of this run (only for a run that never got past its baseline)."""
        from agent.workspace import _git

        self.discarded = True
        try:
            self.ws.remove()
        finally:
            if Path(self.ws.repo_root).is_dir():
                _git(Path(self.ws.repo_root), "branch", "-D", self.ws.branch)
            self.close()  # the lock lives in the run folder
            shutil.rmtree(self.record.dir, ignore_errors=True)

    # ---- evidence ------------------------------------------------------------------------------
    def _message(self, title: str, rationale: str, figures: dict, number: int) -> str:
        return format_commit_message(title, rationale or "(no rationale given)",
                                     evidence_trailers(figures, self.best_build, self.record.info.run_id, number))


class SessionTools:
    """The session as the agent tools see it (`tools.port.SessionPort`): the trusted task, the
    candidate's folder, notes, submit, revert and the ledger; not the gate, the workspace or the record."""

    __slots__ = ("_session",)

    def __init__(self, session: Session) -> None:
        object.__setattr__(self, "_session", session)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the session port is read-only ({name!r})")

    @property
    def task(self) -> Task:
        return self._session.trusted_task

    @property
    def trusted_dir(self) -> Path:
        return self._session.gate.trusted_dir

    @property
    def files_root(self) -> Path:
        """The candidate's task folder; WorkspaceError when the worktree is gone (no tool may read,
        build or time "nothing" and report it as the candidate's failure)."""
        return self._session.task_folder()

    @property
    def notes_path(self) -> Path:
        return self._session.notes_path

    @property
    def device(self) -> dict | None:
        return self._session.baseline.get("device")

    def submit(self, title: str, rationale: str = "", knobs: dict[str, Any] | None = None,
               gate_seconds: float | None = None) -> Verdict:
        return self._session.submit(title, rationale, knobs, gate_seconds=gate_seconds)

    def submit_batch(self, items: list[dict[str, Any]], gate_seconds: float | None = None) -> list:
        return self._session.submit_batch(items, gate_seconds=gate_seconds)

    def revert(self) -> str:
        return self._session.revert()

    def ledger(self) -> str:
        return self._session.ledger()


def evidence_trailers(figures: dict, best: BuildResult | None, run_id: str, number: int) -> list[tuple[str, str]]:
    """Speedup with its interval, time per bench shape, registers/spills per kernel (change from
    best), where it was measured, run and attempt. Figures that are missing or not numbers are
    written as '-' or 'nan' (never a crash: the commit of an accepted verdict must land)."""
    out: list[tuple[str, str]] = []
    if real(figures.get("speedup")) is not None:
        out.append(("Kloop-Speedup", f"{figures['speedup']:.4f}"))
        # the gate's interval: each bound at the look's one-sided level (not a 95% interval; older commits
        # named it Kloop-Speedup-CI95, which the readers still take)
        out.append(("Kloop-Speedup-Interval", f"{fmt_num(figures.get('speedup_lo'))}..{fmt_num(figures.get('speedup_hi'))}"))
    ab = figures.get("ab") if isinstance(figures.get("ab"), dict) else {}
    if real(figures.get("speedup")) is not None and real(ab.get("alpha")) is not None:
        out.append(("Kloop-Speedup-Level", f"one-sided {100 * ab['alpha']:.2g}% per bound, timed look {ab.get('look', 1)} at its best"))
    shapes = ab.get("shapes") if isinstance(ab.get("shapes"), list) else []
    for s in (s for s in shapes if isinstance(s, dict) and s.get("shape")):
        try:
            key = trailer_key("Kloop-Time", str(s["shape"]))
        except ValueError:  # a shape name with nothing a trailer key can hold
            continue
        out.append((key, f"{fmt_ms(s.get('time_a'), sep='')} -> {fmt_ms(s.get('time_b'), sep='')} (x{fmt_num(s.get('speedup'))}, "
                         f"{fmt_num(s.get('speedup_lo'))}..{fmt_num(s.get('speedup_hi'))}, {s.get('pairs')} pairs)"))
    before = {k.name: k for k in (best.kernels if best else [])}
    build = figures.get("build") if isinstance(figures.get("build"), dict) else {}
    kernels = [k for k in (build.get("kernels") if isinstance(build.get("kernels"), list) else [])
               if isinstance(k, dict) and k.get("name")]
    used: set[str] = set()
    for k, short in zip(kernels, kernel_names([str(k["name"]) for k in kernels])):
        b = before.get(str(k["name"]))
        regs = f"{b.registers} -> {k.get('registers')}" if b and b.registers != k.get("registers") else f"{k.get('registers')}"
        spills = f"spills {k.get('spill_store_bytes')}/{k.get('spill_load_bytes')} B"
        if b and (b.spill_store_bytes, b.spill_load_bytes) != (k.get("spill_store_bytes"), k.get("spill_load_bytes")):
            spills = f"spills {b.spill_store_bytes}/{b.spill_load_bytes} -> {k.get('spill_store_bytes')}/{k.get('spill_load_bytes')} B"
        stack, stack_before = k.get("stack_bytes") or 0, (b.stack_bytes if b else None)
        if stack or stack_before:  # local memory: spills or an indexed register array
            spills += f", stack {stack_before} -> {stack} B" if b and stack_before != stack else f", stack {stack} B"
        if isinstance(k.get("setmaxnreg"), list) and k["setmaxnreg"]:  # warp-specialised: ptxas's count is the entry count; then what setmaxnreg sets
            spills += f", setmaxnreg {' / '.join(map(str, k['setmaxnreg']))}"
        try:
            key = base = trailer_key("Kloop-Regs", short)  # short names can still meet once sanitised
        except ValueError:  # a name with nothing a trailer key can hold
            continue
        n = 1
        while key in used:
            n += 1
            key = f"{base}-{n}"
        used.add(key)
        out.append((key, f"{regs} regs, {spills}"))
    if isinstance(build.get("knobs"), dict) and build["knobs"]:
        out.append(("Kloop-Knobs", " ".join(f"{k}={v}" for k, v in build["knobs"].items())))
    dev = figures.get("device") if isinstance(figures.get("device"), dict) else {}
    if dev:
        out.append(("Kloop-Device", device_label(dev, clocks=False)))
    if build.get("compiler"):
        out.append(("Kloop-Compiler", str(build["compiler"])))
    if isinstance(figures.get("e2e"), dict):
        from tools.e2e import summary

        try:
            out.append(("Kloop-E2E", summary(figures["e2e"])))
        except ValueError:  # a malformed record: the commit must still land
            out.append(("Kloop-E2E", "-"))
    if ab:
        out.append(("Kloop-Timing", f"{ab.get('pairs')} pairs in {ab.get('timing_seconds')} s ({ab.get('stopped_because')})"))
    out.append(("Kloop-Run", run_id))
    out.append(("Kloop-Attempt", str(number)))
    return out


def _print_stderr(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
