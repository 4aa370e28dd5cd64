"""The gate: a candidate lands only when it is in scope, builds, is correct and is measurably faster.

Stages, each a reason to reject: scope (every changed path matches the task's editable globs),
static rules (forbidden patterns), build, check (fresh secret seed, every check shape, in a fresh
worker), paired A/B timing against the best (fresh worker; outputs of timed calls re-checked; work
escaping the timed stream detected), and the decision (tools/stats.PassCriterion, rebuilt here from
the report's per-pass times): the speedup is the ratio of the bench workload's times (every call
counted); its lower bound, at this best's spent error budget, must clear 1 + min_gain with no shape
possibly regressing beyond its allowance, on at least MIN_PASSES passes and an interval no wider
than the noise limit.

The manifest, the spec and every non-editable file come from the trusted copy of the task (the
run's base commit), never from the candidate.
"""

from __future__ import annotations

import math
import re
import secrets
import shutil
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tools.scope import change_refusal, symlink_component
from tools.task import KNOBS_FILE, TaskError, load_task
from tools.audit import SOURCE_RULES, AuditError, AuditReport, audit_task_build, source_rules
from tools.build import BuildResult, build
from tools.fmt import fmt_ms, fmt_num, fmt_speedup, fmt_us
from tools.protocol import ABReport, CheckReport, DeviceInfo, E2EReport, WorkerRequest
from tools.judge_handle import StandbySlot, run_worker
from tools.stats import MIN_EVIDENCE_STRETCH, DecisionRules, look_alpha

Stage = Literal["scope", "static", "build", "check", "timing", "undecided", "e2e", "accepted", "interrupted", "partial"]
# how far `Gate.evaluate` goes: every layer ("timing"), or stop after the check or after the audit of
# what was built (`kloop audit --no-timing`, or a CUDA task on a machine without a GPU). A candidate
# that passes every layer run is never accepted by a partial evaluation: its stage is "partial".
Upto = Literal["timing", "check", "audit"]
UNDECIDED = "undecided (noisy machine)"
MIN_GATE_SECONDS, MAX_GATE_SECONDS = 1, 30  # the timing cap an agent may ask for one decision (submit --gate-seconds)

# Built-in static rules: things no kernel needs and every cheat of a known kind does (applied to the
# raw sources here, and by the audit to the preprocessed text of what was built)
DEFAULT_FORBIDDEN = SOURCE_RULES


class GateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt setting in run.json is an error, not a default

    max_seconds: float = 4.0  # timing seconds for one decision
    min_pairs: int = 20
    target_halfwidth: float = 0.004  # stop sampling when the log-speedup interval (at the look's level) is this tight
    check_rounds: int = 2
    # the false-accept rate per best: every timed decision against one best spends from this one
    # budget (the i-th at one-sided level alpha * 6 / (pi^2 i^2), tools/stats.py), so re-submits
    # and longer gates cannot add up to more
    false_accept_rate: float = Field(0.01, gt=0, lt=0.5)
    # work outside the timed region the candidate may add over the best's, like for like: a few robust
    # standard errors of the best's own probes in the same run, plus a small relative (and absolute) floor
    escape_sigmas: float = 4.0
    escape_rel_floor: float = 0.03
    escape_abs_floor_s: float = 1e-6
    # device work after a timed sample's end event (CUDA, on the device's clock, every timed sample): the
    # candidate's lower quartile per call may exceed the best's by a few robust standard errors of the best's
    # own plus a floor: runners differ by process in how late the host wakes after a device sync (A/A medians
    # on the H200 read 17-27 us apart on a 460 us call, 4 of 212 decisions flagged with a 2% floor), which no
    # spread of samples within one runner shows; 5% still leaves 10% hidden work caught
    escape_trail_rel_floor: float = 0.05
    escape_trail_abs_floor_s: float = 2e-6  # per sample
    # the judge's own clock around each timed request beyond the times the runner reported (CUDA C++ tasks,
    # whose host code could make the runner's events lie): the candidate's lower quartile per call may differ
    # from the best's, either way, by a few robust standard errors of the best's plus a floor. More: its
    # events under-report; less: its runner skipped work every runner does in a request. A coarse bound: that
    # time is ~0.37-0.56 ms a request (the runner's Python, the pipe, spin and syncs; 0.44-0.62 while the
    # flush was the runner's) and two runners of one build read up to 115 us apart (H100, 57 A/A decisions,
    # 2026-12-07), so the floor is 150 us a sample and a quarter of the call: a runner reporting half its time
    # was caught in 44 of those 57 decisions replayed as its (bench/gate_bench.py; 27 of 57 with the judge's
    # flush), one reporting 95% in none
    offclock_rel_floor: float = 0.25
    offclock_abs_floor_s: float = 150e-6  # per sample
    # a cold probe's own call, which no sample charges: the candidate's mean over its probes may reach
    # this many times the best's, plus one of the best's timed calls. Beyond, the probes do work of their
    # own (a red-team kernel spun 40 ms in every second probe, unflagged): the window is closed to about a
    # call. CPU: the runner's CPU over the call; CUDA: the call's events
    untimed_call_factor: float = 1.5
    # CUDA: a probe has no spin before its start event, so its events also hold the host's enqueue of the call,
    # which a timed sample of one call hides under its spin (tools/timing.hold_seconds(1): 30 + 15 us). A
    # candidate with more host work per call than the best (descriptors made per call) may spend that in a
    # probe: on a 5 us kernel the factor alone would call 12 us of host set-up work in untimed calls
    untimed_call_gpu_host_s: float = 45e-6
    # CPU after answering, over every timed call (an honest runner sits blocked on its pipe)
    after_return_abs_s: float = 30e-6
    after_return_rel: float = 0.05
    # an interval whose half-width (in log, at the look's level) exceeds this decides nothing, accept
    # and regression alike: "undecided (noisy machine)". It guards against intervals too wide to be
    # trusted (the H200 A/A once accepted at x1.857 [1.159, 2.975]: half-width 0.47); the false-accept
    # level is the look's alpha. 0.10, not 0.05: over per-pass sums a 2-core CPU box gives a clear x1.7
    # as [1.62, 1.89] (half-width 0.076) in 4 s, which decides nothing that a narrower one would not.
    noisy_halfwidth: float = 0.10
    # CPU tasks: both samples of each timed pair pinned to the CPU the judge's thread is on (tools/placement.py);
    # "off" leaves them to the scheduler (only to measure what placement does: bench/placement_ab.py)
    cpu_placement: Literal["current", "off"] = "current"
    # CUDA tasks: the same for the runners' host threads (the request's pipe, Python and syncs, which the judge's
    # clock around a request holds beside the calls). "off" until measured on a GPU host: bench/gate_bench.py
    cuda_placement: Literal["current", "off"] = "off"
    # CUDA C++ tasks, shapes of calls >= 50 us: seconds of calls one timed request spans at least (up to 64 calls
    # on distinct input sets, cold after the judge's flush). The request's own cost (~0.4 ms of the runner's Python,
    # pipe, spin and syncs) is what the judge's clock cannot tell from an under-report: the more calls a request
    # holds, the smaller a lie it catches (the offclock floors are per request). Off (50 us: one call a sample) until
    # the hole it opens is closed: docs/ARCHITECTURE.md, still open 3
    cuda_request_s: float = Field(default=50e-6, gt=0, le=0.1)  # 50e-6: tools.timing.SHORT_CALL_S (off)
    # the best's time now over its time when it was accepted, beyond which nothing is decided
    best_slowdown_limit: float = 2.5
    # refuse to run where the host cannot sandbox untrusted code (tools/sandbox.py status())
    require_sandbox: bool = False
    # keep one judge (and its two runners) pre-started for the next decision (tools/judge_handle.JudgeStandby);
    # KLOOP_STANDBY=off turns it off too. Changes no verdict: only where the start-up seconds go.
    standby: bool = True
    # run the task's end-to-end training check (manifest [e2e]) on the accepts its `when` names
    e2e: bool = True

    def with_settings(self, settings: list[str]) -> "GateConfig":
        """This config with `FIELD=VALUE` settings (a benchmark's `--set`), validated like run.json's: an unknown
        field or a value of the wrong kind is a ValueError naming it."""
        values = self.model_dump()
        for item in settings:
            name, sep, value = item.partition("=")
            if not sep or name.strip() not in type(self).model_fields:
                raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of GateConfig's "
                                 f"({', '.join(sorted(type(self).model_fields))})")
            values[name.strip()] = value.strip()
        try:
            return type(self).model_validate(values)
        except ValidationError as exc:
            raise ValueError(f"--set {' '.join(settings)}: {exc}") from None


