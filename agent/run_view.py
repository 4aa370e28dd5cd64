"""A run record read as what `kloop report`, `kloop serve` and `kloop compare` show.

Built only from the files of the record (run.json, events.jsonl, attempts/NNN.patch, notes.md,
trusted/task.toml): never from the session's worktree or git, so a live session is read, not touched.
Every number keeps where it was measured, and no figure mixes two methods on one axis: the per-shape
series over the commits are the gate's paired A/B figures only (the first accepted verdict's best as
"base", then each accepted candidate, and per-shape speedups compounded from the verdicts); the
session's quick bench (baseline and comparators, timed one after another) is kept apart.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import records as rec
from agent.run_state import RunState
from agent.runlock import read_holder
from tools.fmt import real
from tools.roofline import PEAKS, device_key

# how each figure was measured (every plot and table names one of these, and never mixes two on one axis)
METHOD_GATE = "gate A/B: paired, cache flushed, time per call"
METHOD_BENCH = "quick bench: one build after another, median per call"
METHOD_SWEEP = "sweep: quick bench of each setting, one after another"
IDLE_AFTER_S = 120  # a live session with no event for this long reads "idle since"

PATCH_LIMIT = 400_000  # characters of one attempt's patch shown (a patch that large is read in git)


@dataclass
class KernelFigures:
    """ptxas figures of one kernel, and its SASS mix where the record has one."""

    name: str
    registers: int | None = None
    spill_store: int = 0
    spill_load: int = 0
    smem: int = 0
    stack: int = 0
    sass_total: int | None = None
    sass_families: dict[str, int] = field(default_factory=dict)
    sass_memory: dict[str, int] = field(default_factory=dict)


@dataclass
class ShapeTiming:
    """One bench shape of one paired A/B decision."""

    shape: str
    time_best: float
    time_cand: float
    speedup: float | None
    lo: float | None
    hi: float | None
    pairs: int


@dataclass
class AttemptView:
    number: int
    title: str
    rationale: str = ""
    knobs: dict[str, Any] = field(default_factory=dict)
    verdict: str = "pending"  # accepted | rejected | interrupted | pending (no verdict yet: being judged)
    stage: str = ""  # the gate stage that decided (scope, static, build, check, timing, accepted, ...)
    reason: str = ""
    speedup: float | None = None  # against the best of its time
    lo: float | None = None
    hi: float | None = None
    level: float | None = None  # speedup over the baseline of the best after it (accepted) / it would have had
    commit: str | None = None
    seconds: float | None = None
    shapes: list[ShapeTiming] = field(default_factory=list)
    kernels: list[KernelFigures] = field(default_factory=list)
    patch: str = ""
    patch_truncated: bool = False
    started: str = ""
    e2e: str = ""  # the end-to-end training check's line, when it ran (tools/e2e.summary)


@dataclass
class Comparator:
    name: str
    time: float


@dataclass
class ShapeSeries:
    """One bench shape: over the accepted commits as the gate measured them (METHOD_GATE), and the
    session's quick bench of the baseline beside its comparators (METHOD_BENCH)."""

    shape: str
    flops: float | None
    bytes: float | None
    labels: list[str] = field(default_factory=list)  # "base", "#3", ... (gate figures only)
    times: list[float] = field(default_factory=list)  # base: the first accepted verdict's best; then each candidate
    speedups: list[float] = field(default_factory=list)  # x base on this shape: the verdicts' per-shape speedups compounded
    bench_time: float | None = None  # quick bench of the baseline
    comparators: list[Comparator] = field(default_factory=list)  # quick bench, same harness as bench_time
    bound: float | None = None  # roofline time: max(flops / peak FLOP/s, bytes / peak B/s)


@dataclass
class ToolCallView:
    name: str
    ok: bool
    duration_s: float
    input: Any
    output: str
    event: str | None = None
    at: str = ""  # when it was called (HH:MM:SS UTC)


@dataclass
class TurnView:
    turn: int
    text: str
    cost_usd: float
    stop_reason: str | None
    tool_calls: list[ToolCallView] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    turn_known: bool = True  # False: tool calls with no model turn in the record (an MCP client's), one list


