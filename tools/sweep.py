"""Sweep knob settings: build them in parallel across the cores, time them one after another.

A sweep only ranks (quick, non-gating timings); the gate decides what lands.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field

from tools.task import KnobValue, Task, TaskError
from tools import stats
from tools.build import build
from tools.fmt import fmt_ms
from tools.evaluate import run_bench_many, unsandboxed_refusal


# how a sweep ranks (every sweep table and anything quoting a sweep says so): not the gate's measurement
SWEEP_HOW = ("ranked by the sweep: quick bench, each setting timed alone one after another, median per call, "
             "no paired A/B")
SWEEP_VS_GATE = ("the gate times a candidate against the best in interleaved pairs with the cache flushed and fresh "
                 "inputs each pass, so its speedup can differ from the sweep's ratio; only the gate's lands")


class SweepRow(BaseModel):
    knobs: dict[str, KnobValue]
    # exploration-only constants (-D NAME=VALUE beside the knobs): ranked, never gated
    defines: dict[str, int] = Field(default_factory=dict)
    ok: bool
    error: str | None = None
    times: dict[str, float] = Field(default_factory=dict)  # shape -> median seconds
    score: float | None = None  # the workload time: weight x median per shape, summed (lower is faster)
    registers: dict[str, int | None] = Field(default_factory=dict)
    spills: int = 0
    device: str | None = None


def knob_grid(task: Task, fixed: dict[str, Any] | None = None) -> list[dict[str, KnobValue]]:
    """Every combination of the task's knobs (with `fixed` ones pinned)."""
    names = sorted(task.manifest.knobs)
    pinned = task.resolve_knobs(fixed or {}) if fixed else {}
    axes = [[pinned[n]] if n in (fixed or {}) else task.manifest.knobs[n].values for n in names]
    return [dict(zip(names, combo)) for combo in itertools.product(*axes)]


DEFINE_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,63}")


def define_grid(task: Task, defines: dict[str, list[int]] | None) -> list[dict[str, int]]:
    """Every combination of exploration constants (`{NAME: [values]}`), validated: an upper-case C
    identifier that is not a knob (knobs are swept as knobs), integer values. [{}] when none."""
    if not defines:
        return [{}]
    if task.target == "triton":
        raise TaskError("sweep: defines are -D constants of a C/C++ build; a Triton task's constexprs are its knobs")
    for name, values in defines.items():
        if not DEFINE_NAME.fullmatch(name):
            raise TaskError(f"sweep: define {name!r} is not an upper-case C identifier (A-Z, 0-9, _)")
        if name in task.manifest.knobs:
            raise TaskError(f"sweep: {name} is a knob of {task.name}; sweep it in `configs`, not as a define")
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise TaskError(f"sweep: define {name} needs a non-empty list of integers, got {values!r}")
    names = sorted(defines)
    return [dict(zip(names, combo)) for combo in itertools.product(*(defines[n] for n in names))]


def workload_time(task: Task, times: dict[str, float]) -> float | None:
    """The bench workload's time over `times` (shape -> seconds per call): weight x time summed over the
    bench shapes, the quantity whose ratio the gate decides on (tools/stats.py), so the sweep ranks by
    what lands. (A geometric mean gave a noisy 50 us shape the say of a 500 us one: on rmsnorm_triton the
    sweep's pick read x1.005 in the gate.)"""
    shapes = task.bench_shapes
    if not all(math.isfinite(times.get(s.name, math.nan)) and times[s.name] > 0 for s in shapes):
        return None  # a shape missing from the sum would make the setting look fast: unranked instead
    return stats.workload_time([times[s.name] for s in shapes], [s.weight for s in shapes])


