"""Paired A/B timing of the best build (A) against a candidate (B), each in its own runner process.

The machine drifts (clocks, neighbours, thermals), so single timings decide nothing: A and B are
timed back to back in pairs, in random order within each pair, the cache flushed before every sample
and the input sets rotated; the per-pair ratio tA/tB cancels the drift. Work goes in passes: before
each pass every input set gets fresh values and every output is poisoned, and within a pass each
set is called once per side, so no call ever sees inputs it has seen before (an output cache, keyed
by pointer or by content, has nothing to replay). After each pass a random sample of the candidate's
outputs from that pass is checked against the reference, cold integrity probes (the same for A and
B) look for work outside the timed region, and the pass's summed call times go to the stopping
criterion (tools/stats.PassCriterion, the same object the gate decides with), which says whether to
go on. Sampling stops when the criterion is finished or the time cap is hit; a verdict needs
MIN_PASSES passes whichever comes first.
"""

from __future__ import annotations

import math
import random
import time

import torch

from tools.task import Task
from tools.bench import make_sets
from tools.check import compare, describe_error, differing_elements, passes_clearly, poison, refill
from tools.draws import SecretDraws
from tools.placement import Placement
from tools.protocol import ABReport, ShapeAB
from tools.spec import Spec
from tools.protocol import WorkerRequest
from tools.stats import MIN_EVIDENCE_STRETCH, DecisionRules, PassCriterion, median as _median, robust_se_of_quartile
from tools.timing import SHORT_CALL_S, calibrate, calls_per_sample, set_memory_cap, tensors_bytes

# Each pass pays for fresh inputs, two cold probes and re-checks against the reference (for a big
# attention shape the reference alone takes longer than many timed calls), so a pass holds several
# pairs: one set per call, never reused within the pass. 1 pair per pass gave 8 pairs of a 0.27 ms
# shape in a 4 s decision on the H200 ("undecided" on a clear +10%).
PAIRS_PER_PASS = 8
RECHECK_FRACTION = 0.25  # of the candidate's timed calls of a pass, at random, and at least RECHECK_MIN
RECHECK_MIN = 2
MIN_PASSES = 4
PROBES_PER_PASS = 2  # cold integrity probes per side and pass: at least 8 per side and decision
MAX_SETS = 256
LONG_REQUEST_SPIN_CALLS = 4  # long CUDA requests: the spin covers the first calls' enqueue (tools/libhost.run)


class _Shape:
    """Buffers and samples of one bench shape."""

    def __init__(self, name, dims, weight, allowance):
        self.name, self.dims, self.weight, self.allowance = name, dims, weight, allowance
        self.sets: list = []  # [(inputs, outputs of A, outputs of B)], all in shared memory
        # per pass: summed call seconds of A, of B, calls per side, paired samples
        self.pass_sums: list[tuple[float, float, int, int]] = []
        self.ta: list[float] = []
        self.tb: list[float] = []
        self.k = 1
        self.spin_calls: int | None = None  # long CUDA requests: the spin covers this many calls' enqueue
        self.passes = 0
        self.rechecked = 0
        self.problem: str | None = None  # first wrong timed output seen
        self.probes = {"a": [], "b": []}  # (wall, extra, idle_cpu) per cold integrity probe
        self.after_return = {"a": [], "b": []}  # CPU seconds per call used after answering, per timed sample
        self.trails = {"a": [], "b": []}  # CUDA: seconds per call the device stayed busy after the end event, per timed sample
        self.offclock = {"a": [], "b": []}  # CUDA: seconds per call of the judge's wall beyond the reported times, per sample
        # CUDA: per side, outputs that receive a copy of a probe's outputs made on its stream right after the call
        self.snapshots: dict[str, dict] = {}
        self.snapshot_key = (name, "snapshot")

    def key(self, i: int):
        return (self.name, i)


