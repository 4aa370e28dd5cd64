"""Rich tables for people: the evaluation report (build, ptxas, SASS, check, timing)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tools.task import Task
from tools.fmt import fmt_num, fmt_rate, fmt_time, kernel_names, real
from tools.build import format_build
from tools.evaluate import EvalReport

SASS_FAMILIES_SHOWN = 12


def print_eval(console: Console, task: Task, report: EvalReport) -> None:
    b = report.build
    console.print(f"[bold]{escape(task.name)}[/] ({task.target}{', ' + task.manifest.arch if task.target != 'cpu' else ''}) "
                  f"from {escape(str(task.root))}")
    if not b.ok:
        console.print(f"[bold red]build failed[/] ({escape(b.compiler)})")
        console.print(b.error_text(), markup=False, highlight=False)
        return
    console.print(escape(format_build(b).splitlines()[0] + (f"  knobs: {_knobs(b.knobs)}" if b.knobs else "")), highlight=False)
    if b.kernels:
        t = Table(title="ptxas: resources per kernel", title_justify="left")
        for col in ("kernel", "regs", "spill st/ld B", "stack B", "smem B", "barriers"):
            t.add_column(col, justify="right" if col != "kernel" else "left")
        for k, short in zip(b.kernels, kernel_names([k.name for k in b.kernels])):
            spills = f"{k.spill_store_bytes}/{k.spill_load_bytes}"
            t.add_row(escape(short), str(k.registers), f"[red]{spills}[/]" if k.spill_store_bytes + k.spill_load_bytes else spills,
                      str(k.stack_bytes), str(k.smem_bytes), str(k.barriers))
        console.print(t)
    for w in b.warnings:
        console.print(f"[yellow]ptxas:[/] {escape(w)}", highlight=False)
    if report.audit is not None or report.audit_error:
        from tools.audit import audit_line

        line = audit_line(report.audit, report.audit_error)
        ok = report.audit is not None and report.audit.ok
        console.print(escape(line) if ok else f"[red]{escape(line)}[/]", highlight=False)
    if report.sass:
        print_sass(console, report.sass)
    elif report.sass_error:
        console.print(f"[yellow]SASS unavailable:[/] {escape(report.sass_error)}", highlight=False)
    if report.check_error and not report.check:
        console.print(f"[yellow]check not run:[/] {escape(report.check_error)}", highlight=False)
    if report.check:
        print_check(console, report)
    if report.bench_error:
        console.print(f"[red]timing failed:[/] {escape(report.bench_error)}", highlight=False)
    if report.bench:
        print_bench(console, report)
    if report.device:
        console.print(escape(f"measured on: {report.device.label()}; compiler {b.compiler}"), highlight=False)


def print_sass(console: Console, sass: dict) -> None:
    t = Table(title="SASS: instruction mix per kernel", title_justify="left")
    t.add_column("kernel")
    t.add_column("instrs", justify="right")
    t.add_column("families")
    t.add_column("loads/stores by width")
    shorts = kernel_names([s.get("kernel") or name for name, s in sass.items()])
    for (name, s), short in zip(sass.items(), shorts):
        fams = s.get("families", {})
        top = sorted(fams.items(), key=lambda kv: -kv[1])[:SASS_FAMILIES_SHOWN]
        memory = s.get("memory", {})
        t.add_row(escape(short), str(s.get("total", "")), escape(", ".join(f"{k} {v}" for k, v in top)),
                  escape(", ".join(f"{k} {v}" for k, v in memory.items())))
    console.print(t)
    for (name, s), short in zip(sass.items(), shorts):
        for w in s.get("warnings", []):
            console.print(f"[yellow]SASS {escape(short)}:[/] {escape(str(w))}", highlight=False)


def print_check(console: Console, report: EvalReport) -> None:
    c = report.check
    t = Table(title=f"correctness ({'[green]PASSED[/]' if c.passed else '[red]FAILED[/]'}, {fmt_num(c.seconds, '.1f')} s)",
              title_justify="left")
    for col in ("shape", "call", "output", "max abs", "max rel", "norm rel", "bad", "verdict"):
        t.add_column(col, justify="left" if col in ("shape", "output", "verdict") else "right")
    for s in c.shapes:
        if s.error:
            t.add_row(escape(s.shape), str(s.round), "-", "", "", "", "", f"[red]FAIL[/] {escape(s.error)}")
            continue
        for o in s.outputs:
            why = o.problem or ""
            if o.nonfinite:
                why += f"{o.nonfinite} NaN/Inf "
            if o.mismatches:
                why += f"worst {o.worst_index}: got {fmt_num(o.worst_got, '.5g')} want {fmt_num(o.worst_want, '.5g')}"
            verdict = "[green]ok[/]" if o.passed else f"[red]FAIL[/] {escape(why)}".rstrip()
            t.add_row(escape(s.shape), str(s.round), escape(o.name), _g(o.max_abs), _g(o.max_rel), _g(o.norm_rel),
                      f"{o.mismatches}/{o.numel}", verdict)
        if s.inputs_changed:
            t.add_row(escape(s.shape), str(s.round), "inputs", "", "", "", "", f"[red]FAIL[/] inputs modified: {escape(str(s.inputs_changed))}")
    console.print(t)


def print_bench(console: Console, report: EvalReport) -> None:
    t = Table(title="timing (median per call; L2 flushed, inputs rotated)", title_justify="left")
    for col in ("shape", "what", "median", "p10..p90", "TFLOP/s", "GB/s", "speed vs kernel", "samples"):
        t.add_column(col, justify="left" if col in ("shape", "what") else "right")
    for s in report.bench.shapes:
        if s.error:
            t.add_row(escape(s.shape), "[red]error[/]", escape(s.error), "", "", "", "", "")
            continue
        base = real(s.kernel.median) if s.kernel else None
        entries = ([("kernel", s.kernel)] if s.kernel else []) + list(s.comparators.items())
        for what, tm in entries:
            median = real(tm.median)
            rel = f"{base / median:.2f}x" if base and median and what != "kernel" else ""
            t.add_row(escape(s.shape), escape(what), fmt_time(tm.median), f"{fmt_time(tm.p10)}..{fmt_time(tm.p90)}", fmt_rate(tm.tflops), fmt_rate(tm.gbps), rel,
                      f"{tm.samples}x{tm.calls_per_sample}")
        for what, err in s.comparator_errors.items():
            t.add_row(escape(s.shape), escape(what), "unavailable", escape(err[:60]), "", "", "", "")
    console.print(t)


def _knobs(knobs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items())


def _g(x) -> str:
    return fmt_num(x, ".3g")


class StageStatus:
    """One line saying what runs now and for how long ("attempt 3: check ... 12 s"), so a slow
    or hung kernel is never silence. On a terminal it is redrawn in place; elsewhere (a pipe, a log)
    it prints a line when the stage starts and again every `heartbeat_s` while it runs."""

    def __init__(self, console: Console, heartbeat_s: float = 15.0):
        import threading

        self.console = console
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._label: str | None = None
        self._since = 0.0
        self._status = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, label: str) -> None:
        import threading
        import time

        self.stop()
        with self._lock:
            self._label, self._since = label, time.monotonic()
            self._wake.clear()
            if self.console.is_terminal:
                self._status = self.console.status(f"{label} ...", spinner="dots")
                self._status.start()
            else:
                self.console.print(f"  {label} ...", highlight=False)
            self._thread = threading.Thread(target=self._tick, args=(label,), daemon=True)
            self._thread.start()

    def _tick(self, label: str) -> None:
        import time

        last_line = time.monotonic()
        while not self._wake.wait(0.5):
            with self._lock:
                if self._label != label:
                    return
                elapsed = time.monotonic() - self._since
                if self._status is not None:
                    self._status.update(f"{label} ... {elapsed:.0f} s")
                elif time.monotonic() - last_line >= self.heartbeat_s:
                    self.console.print(f"  {label} ... still running ({elapsed:.0f} s)", highlight=False)
                    last_line = time.monotonic()

    def stop(self) -> float | None:
        """End the current stage (if any); its elapsed seconds."""
        import time

        with self._lock:
            if self._label is None:
                return None
            elapsed = time.monotonic() - self._since
            self._label = None
            self._wake.set()
            if self._status is not None:
                self._status.stop()
                self._status = None
        return elapsed
