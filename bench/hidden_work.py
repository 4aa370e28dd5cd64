"""How much hidden work does the gate catch? Work on a second stream, outside the timed region, of a known size.

    python bench/hidden_work.py [--task kernels/softmax] [--shapes 128x4096,65536x4096] \
        [--fractions 0.05,0.1,0.2] [--trials 10] [--max-seconds 2] [--json OUT.json]

Per shape: best = the softmax as it is; candidates = the same softmax plus a spin of f x (the best's
measured time) on a second, non-blocking stream that starts when the call's work on the timed stream
ends (the task's KLOOP_TEST_HIDDEN_NS hook: a test-only build the audit would refuse), so the timed
stream is unchanged and the hidden work is exactly f of a call, all of it after the timed region.
Each case runs `--trials` decisions through the gate's real judge (as bench/gate_bench.py: one
sandboxed judge per case, `Gate.judge` on each trial) and counts how many say "work outside the timed
region". A/A (f = 0) must never say so. Prints per shape and fraction: the caught rate, the best's
time, the hidden work per call, and the two allowances the gate applied: the judge-clock probes'
(Gate.escape_allowance) and the device clock's over every timed sample (Gate.trail_allowance).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from agent.gate import Gate, GateConfig  # noqa: E402
from gate_bench import built_lib  # noqa: E402
from tools.bench import make_sets, time_remote  # noqa: E402
from tools.device import describe  # noqa: E402
from tools.remote import LibSession  # noqa: E402
from tools.judge_handle import StandbySlot, run_worker  # noqa: E402
from tools.spec import load_spec  # noqa: E402
import secrets  # noqa: E402


def decisions(gate: Gate, slot: StandbySlot, shape: str, best: str, cand: str, n: int) -> list:
    task = gate.task
    req = gate.ab_request(best, cand, secrets.randbits(62)).model_copy(update={
        "shapes": [shape], "allowances": {shape: task.allowance(task.shape(shape))}, "weights": {shape: 1.0},
        "trials": n})
    res = run_worker(req, timeout=n * (4 * gate.config.max_seconds + 15) + 180, standby=slot.take())
    slot.refill()
    if not res.ok:
        raise SystemExit(f"{shape}: the judge failed: {res.error}")
    return [(gate.judge(ab), ab) for ab in (res.trials or [res.ab])]


# The spin waits for the call's work on the timed stream (an event), so all of it runs after the timed
# region's end: work a side stream does beside the call, overlapped, is inside the wall the end event
# times, and costs a user nothing more than what was timed (a 1-thread spin there once read as "hidden"
# work that no clock could see, because there was none to see)
HIDDEN_HOOK = """#ifdef KLOOP_TEST_HIDDEN_NS
    static cudaStream_t side = nullptr;
    static cudaEvent_t timed_done = nullptr;
    if (side == nullptr) {
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        cudaEventCreateWithFlags(&timed_done, cudaEventDisableTiming);
    }
    cudaEventRecord(timed_done, stream);
    cudaStreamWaitEvent(side, timed_done, 0);
    kloop_test_delay<<<1, 1, 0, side>>>(static_cast<unsigned long long>(KLOOP_TEST_HIDDEN_NS));
