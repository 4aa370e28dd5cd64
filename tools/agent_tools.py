"""The agent's engineering tools, bound to a session port (`tools.port.SessionPort`): build, sass,
check, bench, sweep, profile, history, submit, revert (the file and notes tools live in tools/files.py).

Each tool reads the candidate from the port's `files_root`; the manifest and spec always come from
the trusted copy (`task`, `trusted_dir`). Results are short texts (capped by the ToolBox) with
structured data beside them.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from tools.base import Tool, ToolBox, ToolInput, ToolResult
from tools.build import build, format_build
from tools.fmt import fmt_us
from tools.port import SessionPort

KnobMap = dict[str, int | float | str | bool]


def _build(ctx: SessionPort, knobs: KnobMap | None):
    return build(ctx.task, knobs or None, src_root=ctx.files_root)


def _loadable(ctx: SessionPort, knobs: KnobMap | None):
    """The build of the candidate for a tool that loads it, or a ToolResult saying why not: a failed
    build, or (without a sandbox) one the gate's audit refuses (tools.evaluate.unsandboxed_refusal)."""
    from tools.evaluate import unsandboxed_refusal

    result = _build(ctx, knobs)
    if not result.ok:
        return None, ToolResult(ok=False, text=format_build(result))
    refused = unsandboxed_refusal(ctx.task, result)
    if refused:
        return None, ToolResult(ok=False, text=refused, data={"refused": "audit"})
    return result, None


# ---- build --------------------------------------------------------------------------------------

class BuildInput(ToolInput):
    knobs: KnobMap | None = Field(default=None, description="Knob overrides for this build, e.g. {\"THREADS\": 512}. Default: the current settings.")


def build_tool(ctx: SessionPort, args: BuildInput) -> ToolResult:
    """The build, then the gate's own audit of what was built (tools/audit.py): a build the gate
    would refuse at submit says so here, and is not ok."""
    from tools.audit import audit_line
    from tools.evaluate import audit_of

    result = _build(ctx, args.knobs)
    data = result.model_dump(mode="json", exclude={"log_tail"})
    if not result.ok:
        return ToolResult(ok=False, text=format_build(result), data=data)
    audit, error = audit_of(ctx.task, result)
    data["audit"] = audit.model_dump(mode="json") if audit else {"ok": False, "error": error}
    ok = audit is not None and audit.ok
    return ToolResult(ok=ok, text=format_build(result) + "\n" + audit_line(audit, error), data=data)


# ---- sass ---------------------------------------------------------------------------------------

class SassInput(ToolInput):
    kernel: str | None = Field(default=None, description="With `pattern`: the kernel (substring of its name) to excerpt from.")
    pattern: str | None = Field(default=None, description="A regex over SASS lines (e.g. 'LDG|STG', 'HGMMA', 'LDL|STL'); shows the lines around each match.")
    context: int = Field(default=4, ge=0, le=20, description="Lines of context around each match.")
    knobs: KnobMap | None = Field(default=None, description="Knob overrides for the build to disassemble.")


def sass_tool(ctx: SessionPort, args: SassInput) -> ToolResult:
    from tools.sass import format_mix, sass_excerpt, sass_mix

    result = _build(ctx, args.knobs)
    if not result.ok:
        return ToolResult(ok=False, text=format_build(result))
    if not ctx.task.on_gpu:
        return ToolResult(ok=False, text="sass: this is a CPU task; there is no SASS (read the source and time it)")
    if args.pattern:
        kernel = args.kernel or (result.kernels[0].mangled if len(result.kernels) == 1 else None)
        if kernel is None:
            names = ", ".join(k.name for k in result.kernels)
            return ToolResult(ok=False, text=f"sass: name the kernel to excerpt from (one of: {names})")
        return ToolResult(text=sass_excerpt(Path(result.lib), kernel, args.pattern, context=args.context))
    return ToolResult(text=format_mix(sass_mix(Path(result.lib)), resources=result.kernels))