class Verdict(BaseModel):
    accepted: bool
    stage: Stage
    reason: str
    seconds: float = 0.0
    speedup: float | None = None
    speedup_lo: float | None = None
    speedup_hi: float | None = None
    min_gain: float | None = None
    out_of_scope: list[str] = Field(default_factory=list)
    static_hits: list[str] = Field(default_factory=list)
    build: BuildResult | None = None
    audit: AuditReport | None = None  # of what was built (symbols, syscalls, load-time code, headers)
    check: CheckReport | None = None
    ab: ABReport | None = None
    e2e: E2EReport | None = None  # the end-to-end training check, when it ran (tools/e2e.py)
    device: DeviceInfo | None = None
    check_seed: int | None = None  # revealed after the decision, for the record
    timing_seed: int | None = None
    # SASS instruction mix per kernel (mangled name -> families, memory widths, MUFU, total) of what was built
    sass: dict[str, dict] = Field(default_factory=dict)
    sass_error: str | None = None
    # where the decision's seconds went, in order: scope (and static rules), build, audit, processes
    # (the judge's and runners' start, the libraries' load, teardown: what a pre-started judge saves),
    # check, timing, sass (waiting for the SASS figures after the verdict)
    stage_seconds: dict[str, float] = Field(default_factory=dict)
    judge: str | None = None  # "cold" | "warming" | "ready": was the judge pre-started, and warm?
    # undecided: the timing cap (submit gate_seconds) that would likely decide a re-submission of the
    # same change (None: not even MAX_GATE_SECONDS would, or the verdict is not undecided for noise)
    decide_seconds: int | None = None

    def figures(self) -> dict:
        """The numbers a run record keeps (everything but bulky reports)."""
        return self.model_dump(mode="json", exclude={"check"}) | {
            "check_failures": [s.model_dump(mode="json") for s in (self.check.failures() if self.check else [])][:10],
        }

    def summary(self) -> str:
        # "ACCEPTED: faster: ..." (an accepted verdict's stage is "accepted": "at accepted" said it twice)
        head = f"ACCEPTED: {self.reason}" if self.accepted else f"REJECTED at {self.stage}: {self.reason}"
        lines = [head]
        if self.ab:
            for s in self.ab.shapes:
                lines.append(f"  {s.shape}: {fmt_ms(s.time_a)} -> {fmt_ms(s.time_b)}, "
                             f"{fmt_speedup(s.speedup, s.speedup_lo, s.speedup_hi)} ({s.pairs} pairs)")
            lines.append(f"  timing: {self.ab.pairs} pairs in {fmt_num(self.ab.timing_seconds, '.1f')} s ({self.ab.stopped_because})"
                         + _placement_note(self.ab))
        if self.e2e:
            from tools.e2e import summary

            lines.append(f"  e2e: {summary(self.e2e)}")
        if self.check and not self.check.passed:
            from tools.check import format_check  # imports torch: not at startup of a CLI command that needs none

            lines.append(format_check(self.check))
        if self.stage_seconds:
            lines.append("  " + self.stages_line())
        if self.device:
            lines.append(f"  measured on {self.device.label()}")
        return "\n".join(lines)

    def stages_line(self) -> str:
        """One line: where this decision's seconds went."""
        parts = ", ".join(f"{k} {fmt_num(v, '.2f')}" for k, v in self.stage_seconds.items())
        judge = {"cold": "judge started cold", "warming": "judge pre-started, still warming",
                 "ready": "judge pre-started and ready"}.get(self.judge or "", "")
        # judge_built alone sets no total
        total = self.seconds or sum(v for v in self.stage_seconds.values() if isinstance(v, (int, float)))
        return f"seconds: {fmt_num(total, '.2f')} = {parts}" + (f" ({judge})" if judge else "")


@dataclass
class Candidate:
    task_dir: Path  # the candidate's copy of the task folder (a worktree's, or a replay folder)
    changed: list[str]  # paths changed against the best, relative to the repository root


