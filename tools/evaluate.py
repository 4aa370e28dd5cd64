"""The evaluation pipeline behind `kloop eval` and the agent's tools: build, SASS, check, time.

Untrusted code (the built library) only ever runs in a runner process, driven by a judge
(tools/judge_handle.py -> tools/worker.py -> tools/runner.py -> tools/libhost.py).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import BaseModel, Field

from tools.task import KnobValue, Task
from tools.audit import AuditError, AuditReport, audit_task_build
from tools.build import BuildResult, build
from tools.protocol import BenchReport, CheckReport, DeviceInfo, WorkerRequest, WorkerResult
from tools.judge_handle import JudgeStandby, StandbySlot, run_worker

BENCH_SECONDS_PER_SHAPE = 1.0


class EvalReport(BaseModel):
    task: str
    target: str
    build: BuildResult
    sass: dict = Field(default_factory=dict)  # kernel -> SassSummary as a dict
    sass_error: str | None = None
    audit: AuditReport | None = None  # the gate's audit of what was built (tools/audit.py)
    audit_error: str | None = None
    check: CheckReport | None = None
    check_error: str | None = None
    bench: BenchReport | None = None
    bench_error: str | None = None
    device: DeviceInfo | None = None

    @property
    def ok(self) -> bool:
        return self.build.ok and self.check is not None and self.check.passed


def worker_timeout(task: Task, extra: float = 0.0) -> float:
    return task.manifest.timeout_s + extra


def run_check(task: Task, lib: str, seed: int | None = None, shapes: list[str] | None = None,
              rounds: int | None = None, trusted_dir: Path | None = None, standby: JudgeStandby | None = None,
              plan: str = "gate") -> WorkerResult:
    """Check `lib` in a fresh worker (or `standby`, a pre-started one); the manifest and spec come
    from `trusted_dir` (default task.root). Unnamed shapes and rounds come from the manifest's check
    `plan`: "gate" (the long check the gate runs, `kloop eval`) or "quick" (the agent's check tool)."""
    planned, planned_rounds = task.check_plan("quick" if plan == "quick" else "gate")
    req = WorkerRequest(kind="check", task_dir=str(trusted_dir or task.root), libs=[lib],
                        shapes=shapes or [s.name for s in planned],
                        seed=secrets.randbits(62) if seed is None else seed, rounds=rounds or planned_rounds or 2)
    return run_worker(req, timeout=worker_timeout(task), standby=standby)


def run_e2e(task: Task, lib: str, seed: int | None = None, trusted_dir: Path | None = None) -> WorkerResult:
    """The task's end-to-end training check of `lib` (tools/e2e.py) in a fresh judge: what runs before
    an export (`e2e.when = "export"`) or by hand."""
    cfg = task.manifest.e2e
    req = WorkerRequest(kind="e2e", task_dir=str(trusted_dir or task.root), libs=[lib],
                        seed=secrets.randbits(62) if seed is None else seed)
    return run_worker(req, timeout=worker_timeout(task, extra=cfg.timeout_s if cfg else 0))


def run_bench_many(task: Task, libs: list[str], shapes: list[str] | None = None,
                   seconds_per_shape: float = BENCH_SECONDS_PER_SHAPE, trusted_dir: Path | None = None) -> WorkerResult:
    """Quick-bench several libraries (a sweep's settings) in ONE judge: each library still in a runner
    of its own, started together, timed one after another (no comparators). A judge's start (its
    torch import and device context, seconds on the H200) is paid once per batch, not per setting.
    The answer's `benches`/`bench_errors` hold one entry per library, in order (one library: the
    ordinary bench, its answer in the same form)."""
    if len(libs) == 1:
        one = run_bench(task, libs[0], shapes=shapes, comparators=False, seconds_per_shape=seconds_per_shape,
                        trusted_dir=trusted_dir)
        return one.model_copy(update={"ok": True, "benches": [one.bench],
                                      "bench_errors": [None if one.bench else one.error]})
    names = [s.name for s in task.bench_shapes] if shapes is None else shapes
    req = WorkerRequest(kind="bench", task_dir=str(trusted_dir or task.root), libs=list(libs), shapes=names,
                        seed=secrets.randbits(62), comparators=False, max_seconds=seconds_per_shape)
    budget = len(libs) * len(names) * seconds_per_shape
    return run_worker(req, timeout=worker_timeout(task, extra=4 * budget + 60))


def run_bench(task: Task, lib: str | None, shapes: list[str] | None = None, comparators: bool = True,
              seconds_per_shape: float = BENCH_SECONDS_PER_SHAPE, trusted_dir: Path | None = None,
              standby: JudgeStandby | None = None) -> WorkerResult:
    names = shapes or [s.name for s in task.bench_shapes]
    req = WorkerRequest(kind="bench", task_dir=str(trusted_dir or task.root), libs=[lib] if lib else [],
                        shapes=names, seed=secrets.randbits(62), comparators=comparators,
                        max_seconds=seconds_per_shape)
    budget = len(names) * seconds_per_shape * (1 + 0.5 * len(task_comparators(task)) if comparators else 1)
    return run_worker(req, timeout=worker_timeout(task, extra=4 * budget + 60), standby=standby)


def task_comparators(task: Task) -> list[str]:
    from tools.spec import load_spec

    try:
        return list(load_spec(task.spec_path).comparators)
    except Exception:
        return []


def sass_summary(task: Task, lib: str) -> tuple[dict, str | None]:
    if not task.on_gpu:
        return {}, None
    try:
        from tools.sass import sass_mix

        mix = sass_mix(Path(lib))
        return {k: (v.model_dump() if hasattr(v, "model_dump") else v) for k, v in mix.items()}, None
    except Exception as exc:  # no cuobjdump here: say so, the rest of the evaluation stands
        return {}, f"{type(exc).__name__}: {exc}"


def audit_of(task: Task, built: BuildResult) -> tuple[AuditReport | None, str | None]:
    """The gate's audit of a successful build, or why it could not run (the gate would reject then)."""
    try:
        return audit_task_build(task, Path(built.build_dir)), None
    except (AuditError, OSError) as exc:
        return None, str(exc)


def unsandboxed_refusal(task: Task, built: BuildResult) -> str | None:
    """Why a built candidate must not be loaded here, or None. Without a sandbox its code runs with
    the user's rights, so the tools that load it (check, bench, sweep, profile) first run the gate's
    audit of what was built and load nothing the gate would refuse. With a sandbox the runner is
    the boundary, and the audit is left to `build` and the gate."""
    from tools.audit import audit_line
    from tools.sandbox import status

    if status().available:
        return None
    audit, error = audit_of(task, built)
    if audit is not None and audit.ok:
        return None
    return ("not run: there is no sandbox on this host (" + status().reason + "), so candidate code is loaded only "
            "when the gate's audit of what was built passes, and this build fails it; " + audit_line(audit, error))


def evaluate(task: Task, knobs: dict[str, KnobValue] | None = None, src_root: Path | None = None,
             seed: int | None = None, check: bool = True, bench: bool = True, comparators: bool = True,
             shapes: list[str] | None = None, bench_seconds: float = BENCH_SECONDS_PER_SHAPE) -> EvalReport:
    """Build, analyse, check and time one version of a task. Timing runs only after a passing check.
    The check's judge is started before the build (tools/judge_handle.JudgeStandby), so its start-up hides
    behind the compile."""
    runnable = not task.on_gpu or _gpu_available()
    slot = StandbySlot(task.root, enabled=runnable and check)
    slot.refill()
    try:
        return _evaluate(task, slot, knobs, src_root, seed, check, bench, comparators, shapes, bench_seconds, runnable)
    finally:
        slot.close()


def _gpu_available() -> bool:
    from tools.device import gpu_available

    return gpu_available()


def _evaluate(task: Task, slot: StandbySlot, knobs, src_root, seed, check, bench, comparators, shapes, bench_seconds,
              runnable) -> EvalReport:
    built = build(task, knobs, src_root=src_root)
    report = EvalReport(task=task.name, target=task.target, build=built)
    if not built.ok:
        return report
    report.sass, report.sass_error = sass_summary(task, built.lib)
    report.audit, report.audit_error = audit_of(task, built)
    if not runnable:
        report.check_error = "no CUDA GPU on this machine: built and analysed only"
        return report
    if check:
        res = run_check(task, built.lib, seed=seed, shapes=shapes, standby=slot.take())  # named shapes, else every check shape
        report.device = res.device
        report.check, report.check_error = res.check, res.error
        if not (res.ok and res.check and res.check.passed):
            return report
    if bench:
        res = run_bench(task, built.lib, shapes=shapes, comparators=comparators, seconds_per_shape=bench_seconds)
        report.device = report.device or res.device
        report.bench, report.bench_error = res.bench, res.error
    return report