# ---- check / bench ------------------------------------------------------------------------------

class CheckInput(ToolInput):
    knobs: KnobMap | None = Field(default=None, description="Knob overrides for this check.")
    shapes: list[str] | None = Field(default=None, description="Only these shapes (default: the task's quick check set). The gate always runs its own, longer check (every gate check shape, its rounds) on its own secret inputs.")


def check_tool(ctx: SessionPort, args: CheckInput) -> ToolResult:
    from tools.check import format_check
    from tools.evaluate import run_check

    result, refused = _loadable(ctx, args.knobs)
    if refused:
        return refused
    res = run_check(ctx.task, result.lib, shapes=args.shapes, trusted_dir=ctx.trusted_dir, plan="quick")
    if not res.ok or res.check is None:
        return ToolResult(ok=False, text=f"check could not run: {res.error}")
    return ToolResult(ok=res.check.passed, text=format_check(res.check), data={"passed": res.check.passed})


class BenchInput(ToolInput):
    knobs: KnobMap | None = Field(default=None, description="Knob overrides for this timing.")
    shapes: list[str] | None = Field(default=None, description="Bench shapes to time (default: all bench shapes).")
    seconds: float = Field(default=0.5, gt=0, le=5, description="Timing seconds per shape.")
    comparators: bool = Field(default=False, description="Also time the library ops the kernel replaces.")


def bench_tool(ctx: SessionPort, args: BenchInput) -> ToolResult:
    from tools.bench import format_bench
    from tools.evaluate import run_bench

    result, refused = _loadable(ctx, args.knobs)
    if refused:
        return refused
    res = run_bench(ctx.task, result.lib, shapes=args.shapes, comparators=args.comparators,
                    seconds_per_shape=args.seconds, trusted_dir=ctx.trusted_dir)
    if not res.ok or res.bench is None:
        return ToolResult(ok=False, text=f"bench could not run: {res.error}")
    text = format_bench(res.bench, res.device.label() if res.device else "")
    text += "\n" + roofline_lines(ctx, res.bench)
    return ToolResult(text=text + "\n(quick timing, not a gate decision: only submit decides)",
                      data=res.bench.model_dump(mode="json"))


def roofline_lines(ctx: SessionPort, bench) -> str:
    from tools.roofline import peak_rates

    flops_peak, bytes_peak = peak_rates(ctx.task, ctx.device)
    out = []
    for s in bench.shapes:
        if not s.kernel:
            continue
        floor = max((s.flops or 0) / flops_peak if flops_peak else 0, (s.bytes or 0) / bytes_peak if bytes_peak else 0)
        if floor > 0:
            out.append(f"{s.shape}: roofline floor {fmt_us(floor)}; at {100 * floor / s.kernel.median:.1f}% of it")
    return "\n".join(out)


# ---- knobs --------------------------------------------------------------------------------------

class KnobsInput(ToolInput):
    pass


def knobs_tool(ctx: SessionPort, args: KnobsInput) -> ToolResult:
    task = ctx.task
    if not task.manifest.knobs:
        return ToolResult(text="this task has no knobs", data={"knobs": {}, "current": {}, "space": 0})
    current = task.knob_settings(ctx.files_root)
    lines = [f"{name}: {current[name]} (allowed: {', '.join(map(str, k.values))}){' — ' + k.help if k.help else ''}"
             for name, k in task.manifest.knobs.items()]
    lines.append(f"{task.knob_space_size()} settings in all; land one with submit(knobs=...)")
    # each bench shape's largest slowdown the gate accepts: a setting the sweep shows slower than that on a
    # shape is tried last (the gate would find it "no faster" there however large its workload gain)
    allowances = {s.name: task.allowance(s) for s in task.bench_shapes}
    return ToolResult(text="\n".join(lines), data={"knobs": {n: list(k.values) for n, k in task.manifest.knobs.items()},
                                                    "current": current, "space": task.knob_space_size(),
                                                    "allowances": allowances})