def strip_comments(source: str) -> str:
    """C/C++ source without comments (so a comment naming a forbidden call does not trip a rule)."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', re.S)
    return pattern.sub(lambda m: m.group(0) if m.group(0)[0] in "\"'" else " ", source)


class Gate:
    def __init__(self, trusted_dir: Path, task_rel: str, config: GateConfig | None = None):
        """`trusted_dir`: the task folder as of the run's base commit; `task_rel`: its repo-relative path."""
        self.trusted_dir = Path(trusted_dir).resolve()  # the judge runs elsewhere: never a relative path
        self.task = load_task(self.trusted_dir)
        self.task_rel = task_rel.strip("/")
        self.config = config or GateConfig()
        self._recorded_times: dict[str, dict[str, float]] = {}  # lib -> shape -> seconds when it was accepted
        # accepts since the e2e check last ran (`every:N`); a resumed session sets it from its record
        self.accepts_since_e2e = 0
        self._inline_e2e: tuple[str, E2EReport] | None = None  # (lib, report) the gate's judge ran inline
        # progress callback: on_stage(stage, state, ok=None, seconds=None), e.g. ("check", "started")
        self.on_stage = None
        # one pre-started judge for the next decision, warming while the agent works
        self.standby = StandbySlot(self.trusted_dir, enabled=self.config.standby)
        weakref.finalize(self, self.standby.close)

    def close(self) -> None:
        """Stop the pre-started judge (a later decision starts a new one)."""
        self.standby.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _stage(self, stage: str, state: str, **info) -> None:
        if self.on_stage is not None:
            self.on_stage(stage, state, **info)

    # -- stages ----------------------------------------------------------------------------------
    def out_of_scope(self, cand: Candidate) -> list[str]:
        """Changed paths the candidate may not touch (tools/scope.py: the same rule as the file tools')."""
        return self.paths_out_of_scope(cand.changed, cand.task_dir)

    def paths_out_of_scope(self, changed: list[str], task_dir: Path) -> list[str]:
        """Of repo-relative `changed` paths, those outside the editable globs (or through a symlink)."""
        bad = []
        prefix = self.task_rel + "/" if self.task_rel not in ("", ".") else ""
        for path in changed:
            rel = path[len(prefix):] if prefix and path.startswith(prefix) else (path if not prefix else None)
            if rel is None or change_refusal(self.task, rel, by_submit=True):
                bad.append(path)
            elif symlink_component(task_dir, rel):
                bad.append(f"{path} (symlink)")
        return bad

    def write_knobs(self, task_dir: Path, knobs: dict) -> dict:
        """Validate `knobs` against the trusted manifest and write them into task_dir's knobs.toml
        over the settings already there; returns the full setting. TaskError names a bad knob or value."""
        current = self.task.knob_settings(task_dir)
        current.update(self.task.resolve_knobs(knobs))
        self.task.write_knob_settings(task_dir, current)
        return current

    def static_hits(self, cand: Candidate) -> list[str]:
        hits = []
        rules = [(f.pattern, f.reason) for f in self.task.manifest.forbidden]
        if self.task.target == "triton":  # rules on the Python AST (tools/triton_rules.py): the build refuses them too
            from tools.triton_rules import check_task_sources

            hits += [str(v) for v in check_task_sources(self.task, cand.task_dir)]
        else:
            rules = source_rules(self.task.manifest.threads, self.task.target) + rules
        for rel in self.task.editable_files(cand.task_dir):
            text = strip_comments((cand.task_dir / rel).read_text(errors="replace"))
            for pattern, reason in rules:
                for m in re.finditer(pattern, text):
                    line = text.count("\n", 0, m.start()) + 1
                    hits.append(f"{rel}:{line}: `{m.group(0).strip()}` — {reason}")
                    break
        return hits

    def source_tree(self, cand: Candidate, dest: Path) -> Path:
        """The trusted task folder with the candidate's editable files (and knob settings) over it."""
        shutil.copytree(self.trusted_dir, dest, symlinks=True)
        for rel in self.task.editable_files(dest) + [KNOBS_FILE]:
            (dest / rel).unlink(missing_ok=True)
        for rel in self.task.editable_files(cand.task_dir) + [KNOBS_FILE]:
            src = cand.task_dir / rel
            if src.is_file() and not src.is_symlink():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dest / rel)
        return dest

    def build(self, cand: Candidate) -> BuildResult:
        with tempfile.TemporaryDirectory(prefix="kloop-gate-") as tmp:
            src = self.source_tree(cand, Path(tmp) / "task")
            return build(self.task, src_root=src, timeout=self.task.manifest.timeout_s)

    def audit(self, built: BuildResult) -> AuditReport:
        """What was built: imported symbols, syscall instructions, load-time code, headers read, the
        source rules on preprocessed text (tools/audit.py)."""
        return audit_task_build(self.task, Path(built.build_dir))

    # -- the whole evaluation --------------------------------------------------------------------
    def evaluate(self, cand: Candidate, best: BuildResult | None, max_seconds: float | None = None,
                 upto: Upto = "timing", look: int = 1) -> Verdict:
        """Judge a candidate against the best build (None: a baseline evaluation, no timing).
        `max_seconds`: this decision's timing cap (default: the config's). `look`: which timed decision
        against this best this is (1 + the timed decisions the run record holds against it: each
        spends from the best's one error budget). `upto` "check" or "audit"
        stops after that layer (the best then only says whether anything changed); what passes comes
        back rejected at stage "partial", never accepted."""
        started = time.monotonic()
        stages: dict[str, float] = {}
        clock = [started]
        sass_job: list = []  # the SASS figures, read from the binary while the judge runs it

        def lap(name: str) -> None:
            now = time.monotonic()
            stages[name] = round(stages.get(name, 0.0) + now - clock[0], 3)
            clock[0] = now

        def done(v: Verdict) -> Verdict:
            if not stages:
                lap("scope")
            judged = v.stage_seconds  # processes, check, timing: measured around the judge
            if v.build is not None and v.build.ok and v.build.lib:  # the record keeps what the build became
                v.sass, v.sass_error = sass_job[0].result() if sass_job else sass_figures(self.task, v.build.lib)
            sass_wait = round(time.monotonic() - clock[0], 3)
            v.stage_seconds = {**stages, **judged, "sass": sass_wait} if v.build is not None else {**stages, **judged}
            v.seconds = round(time.monotonic() - started, 2)
            return v

        if best is not None and not cand.changed:
            return done(Verdict(accepted=False, stage="scope", reason="nothing changed against the best"))
        bad = self.out_of_scope(cand)
        if bad:
            return done(Verdict(accepted=False, stage="scope", out_of_scope=bad,
                                reason=f"changes outside the editable files {self.task.manifest.editable}: {', '.join(bad)}"))
        try:
            hits = self.static_hits(cand)
        except (OSError, TaskError) as exc:
            return done(Verdict(accepted=False, stage="static", reason=f"cannot read the candidate: {exc}"))
        if hits:
            return done(Verdict(accepted=False, stage="static", static_hits=hits,
                                reason="forbidden patterns: " + "; ".join(hits)))
        lap("scope")
        self.standby.refill()  # the first decision's judge warms up during the build
        self._stage("build", "started")
        try:
            built = self.build(cand)
        except TaskError as exc:  # e.g. a knobs.toml with a value the manifest does not allow
            self._stage("build", "finished", ok=False, seconds=time.monotonic() - started)
            lap("build")
            return done(Verdict(accepted=False, stage="build", reason=str(exc)))
        self._stage("build", "finished", ok=built.ok, seconds=time.monotonic() - started)
        lap("build")
        if not built.ok:
            return done(Verdict(accepted=False, stage="build", build=built,
                                reason="build failed: " + built.error_text()[:1500]))
        if self.task.on_gpu and built.lib:  # cuobjdump reads the binary, never runs it
            pool = ThreadPoolExecutor(1, thread_name_prefix="kloop-sass")
            sass_job.append(pool.submit(sass_figures, self.task, built.lib))
            pool.shutdown(wait=False)
        try:
            audited = self.audit(built)
        except (AuditError, OSError) as exc:
            lap("audit")
            return done(Verdict(accepted=False, stage="build", build=built, reason=f"audit of the build failed: {exc}"))
        lap("audit")
        if not audited.ok:
            return done(Verdict(accepted=False, stage="build", build=built, audit=audited,
                                reason="audit of what was built: " + audited.reason()))
        if upto == "audit":
            return done(Verdict(accepted=False, stage="partial", build=built, audit=audited,
                                reason="scope, static rules, build and audit pass; check and timing not run"))
        verdict = self.judge_built(built, best if upto == "timing" else None, max_seconds=max_seconds, look=look)
        if upto != "timing" and verdict.accepted:
            verdict = verdict.model_copy(update=dict(accepted=False, stage="partial",
                                                     reason="correct on fresh inputs; timing not run"))
        elif verdict.accepted and best is not None:
            verdict = self.e2e_stage(verdict, built)
        clock[0] = time.monotonic()
        return done(verdict)

    # -- the end-to-end stage (tools/e2e.py): after every other stage accepted ---------------------
    def e2e_due(self) -> bool:
        """Does the next accept run the task's e2e check (its `when`, the accepts since it last ran)?"""
        from tools.e2e import due

        cfg = self.task.manifest.e2e
        return bool(cfg and self.config.e2e and due(cfg.when, self.accepts_since_e2e))

    def e2e_stage(self, verdict: Verdict, built: BuildResult) -> Verdict:
        """A verdict every other stage accepted, after the e2e check where it is due: rejected at stage
        "e2e" (both loss figures in the reason) when training with the candidate moves off the reference."""
        if not self.e2e_due():
            if self.task.manifest.e2e:
                self.accepts_since_e2e += 1
            return verdict
        inline, self._inline_e2e = self._inline_e2e, None
        if inline is not None and inline[0] == built.lib:  # run by the gate's own judge, after the timing
            report, seconds = inline[1], dict(verdict.stage_seconds)
        else:
            self._stage("e2e", "started")
            res, stages = self.run_e2e(built.lib)
            seconds = {**verdict.stage_seconds, "e2e": round(sum(stages.values()), 3)}
            report = res.e2e or E2EReport(passed=False, reason=f"the e2e check did not complete: {res.error}")
            self._stage("e2e", "finished", ok=report.passed, seconds=seconds["e2e"])
        if report.passed:
            self.accepts_since_e2e = 0
            return verdict.model_copy(update=dict(e2e=report, stage_seconds=seconds))
        return verdict.model_copy(update=dict(
            accepted=False, stage="e2e", e2e=report, stage_seconds=seconds,
            reason=f"{report.reason} (every earlier stage passed: {verdict.reason})"))

    def run_e2e(self, lib: str):
        """The task's e2e check of `lib` in a judge (fresh secret seed): (WorkerResult, its stages)."""
        cfg = self.task.manifest.e2e
        req = WorkerRequest(kind="e2e", task_dir=str(self.trusted_dir), libs=[lib], seed=secrets.randbits(62))
        return self._run_judge(req, timeout=(cfg.timeout_s if cfg else 60) + self.task.manifest.timeout_s)

    def _run_judge(self, req: WorkerRequest, timeout: float):
        """The request answered by the pre-started judge (or a fresh one), with the judge's stages:
        processes = its wall time less check and timing."""
        t0 = time.monotonic()
        res = run_worker(req, timeout=timeout, standby=self.standby.take())
        wall = time.monotonic() - t0
        self.standby.refill()  # the next decision's judge warms up while the agent works (not on a Ctrl-C)
        inner = {k: v for k, v in res.stage_seconds.items() if k in ("check", "timing", "e2e")}
        stages = {"processes": round(max(0.0, wall - sum(inner.values())), 3), **inner}
        return res, stages

    def judge_built(self, built: BuildResult, best: BuildResult | None, max_seconds: float | None = None,
                    look: int = 1) -> Verdict:
        """The runtime layers on a built library, in ONE judge process: check in the candidate's runner,
        then (against `best`, whose runner starts meanwhile) paired timing."""
        check_seed = secrets.randbits(62)
        planned, planned_rounds = self.task.check_plan("gate")  # the long check (manifest [check])
        check_shapes = [s.name for s in planned]
        rounds = max(planned_rounds or 0, self.config.check_rounds)
        self._stage("check", "started")
        if best is None:
            req = WorkerRequest(kind="check", task_dir=str(self.trusted_dir), libs=[built.lib], shapes=check_shapes,
                                seed=check_seed, rounds=rounds)
            res, stages = self._run_judge(req, timeout=self.task.manifest.timeout_s)
        else:
            timing_seed = secrets.randbits(62)
            seconds = max_seconds or self.config.max_seconds
            req = self.ab_request(best.lib, built.lib, timing_seed, max_seconds=seconds, look=look).model_copy(update={
                "kind": "gate", "seed": check_seed, "timing_seed": timing_seed, "check_shapes": check_shapes,
                "rounds": rounds, "e2e": self.e2e_due(), "e2e_seed": secrets.randbits(62)})
            res, stages = self._run_judge(req, timeout=2 * self.task.manifest.timeout_s + (MIN_EVIDENCE_STRETCH + 1) * seconds + 60)
        ran = dict(stage_seconds=stages, judge=res.standby)
        self._inline_e2e = (built.lib, res.e2e) if res.e2e is not None else None  # for e2e_stage
        if res.check is None:
            return Verdict(accepted=False, stage="check", build=built, device=res.device, check_seed=check_seed,
                           reason=f"check did not complete: {res.error}", **ran)
        if not res.check.passed:
            first = res.check.failures()[0]
            return Verdict(accepted=False, stage="check", build=built, check=res.check, device=res.device,
                           check_seed=check_seed, reason=f"wrong results: {_describe_failure(first)}", **ran)
        if best is None:
            return Verdict(accepted=True, stage="accepted", build=built, check=res.check, device=res.device,
                           check_seed=check_seed, reason="baseline passes its check", **ran)
        return self._timed_verdict(res, built, best, res.check, check_seed, timing_seed).model_copy(update=ran)

    def decide(self, built: BuildResult, best: BuildResult, check: CheckReport, check_seed: int, look: int = 1) -> Verdict:
        """Paired timing alone in a fresh judge, then `judge`."""
        m = self.task.manifest
        timing_seed = secrets.randbits(62)
        self._stage("timing", "started")
        started = time.monotonic()
        res, stages = self._run_judge(self.ab_request(best.lib, built.lib, timing_seed, look=look),
                                      timeout=m.timeout_s + (MIN_EVIDENCE_STRETCH + 1) * self.config.max_seconds + 60)
        verdict = self._timed_verdict(res, built, best, check, check_seed, timing_seed)
        return verdict.model_copy(update=dict(stage_seconds=stages, judge=res.standby,
                                              seconds=round(time.monotonic() - started, 2)))

    def _timed_verdict(self, res, built: BuildResult, best: BuildResult, check, check_seed: int, timing_seed: int) -> Verdict:
        m = self.task.manifest
        common = dict(build=built, check=check, device=res.device, check_seed=check_seed, timing_seed=timing_seed)
        if not res.ok or res.ab is None:
            return Verdict(accepted=False, stage="timing", reason=f"timing did not complete: {res.error}",
                           min_gain=m.min_gain, **common)
        measured = {s.shape for s in res.ab.shapes}
        missing = [sh.name for sh in self.task.bench_shapes if sh.name not in measured]
        if missing:  # fail closed: a speedup over some shapes says nothing of the others
            return Verdict(accepted=False, stage="timing", ab=res.ab, min_gain=m.min_gain, **common,
                           reason="timing did not measure every bench shape: " + ", ".join(missing))
        recorded = self._recorded_times.get(best.lib, {})
        for s in res.ab.shapes:
            s.baseline_a = recorded.get(s.shape)
        verdict = self.judge(res.ab, **common)
        if verdict.accepted:  # the new best's own times (the estimate's): later decisions check the best against them
            self._recorded_times[built.lib] = {s.shape: s.time_b for s in verdict.ab.shapes}
        return verdict

    def remember_times(self, lib: str, times: dict[str, float]) -> None:
        """The best's per-shape seconds per call as recorded when it became the best (the run record's:
        agent/session.py loads them in every process), for the sabotage check of later decisions."""
        if times:
            self._recorded_times[lib] = dict(times)

    def rules(self, look: int = 1, allowances: dict[str, float] | None = None) -> DecisionRules:
        """The decision rules of the `look`-th timed decision against one best (the judge's loop gets
        the same through the request: tools/ab.decision_rules)."""
        from tools.ab import MIN_PASSES

        cfg = self.config
        return DecisionRules(min_gain=self.task.manifest.min_gain, min_passes=MIN_PASSES,
                             allowances=allowances or {s.name: self.task.allowance(s) for s in self.task.bench_shapes},
                             alpha=look_alpha(cfg.false_accept_rate, look), noisy_halfwidth=cfg.noisy_halfwidth,
                             target_halfwidth=cfg.target_halfwidth, min_pairs=cfg.min_pairs)

    def ab_request(self, best_lib: str, cand_lib: str, seed: int, max_seconds: float | None = None,
                   look: int = 1) -> WorkerRequest:
        shapes = self.task.bench_shapes
        rules = self.rules(look)
        return WorkerRequest(
            kind="ab", task_dir=str(self.trusted_dir), libs=[best_lib, cand_lib], shapes=[s.name for s in shapes],
            seed=seed, max_seconds=max_seconds or self.config.max_seconds, min_pairs=rules.min_pairs,
            target_halfwidth=rules.target_halfwidth, noisy_halfwidth=rules.noisy_halfwidth, alpha=rules.alpha,
            look=look, min_gain=rules.min_gain, allowances=rules.allowances, weights={s.name: s.weight for s in shapes},
            cpu_placement=self.config.cpu_placement, cuda_placement=self.config.cuda_placement,
            cuda_request_s=self.config.cuda_request_s,
        )

    def judge(self, ab: ABReport, **evidence) -> Verdict:
        """The decision from paired timings alone (pure: the gate's benchmark calls it directly).

        Order: wrong timed outputs, escaped work (failing closed when the probes are missing), then the
        speed question. A shape counts as regressed only when its whole interval lies below the
        allowance; an interval too wide to say either way is "undecided (noisy machine)": never a
        regression and never an accept.
        """
        m = self.task.manifest
        ab, crit = self.estimated(ab)
        common = dict(evidence, ab=ab, speedup=ab.speedup, speedup_lo=ab.speedup_lo, speedup_hi=ab.speedup_hi,
                      min_gain=m.min_gain)
        problem = self.integrity_problem(ab)
        if problem is not None:
            stage, reason = problem
            # the one undecided integrity layer a longer gate can settle (a speedup not finite; the only
            # one reached with it) advises twice the seconds, as its text says
            seconds = self._longer_gate(ab) if stage == "undecided" and self._speedup_not_finite(ab) else None
            return Verdict(accepted=False, stage=stage, **common, reason=reason, decide_seconds=seconds)
        return self._speed_verdict(ab, crit, common)

    @staticmethod
    def _speedup_not_finite(ab: ABReport) -> bool:
        """Enough passes, yet a speedup or bound (overall or of a shape) that is not finite and positive."""
        from tools.ab import MIN_PASSES

        return ab.passes >= MIN_PASSES and not all(_finite(x) and x > 0 for x in (
            ab.speedup, ab.speedup_lo, ab.speedup_hi, *(v for s in ab.shapes for v in (s.speedup, s.speedup_lo, s.speedup_hi))))

    def _longer_gate(self, ab: ABReport) -> int:
        """Twice the seconds this timing took (the cap where it did not say), at most the most a gate may take."""
        spent = ab.timing_seconds if _finite(ab.timing_seconds) and ab.timing_seconds > 0 else self.config.max_seconds
        return min(MAX_GATE_SECONDS, math.ceil(2 * spent))

    def estimated(self, ab: ABReport):
        """(a copy of the report whose speedups, intervals and per-shape times are the criterion's, the
        criterion): rebuilt from the per-pass times at the report's look, so no figure of a verdict comes
        from anywhere but the one estimator."""
        from tools.ab import criterion_of

        known = {sh.name for sh in self.task.bench_shapes}
        allowances = {s.shape: self.task.allowance(self.task.shape(s.shape)) for s in ab.shapes if s.shape in known}
        crit = criterion_of(ab, self.rules(max(1, ab.look), allowances))
        ab = ab.model_copy(deep=True)
        alpha = crit.rules.alpha
        ab.passes, ab.alpha = crit.passes, alpha
        if not crit.passes:  # nothing to estimate from: no figure at all (the report's own are not believed)
            ab.speedup = ab.speedup_lo = ab.speedup_hi = math.nan
            for s in ab.shapes:
                s.speedup = s.speedup_lo = s.speedup_hi = math.nan
            return ab, crit
        total = crit.estimate()
        ab.speedup, (ab.speedup_lo, ab.speedup_hi) = total.speedup, total.interval(alpha)
        for s in ab.shapes:
            e = crit.shape_estimate(s.shape)
            s.speedup, (s.speedup_lo, s.speedup_hi) = e.speedup, e.interval(alpha)
            s.log_speedup, s.log_speedup_se = e.log_ratio, (e.se if math.isfinite(e.se) else 1e9)
            s.time_a, s.time_b = e.mean_a, e.mean_b
        return ab, crit

    def integrity_problem(self, ab: ABReport) -> tuple[Stage, str] | None:
        """What the timing integrity layers find in a paired-timing report, before any speed question
        (None: nothing): wrong timed outputs, no shape measured, a time below the physics floor, probes
        missing or not finite (fail closed), work escaping the timed region, a speedup that is not
        finite, the best far slower than its recorded time. `kloop audit` asks this alone."""
        wrong = [s for s in ab.shapes if not s.timed_outputs_ok]
        if wrong:
            return "timing", "outputs of timed calls are wrong: " + "; ".join(
                f"{s.shape}: {s.timed_outputs_problem}" for s in wrong)
        if not ab.shapes:
            return "timing", "timing measured no shape"
        known = {sh.name for sh in self.task.bench_shapes}
        unknown = [s.shape for s in ab.shapes if s.shape not in known]
        if unknown:  # fail closed: no allowance or weight of the task's applies to them
            return "timing", ("timing reported shapes the task does not time: " + ", ".join(repr(u) for u in unknown[:5])
                              + f" (its bench shapes: {', '.join(sorted(known))})")
        impossible = [s for s in ab.shapes if _finite(s.floor_s) and _finite(s.time_b) and s.time_b < s.floor_s]
        if impossible:
            return "timing", "faster than physics allows (cached, skipped or mis-timed work): " + "; ".join(
                f"{s.shape}: {fmt_us(s.time_b)} per call, below the roofline floor of {fmt_us(s.floor_s)}" for s in impossible)
        unmeasured = [s for s in ab.shapes if not _integrity_measured(s)]
        unmeasured += [s for s in ab.shapes if s not in unmeasured and not (s.time_a > 0 and s.time_b > 0)]
        if unmeasured:
            return "timing", ("integrity probes missing or not finite (cannot rule out work outside the timed region) on "
                              + ", ".join(s.shape for s in unmeasured))
        escaped = [s for s in ab.shapes if self._escaped(s)]
        if escaped:
            return "timing", "work outside the timed region (other streams, host threads or work after return): " + "; ".join(
                f"{s.shape}: {fmt_us(s.extra_b)} per call outside the timed region vs {fmt_us(s.extra_a)} for the best "
                f"(allowed {fmt_us(self.escape_allowance(s))} more: {self.config.escape_sigmas:g} x sqrt 2 x the best's "
                f"probe spread {fmt_us(s.extra_a_se)}, floor {self.config.escape_rel_floor:.0%} of its time), "
                f"of which after return {fmt_us(s.after_return_b)} vs {fmt_us(s.after_return_a)} "
                f"(timed {fmt_us(s.time_b)} vs {fmt_us(s.time_a)}; wall until idle {fmt_us(s.wall_b)} vs {fmt_us(s.wall_a)}; "
                f"{s.probes} cold probes each)" for s in escaped)
        untimed = [s for s in ab.shapes if _finite(s.probe_call_a) and _finite(s.probe_call_b)
                   and s.probe_call_b > self.untimed_call_allowance(s)]
        if untimed:
            return "timing", "work in untimed calls (the cold probes, which no sample charges): " + "; ".join(
                f"{s.shape}: a probe's call took {fmt_us(s.probe_call_b)} on average vs {fmt_us(s.probe_call_a)} for the "
                f"best's (allowed up to {fmt_us(self.untimed_call_allowance(s))}: {self.config.untimed_call_factor:g} x the "
                f"best's plus one of its timed calls, {fmt_us(s.time_a)}, scaled by the candidate's own timed calls "
                f"where slower, {fmt_us(s.time_b)}"
                + (f", plus {fmt_us(self.config.untimed_call_gpu_host_s)} of host enqueue a timed call's spin hides"
                   if self.task.on_gpu else "") + f"; {s.probes} probes each)" for s in untimed)
        if self.task.on_gpu:
            untrailed = [s for s in ab.shapes if not (_finite(s.trail_a) and _finite(s.trail_b) and _finite(s.trail_a_se)
                                                       and s.trail_samples > 0)]
            if untrailed:
                return "timing", ("device work after the timed region not measured (cannot rule out work left on other "
                                  "streams) on " + ", ".join(s.shape for s in untrailed))
            trailed = [s for s in ab.shapes if s.trail_b - s.trail_a > self.trail_allowance(s)]
            if trailed:
                return "timing", "work outside the timed region (device work left running after the timed stream's end): " + "; ".join(
                    f"{s.shape}: the device stayed busy {fmt_us(s.trail_b)} per call after the timed region vs "
                    f"{fmt_us(s.trail_a)} for the best (lower quartile of {s.trail_samples} timed samples each, on the device's "
                    f"clock; allowed {fmt_us(self.trail_allowance(s))} more: {self.config.escape_sigmas:g} x sqrt 2 x the "
                    f"best's spread {fmt_us(s.trail_a_se)}, floor {self.config.escape_trail_rel_floor:.0%} of its time "
                    f"{fmt_us(s.time_a)})" for s in trailed)
            if self.task.target == "cuda":  # a Triton task's launch is ours: no candidate host code can touch the events
                # fails closed on a missing figure too: only fresh reports are judged (audit and replay re-time)
                unclocked = [s for s in ab.shapes
                             if not (_finite(s.offclock_a) and _finite(s.offclock_b) and _finite(s.offclock_a_se))]
                if unclocked:
                    return "timing", ("the judge's clock around the timed requests not measured (cannot rule out "
                                      "under-reported times) on " + ", ".join(s.shape for s in unclocked))
                offclock = [s for s in ab.shapes if abs(s.offclock_b - s.offclock_a) > self.offclock_allowance(s)]
                if offclock:
                    return "timing", "timing integrity (the runner's reported times disagree with the judge's clock): " + "; ".join(
                        f"{s.shape}: each timed request took {fmt_us(s.offclock_b)} per call beyond the times the candidate's "
                        f"runner reported vs {fmt_us(s.offclock_a)} for the best's (lower quartile of {s.trail_samples} timed "
                        f"samples each; allowed {fmt_us(self.offclock_allowance(s))} apart either way: "
                        f"{self.config.escape_sigmas:g} x sqrt 2 x the best's spread {fmt_us(s.offclock_a_se)}, floor "
                        f"{fmt_us(self.config.offclock_abs_floor_s)} or {self.config.offclock_rel_floor:.0%} of its time {fmt_us(s.time_a)} "
                        f"a request, over {s.calls_per_sample} call(s) a request). More: times under-reported; less: the runner skipped work every request does" for s in offclock)
        if self._speedup_not_finite(ab):
            return "undecided", (
                f"{UNDECIDED}: the speedup is not finite and positive. To decide: re-submit the same change with a longer "
                f"gate (--gate-seconds {self._longer_gate(ab)}; MCP: gate_seconds={self._longer_gate(ab)})")
        sabotaged = [s for s in ab.shapes if _finite(s.baseline_a) and s.baseline_a > 0
                     and s.time_a > self.config.best_slowdown_limit * s.baseline_a]
        if sabotaged:
            return "undecided", ("undecided: best slower than its baseline ("
                                 "the machine is far noisier than when the best was measured, or something slows the best): "
                                 + "; ".join(f"{s.shape}: best {fmt_us(s.time_a)} now vs {fmt_us(s.baseline_a)} when accepted"
                                             for s in sabotaged))
        return None

    def _speed_verdict(self, ab: ABReport, crit, common: dict) -> Verdict:
        """The speed question, once the integrity layers found nothing: the criterion's decision."""
        m = self.task.manifest
        d = crit.decision()
        allowed = {s.shape: 1 - self.task.allowance(self.task.shape(s.shape)) for s in ab.shapes}
        by_name = {s.shape: s for s in ab.shapes}
        needed = 1 + m.min_gain
        level = (f"interval at one-sided {100 * ab.alpha:.2g}% per bound (timed look {ab.look} at this best), "
                 f"{ab.passes} passes")
        interval = f"x{ab.speedup:.4f}, {level}: [{ab.speedup_lo:.4f}, {ab.speedup_hi:.4f}]"
        if d.kind == "regression":
            return Verdict(accepted=False, stage="timing", **common, reason="regression beyond the allowance on " + ", ".join(
                f"{s.shape} (x{s.speedup:.4f}, interval [{s.speedup_lo:.4f}, {s.speedup_hi:.4f}], allowed down to "
                f"x{allowed[s.shape]:.3f})" for s in (by_name[n] for n in d.regressed)) + f" ({level})")
        if d.kind == "accept":
            return Verdict(accepted=True, stage="accepted", **common, reason=(
                f"faster: workload time ratio {interval} > x{needed:.3f}"))
        if d.kind == "not faster":
            return Verdict(accepted=False, stage="timing", **common, reason=(
                f"not measurably faster: workload time ratio {interval}; the lower bound must exceed x{needed:.3f}"))
        maybe = [by_name[n] for n in d.maybe_regressed]
        why = {"too few passes": f"fewer than {crit.rules.min_passes} passes (or {crit.rules.min_pairs} pairs per shape) "
                                 "decide nothing",
               "too wide": f"the interval is wider than the noise limit (half-width {crit.rules.noisy_halfwidth} in log)",
               "maybe regressed": ", ".join(s.shape for s in maybe) + " may or may not regress beyond the allowance",
               }.get(d.why, "the interval straddles the threshold")
        if d.why == "too few passes":  # time for the passes first; the interval says nothing yet
            spent = ab.timing_seconds if _finite(ab.timing_seconds) and ab.timing_seconds > 0 else self.config.max_seconds
            want = math.ceil(spent * crit.rules.min_passes / max(1, ab.passes) * 1.2)
            seconds = min(MAX_GATE_SECONDS, max(want, math.floor(spent) + 1))
            advice = (f"To decide: re-submit the same change with --gate-seconds {seconds} (MCP: gate_seconds={seconds}): "
                      f"{ab.passes} passes took {spent:.1f} s here")
        else:
            seconds, advice = self.undecided_advice(ab, needed, maybe, allowed)
        return Verdict(accepted=False, stage="undecided", **common, decide_seconds=seconds, reason=(
            f"{UNDECIDED}: workload time ratio {interval} after {ab.pairs} pairs in {ab.timing_seconds:.1f} s "
            f"({ab.stopped_because or 'stopped'}): {why}; the lower bound must exceed x{needed:.3f}. " + advice))

    def undecided_advice(self, ab: ABReport, needed: float, maybe_regressed: list,
                         allowed: dict[str, float]) -> tuple[int | None, str]:
        """The gate seconds (None: not even the most) and what would decide an undecided verdict: the interval narrows with the square root of the
        pairs, so the pairs (and seconds) needed for its half-width to fall below the distance between
        the estimate and the threshold it straddles (the overall gain, and each shape's allowance)."""
        def factor(s: float, lo: float, hi: float, threshold: float) -> float:
            if not all(_finite(x) and x > 0 for x in (s, lo, hi, threshold)):
                return 4.0
            half = (math.log(hi) - math.log(lo)) / 2
            gap = abs(math.log(s) - math.log(threshold))
            return math.inf if gap < 1e-9 else max(1.0, (half / gap) ** 2)

        # (factor, what straddles which threshold): the workload's gain, then each shape's allowance
        factors = [(factor(ab.speedup, ab.speedup_lo, ab.speedup_hi, needed),
                    f"the estimate x{ab.speedup:.4f} sits too close to the threshold x{needed:.3f}")]
        factors += [(factor(s.speedup, s.speedup_lo, s.speedup_hi, allowed[s.shape]),
                     f"{s.shape}'s estimate x{s.speedup:.4f} sits too close to its allowance x{allowed[s.shape]:.3f}")
                    for s in maybe_regressed]
        worst, binding = max(factors, key=lambda f: f[0])
        grow = worst * 1.2  # a margin: the estimate moves too
        spent = ab.timing_seconds if _finite(ab.timing_seconds) and ab.timing_seconds > 0 else self.config.max_seconds
        want = spent * grow
        if want > MAX_GATE_SECONDS:
            return None, (f"To decide: even --gate-seconds {MAX_GATE_SECONDS} (the most) would likely not: "
                    f"{binding} for this machine's spread "
                    f"(about {grow:.0f}x the {ab.pairs} pairs would be needed). Make the change larger, or move on")
        seconds = min(MAX_GATE_SECONDS, max(math.ceil(want), math.floor(spent) + 1))
        return seconds, (f"To decide: re-submit the same change with --gate-seconds {seconds} (MCP: gate_seconds={seconds}): "
                f"about {math.ceil(ab.pairs * grow)} pairs instead of {ab.pairs} (the interval narrows with the square "
                "root of the pairs)")

    def escape_allowance(self, s) -> float:
        """Seconds per call the candidate's work outside the timed region may exceed the best's by:
        `escape_sigmas` robust standard errors of the best's own probes in this run (like for like:
        the same cold probes, the same machine, the same minute), plus a small relative floor. So the
        bound scales with the measured noise, not with the kernel's time: 10% hidden work is caught on
        a 16 us kernel as on a 1 ms one wherever the probes are steadier than that."""
        cfg = self.config
        se = s.extra_a_se if _finite(s.extra_a_se) else math.inf
        return max(cfg.escape_abs_floor_s, cfg.escape_rel_floor * s.time_a) + cfg.escape_sigmas * math.sqrt(2) * se

    def untimed_call_allowance(self, s) -> float:
        """Seconds a cold probe's call of the candidate may take on average: `untimed_call_factor` x the
        best's plus one of the best's timed calls, or the same scaled to the candidate's own timed calls
        when those are slower (an honestly slower kernel is slower cold too: that is a regression for
        the speed question, not work hidden in probes). A faster kernel's cold call is rarely slower than
        the best's; the factor leaves room for one that is, and for the noise of a few cold calls."""
        factor = self.config.untimed_call_factor
        own = s.time_b / s.time_a if _finite(s.time_b) and s.time_a > 0 and s.time_b > s.time_a else 1.0
        host = self.config.untimed_call_gpu_host_s if self.task.on_gpu else 0.0
        return (factor * s.probe_call_a + s.time_a) * own + host

    def offclock_allowance(self, s) -> float:
        """Seconds per call the candidate's judge-clock time beyond its reported times may differ from the best's:
        as `trail_allowance`, from the spread of the best's own requests over every timed sample, plus a floor."""
        cfg = self.config
        se = s.offclock_a_se if _finite(s.offclock_a_se) else math.inf
        # both floors are per request (what two runners' requests differ by), spread over the calls it holds: the
        # same as per call where a request holds one call or short ones (150 us / k exceeds a quarter of a call
        # there), and what lets a long request (GateConfig.cuda_request_s) bound a smaller lie
        per_request_floor = max(cfg.offclock_abs_floor_s, cfg.offclock_rel_floor * s.time_a)
        return per_request_floor / max(1, s.calls_per_sample) + cfg.escape_sigmas * math.sqrt(2) * se

    def trail_allowance(self, s) -> float:
        """Seconds per call the candidate's device work after the timed region may exceed the best's by: as
        `escape_allowance`, but from the spread of the best's own trailing times over every timed sample (it narrows
        with the samples, unlike the few probes, and no pipe's jitter is in it), plus a small floor."""
        cfg = self.config
        se = s.trail_a_se if _finite(s.trail_a_se) else math.inf
        per_sample_floor = cfg.escape_trail_abs_floor_s / max(1, s.calls_per_sample)  # the values are per call
        return max(per_sample_floor, cfg.escape_trail_rel_floor * s.time_a) + cfg.escape_sigmas * math.sqrt(2) * se

    def _escaped(self, s) -> bool:
        """Like with like: both sides measured by the same cold probes; only the difference counts,
        against the best's measured spread. Work after return, measured over every timed call, has its
        own bound: an honest runner sits blocked on its pipe, loaded machine or not."""
        if s.extra_b - s.extra_a > self.escape_allowance(s):
            return True
        if _finite(s.after_return_a) and _finite(s.after_return_b):
            return s.after_return_b - s.after_return_a > max(self.config.after_return_abs_s,
                                                             self.config.after_return_rel * s.time_a)
        return False