#endif
"""


def _with_hidden_hook(task: Path, dest: Path) -> Path:
    """A copy of the softmax task whose kernel also spins on a second stream when built with
    -DKLOOP_TEST_HIDDEN_NS (kept out of the shipped source, whose static rules refuse streams)."""
    import shutil

    out = dest / task.name
    shutil.copytree(task, out)
    src = out / "softmax.cu"
    text = src.read_text()
    tail = "    return static_cast<int>(cudaGetLastError());\n}"
    if tail not in text:
        raise SystemExit(f"{src}: cannot place the hidden-work hook (no kloop_softmax epilogue)")
    text = text.replace("#if defined(KLOOP_TEST_DELAY_NS)", "#if defined(KLOOP_TEST_DELAY_NS) || defined(KLOOP_TEST_HIDDEN_NS)", 1)
    src.write_text(text.replace(tail, HIDDEN_HOOK + tail, 1))
    return out


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default=str(Path(__file__).resolve().parents[1] / "kernels" / "softmax"))
    ap.add_argument("--shapes", default="128x4096,65536x4096")
    ap.add_argument("--fractions", default="0,0.05,0.1,0.2")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=2.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a GateConfig setting for every decision (repeatable), e.g. --set cuda_request_s=0.01")
    args = ap.parse_args(argv)

    started = time.monotonic()
    task_dir = _with_hidden_hook(Path(args.task), Path(tempfile.mkdtemp(prefix="kloop-hidden-")))
    gate = Gate(task_dir, task_rel=task_dir.name, config=GateConfig(max_seconds=args.max_seconds).with_settings(args.set))
    task = gate.task
    device = torch.device("cuda" if task.target == "cuda" else "cpu")
    spec = load_spec(task.spec_path)
    info = describe(device)
    best = built_lib(task, ["-DKLOOP_AA_COPY=1"])
    slot = StandbySlot(gate.trusted_dir)
    slot.refill()
    rows = []
    try:
        for shape in [s for s in args.shapes.split(",") if s]:
            dims = task.shape(shape).dims
            gen = torch.Generator(device=device)
            gen.manual_seed(1)
            with LibSession(task, [best]) as one:  # a calibration, not a decision
                sets = make_sets(spec, dims, gen, device, one.timer)
                t = time_remote(one.libs[0], spec, shape, dims, sets, one.arena, 1.0, None, None).median
                del sets
            for f in (float(x) for x in args.fractions.split(",") if x):
                ns = int(round(f * t * 1e9))
                cand = built_lib(task, [f"-DKLOOP_TEST_HIDDEN_NS={ns}"] if ns else ["-DKLOOP_AA_COPY=2"])
                verdicts = decisions(gate, slot, shape, best, cand, args.trials)
                caught = sum("outside the timed region" in v.reason for v, _ in verdicts)
                allow = [gate.escape_allowance(v.ab.shapes[0]) for v, _ in verdicts if v.ab and v.ab.shapes]
                trail_allow = [gate.trail_allowance(v.ab.shapes[0]) for v, _ in verdicts if v.ab and v.ab.shapes]
                trail_diff = [v.ab.shapes[0].trail_b - v.ab.shapes[0].trail_a for v, _ in verdicts
                              if v.ab and v.ab.shapes and v.ab.shapes[0].trail_a is not None]
                row = {"shape": shape, "best_s": t, "fraction": f, "hidden_ns": ns, "trials": len(verdicts),
                       "caught": caught, "accepted": sum(v.accepted for v, _ in verdicts),
                       "allowance_s_median": _median(allow),
                       "extra_diff_s": [v.ab.shapes[0].extra_b - v.ab.shapes[0].extra_a for v, _ in verdicts if v.ab],
                       "trail_allowance_s_median": _median(trail_allow), "trail_diff_s": trail_diff,
                       "reasons": [v.reason[:200] for v, _ in verdicts]}
                rows.append(row)
                print(f"{shape}: best {t * 1e6:.1f} us, hidden {ns / 1e3:.1f} us ({f:.0%}): caught {caught}/{len(verdicts)}, "
                      f"accepted {row['accepted']}; probes' allowance ~{(row['allowance_s_median'] or 0) * 1e6:.2f} us, "
                      f"device-clock allowance ~{(row['trail_allowance_s_median'] or 0) * 1e6:.2f} us, its excess "
                      f"~{(_median(trail_diff) or 0) * 1e6:.2f} us", flush=True)
                if args.json:
                    args.json.write_text(json.dumps({"device": info.model_dump(mode="json"), "rows": rows}, indent=1))
    finally:
        slot.close()
    print(f"on {info.label()}; {time.monotonic() - started:.0f} s")
    aa_flagged = sum(r["caught"] for r in rows if r["fraction"] == 0)
    ten = [r for r in rows if abs(r["fraction"] - 0.1) < 1e-9]
    return 0 if aa_flagged == 0 and all(r["caught"] == r["trials"] for r in ten) else 1


if __name__ == "__main__":
    sys.exit(main())
