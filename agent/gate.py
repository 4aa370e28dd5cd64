"""The gate: a candidate lands only when it is in scope, builds, is correct and is measurably faster.

Stages, each a reason to reject: scope (every changed path matches the task's editable globs),
static rules (forbidden patterns), build, check (fresh secret seed, every check shape, in a fresh
worker), paired A/B timing against the best (fresh worker; outputs of timed calls re-checked; work
escaping the timed stream detected), and the decision: the lower 95% bound of the weighted
geometric-mean speedup must clear 1 + min_gain with no shape regressing beyond its allowance.

The manifest, the spec and every non-editable file come from the trusted copy of the task (the
run's base commit), never from the candidate.
"""

from __future__ import annotations

import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from tools.scope import change_refusal, symlink_component
from tools.task import KNOBS_FILE, TaskError, load_task
from tools.audit import SOURCE_RULES, AuditError, AuditReport, audit_build
from tools.build import BuildResult, build
from tools.check import format_check
from tools.fmt import fmt_ms, fmt_speedup
from tools.protocol import ABReport, CheckReport, DeviceInfo, WorkerRequest
from tools.runner import run_worker

Stage = Literal["scope", "static", "build", "check", "timing", "accepted", "interrupted"]

# Built-in static rules: things no kernel needs and every cheat of a known kind does (applied to the
# raw sources here, and by the audit to the preprocessed text of what was built)
DEFAULT_FORBIDDEN = SOURCE_RULES