@dataclass
class RunView:
    run_id: str
    dir: Path
    task: str
    policy: str
    driven_by: str  # who drove it: the MCP clients named in run.json, else the policy
    started: str
    device: str
    device_kind: str
    driver: str | None
    compiler: str | None
    torch: str | None
    branch: str
    base_commit: str
    budget: dict[str, Any]
    model: str | None
    cost_usd: float | None
    turns: int
    state: str  # live ... | idle since ... | ended: <reason> | stopped without an end ...
    compute_unit: str
    peak_flops: float | None
    peak_bytes: float | None
    peak_source: str
    attempts: list[AttemptView]
    baseline_kernels: list[KernelFigures]
    series: list[ShapeSeries]
    transcript: list[TurnView]
    notes: str
    events: int
    torn: bool

    @property
    def accepted(self) -> list[AttemptView]:
        return [a for a in self.attempts if a.verdict == "accepted"]

    @property
    def best_speedup(self) -> float:
        acc = self.accepted
        return acc[-1].level if acc and acc[-1].level else 1.0

    def best_kernels(self) -> list[KernelFigures]:
        """ptxas/SASS figures of the current best: the last accepted attempt's build, else the baseline's."""
        for a in reversed(self.accepted):
            if a.kernels:
                return a.kernels
        return self.baseline_kernels


# ---- reading ------------------------------------------------------------------------------------

# A record is data written by some version of kloop (or edited by hand): every figure read from it is
# checked here, once, so that what the report and the pages format is a finite number or None.

def _dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _list(x: Any) -> list:
    return x if isinstance(x, list) else []


def _int(x: Any) -> int | None:
    r = real(x)
    return int(r) if r is not None and r == int(r) else None


def _pos(x: Any) -> float | None:
    """A positive finite number (a time, a speedup, a rate), else None."""
    r = real(x)
    return r if r is not None and r > 0 else None


def _counts(x: Any) -> dict[str, int]:
    return {str(k): v for k, v in ((k, _int(v)) for k, v in _dict(x).items()) if v is not None}


def _kernels(figures: dict) -> list[KernelFigures]:
    build = _dict(figures.get("build"))
    sass = _dict(figures.get("sass"))
    out, used = [], set()
    for k in (k for k in _list(build.get("kernels")) if isinstance(k, dict)):
        name = str(k.get("name") or k.get("mangled") or "?")
        key = next((x for x in (k.get("mangled"), name) if isinstance(x, str) and x in sass), None)  # the gate keys SASS by mangled name
        used.add(key)
        s = _dict(sass.get(key))
        out.append(KernelFigures(
            name=name, registers=_int(k.get("registers")), spill_store=_int(k.get("spill_store_bytes")) or 0,
            spill_load=_int(k.get("spill_load_bytes")) or 0, smem=_int(k.get("smem_bytes")) or 0, stack=_int(k.get("stack_bytes")) or 0,
            sass_total=_int(s.get("total")), sass_families=_counts(s.get("families")), sass_memory=_counts(s.get("memory")),
        ))
    for key, s in sass.items():  # SASS of a kernel ptxas did not list (should not happen; shown anyway)
        if key not in used and isinstance(s, dict):
            out.append(KernelFigures(name=str(s.get("kernel") or key), sass_total=_int(s.get("total")),
                                     sass_families=_counts(s.get("families")), sass_memory=_counts(s.get("memory"))))
    return out


def _e2e_line(e2e: Any) -> str:
    if not isinstance(e2e, dict):
        return ""
    from tools.e2e import summary

    try:
        return summary(e2e)
    except ValueError:  # a record this version cannot read: say so, never fail the view
        return "(unreadable e2e figures)"


def _shape_timings(ab: Any) -> list[ShapeTiming]:
    """The per-shape paired timings of a verdict's figures; a shape without its two times is left out."""
    out = []
    for s in (s for s in _list(_dict(ab).get("shapes")) if isinstance(s, dict)):
        ta, tb = _pos(s.get("time_a")), _pos(s.get("time_b"))
        if s.get("shape") is None or ta is None or tb is None:
            continue
        out.append(ShapeTiming(str(s["shape"]), ta, tb, _pos(s.get("speedup")), _pos(s.get("speedup_lo")),
                               _pos(s.get("speedup_hi")), _int(s.get("pairs")) or 0))
    return out


