"""What the agent is told: the rules, the task briefing (roofline, baseline, knobs), its memory.

The texts live in prompts/; this module computes the figures that fill them.
"""

from __future__ import annotations

from tools.fmt import fmt_speedup, fmt_time
from tools.roofline import PEAKS, device_key, peak_rates
from tools.task import Task

def _peak_text(task: Task, device: dict | None) -> str:
    key = device_key(device)
    if key is None:
        return "unknown for this device: judge by the comparators and by time"
    peaks = PEAKS[key]
    unit = task.manifest.compute_unit
    return (f"{unit} {peaks[unit][0] / 1e12:.0f} TFLOP/s ({peaks[unit][1]}), "
            f"memory {peaks['bytes'][0] / 1e12:.2f} TB/s ({peaks['bytes'][1]})")


def bench_table(session) -> str:
    task: Task = session.gate.task
    flops_peak, bytes_peak = peak_rates(task, session.baseline.get("device"))
    bench = {s["shape"]: s for s in (session.baseline.get("bench") or {}).get("shapes", [])}
    rows = ["| shape | dims | FLOPs | bytes | roofline | bound | baseline | % of roofline | comparators |",
            "|---|---|---|---|---|---|---|---|---|"]
    for shape in task.bench_shapes:
        b = bench.get(shape.name, {})
        flops, nbytes = b.get("flops"), b.get("bytes")
        t_c = flops / flops_peak if flops and flops_peak else None
        t_m = nbytes / bytes_peak if nbytes and bytes_peak else None
        floor = max([t for t in (t_c, t_m) if t is not None], default=None)
        bound = "-" if floor is None else ("compute" if floor == t_c else "memory")
        base = (b.get("kernel") or {}).get("median")
        pct = f"{100 * floor / base:.1f}%" if floor and base else "-"
        comps = ", ".join(f"{n} {fmt_time(c.get('median'))}" for n, c in (b.get("comparators") or {}).items()) or "-"
        dims = " ".join(f"{k}={v}" for k, v in shape.dims.items())
        rows.append(f"| {shape.name} | {dims} | {flops or 0:.3g} | {nbytes or 0:.3g} | {fmt_time(floor)} | {bound} | "
                    f"{fmt_time(base)} | {pct} | {comps} |")
    return "\n".join(rows)


def knobs_table(session) -> str:
    task: Task = session.gate.task
    if not task.manifest.knobs:
        return "This task has no knobs."
    current = task.knob_settings(session.ws.task_path)
    rows = ["| knob | allowed | current | what it does |", "|---|---|---|---|"]
    for name, knob in task.manifest.knobs.items():
        rows.append(f"| {name} | {', '.join(map(str, knob.values))} | {current[name]} | {knob.help or '-'} |")
    return "\n".join(rows)


def _budget_text(budget) -> str:
    parts = []
    if budget.max_turns:
        parts.append(f"{budget.max_turns} turns")
    if budget.max_attempts:
        parts.append(f"{budget.max_attempts} attempts")
    if budget.max_hours:
        parts.append(f"{budget.max_hours:g} hours")
    if budget.max_cost_usd:
        parts.append(f"${budget.max_cost_usd:g}")
    return ", ".join(parts) or "unbounded"