# ---- sweep --------------------------------------------------------------------------------------

class SweepInput(ToolInput):
    configs: list[KnobMap] | None = Field(default=None, description="Knob settings to rank, each a map of overrides. Default: every combination of the knobs (capped at 64).")
    seconds: float = Field(default=0.3, gt=0, le=3, description="Timing seconds per shape per setting.")
    defines: dict[str, list[int]] | None = Field(default=None, description=(
        "Exploration only: constants that are not knobs (read in the source with `#ifndef NAME`), each "
        "with integer values to try, e.g. {\"LANES\": [8, 16]}; crossed with every setting. The gate "
        "ignores them: write the winner into the source before you submit."))


def sweep_tool(ctx: SessionPort, args: SweepInput) -> ToolResult:
    from tools.sweep import define_grid, format_sweep, knob_grid, sweep
    from tools.task import TaskError

    configs = args.configs or (knob_grid(ctx.task) if not args.defines else [{}])
    try:
        n = len(configs) * len(define_grid(ctx.task, args.defines))
    except TaskError as exc:
        return ToolResult(ok=False, text=str(exc))
    if n > 64:
        return ToolResult(ok=False, text=f"sweep: {n} settings is too many for one call (max 64); pass `configs` or fewer `defines`")
    rows = sweep(ctx.task, configs, src_root=ctx.files_root, trusted_dir=ctx.trusted_dir, seconds_per_shape=args.seconds,
                 defines=args.defines)
    current = ctx.task.knob_settings(ctx.files_root)
    return ToolResult(text=format_sweep(rows, baseline=current) + "\nTo land a setting, submit with `knobs`.",
                      data={"rows": [r.model_dump(mode="json") for r in rows]})


# ---- profile ------------------------------------------------------------------------------------

class ProfileInput(ToolInput):
    shape: str | None = Field(default=None, description="Bench shape to profile (default: the first).")
    knobs: KnobMap | None = Field(default=None, description="Knob overrides.")


def profile_tool(ctx: SessionPort, args: ProfileInput) -> ToolResult:
    import sys
    import tempfile

    from tools.judge_handle import profiled_judge_command
    from tools.profile import format_profile, ncu_install_dirs, profile_command
    from tools.protocol import WorkerRequest

    task = ctx.task
    if not task.on_gpu:
        return ToolResult(ok=False, text="profile: unavailable for CPU tasks (ncu profiles CUDA kernels)")
    result, refused = _loadable(ctx, args.knobs)
    if refused:
        return refused
    shape = args.shape or task.bench_shapes[0].name
    task.shape(shape)
    regex = "|".join(dict.fromkeys(k.mangled.split("[")[0] for k in result.kernels)) or None  # a Triton variant: its kernel
    with tempfile.TemporaryDirectory(prefix="kloop-profile-") as tmp:
        req = WorkerRequest(kind="bench", task_dir=str(ctx.trusted_dir), libs=[result.lib], shapes=[shape],
                            comparators=False, max_seconds=0.0)
        Path(tmp, "req.json").write_text(req.model_dump_json())
        # ncu, the judge and its runners in the sandbox every judge runs in: the candidate's library is
        # untrusted here as at the gate
        readable = [Path(ctx.trusted_dir), Path(result.lib).resolve().parent]
        prof = profile_command([sys.executable, "-m", "tools.worker", str(Path(tmp, "req.json")), str(Path(tmp, "res.json"))],
                               kernel_regex=regex, cwd=tmp, timeout=300,
                               wrap=lambda argv: profiled_judge_command(argv, scratch=Path(tmp),
                                                                        readable=readable + ncu_install_dirs(argv[0])))
    return ToolResult(ok=prof.ok, text=format_profile(prof), data=prof.model_dump(mode="json"))