def _manifest(run_dir: Path) -> dict:
    path = run_dir / "trusted" / "task.toml"
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def _peaks(device: dict | None, compute_unit: str) -> tuple[float | None, float | None, str]:
    key = device_key(device)
    if key is None:
        return None, None, "no peak rates known for this device"
    peaks = PEAKS[key]
    unit = peaks.get(compute_unit) or peaks["fp32"]
    return unit[0], peaks["bytes"][0], f"{key} {compute_unit} {unit[0] / 1e12:.0f} TFLOP/s ({unit[1]}), " \
                                        f"{peaks['bytes'][0] / 1e12:.2f} TB/s ({peaks['bytes'][1]})"


def _read_patch(run_dir: Path, rel: str | None, number: int) -> tuple[str, bool]:
    path = run_dir / (rel or f"{rec.ATTEMPTS}/{number:03d}.patch")
    try:
        if path.resolve().parent != (run_dir / rec.ATTEMPTS).resolve():
            return f"(patch path {rel!r} is outside the record's attempts folder; not shown)", False
        text = path.read_bytes().decode(rec.ENCODING, "replace")
    except OSError:
        return "", False
    if len(text) > PATCH_LIMIT:
        return text[:PATCH_LIMIT], True
    return text, False


def load_view(run_dir: Path) -> RunView:
    """The view of the run record in `run_dir` (RecordError when it cannot be read)."""
    run_dir = Path(run_dir)
    record = rec.RunRecord.open(run_dir)
    info = record.info
    events, torn = record.read()
    manifest = _manifest(run_dir)
    compute_unit = manifest.get("compute_unit", "fp32")

    baseline: dict = {}
    by_no: dict[int, AttemptView] = {}
    transcript: list[TurnView] = []
    turns_by_no: dict[int, TurnView] = {}
    loose: TurnView | None = None
    cost = None
    for ev in events:
        if isinstance(ev, rec.Baseline):
            baseline = ev.figures
        elif isinstance(ev, rec.AttemptStarted):
            patch, cut = _read_patch(run_dir, ev.patch, ev.attempt)
            by_no[ev.attempt] = AttemptView(ev.attempt, ev.title, ev.rationale, dict(ev.knobs), patch=patch,
                                            patch_truncated=cut, started=ev.t.strftime("%H:%M:%S"))
        elif isinstance(ev, rec.Verdict) and ev.attempt in by_no:
            a, f = by_no[ev.attempt], ev.figures
            stage = f.get("stage")
            a.stage = stage if isinstance(stage, str) and stage else ("accepted" if ev.accepted else "")
            a.reason, a.seconds = ev.reason, real(f.get("seconds"))
            a.speedup, a.lo, a.hi = _pos(f.get("speedup")), _pos(f.get("speedup_lo")), _pos(f.get("speedup_hi"))
            a.shapes = _shape_timings(f.get("ab"))
            a.kernels = _kernels(f)
            a.e2e = _e2e_line(f.get("e2e"))
        elif isinstance(ev, rec.Committed) and ev.attempt in by_no:
            by_no[ev.attempt].commit = ev.commit
        elif isinstance(ev, rec.LlmTurn):
            t = TurnView(ev.turn, ev.text, ev.cost_usd, ev.stop_reason)
            transcript.append(t)
            turns_by_no[ev.turn] = t
            if ev.total_cost_usd is not None:
                cost = ev.total_cost_usd
        elif isinstance(ev, rec.ToolCall):
            if ev.turn is None:  # an MCP client's call (its turns are not ours to see): all in one list
                t = loose
                if t is None:
                    loose = t = TurnView(0, "", 0.0, None, turn_known=False)
                    transcript.append(t)
            else:
                t = turns_by_no.get(ev.turn)
                if t is None:
                    t = turns_by_no[ev.turn] = TurnView(ev.turn, "", 0.0, None)
                    transcript.append(t)
            t.tool_calls.append(ToolCallView(ev.name, ev.ok, ev.duration_s, ev.input, ev.text or (ev.error or ""), ev.event,
                                             at=ev.t.strftime("%H:%M:%S")))
        elif isinstance(ev, rec.Note) and (ev.data or {}).get("source") == "llm":
            t = turns_by_no.get((ev.data or {}).get("turn"))
            if t is not None:
                t.notes.append(ev.text)
        elif isinstance(ev, rec.PolicyStop):
            cost = ev.cost_usd if ev.cost_usd else cost
    attempts = [by_no[k] for k in sorted(by_no)]
    folded = RunState.fold(events)  # the one reading of verdicts and of the session's state
    for a, st in zip(attempts, folded.attempts):
        a.verdict = st.verdict
    pending = attempts[-1].number if attempts and attempts[-1].verdict == "pending" else None
    state = session_state(run_dir, folded.ended, events[-1].t if events else None, pending)
    level = 1.0
    for a in attempts:  # the staircase: accepted speedups compound
        if a.verdict == "accepted" and a.speedup:
            level *= a.speedup
            a.level = level
        elif a.speedup:
            a.level = level * a.speedup

    device = _dict(baseline.get("device")) or _dict(info.machine)
    peak_flops, peak_bytes, peak_source = _peaks(device, compute_unit)
    series = _series(baseline, attempts, peak_flops, peak_bytes)
    cfg = info.config or {}
    notes_path = run_dir / "notes.md"
    try:
        notes = notes_path.read_text(errors="replace") if notes_path.is_file() else ""
    except OSError:
        notes = ""
    return RunView(
        run_id=info.run_id, dir=run_dir, task=info.task, policy=info.policy, driven_by=driven_by(info),
        started=info.started_at.strftime("%Y-%m-%d %H:%M UTC"), device=str(device.get("name") or info.gpu or "?"),
        device_kind=str(device.get("kind", "?")), driver=info.versions.driver, compiler=info.versions.compiler,
        torch=info.versions.torch, branch=info.branch, base_commit=info.base_commit,
        budget={k: v for k, v in (cfg.get("budget") or {}).items() if v is not None}, model=cfg.get("model"),
        cost_usd=cost, turns=len([t for t in transcript if t.text or t.stop_reason]), state=state,
        compute_unit=compute_unit, peak_flops=peak_flops, peak_bytes=peak_bytes, peak_source=peak_source,
        attempts=attempts, baseline_kernels=_kernels(baseline), series=series, transcript=transcript, notes=notes,
        events=len(events), torn=torn is not None,
    )