def decision_rules(req: WorkerRequest) -> DecisionRules:
    """The rules of one timed decision, as the request (built by the gate) states them."""
    return DecisionRules(min_gain=req.min_gain, allowances=req.allowances, alpha=req.alpha, min_passes=MIN_PASSES,
                         noisy_halfwidth=req.noisy_halfwidth, target_halfwidth=req.target_halfwidth,
                         min_pairs=req.min_pairs)


def criterion_of(report: ABReport, rules: DecisionRules) -> PassCriterion:
    """The criterion rebuilt from a report's per-pass times (what the gate decides from)."""
    crit = PassCriterion({s.shape: s.weight for s in report.shapes}, rules)
    n = min((min(len(s.pass_a), len(s.pass_b)) for s in report.shapes), default=0)
    for i in range(n):
        crit.add_measurement({s.shape: (s.pass_a[i], s.pass_b[i], 1, 0) for s in report.shapes})
    for s in report.shapes:
        crit.pairs[s.shape] = s.pairs
    return crit


def ab_in_process(task: Task, spec: Spec, lib_a, lib_b, shapes: list[str], seed: int, device: torch.device,
                  max_seconds: float, rules: DecisionRules, weights: dict[str, float], arena=None,
                  look: int = 1, placement: str = "current", cuda_placement: str = "off",
                  cuda_request_s: float = SHORT_CALL_S) -> ABReport:
    """`lib_a`, `lib_b`: tools.remote.RemoteLib handles on the best's and the candidate's runners;
    `rules`: the decision's (decision_rules of the gate's request), `look`: which timed look at this best;
    `placement`: CPU tasks, "current" (tools/placement.py) or "off"; `cuda_placement` the same on CUDA tasks;
    `cuda_request_s`: CUDA tasks, seconds of calls a timed request spans at least (GateConfig.cuda_request_s)."""
    draws = SecretDraws(seed, device, "timing")  # every set's values unpredictable from the sets before it
    rng = random.Random(seed ^ 0x5EED)
    timer = lib_a.timer
    share = arena.share_dict if arena is not None else (lambda d, inputs=False: d)

    # CPU tasks: each pair's two samples on the CPU the judge's thread is on (tools/placement.py; its own
    # generator where it must draw: the draws of sets and orders stay what they were)
    place = (Placement([lib_a.runner, lib_b.runner], lib_a.threads, random.Random(seed ^ 0xC7))
             if (placement if device.type == "cpu" else cuda_placement) != "off" else None)
    # CUDA C++ tasks: requests longer than one short sample (GateConfig.cuda_request_s), so that the request's own
    # cost is small beside its calls on the judge's clock, which bounds what the runner's events report (the gate's
    # offclock check). Only for shapes whose one call fills a short sample already: shorter calls are enqueued
    # slower than they run, and a request of them needs the spin over all its calls. Not Triton tasks: no
    # candidate host code runs in their runners
    long_requests = device.type == "cuda" and cuda_request_s > SHORT_CALL_S and task.manifest.target != "triton"

    states = []
    for name in shapes:
        dims = task.shape(name).dims
        st = _Shape(name, dims, weights.get(name, 1.0), rules.allowances.get(name, 0.03))
        for inputs, outs_a in make_sets(spec, dims, draws, device, timer):
            _add_set(spec, st, share(inputs, inputs=True), share, lib_a, lib_b)
        warm = [st.key(i) for i in range(len(st.sets))]
        lib_a.call(warm)
        lib_b.call(warm)
        st.k, single = calibrate(lambda i: lib_a.sample([st.key(i % len(st.sets))]), lib_a.min_sample_s)
        lib_a._pending = lib_b._pending = None
        if long_requests and single >= SHORT_CALL_S:
            st.k = calls_per_sample(single, short_s=cuda_request_s)
            st.spin_calls = LONG_REQUEST_SPIN_CALLS
        # within a pass no set may be called twice by one side: enough sets for PAIRS_PER_PASS samples
        # (at least one whole sample) in the memory cap
        per_set = tensors_bytes(st.sets[0][0]) + 2 * tensors_bytes(st.sets[0][1])
        cap = set_memory_cap(device, st.spin_calls is not None) // max(per_set, 1)
        while len(st.sets) < max(min(st.k, cap), min(st.k * PAIRS_PER_PASS, MAX_SETS, cap)):
            _add_set(spec, st, share(spec.make_inputs(dims, draws.next(), device), inputs=True), share, lib_a, lib_b)
        st.k = min(st.k, len(st.sets))
        # the sets added after the calibration are warmed too: no timed call pays a buffer's first touch
        added = [st.key(i) for i in range(len(warm), len(st.sets))]
        if added:
            lib_a.call(added)
            lib_b.call(added)
        if device.type == "cuda":
            for which, lib in (("a", lib_a), ("b", lib_b)):
                _snapshot_like(st, which, st.sets[0][1], share, lib)
        states.append(st)
    for lib in (lib_a, lib_b):  # what the runners spent setting up is booked now, not on the first timed sample
        lib.close_setup()

    started = time.monotonic()
    stopped = "time cap"
    crit = PassCriterion({st.name: st.weight for st in states}, rules)
    spent: dict[str, float] = {}
    while True:
        for st in states:
            one_pass(spec, task, st, draws, rng, lib_a, lib_b, share, spent, place)
        crit.add_measurement({st.name: st.pass_sums[-1] for st in states})
        if any(st.problem for st in states):
            stopped = "wrong timed outputs"
            break
        elapsed = time.monotonic() - started
        # the cap holds once the interval is narrow enough to decide (DecisionRules.decisive_halfwidth);
        # short of the passes, or wider (a slow or noisy machine), timing goes on up to
        # MIN_EVIDENCE_STRETCH x the cap rather than end in "too few passes", "too wide" or a straddle that
        # only a re-submit (a stricter look) could settle. Past the cap the rule reads the width alone,
        # never the estimate, so the stretch adds no optional stopping (PassCriterion.should_stop)
        if crit.should_stop(elapsed >= max_seconds, elapsed >= MIN_EVIDENCE_STRETCH * max_seconds):
            stopped = crit.finished_because
            break

    timing_seconds = time.monotonic() - started
    total = crit.estimate()
    report = ABReport(pairs=sum(crit.pairs.values()), timing_seconds=round(timing_seconds, 3), stopped_because=stopped,
                      passes=crit.passes, look=look, alpha=rules.alpha,
                      pass_seconds={k: round(v, 4) for k, v in spent.items()},
                      placed_from_cpus=len(place.home) if place is not None and place.pinned else 0,
                      placement_error=place.error if place is not None else None)
    for st in states:
        est = crit.shape_estimate(st.name)
        slo, shi = est.interval(rules.alpha)
        row = ShapeAB(
            shape=st.name, weight=st.weight, pairs=crit.pairs[st.name], log_speedup=est.log_ratio,
            log_speedup_se=est.se if math.isfinite(est.se) else 1e9, speedup=est.speedup, speedup_lo=slo, speedup_hi=shi,
            time_a=est.mean_a, time_b=est.mean_b, pass_a=list(crit.a[st.name]), pass_b=list(crit.b[st.name]),
            floor_s=physics_floor(spec, st.dims, device),
        )
        # the lower quartile: delays (pipes, scheduling) only ever add to a probe, work outside the timed
        # region is in every probe of the side that does it
        row.wall_a, row.extra_a, row.idle_cpu_a = (_low_quartile([p[j] for p in st.probes["a"]]) for j in range(3))
        row.wall_b, row.extra_b, row.idle_cpu_b = (_low_quartile([p[j] for p in st.probes["b"]]) for j in range(3))
        # the best's own spread: the escape allowance is a few of these (the candidate's spread is its own to inflate)
        row.extra_a_se = robust_se_of_quartile([p[1] for p in st.probes["a"]])
        row.probes = min(len(st.probes["a"]), len(st.probes["b"]))
        # every probe counted (a mean: time spent in one probe of two is not trimmed away); NaN (no probe):
        # the gate skips this bound, and the probes' other figures (wall, extra, idle) fail closed instead
        row.probe_call_a, row.probe_call_b = (_mean([p[3] for p in st.probes[w]]) for w in ("a", "b"))
        # work after return over every timed call (not only the probes) counts as work outside the timing
        for which in ("a", "b"):
            leak = _median(st.after_return[which]) if st.after_return[which] else 0.0
            setattr(row, f"extra_{which}", getattr(row, f"extra_{which}") + leak)
            setattr(row, f"idle_cpu_{which}", getattr(row, f"idle_cpu_{which}") + leak)
            setattr(row, f"after_return_{which}", leak)
        if device.type == "cuda":
            # device work after the timed region, on the device's clock over every timed sample (hundreds, not
            # the probes' few): the lower quartile per side, as for the probes (the host's late wake-ups after
            # the device sync only ever add, and came in bursts: medians of an A/A on the H200 once read 20 us
            # apart on a 490 us call; work left on a stream is in every sample), and the best's own spread
            row.trail_a, row.trail_b = (_low_quartile(st.trails[w]) for w in ("a", "b"))
            row.trail_a_se = robust_se_of_quartile(st.trails["a"])
            row.trail_samples = min(len(st.trails["a"]), len(st.trails["b"]))
            # the judge's clock around each timed request beyond what the runner reported: the lower quartile per
            # side and the best's spread, as above (late wake-ups and pipe delays only add)
            row.offclock_a, row.offclock_b = (_low_quartile(st.offclock[w]) for w in ("a", "b"))
            row.offclock_a_se = robust_se_of_quartile(st.offclock["a"])
        row.calls_per_sample = st.k
        row.rechecked = st.rechecked
        row.passes = st.passes
        row.timed_outputs_ok = st.problem is None and st.rechecked > 0
        row.timed_outputs_problem = st.problem if st.problem else (None if st.rechecked else "no timed call was re-checked")
        report.shapes.append(row)
    report.speedup = total.speedup
    report.speedup_lo, report.speedup_hi = total.interval(rules.alpha)
    return report


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _low_quartile(xs: list[float]) -> float:
    finite = sorted(x for x in xs if math.isfinite(x))
    if len(finite) < len(xs) or not finite:  # a missing or NaN probe fails closed (the gate rejects NaN)
        return float("nan")
    return finite[(len(finite) - 1) // 4]


def _add_set(spec: Spec, st: _Shape, inputs: dict, share, lib_a, lib_b) -> None:
    outs_a = share(spec.make_outputs(st.dims, inputs))
    outs_b = share(spec.make_outputs(st.dims, inputs))
    i = len(st.sets)
    st.sets.append((inputs, outs_a, outs_b))
    lib_a.bind(st.key(i), st.dims, inputs, outs_a)
    lib_b.bind(st.key(i), st.dims, inputs, outs_b)


def one_pass(spec: Spec, task: Task, st: _Shape, draws: SecretDraws, rng: random.Random, lib_a, lib_b, share,
             spent: dict[str, float] | None = None, place: Placement | None = None) -> None:
    """Fresh values and poison; every set called once per side in pairs; a random re-check of those calls;
    probes on fresh values, their output checked too. `spent`: wall seconds per part of the pass, added
    to (where a decision's seconds go beyond the timed calls). `place`: CPU tasks, both sides of each pair
    (and of each probe pair) pinned to the judge's CPU (tools/placement.py)."""
    spent = {} if spent is None else spent
    mark = time.monotonic()

    def book(part: str) -> None:
        nonlocal mark
        now = time.monotonic()
        spent[part] = spent.get(part, 0.0) + now - mark
        mark = now

    refresh(spec, st, draws, share, lib_a, lib_b)
    book("fresh inputs")
    n = len(st.sets)
    order = list(range(n))
    rng.shuffle(order)
    pairs = n // st.k
    leak0 = {"a": len(lib_a.sample_leaks), "b": len(lib_b.sample_leaks)}
    trail0 = {"a": len(lib_a.sample_trails), "b": len(lib_b.sample_trails)}
    off0 = {"a": len(lib_a.sample_offclock), "b": len(lib_b.sample_offclock)}
    first = len(st.ta)
    for p in range(pairs):
        keys = [st.key(i) for i in order[p * st.k:(p + 1) * st.k]]
        if place is not None:
            place.draw()
        if rng.random() < 0.5:
            lib_b.sample(keys, st.tb, st.spin_calls)
            lib_a.sample(keys, st.ta, st.spin_calls)
        else:
            lib_a.sample(keys, st.ta, st.spin_calls)
            lib_b.sample(keys, st.tb, st.spin_calls)
    # CPU a runner used after answering is charged to its sample: settle the last ones now
    lib_a._gap()
    lib_b._gap()
    lib_a._pending = lib_b._pending = None
    book("paired samples")
    # of which the calls' own measured time; the rest is requests, flushes and the runners' clocks
    measured = st.k * (sum(st.ta[first:]) + sum(st.tb[first:]))
    spent["paired samples"] -= measured
    spent["timed calls"] = spent.get("timed calls", 0.0) + measured
    for which, lib in (("a", lib_a), ("b", lib_b)):
        st.after_return[which].extend(lib.sample_leaks[leak0[which]:])
        st.trails[which].extend(lib.sample_trails[trail0[which]:])
        st.offclock[which].extend(lib.sample_offclock[off0[which]:])
    # the pass's whole time per side, every call counted: what the criterion and the verdict see
    st.pass_sums.append((st.k * sum(st.ta[first:]), st.k * sum(st.tb[first:]), st.k * pairs, pairs))
    called = order[:pairs * st.k]
    st.passes += 1
    # the re-check first, on the outputs exactly as the timed calls left them: no later call (a probe)
    # can have paid a debt into them by then
    recheck = max(RECHECK_MIN, math.ceil(RECHECK_FRACTION * len(called)))
    for i in rng.sample(called, min(recheck, len(called))):
        _recheck(task, spec, st, i, f"pass {st.passes}, set {i}")
    book("re-checks")
    # cold integrity probes, A and B alike, each on fresh values (a probe must not be told from a timed
    # call by values it has seen before), and the candidate's probe output checked too: an untimed call
    # is no place to do owed work
    probe_set = called[rng.randrange(len(called))]
    # the idle window scales with the best's call time (same window for both): work handed to a thread
    # after return shows up in it whole
    idle_s = min(0.05, max(2e-3, 2 * _median(st.ta[-pairs:])))
    for _ in range(PROBES_PER_PASS):
        fresh_values(spec, st, probe_set, draws, share, lib_a, lib_b)
        if place is not None:  # the probes compare the two sides too: on the same CPUs
            place.draw()
        for which in (["b", "a"] if rng.random() < 0.5 else ["a", "b"]):
            lib = lib_a if which == "a" else lib_b
            snap = st.snapshots.get(which)
            if snap is not None:
                # the probe set's outputs may have been drawn anew in another shape (fresh_values)
                snap = _snapshot_like(st, which, st.sets[probe_set][1 if which == "a" else 2], share, lib)
                poison(snap)
            into = {"snapshot": st.snapshot_key} if snap is not None else {}
            st.probes[which].append(lib.probe(st.key(probe_set), idle_s, **into))
            if snap is not None and which == "b":  # the best copies too, so that both probes carry the same copy
                problem = unfinished_outputs(snap, st.sets[probe_set][2])
                if problem and st.problem is None:
                    st.problem = f"pass {st.passes}, probe of set {probe_set}: {problem}"
    # the last probe's output (one reference more per pass: for attention shapes a reference is dear)
    _recheck(task, spec, st, probe_set, f"pass {st.passes}, probe of set {probe_set}")
    book("probes")


def _snapshot_like(st: _Shape, which: str, outputs: dict, share, lib) -> dict:
    """Side `which`'s buffers for a probe's stream-ordered copy of `outputs`, bound in its runner; made
    anew only when a name, shape or dtype differs from the ones it has."""
    snap = st.snapshots.get(which)
    same = snap is not None and snap.keys() == outputs.keys() and all(
        not isinstance(v, torch.Tensor) or (snap[k].shape == v.shape and snap[k].dtype == v.dtype)
        for k, v in outputs.items())
    if not same:
        snap = share({k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in outputs.items()})
        lib.bind(st.snapshot_key, st.dims, {}, snap)
        st.snapshots[which] = snap
    return snap


def unfinished_outputs(at_stream_end: dict, at_idle: dict) -> str | None:
    """The outputs as the call's stream left them (a copy enqueued on it right after the call) against
    the same outputs once the whole device was idle: an honest call, whose stream completes only when
    its outputs are written, leaves them equal bit for bit. Work on another stream that the call's
    stream does not wait for is what differs: a user's next kernel on that stream would race it."""
    problems = []
    for name, final in at_idle.items():
        if not isinstance(final, torch.Tensor):
            continue
        n = differing_elements(at_stream_end[name], final)
        if n:
            problems.append(f"output {name}: {n} of {final.numel()} elements were written after the call's stream "
                            "had finished (work left on another stream that the call's stream does not wait for: "
                            "the next kernel on the stream would read them unfinished)")
    return "; ".join(problems) if problems else None


def _recheck(task: Task, spec: Spec, st: _Shape, i: int, where: str) -> None:
    problem = recheck_set(task, spec, st, i)
    st.rechecked += 1
    if problem and st.problem is None:
        st.problem = f"{where}: {problem}"


def refresh(spec: Spec, st: _Shape, draws: SecretDraws, share, lib_a, lib_b) -> None:
    """New input values in the same buffers and poisoned outputs, before every pass."""
    for i in range(len(st.sets)):
        fresh_values(spec, st, i, draws, share, lib_a, lib_b, sync=False)
    _sync(st)


def fresh_values(spec: Spec, st: _Shape, i: int, draws: SecretDraws, share, lib_a, lib_b, sync: bool = True) -> None:
    """New input values in set i's buffers (new buffers, bound to both sides, if the spec drew other
    shapes) and both outputs poisoned."""
    inputs, outs_a, outs_b = st.sets[i]
    fresh = spec.make_inputs(st.dims, draws.next(), _device(st))
    if not refill(inputs, fresh):
        inputs = share(fresh, inputs=True)
        outs_a, outs_b = share(spec.make_outputs(st.dims, inputs)), share(spec.make_outputs(st.dims, inputs))
        st.sets[i] = (inputs, outs_a, outs_b)
        lib_a.bind(st.key(i), st.dims, inputs, outs_a)
        lib_b.bind(st.key(i), st.dims, inputs, outs_b)
    poison(outs_a)
    poison(outs_b)
    if sync:
        _sync(st)


def _device(st: _Shape) -> torch.device:
    return next(t for t in st.sets[0][0].values() if isinstance(t, torch.Tensor)).device


def _sync(st: _Shape) -> None:
    device = _device(st)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def recheck_set(task: Task, spec: Spec, st: _Shape, i: int) -> str | None:
    """The candidate's outputs of set i (written by its one timed call in this pass) against the reference."""
    inputs, _, outs_b = st.sets[i]
    problems = []
    ref = spec.reference(st.dims, inputs)
    for name, want in ref.items():
        tol = task.tolerance(name)
        if passes_clearly(outs_b.get(name), want, tol.atol, tol.rtol, tol.norm_rtol):
            continue
        err = compare(name, outs_b.get(name), want, tol.atol, tol.rtol, tol.norm_rtol)
        if not err.passed:
            problems.append(f"output {name}: {describe_error(err)}")
    return "; ".join(problems) if problems else None


def physics_floor(spec: Spec, dims: dict, device: torch.device) -> float | None:
    """The fewest seconds one call can take on this device: max(FLOPs / peak, bytes / peak bandwidth)."""
    from tools.roofline import floor_rates

    flops, nbytes = spec.flops(dims), spec.bytes_moved(dims)
    peak_flops, peak_bytes = floor_rates(device)
    times = [x / r for x, r in ((flops, peak_flops), (nbytes, peak_bytes)) if x and r]
    return max(times) if times else None