# ---- history, submit, revert --------------------------------------------------------------------

class HistoryInput(ToolInput):
    pass


def history_tool(ctx: SessionPort, args: HistoryInput) -> ToolResult:
    return ToolResult(text=ctx.ledger() or "no attempts yet")


class SubmitInput(ToolInput):
    title: str = Field(min_length=3, max_length=200, description="One line: what changed (becomes the commit title).")
    rationale: str = Field(default="", max_length=4000, description="Why it should be faster, what you measured (becomes the commit body).")
    knobs: KnobMap | None = Field(default=None, description="Knob settings to land with this change (saved in knobs.toml).")
    gate_seconds: float | None = Field(default=None, ge=1, le=30, description=(
        "Timing seconds for this decision (1 to 30; default: the session's). Use it when a verdict was "
        "'undecided (noisy machine)': its reason says how many seconds would decide."))

    @field_validator("title")
    @classmethod
    def _title_has_words(cls, title: str) -> str:
        # refused here, before the gate runs: a title that is only whitespace cannot become a commit title
        if len(" ".join(title.split())) < 3:
            raise ValueError(f"the title {title!r} has fewer than 3 visible characters: say in one line what changed")
        return title


def submit_tool(ctx: SessionPort, args: SubmitInput) -> ToolResult:
    from tools.port import SubmitRefused

    try:
        verdict = ctx.submit(args.title, args.rationale, args.knobs, gate_seconds=args.gate_seconds)
    except SubmitRefused as exc:
        return ToolResult(ok=False, text=f"not run: {exc}", event="refused")
    text = verdict.summary()
    text += ("\nThe change is committed; it is the new best." if verdict.accepted
             else "\nThe worktree is back at the best version; your edits were reverted (the attempt is recorded).")
    return ToolResult(ok=True, text=text, event="accepted" if verdict.accepted else "rejected", data=submit_data(verdict))


def submit_data(verdict) -> dict:
    """The verdict as data, with the same facts as its text (a client that shows its model only the
    structured result, as Claude Code does, must not lose the per-shape timings, the check table or
    what happened to the worktree)."""
    ab, check = getattr(verdict, "ab", None), getattr(verdict, "check", None)
    return {
        "accepted": verdict.accepted, "stage": verdict.stage, "reason": verdict.reason,
        "decide_seconds": getattr(verdict, "decide_seconds", None),  # undecided: the gate_seconds to re-submit with
        "speedup": verdict.speedup, "speedup_lo": verdict.speedup_lo, "speedup_hi": verdict.speedup_hi,
        "worktree": ("committed: the change is the new best" if verdict.accepted
                     else "reverted: the worktree is back at the best version, your edits are gone (the attempt is recorded)"),
        "timing_method": "gate A/B: best and candidate in interleaved pairs, cache flushed, seconds per call",
        "shapes": [{"shape": s.shape, "time_best": s.time_a, "time_candidate": s.time_b, "speedup": s.speedup,
                    "speedup_lo": s.speedup_lo, "speedup_hi": s.speedup_hi, "pairs": s.pairs}
                   for s in (ab.shapes if ab is not None else [])],
        "check_failures": [f.model_dump(mode="json") for f in (check.failures() if check is not None else [])][:10],
    }


class BatchItem(ToolInput):
    title: str = Field(min_length=3, max_length=200, description="One line: what this setting changes.")
    rationale: str = Field(default="", max_length=4000)
    knobs: KnobMap = Field(description="The knob settings of this candidate (on top of the current sources).")


class SubmitBatchInput(ToolInput):
    candidates: list[BatchItem] = Field(min_length=1, max_length=16, description=(
        "Knob settings to judge at once, each against the same best."))
    gate_seconds: float | None = Field(default=None, ge=1, le=30, description="Timing seconds per decision.")