def _series(baseline: dict, attempts: list[AttemptView], peak_flops: float | None, peak_bytes: float | None) -> list[ShapeSeries]:
    by_shape: dict[str, ShapeSeries] = {}
    for s in (s for s in _list(_dict(baseline.get("bench")).get("shapes")) if isinstance(s, dict) and s.get("shape") is not None):
        ss = ShapeSeries(str(s["shape"]), _pos(s.get("flops")), _pos(s.get("bytes")))
        ss.bench_time = _pos(_dict(s.get("kernel")).get("median"))
        ss.comparators = [Comparator(str(name), _pos(_dict(t).get("median"))) for name, t in _dict(s.get("comparators")).items()
                          if _pos(_dict(t).get("median"))]
        bounds = [x for x in ((ss.flops / peak_flops) if ss.flops and peak_flops else None,
                              (ss.bytes / peak_bytes) if ss.bytes and peak_bytes else None) if x]
        ss.bound = max(bounds) if bounds else None
        by_shape[ss.shape] = ss
    for a in attempts:  # the gate's figures only: never a quick-bench time beside a paired one
        if a.verdict != "accepted":
            continue
        for st in a.shapes:
            ss = by_shape.setdefault(st.shape, ShapeSeries(st.shape, None, None))
            if not ss.times:  # "base": the best as the first accepted decision timed it
                ss.labels.append("base")
                ss.times.append(st.time_best)
                ss.speedups.append(1.0)
            ss.labels.append(f"#{a.number}")
            ss.times.append(st.time_cand)
            ss.speedups.append(ss.speedups[-1] * (st.speedup or st.time_best / st.time_cand))
    return list(by_shape.values())


def driven_by(info: rec.RunInfo) -> str:
    """Who drove the run: the MCP clients run.json names (name/version from `initialize`), else the policy."""
    clients = [c for c in info.clients if c.name]
    if not clients:
        return info.policy
    names = list(dict.fromkeys(f"{c.name} {c.version or '?'}" for c in clients))
    return ", ".join(names) + " (over MCP)"