class GateConfig(BaseModel):
    max_seconds: float = 4.0  # timing seconds for one decision
    min_pairs: int = 20
    target_halfwidth: float = 0.004  # stop sampling when the log-speedup 95% interval is this tight
    check_rounds: int = 2
    # extra slowdown (s) the candidate may add outside the timed stream before it counts as escaping
    escape_abs_s: float = 30e-6
    escape_rel: float = 0.25
    # refuse to run where the host cannot sandbox untrusted code (tools/sandbox.py status())
    require_sandbox: bool = False


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
    device: DeviceInfo | None = None
    check_seed: int | None = None  # revealed after the decision, for the record
    timing_seed: int | None = None
    # SASS instruction mix per kernel (mangled name -> families, memory widths, MUFU, total) of what was built
    sass: dict[str, dict] = Field(default_factory=dict)
    sass_error: str | None = None

    def figures(self) -> dict:
        """The numbers a run record keeps (everything but bulky reports)."""
        return self.model_dump(mode="json", exclude={"check"}) | {
            "check_failures": [s.model_dump(mode="json") for s in (self.check.failures() if self.check else [])][:10],
        }

    def summary(self) -> str:
        head = f"{'ACCEPTED' if self.accepted else 'REJECTED'} at {self.stage}: {self.reason}"
        lines = [head]
        if self.ab:
            for s in self.ab.shapes:
                lines.append(f"  {s.shape}: {fmt_ms(s.time_a)} -> {fmt_ms(s.time_b)}, "
                             f"{fmt_speedup(s.speedup, s.speedup_lo, s.speedup_hi)} ({s.pairs} pairs)")
            lines.append(f"  timing: {self.ab.pairs} pairs in {self.ab.timing_seconds:.1f} s ({self.ab.stopped_because})")
        if self.check and not self.check.passed:
            lines.append(format_check(self.check))
        if self.device:
            lines.append(f"  measured on {self.device.label()}")
        return "\n".join(lines)


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
        self.trusted_dir = Path(trusted_dir)
        self.task = load_task(self.trusted_dir)
        self.task_rel = task_rel.strip("/")
        self.config = config or GateConfig()
        # progress callback: on_stage(stage, state, ok=None, seconds=None), e.g. ("check", "started")
        self.on_stage = None

    def _stage(self, stage: str, state: str, **info) -> None:
        if self.on_stage is not None:
            self.on_stage(stage, state, **info)

    # -- stages ----------------------------------------------------------------------------------
    def out_of_scope(self, cand: Candidate) -> list[str]:
        """Changed paths the candidate may not touch (tools/scope.py: the same rule as the file tools')."""
        bad = []
        prefix = self.task_rel + "/" if self.task_rel not in ("", ".") else ""
        for path in cand.changed:
            rel = path[len(prefix):] if prefix and path.startswith(prefix) else (path if not prefix else None)
            if rel is None or change_refusal(self.task, rel, by_submit=True):
                bad.append(path)
            elif symlink_component(cand.task_dir, rel):
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
        rules = [(p, r) for p, r in DEFAULT_FORBIDDEN] + [(f.pattern, f.reason) for f in self.task.manifest.forbidden]
        hits = []
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
        m = self.task.manifest
        return audit_build(Path(built.build_dir), m.target, sources=m.sources, allowed_symbols=m.allowed_symbols,
                           extra_rules=[(f.pattern, f.reason) for f in m.forbidden])

    # -- the whole evaluation --------------------------------------------------------------------
    def evaluate(self, cand: Candidate, best: BuildResult | None) -> Verdict:
        """Judge a candidate against the best build (None: a baseline evaluation, no timing)."""
        started = time.monotonic()

        def done(v: Verdict) -> Verdict:
            if v.build is not None and v.build.ok and v.build.lib:  # the record keeps what the build became
                v.sass, v.sass_error = sass_figures(self.task, v.build.lib)
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
        self._stage("build", "started")
        try:
            built = self.build(cand)
        except TaskError as exc:  # e.g. a knobs.toml with a value the manifest does not allow
            self._stage("build", "finished", ok=False, seconds=time.monotonic() - started)
            return done(Verdict(accepted=False, stage="build", reason=str(exc)))
        self._stage("build", "finished", ok=built.ok, seconds=time.monotonic() - started)
        if not built.ok:
            return done(Verdict(accepted=False, stage="build", build=built,
                                reason="build failed: " + built.error_text()[:1500]))
        try:
            audited = self.audit(built)
        except (AuditError, OSError) as exc:
            return done(Verdict(accepted=False, stage="build", build=built, reason=f"audit of the build failed: {exc}"))
        if not audited.ok:
            return done(Verdict(accepted=False, stage="build", build=built, audit=audited,
                                reason="audit of what was built: " + audited.reason()))
        check_seed = secrets.randbits(62)
        req = WorkerRequest(kind="check", task_dir=str(self.trusted_dir), libs=[built.lib],
                            shapes=[s.name for s in self.task.check_shapes], seed=check_seed,
                            rounds=self.config.check_rounds)
        self._stage("check", "started")
        res = run_worker(req, timeout=self.task.manifest.timeout_s)
        if not res.ok or res.check is None:
            return done(Verdict(accepted=False, stage="check", build=built, device=res.device, check_seed=check_seed,
                                reason=f"check did not complete: {res.error}"))
        if not res.check.passed:
            first = res.check.failures()[0]
            return done(Verdict(accepted=False, stage="check", build=built, check=res.check, device=res.device,
                                check_seed=check_seed, reason=f"wrong results: {_describe_failure(first)}"))
        if best is None:
            return done(Verdict(accepted=True, stage="accepted", build=built, check=res.check, device=res.device,
                                check_seed=check_seed, reason="baseline passes its check"))
        return done(self.decide(built, best, res.check, check_seed))

    def decide(self, built: BuildResult, best: BuildResult, check: CheckReport, check_seed: int) -> Verdict:
        """Paired timing in a fresh worker, then `judge`."""
        m = self.task.manifest
        timing_seed = secrets.randbits(62)
        self._stage("timing", "started")
        res = run_worker(self.ab_request(best.lib, built.lib, timing_seed), timeout=m.timeout_s + 4 * self.config.max_seconds + 60)
        common = dict(build=built, check=check, device=res.device, check_seed=check_seed, timing_seed=timing_seed)
        if not res.ok or res.ab is None:
            return Verdict(accepted=False, stage="timing", reason=f"timing did not complete: {res.error}",
                           min_gain=m.min_gain, **common)
        return self.judge(res.ab, **common)

    def ab_request(self, best_lib: str, cand_lib: str, seed: int) -> WorkerRequest:
        shapes = self.task.bench_shapes
        return WorkerRequest(
            kind="ab", task_dir=str(self.trusted_dir), libs=[best_lib, cand_lib], shapes=[s.name for s in shapes],
            seed=seed, max_seconds=self.config.max_seconds, min_pairs=self.config.min_pairs,
            target_halfwidth=self.config.target_halfwidth, min_gain=self.task.manifest.min_gain,
            allowances={s.name: self.task.allowance(s) for s in shapes}, weights={s.name: s.weight for s in shapes},
        )

    def judge(self, ab: ABReport, **evidence) -> Verdict:
        """The decision from paired timings alone (pure: the gate's benchmark calls it directly)."""
        m = self.task.manifest
        common = dict(evidence, ab=ab, speedup=ab.speedup, speedup_lo=ab.speedup_lo, speedup_hi=ab.speedup_hi,
                      min_gain=m.min_gain)
        wrong = [s for s in ab.shapes if not s.timed_outputs_ok]
        if wrong:
            return Verdict(accepted=False, stage="timing", **common,
                           reason="outputs of timed calls are wrong: " + "; ".join(f"{s.shape}: {s.timed_outputs_problem}" for s in wrong))
        escaped = [s for s in ab.shapes if self._escaped(s)]
        if escaped:
            return Verdict(accepted=False, stage="timing", **common, reason="work outside the timed stream (other streams, or host time per call): " + "; ".join(
                f"{s.shape}: events {s.time_b * 1e6:.1f} us but {s.wall_b * 1e6:.1f} us until the device is idle "
                f"(best: {s.time_a * 1e6:.1f} / {s.wall_a * 1e6:.1f} us)" for s in escaped))
        regressed = [s for s in ab.shapes if s.speedup < 1 - self.task.allowance(self.task.shape(s.shape))]
        if regressed:
            return Verdict(accepted=False, stage="timing", **common, reason="regression beyond the allowance on " + ", ".join(
                f"{s.shape} (x{s.speedup:.4f}, allowed down to x{1 - self.task.allowance(self.task.shape(s.shape)):.3f})" for s in regressed))
        needed = 1 + m.min_gain
        if ab.speedup_lo <= needed:
            return Verdict(accepted=False, stage="timing", **common, reason=(
                f"not measurably faster: speedup x{ab.speedup:.4f}, 95% interval [{ab.speedup_lo:.4f}, {ab.speedup_hi:.4f}]; "
                f"the lower bound must exceed x{needed:.3f}"))
        return Verdict(accepted=True, stage="accepted", **common, reason=(
            f"faster: x{ab.speedup:.4f}, 95% interval [{ab.speedup_lo:.4f}, {ab.speedup_hi:.4f}] > x{needed:.3f}"))

    def _escaped(self, s) -> bool:
        if s.wall_a is None or s.wall_b is None:
            return False
        extra = (s.wall_b - s.time_b) - (s.wall_a - s.time_a)
        return extra > max(self.config.escape_abs_s, self.config.escape_rel * s.time_a)


def sass_figures(task, lib: str) -> tuple[dict[str, dict], str | None]:
    """The SASS mix of a built library for the run record (CUDA only; reading the binary, never running it)."""
    from tools.evaluate import sass_summary

    mix, error = sass_summary(task, lib)
    keep = ("kernel", "total", "families", "memory", "mufu")
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
                             f"{o.max_abs:.3g}, norm rel err {o.norm_rel:.3g}; worst at {o.worst_index}: got "
                             f"{o.worst_got:.6g}, want {o.worst_want:.6g}")
    return f"shape {s.shape} (call {s.round}) {s.dims}: " + "; ".join(parts)
