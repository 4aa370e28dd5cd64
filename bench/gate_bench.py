"""The gate's own benchmark: how often does it accept changes of known effect, and how fast does it decide?

    python bench/gate_bench.py [--task kernels/softmax] [--shape 16384x16384] [--aa 100] \
        [--gains 0.005:40,0.02:40,0.03:40] [--json OUT.json]

Cases, each decided exactly as `submit` decides (paired A/B timing, `Gate.judge`), with a fresh
timing seed per trial:
  A/A   two builds of the same source (different .so files, identical machine code): any accept
        is a false accept;
  gain  best = the kernel followed by a spin of d ns on the same stream (the task's
        KLOOP_TEST_DELAY_NS hook), candidate = the same with a spin of 0 ns, d = gain x the
        candidate's measured time; the true ratio is measured once more with a long paired run.
Targets (min_gain 1%): A/A accepts <= 1/100; 0.5% gains <= 5%; 2% gains >= 95%; 3% gains >= 99%;
<= 5 s of timing per decision. The trials run in one judge process with one runner per library (each
library loaded once, in its own process, as in the gate); a real submit adds the processes' start-up.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agent.gate import Gate, GateConfig  # noqa: E402
from tools.ab import ab_in_process  # noqa: E402
from tools.bench import make_sets, time_remote  # noqa: E402
from tools.build import build  # noqa: E402
from tools.device import describe  # noqa: E402
from tools.remote import LibSession  # noqa: E402
from tools.spec import load_spec  # noqa: E402

TARGETS = {"A/A": ("<=", 0.01), 0.005: ("<=", 0.05), 0.02: (">=", 0.95), 0.03: (">=", 0.99)}


def built_lib(task, flags: list[str]) -> str:
    result = build(task, extra_flags=flags)
    if not result.ok:
        raise SystemExit(f"build with {flags} failed:\n{result.error_text()}")
    return result.lib


def run_trials(gate: Gate, spec, libs: LibSession, shape: str, n: int, label: str, log) -> list[dict]:
    cfg, task = gate.config, gate.task
    lib_a, lib_b = libs.libs
    out = []
    for i in range(n):
        ab = ab_in_process(task, spec, lib_a, lib_b, [shape], secrets.randbits(62), libs.device, cfg.max_seconds,
                           cfg.min_pairs, cfg.target_halfwidth, task.manifest.min_gain,
                           {shape: task.allowance(task.shape(shape))}, {shape: 1.0}, libs.arena)
        v = gate.judge(ab)
        out.append({"accepted": v.accepted, "speedup": ab.speedup, "lo": ab.speedup_lo, "hi": ab.speedup_hi,
                    "pairs": ab.pairs, "timing_s": ab.timing_seconds, "stopped": ab.stopped_because, "reason": v.reason})
        log(f"{label} trial {i + 1}/{n}: {'ACCEPT' if v.accepted else 'reject'} x{ab.speedup:.4f} "
            f"[{ab.speedup_lo:.4f}, {ab.speedup_hi:.4f}] {ab.pairs} pairs {ab.timing_seconds:.2f} s ({ab.stopped_because})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default=str(Path(__file__).resolve().parents[1] / "kernels" / "softmax"))
    ap.add_argument("--shape", default=None, help="bench shape to time (default: the task's first bench shape)")
    ap.add_argument("--aa", type=int, default=100, help="A/A trials")
    ap.add_argument("--gains", default="0.005:40,0.02:40,0.03:40", help="gain:trials,...")
    ap.add_argument("--max-seconds", type=float, default=GateConfig().max_seconds, help="timing cap per decision")
    ap.add_argument("--json", type=Path, default=None, help="write every trial here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    log = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))
    gate = Gate(Path(args.task), task_rel=Path(args.task).name, config=GateConfig(max_seconds=args.max_seconds))
    task = gate.task
    shape = args.shape or task.bench_shapes[0].name
    task.shape(shape)
    device = torch.device("cuda" if task.target == "cuda" else "cpu")
    spec = load_spec(task.spec_path)
    info = describe(device)
    results: dict = {"device": info.model_dump(mode="json"), "task": task.name, "shape": shape,
                     "min_gain": task.manifest.min_gain, "config": gate.config.model_dump(), "cases": []}

    # A/A: the same code in two libraries
    cases = [("A/A", None, built_lib(task, ["-DKLOOP_AA_COPY=1"]), built_lib(task, ["-DKLOOP_AA_COPY=2"]), args.aa)]
    # gains: best carries a spin of gain x T after the kernel
    gains = [(float(g), int(n)) for g, n in (item.split(":") for item in args.gains.split(",") if item)]
    if gains:
        fast = built_lib(task, ["-DKLOOP_TEST_DELAY_NS=0"])
        gen = torch.Generator(device=device)
        gen.manual_seed(1)
        dims = task.shape(shape).dims
        with LibSession(task, [fast]) as one:
            sets = make_sets(spec, dims, gen, device, one.timer)
            t = time_remote(one.libs[0], spec, shape, dims, sets, one.arena, 2.0, None, None).median
            del sets
        log(f"candidate time on {shape}: {t * 1e6:.1f} us")
        for g, n in gains:
            slow = built_lib(task, [f"-DKLOOP_TEST_DELAY_NS={int(round(g * t * 1e9))}"])
            cases.append((g, int(round(g * t * 1e9)), slow, fast, n))

    rows = []
    for label, delay_ns, path_a, path_b, n in cases:
        with LibSession(task, [path_a, path_b], names=["best", "cand"]) as libs:
            trials = run_trials(gate, spec, libs, shape, n, f"gain {label}" if label != "A/A" else "A/A", log)
            # the true ratio, from one long paired run
            true = ab_in_process(task, spec, libs.libs[0], libs.libs[1], [shape], 7, device, 10.0, 200, 0.0003,
                                 task.manifest.min_gain, {shape: 0.5}, {shape: 1.0}, libs.arena)
        accepted = sum(t["accepted"] for t in trials)
        rate = accepted / max(1, len(trials))
        op, target = TARGETS.get(label, ("", None))
        met = None if target is None else (rate <= target if op == "<=" else rate >= target)
        secs = [t["timing_s"] for t in trials]
        row = {"case": "A/A" if label == "A/A" else f"gain {100 * label:g}%", "delay_ns": delay_ns, "trials": len(trials),
               "accepted": accepted, "rate": rate, "target": f"{op} {target:.0%}" if target is not None else "",
               "met": met, "true_speedup": true.speedup, "true_ci": [true.speedup_lo, true.speedup_hi],
               "timing_s_mean": sum(secs) / len(secs), "timing_s_max": max(secs),
               "pairs_mean": sum(t["pairs"] for t in trials) / len(trials)}
        rows.append(row)
        results["cases"].append(row | {"trials_detail": trials})
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    print(f"\ngate benchmark: task {task.name}, shape {shape}, min_gain {task.manifest.min_gain:.0%}, "
          f"timing cap {gate.config.max_seconds:g} s; on {info.label()}")
    print(f"{'case':<12} {'true speedup':>22} {'trials':>6} {'accepted':>8} {'rate':>6} {'target':>8} {'met':>4} "
          f"{'s/decision':>10} {'max s':>6} {'pairs':>6}")
    for r in rows:
        ci = f"x{r['true_speedup']:.4f} [{r['true_ci'][0]:.4f},{r['true_ci'][1]:.4f}]"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['case']:<12} {ci:>22} {r['trials']:>6} {r['accepted']:>8} {r['rate']:>6.1%} {r['target']:>8} {met:>4} "
              f"{r['timing_s_mean']:>10.2f} {r['timing_s_max']:>6.2f} {r['pairs_mean']:>6.0f}")
    return 0 if all(r["met"] in (None, True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