def session_state(run_dir: Path, ended: str | None, last_event, pending: int | None) -> str:
    """The session's real state: ended (its reason), live (a process holds the run's lock), idle since
    the last event, or stopped without an end (no live holder)."""
    if ended is not None:
        return f"ended: {ended}"
    since = last_event.strftime("%Y-%m-%d %H:%M:%S UTC") if last_event else "?"
    holder = read_holder(run_dir)
    alive = holder.alive() if holder else False
    if alive is False:
        return f"stopped without an end (no process holds the run; last event {since})"
    who = f"pid {holder.pid} on {holder.host}"
    if pending is not None:
        return f"live ({who}): the gate is judging attempt {pending}"
    from datetime import datetime, timezone

    quiet = (datetime.now(timezone.utc) - last_event).total_seconds() if last_event else 0
    if alive is None:
        return f"held by {who} (another host: not checked from here); last event {since}"
    return f"live ({who}), idle since {since}" if quiet >= IDLE_AFTER_S else f"live ({who}), last event {since}"


# ---- deltas against the best --------------------------------------------------------------------

@dataclass
class KernelDelta:
    kernel: str
    rows: list[tuple[str, Any, Any]]  # (figure, attempt's value, best's value), only those that differ or matter


def kernel_deltas(attempt: AttemptView, best: list[KernelFigures]) -> list[KernelDelta]:
    """Per kernel: registers, spills, shared memory, stack and SASS families of the attempt vs the best."""
    by_name = {k.name: k for k in best}
    out = []
    for k in attempt.kernels:
        b = by_name.get(k.name)
        rows: list[tuple[str, Any, Any]] = [
            ("registers", k.registers, b.registers if b else None),
            ("spill stores B", k.spill_store, b.spill_store if b else None),
            ("spill loads B", k.spill_load, b.spill_load if b else None),
            ("shared B", k.smem, b.smem if b else None),
            ("stack B", k.stack, b.stack if b else None),
        ]
        if k.sass_total is not None:
            rows.append(("SASS instructions", k.sass_total, b.sass_total if b else None))
            fams = list(dict.fromkeys(list(k.sass_families) + list(b.sass_families if b else {})))
            rows += [(f"SASS {f}", k.sass_families.get(f, 0), (b.sass_families.get(f, 0) if b else None)) for f in fams]
            mem = list(dict.fromkeys(list(k.sass_memory) + list(b.sass_memory if b else {})))
            rows += [(f"SASS {m}", k.sass_memory.get(m, 0), (b.sass_memory.get(m, 0) if b else None)) for m in mem]
        out.append(KernelDelta(k.name, rows))
    return out


# ---- the list of runs ---------------------------------------------------------------------------

@dataclass
class RunRow:
    """One line of `kloop serve`'s run list: the record's summary plus the compounded speedup and device."""

    name: str  # the run's folder (what URLs name)
    summary: rec.RunSummary
    device: str = ""
    speedup: float | None = None  # compounded over accepted attempts (what the report calls "over the baseline")
    pending: int | None = None  # the attempt being judged, if any
    driven_by: str = ""
    state: str = ""  # session_state()


def run_rows(runs_root: Path) -> list[RunRow]:
    """The run folders under `runs_root` (those holding a run.json), newest first."""
    root = Path(runs_root)
    dirs = sorted((p for p in root.iterdir() if p.is_dir() and (p / rec.RUN_JSON).is_file()), reverse=True) if root.is_dir() else []
    rows = []
    for d in dirs:
        try:
            record = rec.RunRecord.open(d)
        except rec.RecordError as exc:
            rows.append(RunRow(d.name, rec.RunSummary(run_id=d.name, error=str(exc))))
            continue
        s = rec.summarize(record)
        row = RunRow(d.name, s)
        rows.append(row)
        if s.error is not None:
            continue
        state = RunState.fold(record.read()[0])
        device = record.info.machine or {}
        row.device = str(device.get("name") or record.info.gpu or "")
        row.speedup = state.best_speedup if s.accepted else None
        pending = state.pending
        row.pending = pending.number if pending is not None and not s.ended else None
        row.driven_by = driven_by(record.info)
        row.state = session_state(d, s.end_reason if s.ended else None, s.last_event_at, row.pending)
    return rows
