"""Seconds per gate decision beyond compile and paired timing, stage by stage.

    python bench/decision_overhead.py [--task kernels/softmax] [--knob VEC=8] [--decisions 2] [--think 30]

Builds the task (the best) and a candidate with one knob changed (both compiled before the measured
decisions, so "build" is the cached lookup), then runs `Gate.evaluate` on the candidate `--decisions`
times, as `submit` does, and prints per decision the total, the paired timing, the rest, and the
verdict's per-stage seconds (scope, build, audit, processes, check, timing, sass) with whether the
judge was pre-started. Between decisions it waits up to `--think` seconds for the gate's standby
judge to be warm, as an agent's thinking would (0: back to back).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.gate import Candidate, Gate, GateConfig  # noqa: E402
from tools.build import build  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default=str(ROOT / "kernels" / "softmax"))
    ap.add_argument("--knob", default="VEC=8", help="NAME=VALUE: the candidate's change")
    ap.add_argument("--decisions", type=int, default=2)
    ap.add_argument("--think", type=float, default=30.0, help="most seconds to wait for a warm judge between decisions")
    ap.add_argument("--max-seconds", type=float, default=3.0, help="timing cap per decision")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a GateConfig setting for every decision (repeatable), e.g. --set cuda_request_s=0.01")
    args = ap.parse_args(argv)

    trusted = Path(args.task).resolve()
    gate = Gate(trusted, f"kernels/{trusted.name}", GateConfig(max_seconds=args.max_seconds).with_settings(args.set))
    name, value = args.knob.split("=", 1)
    best = build(gate.task)
    with tempfile.TemporaryDirectory(prefix="kloop-overhead-") as tmp, gate:
        cand = Path(tmp) / trusted.name
        shutil.copytree(trusted, cand)
        gate.task.write_knob_settings(cand, {name: int(value)})
        build(gate.task, src_root=cand)  # compile outside the measured decisions
        beyond = []
        for i in range(args.decisions):
            if i:
                waited = wait_warm(gate, args.think)
                print(f"  (waited {waited:.1f} s for the standby judge to warm up)")
            t = time.monotonic()
            v = gate.evaluate(Candidate(cand, [f"kernels/{trusted.name}/knobs.toml"]), best)
            total = time.monotonic() - t
            timing = v.ab.timing_seconds if v.ab else 0.0
            beyond.append(total - timing - v.stage_seconds.get("build", 0.0))
            print(f"decision {i}: {total:.2f} s total, {timing:.2f} s of paired timing, beyond compile and timing "
                  f"{beyond[-1]:.2f} s; {v.summary().splitlines()[0][:120]}")
            print(f"  {v.stages_line()}", flush=True)
    print(f"beyond compile and timing: {', '.join(f'{b:.2f}' for b in beyond)} s")
    return 0


def wait_warm(gate: Gate, limit: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        cur = gate.standby._current
        if cur is None or not cur.alive() or cur.ready():
            break
        time.sleep(0.1)
    return time.monotonic() - t0


if __name__ == "__main__":
    sys.exit(main())