def sweep(task: Task, configs: list[dict[str, Any]], src_root: Path | None = None, trusted_dir: Path | None = None,
          seconds_per_shape: float = 0.3, shapes: list[str] | None = None, jobs: int | None = None,
          on_row: Callable[[int, int, SweepRow], None] | None = None,
          defines: dict[str, list[int]] | None = None) -> list[SweepRow]:
    """Rank `configs` (knob overrides), each crossed with every combination of `defines`
    (exploration constants the source reads with `#ifndef NAME`): parallel builds, then sequential
    timings, fastest first. The gate builds from the files alone: a define wins nothing until it is
    written into the source.

    `on_row(i, n, row)` is called as each setting is timed (progress displays)."""
    jobs = jobs or max(1, (os.cpu_count() or 2))
    settings = [(knobs, consts) for knobs in configs for consts in define_grid(task, defines)]

    def build_one(setting):
        knobs, consts = setting
        try:
            flags = [f"-D{n}={v}" for n, v in sorted(consts.items())] or None
            return knobs, consts, build(task, knobs, src_root=src_root, extra_flags=flags), None
        except TaskError as exc:
            return knobs, consts, None, str(exc)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        built = list(pool.map(build_one, settings))
    rows: list[SweepRow | None] = []
    timeable = []  # (row index, build, knobs, defines) of the settings that built and may be loaded
    for knobs, consts, result, error in built:
        full = result.knobs if result else knobs
        if result is None or not result.ok:
            rows.append(SweepRow(knobs=full, defines=consts, ok=False,
                                 error=error or (result.error_text()[:500] if result else "")))
            continue
        refused = unsandboxed_refusal(task, result)  # no sandbox: nothing the gate's audit refuses is loaded
        if refused:
            rows.append(SweepRow(knobs=full, defines=consts, ok=False, error=refused[:500]))
            continue
        rows.append(None)
        timeable.append((len(rows) - 1, result, full, consts))
    shown = 0

    def show_ready() -> None:  # progress in setting order, as each row is known
        nonlocal shown
        while shown < len(rows) and rows[shown] is not None:
            shown += 1
            if on_row:
                on_row(shown, len(built), rows[shown - 1])

    show_ready()
    for start in range(0, len(timeable), JUDGE_BATCH):
        batch = timeable[start:start + JUDGE_BATCH]
        res = run_bench_many(task, [r.lib for _, r, _, _ in batch], shapes=shapes, seconds_per_shape=seconds_per_shape,
                             trusted_dir=trusted_dir)
        for j, (i, result, full, consts) in enumerate(batch):
            if res.ok:
                report = res.benches[j] if j < len(res.benches) else None
                error = res.bench_errors[j] if j < len(res.bench_errors) else "no answer for this setting"
            else:  # the judge itself failed: every setting of the batch says why
                report, error = None, res.error
            rows[i] = _row(task, full, consts, result, report, error, res.device)
        show_ready()
    return sorted(rows, key=lambda r: (not r.ok, r.score if r.score is not None else math.inf))


# settings quick-benched per judge: each has a runner of its own (a process holding torch and, on a
# GPU, a device context), all started together
JUDGE_BATCH = 8


def _row(task: Task, knobs, consts, result, report, error, device) -> SweepRow:
    """A timed setting's row: its bench report (None: `error` says why)."""
    row = SweepRow(knobs=knobs, defines=consts, ok=report is not None,
                   registers={k.name: k.registers for k in result.kernels},
                   spills=sum(k.spill_store_bytes + k.spill_load_bytes for k in result.kernels),
                   device=device.label() if device else None)
    if report is not None:
        errors = [f"{s.shape}: {s.error}" for s in report.shapes if s.error]
        row.times = {s.shape: s.kernel.median for s in report.shapes if s.kernel}
        row.score = workload_time(task, row.times)
        if errors:
            row.ok, row.error = False, "; ".join(errors)[:500]
    else:
        row.error = error
    return row


def format_sweep(rows: list[SweepRow], baseline: dict[str, KnobValue] | None = None) -> str:
    """A ranked table; speed relative to the baseline setting when it was swept."""
    base = next((r.score for r in rows if baseline and r.knobs == baseline and not r.defines and r.score), None)
    lines = [f"{'rank':>4}  {'score (workload)':>16} {'vs current':>10}  knobs"]
    for i, r in enumerate(rows, 1):
        knobs = " ".join(f"{k}={v}" for k, v in r.knobs.items())
        if r.defines:
            knobs += "  -D " + " ".join(f"{k}={v}" for k, v in r.defines.items())
        if not r.ok:
            lines.append(f"{i:>4}  {'failed':>16} {'':>10}  {knobs}: {(r.error or '').splitlines()[0][:120] if r.error else ''}")
            continue
        rel = f"x{base / r.score:.3f}" if base and r.score else ""
        spill = f"  SPILLS {r.spills} B" if r.spills else ""
        score = fmt_ms(r.score) if r.score is not None else "no bench shape"
        lines.append(f"{i:>4}  {score:>16} {rel:>10}  {knobs}{spill}")
    if rows:
        lines.append(f"({SWEEP_HOW}; measured on {rows[0].device or 'this machine'}. Not gating: {SWEEP_VS_GATE})")
    if any(r.defines for r in rows):
        lines.append("(-D constants are exploration only: the gate builds from the files; write the winner into the source to land it)")
    return "\n".join(lines)