def submit_batch_tool(ctx: SessionPort, args: SubmitBatchInput) -> ToolResult:
    from tools.port import BatchPort

    if not isinstance(ctx, BatchPort):
        return ToolResult(ok=False, text="not run: this session cannot judge candidates in a batch; use submit", event="refused")
    outcomes = ctx.submit_batch([c.model_dump() for c in args.candidates], gate_seconds=args.gate_seconds)
    lines, data = [], []
    for item, o in zip(args.candidates, outcomes):
        if isinstance(o, str):
            lines.append(f"- {item.title}: not run: {o}")
            data.append({"title": item.title, "refused": o})
            continue
        lines.append(f"- {item.title}: {o.summary()}")
        data.append({"title": item.title, "accepted": o.accepted, "stage": o.stage, "reason": o.reason,
                     "speedup": o.speedup, "speedup_lo": o.speedup_lo, "speedup_hi": o.speedup_hi})
    won = [d for d in data if d.get("accepted")]
    lines.append("One candidate was committed as the new best; the others are recorded (superseded, rejected or "
                 "interrupted)." if won else "None was accepted; the worktree is back at the best version.")
    return ToolResult(ok=True, text="\n".join(lines), event="accepted" if won else "rejected", data={"results": data})


class RevertInput(ToolInput):
    pass


def revert_tool(ctx: SessionPort, args: RevertInput) -> ToolResult:
    sha = ctx.revert()
    return ToolResult(text=f"worktree restored to the best version ({sha[:10]}); uncommitted edits are gone", event="reverted")


ENGINEERING_TOOLS = [
    Tool("build", "Compile the current sources (optionally with knob overrides): errors with file:line; per kernel the registers (and setmaxnreg values), spills, shared memory and ptxas advisories; then the gate's audit of what was built (symbols, syscalls, load-time code, includes): not ok when the gate would refuse it at submit.", BuildInput, build_tool),
    Tool("sass", "The SASS instruction mix per kernel (tensor-core, FP32, loads/stores with widths, local memory, barriers, shuffles, MUFU), or an excerpt around a regex.", SassInput, sass_tool),
    Tool("check", "Run the correctness check (fresh random inputs, every check shape, poisoned outputs, inputs verified unchanged) and show the error table.", CheckInput, check_tool),
    Tool("bench", "Quick non-gating timing per bench shape: median and spread, TFLOP/s and GB/s, % of the roofline; optionally the comparators.", BenchInput, bench_tool),
    Tool("knobs", "The task's knobs: current setting, allowed values and what each does.", KnobsInput, knobs_tool),
    Tool("sweep", "Rank knob settings: parallel builds, quick timings, a ranked table. Use it before hand-tuning constants.", SweepInput, sweep_tool),
    Tool("profile", "Nsight Compute figures for one bench shape: SM/DRAM/tensor-pipe throughput %, occupancy, top stall reasons, bank conflicts.", ProfileInput, profile_tool),
    Tool("history", "Every attempt so far: title, verdict, speedup and the gate's reason.", HistoryInput, history_tool),
    Tool("submit", "Submit the current sources (and optional knob settings) to the gate. Accepted: committed as the new best. Rejected: the worktree is restored to best. Each call costs an attempt.", SubmitInput, submit_tool),
    Tool("submit_batch", "Submit several knob settings at once, each judged by the gate against the same best (in parallel where the session has several judges). The fastest accepted one is committed; other accepted ones are recorded as superseded. Each candidate costs an attempt.", SubmitBatchInput, submit_batch_tool),
    Tool("revert", "Throw away uncommitted edits: restore the worktree to the best version.", RevertInput, revert_tool),
]


def session_toolbox(ctx: SessionPort) -> ToolBox:
    """Every agent tool (files, notes, engineering), bound to one session port."""
    from tools.files import file_tools

    box = ToolBox(context=ctx)
    for tool in [*file_tools(), *ENGINEERING_TOOLS]:
        box.add(tool)
    return box
