"""The gate's A/A and known-gain trials on the CPU task, through the real evaluation path.

    python bench/gate_cpu_trials.py [--aa 2] [--gain 2] [--max-seconds 4] [--hog N] [--json OUT.json]

Each trial is one `Gate.decide` (fresh worker processes, paired A/B timing, `Gate.judge`), exactly what
`submit` runs after the check:
  A/A   two builds of the same source (different .so files, identical code): an accept is a FALSE ACCEPT;
  x2    best = the kernel doing its work twice, candidate = once: a true x2 that no noise can fake or
        hide; a rejection as escape or regression is a FALSE ESCAPE / FALSE REGRESSION ("undecided
        (noisy machine)" is allowed: it says the machine could not decide, not that the change is bad).
Exits 1 on any false accept, false escape or false regression; 0 otherwise. Meant for CI on a loaded
2-core machine (about 60 s). `--hog N`: N busy-looping processes beside the trials, for the whole run
(the machine a user shares with a build or a training job).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.gate import Gate, GateConfig  # noqa: E402
from tools.build import build  # noqa: E402

TASK = ROOT / "kernels" / "matmul_cpu"
CALL = "  matmul_ikj(A, B, C, M, N, K);\n"
KNOBS = {"LOOP_ORDER": 1}  # the fast loop order: shorter calls, more pairs per second


def built(task, src_root: Path | None = None, flags: list[str] | None = None):
    res = build(task, knobs=KNOBS, src_root=src_root, extra_flags=flags or [])
    if not res.ok:
        raise SystemExit(f"build failed:\n{res.error_text()}")
    return res


def repeat_source(tmp: Path) -> Path:
    """A copy of the task whose kernel does its whole work KLOOP_TEST_REPEAT times (-D at build time).

    Every variant (once, twice, the A/A copies) calls the same out-of-line function through a
    volatile pointer, so the compiler treats all of them alike and cannot merge the repeats."""
    dest = tmp / "matmul_repeat"
    shutil.copytree(TASK, dest)
    src = dest / "matmul.cpp"
    text = src.read_text()
    if CALL not in text:
        raise SystemExit(f"{src}: cannot find {CALL.strip()!r} to repeat")
    repeat = ("  { void (*volatile run)(const float*, const float*, float*, int, int, int) = matmul_ikj;\n"
              "    for (int r = 0; r < KLOOP_TEST_REPEAT; ++r) { run(A, B, C, M, N, K); asm volatile(\"\" ::: \"memory\"); } }\n")
    src.write_text(text.replace(CALL, repeat, 1))
    return dest


def classify(case: str, v) -> str | None:
    """The failure this verdict is, if any."""
    if case == "A/A":
        return "false accept" if v.accepted else None
    if v.accepted or v.stage == "undecided":
        return None
    if "outside the timed region" in v.reason or "integrity probes" in v.reason:
        return "false escape"
    if "regression" in v.reason:
        return "false regression"
    return "true gain rejected"  # 'not measurably faster' on a x2: the gate is blind


def pass_ratios(ab) -> list[float]:
    """Per pass, the best's workload time over the candidate's (what the verdict's estimate sums): a steady
    offset from the first pass on, or a transient in a few, reads here."""
    if ab is None or not ab.shapes:
        return []
    n = min(min(len(s.pass_a), len(s.pass_b)) for s in ab.shapes)
    wa = [sum(s.weight * s.pass_a[i] for s in ab.shapes) for i in range(n)]
    wb = [sum(s.weight * s.pass_b[i] for s in ab.shapes) for i in range(n)]
    return [round(a / b, 4) for a, b in zip(wa, wb)]


def _spin() -> None:
    while True:
        pass


def start_hogs(n: int) -> list:
    """`n` processes that each keep one core busy until killed."""
    hogs = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(n)]
    for h in hogs:
        h.start()
    return hogs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aa", type=int, default=2, help="A/A trials")
    ap.add_argument("--gain", type=int, default=2, help="x2 trials")
    ap.add_argument("--max-seconds", type=float, default=4.0, help="timing cap per decision (MIN_PASSES must fit in it)")
    ap.add_argument("--hog", type=int, default=0, help="busy-looping processes beside the trials")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--placement", default="current", help="GateConfig.cpu_placement (tools/placement.py)")
    args = ap.parse_args(argv)

    hogs = start_hogs(args.hog)
    try:
        return _trials(args)
    finally:
        for h in hogs:
            h.kill()


def _trials(args) -> int:
    started = time.monotonic()
    gate = Gate(TASK, "kernels/matmul_cpu", GateConfig(max_seconds=args.max_seconds, cpu_placement=args.placement))
    with tempfile.TemporaryDirectory(prefix="kloop-trials-") as tmp:
        src = repeat_source(Path(tmp))
        once = built(gate.task, src, ["-DKLOOP_TEST_REPEAT=1"])
        copy = built(gate.task, src, ["-DKLOOP_TEST_REPEAT=1", "-DKLOOP_AA_COPY=1"])
        twice = built(gate.task, src, ["-DKLOOP_TEST_REPEAT=2"])
        cases = [("A/A", once, copy)] * args.aa + [("x2", twice, once)] * args.gain
        rows, failures = [], []
        for i, (case, best, cand) in enumerate(cases):
            v = gate.decide(cand, best, check=None, check_seed=0)
            bad = classify(case, v)
            rows.append({"case": case, "accepted": v.accepted, "stage": v.stage, "speedup": v.speedup,
                         "lo": v.speedup_lo, "hi": v.speedup_hi, "seconds": v.seconds, "reason": v.reason, "failure": bad,
                         "pass_ratios": pass_ratios(v.ab), "placed_from_cpus": v.ab.placed_from_cpus if v.ab else None})
            print(f"{case:<4} trial {i + 1}/{len(cases)}: {'ACCEPT' if v.accepted else 'reject'} at {v.stage} "
                  f"{'FAIL (' + bad + ')' if bad else 'ok'}: {v.reason[:300]}", flush=True)
            if bad:
                failures.append(f"{case}: {bad}: {v.reason}")
    if args.json:
        args.json.write_text(json.dumps({"hog": args.hog, "trials": rows}, indent=1))
    print(f"{len(cases)} trials{f' beside {args.hog} CPU hog(s)' if args.hog else ''} in {time.monotonic() - started:.0f} s; "
          + ("all verdicts honest" if not failures else f"{len(failures)} FAILED:\n  " + "\n  ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
