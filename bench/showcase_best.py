"""A showcase run's best accepted kernel as machine-readable `best.json`, and the README table made from it.

    python bench/showcase_best.py runs/showcase/flash_attn_fwd/RUN_ID [-o runs/showcase/flash_attn_fwd/best.json] [--markdown]

Everything comes from the run record (agent/run_view.py), each figure with the method that measured it:
per bench shape the best's time as the gate measured it when it was accepted (paired A/B, cache flushed)
and its TFLOP/s or TB/s, the baseline's in the same verdicts, and the comparators (torch SDPA, cuDNN, ...)
as the session's quick bench measured them at its start, in the same run on the same machine. The two
methods are never divided into one another: the best's gain is the gate's (its verdicts' per-shape
speedups compounded, so it can differ slightly from the ratio of the two gate times shown).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.run_view import METHOD_BENCH, METHOD_GATE, RunView, load_view  # noqa: E402


def _rate(flops: float | None, nbytes: float | None, seconds: float | None) -> dict:
    if not seconds:
        return {}
    out = {}
    if flops:
        out["tflops"] = round(flops / seconds / 1e12, 2)
    if nbytes:
        out["tbps"] = round(nbytes / seconds / 1e12, 3)
    return out


def _bound_kind(view: RunView, flops: float | None, nbytes: float | None) -> str | None:
    """"compute" or "memory": which roof is the lower at this shape (its figure of merit is TFLOP/s or TB/s)."""
    t_flops = flops / view.peak_flops if flops and view.peak_flops else None
    t_bytes = nbytes / view.peak_bytes if nbytes and view.peak_bytes else None
    if t_flops is None and t_bytes is None:
        return None
    return "memory" if (t_bytes or 0) > (t_flops or 0) else "compute"


def best_record(view: RunView) -> dict:
    """The best accepted commit of `view`'s run with its per-shape figures (no accepted commit: ValueError)."""
    accepted = [a for a in view.attempts if a.verdict == "accepted" and a.commit]
    if not accepted:
        raise ValueError(f"{view.dir}: run {view.run_id} has no accepted commit")
    best = accepted[-1]  # each accept is against the best before it: the last is the best
    shapes = {}
    for s in view.series:
        if not s.times:
            continue
        base_gate, best_gate = s.times[0], s.times[-1]
        shapes[s.shape] = {
            "best": {"time_s": best_gate, **_rate(s.flops, s.bytes, best_gate), "method": METHOD_GATE},
            "baseline": {"time_s": base_gate, **_rate(s.flops, s.bytes, base_gate), "method": METHOD_GATE},
            "speedup_over_baseline": round(s.speedups[-1], 4),
            "baseline_quick_bench": ({"time_s": s.bench_time, **_rate(s.flops, s.bytes, s.bench_time), "method": METHOD_BENCH}
                                     if s.bench_time else None),
            "comparators": {c.name: {"time_s": c.time, **_rate(s.flops, s.bytes, c.time), "method": METHOD_BENCH}
                            for c in s.comparators},
            "roofline_time_s": s.bound,
            "bound": _bound_kind(view, s.flops, s.bytes),
        }
    return {
        "task": view.task, "run_id": view.run_id, "branch": view.branch, "base_commit": view.base_commit,
        "best_commit": best.commit, "best_attempt": best.number, "best_title": best.title,
        "speedup_over_baseline": best.level, "interval_of_its_verdict": [best.lo, best.hi],
        "measured": {"gpu": view.device, "driver": view.driver, "compiler": view.compiler, "torch": view.torch,
                     "started": view.started},
        "shapes": shapes,
    }


def markdown(best: dict) -> str:
    """The README's table: one row per bench shape."""
    names = sorted({n for s in best["shapes"].values() for n in s["comparators"]})
    head = (f"| shape | baseline (gate) | best #{best['best_attempt']} (gate) | x baseline (gate, compounded) | "
            + " | ".join(f"{n} (quick bench)" for n in names) + " |")
    lines = [head, "|" + " --- |" * (4 + len(names))]

    def cell(fig: dict | None, bound: str | None) -> str:
        if not fig:
            return "-"
        rate, unit = ("tbps", "TB/s") if bound == "memory" or "tflops" not in fig else ("tflops", "TFLOP/s")
        t = fig["time_s"]
        when = f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"
        return f"{when} ({fig[rate]:g} {unit})" if rate in fig else when

    for shape, s in best["shapes"].items():
        b = s.get("bound")
        lines.append(f"| `{shape}` | {cell(s['baseline'], b)} | **{cell(s['best'], b)}** | x{s['speedup_over_baseline']:.3f} | "
                     + " | ".join(cell(s["comparators"].get(n), b) for n in names) + " |")
    m = best["measured"]
    lines.append(f"\n{best['run_id']}, commit {best['best_commit'][:12]}: {m['gpu']}, driver {m['driver']}, {m['compiler']}, "
                 f"torch {m['torch']}, {m['started']}. Methods: (gate) {METHOD_GATE}; (quick bench) {METHOD_BENCH}, "
                 "at the session's start.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a run folder (run.json, events.jsonl)")
    ap.add_argument("-o", "--out", type=Path, help="write best.json here (else print it)")
    ap.add_argument("--markdown", action="store_true", help="print the README table too")
    args = ap.parse_args()
    try:
        best = best_record(load_view(args.run))
    except (ValueError, OSError) as exc:
        print(f"showcase_best: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(best, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    if args.markdown:
        print(markdown(best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