def _placement_note(ab: ABReport) -> str:
    """Where the pairs ran, when that matters to reading the timing line: a host that refused the pinning (the pairs
    then ran where the scheduler put them, as before tools/placement.py, and an offset between CPUs is possible)."""
    if ab.placement_error:
        return f"; pairs not pinned to one CPU ({ab.placement_error})"
    return ""


def _finite(x) -> bool:
    import math

    return isinstance(x, (int, float)) and math.isfinite(x)


def _integrity_measured(s) -> bool:
    return isinstance(s.probes, int) and s.probes > 0 and all(
        _finite(x) for x in (s.extra_a, s.extra_b, s.extra_a_se, s.wall_a, s.wall_b, s.time_a, s.time_b))


def sass_figures(task, lib: str) -> tuple[dict[str, dict], str | None]:
    """The SASS mix of a built library for the run record (CUDA only; reading the binary, never running it)."""
    from tools.evaluate import sass_summary

    mix, error = sass_summary(task, lib)
    keep = ("kernel", "total", "families", "memory", "mufu", "setmaxnreg")
    return {name: {k: v for k, v in summary.items() if k in keep} for name, summary in mix.items()}, error


def _describe_failure(s) -> str:
    if s.error:
        return f"shape {s.shape} (call {s.round}): {s.error}"
    if s.inputs_changed:
        return f"shape {s.shape} (call {s.round}): the kernel modified its inputs {s.inputs_changed}"
    parts = []
    for o in s.outputs:
        if not o.passed:
            if o.problem:
                parts.append(f"{o.name}: {o.problem}")
            else:
                parts.append(f"{o.name}: {o.mismatches}/{o.numel} elements wrong, {o.nonfinite} NaN/Inf, max abs err "
                             f"{fmt_num(o.max_abs, '.3g')}, norm rel err {fmt_num(o.norm_rel, '.3g')}; worst at {o.worst_index}: got "
                             f"{fmt_num(o.worst_got, '.6g')}, want {fmt_num(o.worst_want, '.6g')}")
    return f"shape {s.shape} (call {s.round}) {s.dims}: " + "; ".join(parts)
