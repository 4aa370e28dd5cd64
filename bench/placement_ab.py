"""What CPU placement does to the gate's A/A decisions on the CPU task: placed and unplaced, interleaved.

    python bench/placement_ab.py [--trials 10] [--hog N] [--max-seconds 4] [--json OUT.json]

Each trial is one A/A `Gate.decide` per mode (GateConfig.cpu_placement "current", then "off"), in turn, so
both modes see the same machine. Per mode it prints the spread (rms) of the decisions' log ratios (0 is
the truth), the per-pass log ratios' rms, how many intervals exclude 1, the passes and the mean interval
half-width (in log). A smaller spread at the same or more passes is the better mode; the gate is only
sound if intervals exclude 1 at about the look's level (2 x 0.61% of the decisions here).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from agent.gate import Gate, GateConfig  # noqa: E402
from gate_cpu_trials import TASK, built, pass_ratios, repeat_source, start_hogs  # noqa: E402

MODES = ("current", "off")


def summary(rows: list[dict]) -> dict:
    lr = [math.log(r["speedup"]) for r in rows]
    per_pass = [math.log(x) for r in rows for x in r["pass_ratios"]]
    half = [(math.log(r["hi"]) - math.log(r["lo"])) / 2 for r in rows]
    return {"decisions": len(rows), "mean_log": sum(lr) / len(lr), "rms_log": math.sqrt(sum(x * x for x in lr) / len(lr)),
            "per_pass_rms": math.sqrt(sum(x * x for x in per_pass) / max(1, len(per_pass))),
            "excluding_1": sum(r["lo"] > 1 or r["hi"] < 1 for r in rows), "accepted": sum(r["accepted"] for r in rows),
            "passes": sum(r["passes"] for r in rows) / len(rows), "halfwidth": sum(half) / len(half)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10, help="A/A decisions per mode")
    ap.add_argument("--hog", type=int, default=0, help="busy-looping processes beside the decisions")
    ap.add_argument("--max-seconds", type=float, default=4.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    hogs = start_hogs(args.hog)
    try:
        rows = _run(args)
    finally:
        for h in hogs:
            h.kill()
    table = {m: summary([r for r in rows if r["mode"] == m]) for m in MODES}
    print(f"{'mode':<8} {'decisions':>9} {'mean log':>9} {'rms log':>8} {'per-pass rms':>12} {'excl. 1':>7} "
          f"{'accepted':>8} {'passes':>6} {'half-width':>10}")
    for m, t in table.items():
        print(f"{m:<8} {t['decisions']:>9} {t['mean_log']:>9.4f} {t['rms_log']:>8.4f} {t['per_pass_rms']:>12.4f} "
              f"{t['excluding_1']:>7} {t['accepted']:>8} {t['passes']:>6.1f} {t['halfwidth']:>10.4f}")
    if args.json:
        args.json.write_text(json.dumps({"hog": args.hog, "max_seconds": args.max_seconds, "summary": table, "decisions": rows}, indent=1))
    return 0


def _run(args) -> list[dict]:
    gates = {m: Gate(TASK, "kernels/matmul_cpu", GateConfig(max_seconds=args.max_seconds, cpu_placement=m)) for m in MODES}
    rows = []
    with tempfile.TemporaryDirectory(prefix="kloop-placement-") as tmp:
        src = repeat_source(Path(tmp))
        once = built(gates["off"].task, src, ["-DKLOOP_TEST_REPEAT=1"])
        copy = built(gates["off"].task, src, ["-DKLOOP_TEST_REPEAT=1", "-DKLOOP_AA_COPY=1"])
        for i in range(args.trials):
            for m in MODES:
                t0 = time.monotonic()
                v = gates[m].decide(copy, once, check=None, check_seed=i)
                if v.ab is None:
                    raise SystemExit(f"trial {i} ({m}): no timing: {v.reason}")
                rows.append({"mode": m, "trial": i, "accepted": v.accepted, "speedup": v.ab.speedup, "lo": v.ab.speedup_lo,
                             "hi": v.ab.speedup_hi, "passes": v.ab.passes, "placed_from_cpus": v.ab.placed_from_cpus,
                             "pass_ratios": pass_ratios(v.ab), "seconds": round(time.monotonic() - t0, 1)})
                r = rows[-1]
                print(f"trial {i + 1}/{args.trials} {m:<7} x{r['speedup']:.4f} [{r['lo']:.4f}, {r['hi']:.4f}] "
                      f"{r['passes']} passes, placed from {r['placed_from_cpus']} CPUs", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