def briefing_fields(session) -> dict[str, str]:
    task: Task = session.gate.task
    m = task.manifest
    device = session.baseline.get("device") or {}
    build = session.baseline.get("build") or {}
    tol = m.tolerance
    tol_text = f"|out-ref| <= {tol.atol:g} + {tol.rtol:g}*|ref| per element" + (
        f" and ||out-ref||/||ref|| <= {tol.norm_rtol:g}" if tol.norm_rtol is not None else "")
    for name, t in m.tolerance_for.items():
        tol_text += f"; output {name}: atol {t.atol:g}, rtol {t.rtol:g}" + (f", norm {t.norm_rtol:g}" if t.norm_rtol is not None else "")
    from tools.audit import source_rules

    forbidden = [f"- `{f.pattern}`: {f.reason}" for f in m.forbidden]
    if m.target == "triton":  # rules on the Python AST (tools/triton_rules.py), not C patterns
        forbidden += ["- anything but imports of triton / triton.language, constants (literal or tl.constexpr(literal)) "
                      "and top-level @triton.jit functions; in kernels: names outside triton.language, `_` attributes, "
                      "getattr/exec/open/print, lambdas, f-strings, device printing",
                      "- changing a kernel's parameters: the launch (signature, constexprs, grid) is the task's "
                      f"({', '.join(f'{k.name}({chr(44).join(k.signature)})' for k in m.triton.kernels)})"]
    else:
        forbidden += [f"- `{p}`: {r}" for p, r in source_rules(m.threads, m.target)]
    files = task.editable_files(session.ws.task_path)
    return {
        "task_name": m.name,
        "task_description": m.description or "(no description)",
        "target": f"{m.target}" + (f" ({m.arch})" if m.target != "cpu" else ""),
        "gpu_name": device.get("name", "unknown") + (f" ({device['sm_count']} SMs)" if device.get("sm_count") else ""),
        "driver": device.get("driver") or "n/a",
        "compiler": build.get("compiler", "unknown"),
        "flags": " ".join(m.flags + (m.cuda_flags if m.target == "cuda" else m.cxx_flags)) or "(none)",
        "peak_rates": _peak_text(task, device),
        "bench_table": bench_table(session),
        "knobs_table": knobs_table(session),
        "editable_files": f"{', '.join(m.editable)} (matches: {', '.join(files) or 'none yet'})",
        "check_shapes": _check_text(task),
        "tolerance": tol_text,
        "forbidden": "\n".join(forbidden) or "none",
        "min_gain": f"{100 * m.min_gain:g}% (lower bound of the workload speedup > {1 + m.min_gain:g})",
        "max_regression": f"{100 * m.max_regression:g}% on every bench shape unless the shape says otherwise",
        "budget": _budget_text(session.budget),
    }


def _check_text(task) -> str:
    """The gate's check shapes; the quick set the check tool runs, and the e2e stage, where they differ."""
    gate, rounds = task.check_plan("gate")
    quick, _ = task.check_plan("quick")
    text = ", ".join(f"{s.name} {s.dims}" for s in gate)
    if rounds:
        text += f" ({rounds} calls each)"
    if [s.name for s in quick] != [s.name for s in gate]:
        text += f"; your check tool runs the quick set only: {', '.join(s.name for s in quick)}"
    e2e = task.manifest.e2e
    if e2e is not None and e2e.when != "export":
        often = "every accept" if e2e.when == "accept" else f"every {e2e.every()}th accept"
        text += (f"; then, on {often}, an end-to-end training check: a small model trained {e2e.steps} steps with "
                 f"your kernel must end within {e2e.bound * 100:g}% of the same run with the reference")
    return text


def briefing(session) -> str:
    from agent.prompts import load_prompt, render_briefing

    text = render_briefing(**briefing_fields(session))
    playbook = "hopper" if session.gate.task.on_gpu else "cpu"
    try:
        text += "\n\n" + load_prompt(playbook)
    except FileNotFoundError:
        pass
    return text


def system_prompt(session) -> str:
    from agent.prompts import load_prompt

    return load_prompt("system")


def ledger(session) -> str:
    """Every attempt so far, one line each: the agent's memory of what was tried."""
    lines = []
    for a in session.attempts():
        if a.accepted is None:
            verdict = "interrupted"
        else:
            verdict = "ACCEPTED" if a.accepted else "rejected"
        sp = a.figures.get("speedup")
        extra = " " + fmt_speedup(sp, a.figures.get("speedup_lo"), a.figures.get("speedup_hi")) if sp else ""
        knobs = f" knobs {a.knobs}" if a.knobs else ""
        lines.append(f"#{a.number} {verdict}{extra}: {a.title}{knobs} — {a.reason[:300]}")
    return "\n".join(lines)


def memory(session) -> str:
    notes = session.notes_path.read_text() if session.notes_path.is_file() else "(no notes yet)"
    return ("Your notes so far:\n" + notes + "\n\nAttempts so far:\n" + (ledger(session) or "(none)") +
            f"\n\nThe branch is at the best version ({session.best_commit[:10]}).")
