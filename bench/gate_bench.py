"""The gate's own benchmark: how often does it accept changes of known effect, and how fast does it decide?

    python bench/gate_bench.py [--task kernels/softmax] [--shape 16384x16384] [--aa 100] \
        [--gains 0.005:40,0.02:40,0.03:40] [--json OUT.json]

Cases, each decided exactly as `submit` decides (paired A/B timing, `Gate.judge`), with a fresh
timing seed per trial:
  A/A   two builds of the same source (different .so files, identical machine code): any accept
        is a false accept;
  gain  best = the kernel followed by a spin of d ns on the same stream (the task's
        KLOOP_TEST_DELAY_NS hook), candidate = the same with a spin of 0 ns, d = gain x the
        candidate's measured time; the true ratio is the pooled estimate over all the case's trials.
Targets (min_gain 1%): A/A accepts <= 1/100 with no accepted interval wider than the noise limit
(GateConfig.noisy_halfwidth); 0.5% gains <= 5%; 2% gains >= 95%; 3% gains >= 99%; <= 2 s of timing
per decision (--max-seconds 2). The estimate is the gate's: the ratio of the workload's times over
passes (tools/stats.py), each trial the first look at its best; printed per case with the widest
interval that was accepted (its half-width in log).

Every case goes through the gate's real isolation path: ONE request to a sandboxed judge (a
pre-started one, tools/judge_handle.JudgeStandby, as the gate uses) whose two seccomp-locked runners each
load one library; the judge runs the case's trials back to back (`trials` of the request: each its
own timing seed drawn in the judge, fresh input sets, its own statistics) and the verdicts are
`Gate.judge`'s. Only the check is left out (it is not what is measured here). Printed per case:
seconds per decision (the trial's time in the judge plus its share of the processes' start-up) and
the overhead beyond the paired timing itself.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agent.gate import Gate, GateConfig  # noqa: E402
from tools.bench import make_sets, time_remote  # noqa: E402
from tools.build import build  # noqa: E402
from tools.device import describe  # noqa: E402
from tools.remote import LibSession  # noqa: E402
from tools.judge_handle import StandbySlot, run_worker  # noqa: E402
from tools.spec import load_spec  # noqa: E402
from tools.stats import t_quantile  # noqa: E402

TARGETS = {"A/A": ("<=", 0.01), 0.005: ("<=", 0.05), 0.02: (">=", 0.95), 0.03: (">=", 0.99)}


def built_lib(task, flags: list[str]) -> str:
    result = build(task, extra_flags=flags)
    if not result.ok:
        raise SystemExit(f"build with {flags} failed:\n{result.error_text()}")
    return result.lib


def run_trials(gate: Gate, slot: StandbySlot, shape: str, path_a: str, path_b: str, n: int, label: str,
               log, budget_s: float = 0.0, look: int = 1, max_seconds: float | None = None) -> tuple[list[dict], dict]:
    """`n` decisions of best `path_a` against candidate `path_b` in ONE judge (one request); with
    `budget_s`, no trial starts after that many seconds of trials (fewer trials, said so). `look`: which
    timed decision against this best each trial is (its share of the error budget)."""
    cfg, task = gate.config, gate.task
    req = gate.ab_request(path_a, path_b, secrets.randbits(62), max_seconds=max_seconds, look=look).model_copy(update={
        "shapes": [shape], "allowances": {shape: task.allowance(task.shape(shape))}, "weights": {shape: 1.0},
        "trials": n, "trials_seconds": budget_s})
    t0 = time.monotonic()
    res = run_worker(req, timeout=n * (4 * req.max_seconds + 15) + 180, standby=slot.take())
    wall = time.monotonic() - t0
    slot.refill()  # the next case's judge warms up (after this case's timing: it never overlaps it)
    if not res.ok:
        raise SystemExit(f"{label}: the judge failed: {res.error}")
    reports = res.trials or [res.ab]
    seconds = res.trial_seconds or [res.stage_seconds.get("timing", 0.0)]
    # the processes' start-up and the libraries' load, shared by the case's trials
    processes = max(0.0, wall - res.stage_seconds.get("timing", 0.0))
    out = []
    for i, (ab, secs) in enumerate(zip(reports, seconds)):
        v = gate.judge(ab)
        per_decision = secs + processes / len(reports)
        out.append({"accepted": v.accepted, "speedup": v.speedup, "lo": v.speedup_lo, "hi": v.speedup_hi,
                    "pairs": ab.pairs, "timing_s": ab.timing_seconds, "decision_s": round(per_decision, 3),
                    "overhead_s": round(per_decision - ab.timing_seconds, 3), "stopped": ab.stopped_because,
                    "reason": v.reason, "passes": v.ab.passes if v.ab else 0, "pass_seconds": ab.pass_seconds,
                    "log_ratio": v.ab.shapes[0].log_speedup if v.ab and v.ab.shapes else float("nan"),
                    # per pass, each side's seconds per call: another statistic can be tried on the same draws
                    "pass_a": list(ab.shapes[0].pass_a) if ab.shapes else [],
                    "pass_b": list(ab.shapes[0].pass_b) if ab.shapes else [],
                    # each side's mean cold-probe call (CUDA: its events; CPU: its CPU time) and time per
                    # timed call: what a like-for-like bound on untimed calls would compare on a GPU
                    "probe_call_a": ab.shapes[0].probe_call_a if ab.shapes else None,
                    "probe_call_b": ab.shapes[0].probe_call_b if ab.shapes else None,
                    "time_a": ab.shapes[0].time_a if ab.shapes else None,
                    "time_b": ab.shapes[0].time_b if ab.shapes else None,
                    "stage": v.stage, "look": ab.look,
                    # an integrity bound's reason (work outside the timed region, the judge's clock, ...): None if none fired
                    "integrity": _integrity(gate, v),
                    # CUDA: the judge's wall per call beyond the reported times (lower quartiles, best's spread)
                    **{k: getattr(ab.shapes[0], k, None) if ab.shapes else None
                       for k in ("offclock_a", "offclock_b", "offclock_a_se", "trail_a", "trail_b", "trail_a_se",
                                 "calls_per_sample",
                                 # the probes' work outside the timed region (the escape bound's figures): kept so
                                 # its false flags (per-runner host offsets) can be studied on recorded decisions
                                 "extra_a", "extra_b", "extra_a_se")}})
        log(f"{label} trial {i + 1}/{n}: {'ACCEPT' if v.accepted else 'reject'} x{v.speedup:.4f} "
            f"[{v.speedup_lo:.4f}, {v.speedup_hi:.4f}] {ab.passes} passes {ab.pairs} pairs {ab.timing_seconds:.2f} s "
            f"({ab.stopped_because})")
    meta = {"judge": res.standby, "wall_s": round(wall, 2), "processes_s": round(processes, 2),
            "judge_stages": res.stage_seconds}
    log(f"{label}: {len(out)} trials in {wall:.1f} s (judge {res.standby}; processes and loads {processes:.2f} s)")
    return out, meta


def _integrity(gate: Gate, v) -> str | None:
    if v.ab is None:
        return None
    problem = gate.integrity_problem(v.ab)
    return problem[1] if problem and problem[0] == "timing" else None


UNDER_REPORTS = (0.05, 0.10, 0.25, 0.5)


def under_report_catches(gate: Gate, trials: list[dict]) -> dict:
    """On A/A trials: how often the judge's clock would flag a candidate whose runner reported `u` less than
    its true time, per u. Such a runner's requests take as long on the judge's clock, so each sample's time
    beyond what it reported grows by u x its true time: the candidate's lower quartile by u x its time per
    call (the shift is the same for every sample of the decision). Also how often the unshifted A/A is
    flagged (a false flag). Trials without the judge-clock figures (CPU tasks) count for nothing."""
    from tools.protocol import ShapeAB

    rows = [t for t in trials if all(isinstance(t.get(k), (int, float)) and math.isfinite(t[k])
                                     for k in ("offclock_a", "offclock_b", "offclock_a_se", "time_a", "time_b"))]
    out = {"trials": len(rows), "flagged_unshifted": 0, "caught": {str(u): 0 for u in UNDER_REPORTS}, "apart_rel": [],
           "offclock_us": sorted(round(t[k] * 1e6, 1) for t in rows for k in ("offclock_a", "offclock_b")),
           "calls_per_request": sorted({t.get("calls_per_sample") or 1 for t in rows})}
    for t in rows:
        s = ShapeAB(shape="x", weight=1.0, pairs=0, speedup=1.0, speedup_lo=1.0, speedup_hi=1.0,
                    time_a=t["time_a"], time_b=t["time_b"],
                    offclock_a=t["offclock_a"], offclock_b=t["offclock_b"], offclock_a_se=t["offclock_a_se"],
                    calls_per_sample=t.get("calls_per_sample") or 1)
        allowed = gate.offclock_allowance(s)
        out["apart_rel"].append((t["offclock_b"] - t["offclock_a"]) / t["time_a"] if t["time_a"] > 0 else math.inf)
        out["flagged_unshifted"] += abs(t["offclock_b"] - t["offclock_a"]) > allowed
        for u in UNDER_REPORTS:
            out["caught"][str(u)] += abs(t["offclock_b"] + u * t["time_b"] - t["offclock_a"]) > allowed
    return out


def pooled(trials: list[dict]) -> tuple[float, float, float]:
    """The true ratio from every trial of a case: mean of the trials' log workload ratios, with its 95% interval."""
    xs = [t["log_ratio"] for t in trials if math.isfinite(t["log_ratio"])]
    if not xs:
        return float("nan"), float("nan"), float("nan")
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return math.exp(m), float("nan"), float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    h = t_quantile(len(xs) - 1, 0.025) * sd / math.sqrt(len(xs))
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default=str(Path(__file__).resolve().parents[1] / "kernels" / "softmax"))
    ap.add_argument("--shape", default=None, help="bench shape to time (default: the task's first bench shape)")
    ap.add_argument("--aa", type=int, default=100, help="A/A trials")
    ap.add_argument("--gains", default="0.005:40,0.02:40,0.03:40", help="gain:trials,...")
    ap.add_argument("--max-seconds", type=float, default=GateConfig().max_seconds, help="timing cap per decision")
    ap.add_argument("--json", type=Path, default=None, help="write every trial here")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds for the whole run (0: none): each case's trials stop early, pro rata, to fit")
    ap.add_argument("--looks", type=int, default=1,
                    help="repeated looks: the A/A case runs as look 1..N against one best, each with twice the "
                         "previous timing cap (an agent re-submitting as 'undecided' suggests); an agent is "
                         "accepted if any of its looks was")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a GateConfig setting for every decision (repeatable), e.g. --set cuda_request_s=0.01")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    started = time.monotonic()
    log = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))
    gate = Gate(Path(args.task), task_rel=Path(args.task).name,
                config=GateConfig(max_seconds=args.max_seconds).with_settings(args.set))
    task = gate.task
    shape = args.shape or task.bench_shapes[0].name
    task.shape(shape)
    device = torch.device("cuda" if task.target == "cuda" else "cpu")
    spec = load_spec(task.spec_path)
    info = describe(device)
    results: dict = {"device": info.model_dump(mode="json"), "task": task.name, "shape": shape,
                     "min_gain": task.manifest.min_gain, "config": gate.config.model_dump(), "cases": []}
    slot = StandbySlot(gate.trusted_dir)
    slot.refill()  # the first case's judge warms up during the builds
    pool = ThreadPoolExecutor(4)
    gains = [(float(g), int(n)) for g, n in (item.split(":") for item in args.gains.split(",") if item)]
    if gains and not any("KLOOP_TEST_DELAY_NS" in (task.root / src).read_text(errors="replace")
                         for src in task.manifest.sources):
        # without the hook every "gain" build is the same kernel: the case would measure nothing
        ap.error(f"{task.name} has no KLOOP_TEST_DELAY_NS hook in {task.manifest.sources}: "
                 "run its A/A case alone (--gains '') or use a task with the hook (softmax)")
    # the builds in parallel (each a sandboxed ninja); the gain builds need the candidate's time first
    aa = [pool.submit(built_lib, task, [f"-DKLOOP_AA_COPY={i}"]) for i in (1, 2)] if args.aa else []
    fast_job = pool.submit(built_lib, task, ["-DKLOOP_TEST_DELAY_NS=0"]) if gains else None
    cases = [("A/A", None, aa[0].result(), aa[1].result(), args.aa)] if args.aa else []
    looks: list[list[dict]] = []  # per look >= 2, the A/A trials (trial i: agent i's look)
    if gains:
        fast = fast_job.result()
        gen = torch.Generator(device=device)
        gen.manual_seed(1)
        dims = task.shape(shape).dims
        with LibSession(task, [fast]) as one:  # a calibration, not a decision
            sets = make_sets(spec, dims, gen, device, one.timer)
            t = time_remote(one.libs[0], spec, shape, dims, sets, one.arena, 2.0, None, None).median
            del sets
        log(f"candidate time on {shape}: {t * 1e6:.1f} us")
        for g, n in gains:
            delay = int(round(g * t * 1e9))
            cases.append((g, delay, pool.submit(built_lib, task, [f"-DKLOOP_TEST_DELAY_NS={delay}"]), fast, n))
    log(f"set-up (builds, calibration) {time.monotonic() - started:.1f} s")

    def weight(label) -> int:  # the A/A case's looks run `n` trials each at a doubling cap: 1 + 2 + 4 ... caps' worth
        return 2 ** args.looks - 1 if label == "A/A" else 1

    rows = []
    try:
        for c, (label, delay_ns, path_a, path_b, n) in enumerate(cases):
            path_a = path_a if isinstance(path_a, str) else path_a.result()
            name = f"gain {label}" if label != "A/A" else "A/A"
            budget = 0.0
            if args.budget:  # what is left, shared by the cases to come by their trials x caps, less start-ups
                starts = sum(args.looks if lb == "A/A" else 1 for lb, *_ in cases[c:])  # a judge start each
                left = args.budget - (time.monotonic() - started) - 10 * starts
                budget = max(1.0, left * n * weight(label) / max(1, sum(k * weight(lb) for lb, *_, k in cases[c:])))
            # each look its share of the case's budget, by its cap
            share = (lambda look: budget * 2 ** (look - 1) / weight(label)) if budget else (lambda look: 0.0)
            trials, meta = run_trials(gate, slot, shape, path_a, path_b, n, name, log, share(1))
            if label == "A/A":
                for look in range(2, args.looks + 1):
                    more, _ = run_trials(gate, slot, shape, path_a, path_b, n, f"A/A look {look}", log, share(look),
                                         look=look, max_seconds=args.max_seconds * 2 ** (look - 1))
                    looks.append(more)
            true, true_lo, true_hi = pooled(trials)
            accepted = sum(t["accepted"] for t in trials)
            rate = accepted / max(1, len(trials))
            op, target = TARGETS.get(label, ("", None))
            met = None if target is None else (rate <= target if op == "<=" else rate >= target)
            secs = [t["timing_s"] for t in trials]
            # the widest interval any accept rested on (half-width in log): none may exceed the noise limit
            widths = [(math.log(t["hi"]) - math.log(t["lo"])) / 2 for t in trials if t["accepted"]]
            widest = max(widths) if widths else None
            if widest is not None and widest > gate.config.noisy_halfwidth:
                met = False
            parts: dict[str, float] = {}  # where the timing loop's seconds went, summed over the case's trials
            for t in trials:
                for k, v in t["pass_seconds"].items():
                    parts[k] = parts.get(k, 0.0) + v
            row = {"case": "A/A" if label == "A/A" else f"gain {100 * label:g}%", "delay_ns": delay_ns,
                   "trials": len(trials), "trials_asked": n, "accepted": accepted, "rate": rate,
                   "target": f"{op} {target:.0%}" if target is not None else "", "met": met,
                   "true_speedup": true, "true_ci": [true_lo, true_hi],
                   "timing_s_mean": sum(secs) / len(secs), "timing_s_max": max(secs),
                   "decision_s_mean": sum(t["decision_s"] for t in trials) / len(trials),
                   "overhead_s_mean": sum(t["overhead_s"] for t in trials) / len(trials),
                   "pairs_mean": sum(t["pairs"] for t in trials) / len(trials),
                   "passes_mean": sum(t["passes"] for t in trials) / len(trials), "widest_accepted_halfwidth": widest,
                   "pass_seconds_share": {k: round(v / max(sum(parts.values()), 1e-9), 3) for k, v in parts.items()},
                   "integrity_rejects": sum(bool(t["integrity"]) for t in trials), **meta}
            if label == "A/A":
                row["under_report"] = under_report_catches(gate, trials)
                if looks:
                    agents = [trials] + looks
                    # an agent is trial i of every look: only those with all their looks count (a --budget can
                    # cut a look short); the accepts of the looks beyond are counted per look all the same
                    whole = min(len(look) for look in agents)
                    per_agent = [any(look[i]["accepted"] for look in agents) for i in range(whole)]
                    row["looks"] = {"looks": len(agents), "agents": whole, "agents_accepted": sum(per_agent),
                                    "accepted_per_look": [sum(t["accepted"] for t in look) for look in agents],
                                    "trials_per_look": [len(look) for look in agents]}
            rows.append(row)
            # said as each case ends (also under --quiet): a run cut off by its device command keeps what it decided
            print(f"case {row['case']}: {accepted} of {len(trials)} accepted, {row['integrity_rejects']} integrity flags, "
                  f"{row['timing_s_mean']:.2f} s timing a decision (max {row['timing_s_max']:.2f})"
                  + (f"; looks: {row['looks']['agents_accepted']} of {row['looks']['agents']} agents accepted"
                     if row.get("looks") else ""), flush=True)
            results["cases"].append(row | {"trials_detail": trials} | ({"looks_detail": looks} if label == "A/A" and looks else {}))
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    finally:
        slot.close()
        pool.shutdown(wait=False, cancel_futures=True)

    print(f"\ngate benchmark: task {task.name}, shape {shape}, min_gain {task.manifest.min_gain:.0%}, "
          f"timing cap {gate.config.max_seconds:g} s; on {info.label()}; {time.monotonic() - started:.0f} s in all")
    print(f"{'case':<12} {'true speedup (pooled)':>24} {'trials':>6} {'accepted':>8} {'rate':>6} {'target':>8} {'met':>4} "
          f"{'timing s':>8} {'max s':>6} {'s/decision':>10} {'overhead s':>10} {'pairs':>6} {'passes':>6} {'widest acc.':>11}")
    for r in rows:
        ci = f"x{r['true_speedup']:.4f} [{r['true_ci'][0]:.4f},{r['true_ci'][1]:.4f}]"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['case']:<12} {ci:>24} {r['trials']:>6} {r['accepted']:>8} {r['rate']:>6.1%} {r['target']:>8} {met:>4} "
              f"{r['timing_s_mean']:>8.2f} {r['timing_s_max']:>6.2f} {r['decision_s_mean']:>10.3f} "
              f"{r['overhead_s_mean']:>10.3f} {r['pairs_mean']:>6.0f} {r['passes_mean']:>6.1f} "
              f"{'-' if r['widest_accepted_halfwidth'] is None else format(r['widest_accepted_halfwidth'], '.4f'):>11}")
    print("s/decision: the trial's seconds in the judge plus its share of the judge's and runners' start-up and "
          "loads; overhead: s/decision less the paired timing itself; widest acc.: the widest accepted interval's "
          f"half-width in log (noise limit {gate.config.noisy_halfwidth}; wider fails the case)")
    for r in rows:
        print(f"{r['case']}: timing loop by part: " + ", ".join(f"{k} {v:.0%}" for k, v in r["pass_seconds_share"].items()))
    for r in rows:
        if r["integrity_rejects"]:
            print(f"{r['case']}: {r['integrity_rejects']} trials rejected by an integrity bound (work outside the timed "
                  "region, the judge's clock, untimed calls): false flags where the case is honest")
        ur = r.get("under_report")
        if ur and ur["trials"]:
            apart = sorted(abs(x) for x in ur["apart_rel"])
            print(f"{r['case']}: the judge's clock beyond the reported times, candidate vs best: at most "
                  f"{100 * apart[-1]:.2f}% of the best's time apart (median {100 * apart[len(apart) // 2]:.2f}%), "
                  f"flagged {ur['flagged_unshifted']} of {ur['trials']} (each side's lower quartile "
                  f"{ur['offclock_us'][0]:.0f}-{ur['offclock_us'][-1]:.0f} us a call, {ur['calls_per_request']} calls a "
                  f"request); a runner under-reporting by "
                  + ", ".join(f"{100 * float(u):g}% caught {c} of {ur['trials']}" for u, c in ur["caught"].items()))
        lk = r.get("looks")
        if lk:
            print(f"{r['case']}: {lk['agents']} agents re-submitting the A/A change up to {lk['looks']} times (timing cap "
                  f"doubling): {lk['agents_accepted']} accepted ({lk['agents_accepted'] / max(1, lk['agents']):.1%}); "
                  f"accepts per look {lk['accepted_per_look']} of {lk['trials_per_look']}")
    short = [f"{r['case']} {r['trials']} of {r['trials_asked']}" for r in rows if r["trials"] < r["trials_asked"]]
    if short:
        print("fewer trials than asked, to fit --budget: " + ", ".join(short))
    return 0 if all(r["met"] in (None, True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
