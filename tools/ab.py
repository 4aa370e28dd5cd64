"""Paired A/B timing of the best build (A) against a candidate (B), in one worker process.

The machine drifts (clocks, neighbours, thermals), so single timings decide nothing: A and B are
timed back to back in pairs, in random order within each pair, the L2 flushed before every call and
the input sets rotated; the per-pair ratio tA/tB cancels the drift. Sampling goes on until the
interval of the weighted geometric-mean speedup is tight enough, the decision is clear, or the time
cap is hit. Between batches the inputs get fresh values and the outputs are poisoned, and at the
end the outputs of the last timed calls are checked against the reference: timed calls must compute.
"""

from __future__ import annotations

import ctypes
import math
import random
import time

import torch

from tools.task import Task
from tools.bench import make_sets
from tools.check import compare, describe_error, poison, refill
from tools.protocol import ABReport, ShapeAB
from tools.spec import Spec
from tools.stats import Estimate, combine, t_quantile_975, trimmed_estimate
from tools.timing import Timer, calls_per_sample

BATCH_SECONDS = 0.05  # timing between two looks at the statistics
RECHECK_SETS = 2


class _Shape:
    """Buffers and samples of one bench shape."""

    def __init__(self, name, dims, weight, allowance, sets, outs_b):
        self.name, self.dims, self.weight, self.allowance = name, dims, weight, allowance
        self.sets = sets  # [(inputs, outputs of A)]
        self.outs_b = outs_b  # outputs of B, one per set
        self.log_ratios: list[float] = []
        self.ta: list[float] = []
        self.tb: list[float] = []
        self.k = 1
        self.next_set = 0
        self.called_b: set[int] = set()  # sets the candidate wrote since the last refresh
        self.probes = {"a": [], "b": []}  # (wall, extra, idle_cpu) per cold integrity probe

    def estimate(self) -> Estimate:
        return trimmed_estimate(self.log_ratios)


def ab_in_process(task: Task, spec: Spec, lib_a: ctypes.CDLL, lib_b: ctypes.CDLL, shapes: list[str], seed: int,
                  device: torch.device, max_seconds: float, min_pairs: int, target_halfwidth: float,
                  min_gain: float, allowances: dict[str, float], weights: dict[str, float]) -> ABReport:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    rng = random.Random(seed ^ 0x5EED)
    timer = Timer(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0

    def call(lib, st: _Shape, i: int, outs) -> None:
        spec.launch(lib, st.dims, st.sets[i][0], outs, stream)

    states = []
    for name in shapes:
        dims = task.shape(name).dims
        sets = make_sets(spec, dims, gen, device, timer)
        outs_b = [spec.make_outputs(dims, inp) for inp, _ in sets]
        st = _Shape(name, dims, weights.get(name, 1.0), allowances.get(name, 0.03), sets, outs_b)
        for i in range(len(sets)):  # warm-up both
            call(lib_a, st, i, sets[i][1])
            call(lib_b, st, i, outs_b[i])
        timer.sync()
        single = min(timer.run([lambda i=i: call(lib_a, st, i % len(sets), sets[i % len(sets)][1]) for i in range(3)]))
        st.k = calls_per_sample(single)
        st.pair_seconds = 2 * single * st.k
        states.append(st)

    def sample(lib, st: _Shape, outs_of, written: set[int] | None = None):
        first = st.next_set

        def run() -> None:
            for j in range(st.k):
                i = (first + j) % len(st.sets)
                call(lib, st, i, outs_of(i))
                if written is not None:
                    written.add(i)
        return run

    started = time.monotonic()
    stopped = "time cap"
    threshold = math.log1p(min_gain)
    while True:
        for st in states:
            refresh(spec, st, gen)
            n_pairs = max(2, min(200, int(BATCH_SECONDS / max(st.pair_seconds, 1e-7))))
            calls, order = [], []
            for _ in range(n_pairs):
                a = sample(lib_a, st, lambda i, st=st: st.sets[i][1])
                b = sample(lib_b, st, lambda i, st=st: st.outs_b[i], st.called_b)
                st.next_set = (st.next_set + st.k) % len(st.sets)
                b_first = rng.random() < 0.5
                calls += [b, a] if b_first else [a, b]
                order.append(b_first)
            times = timer.run(calls)
            for which in (["b", "a"] if rng.random() < 0.5 else ["a", "b"]):  # cold integrity probes, A and B alike
                lib, outs_of = (lib_a, lambda i, st=st: st.sets[i][1]) if which == "a" else (lib_b, lambda i, st=st: st.outs_b[i])
                i = st.next_set
                st.probes[which].append(timer.probe(lambda: call(lib, st, i, outs_of(i))))
                if which == "b":
                    st.called_b.add(i)
            for p, b_first in enumerate(order):
                t1, t2 = times[2 * p] / st.k, times[2 * p + 1] / st.k
                ta, tb = (t2, t1) if b_first else (t1, t2)
                st.ta.append(ta)
                st.tb.append(tb)
                st.log_ratios.append(math.log(ta / tb) if ta > 0 and tb > 0 else 0.0)
        elapsed = time.monotonic() - started
        ests = [st.estimate() for st in states]
        total = combine(ests, [st.weight for st in states])
        z = t_quantile_975(min(e.effective_df() for e in ests))
        lo, hi = total.mean - z * total.se, total.mean + z * total.se
        enough = all(len(st.log_ratios) >= min_pairs for st in states)
        if enough and (hi - lo) / 2 <= target_halfwidth:
            stopped = "interval tight"
            break
        if enough and hi < threshold:
            stopped = "cannot reach min_gain"
            break
        if enough and lo > threshold + target_halfwidth:
            stopped = "clearly faster"
            break
        if elapsed >= max_seconds:
            break

    timing_seconds = time.monotonic() - started
    report = ABReport(pairs=sum(len(st.log_ratios) for st in states), timing_seconds=round(timing_seconds, 3),
                      stopped_because=stopped)
    for st, est in zip(states, ests):
        slo, shi = est.interval()
        row = ShapeAB(
            shape=st.name, weight=st.weight, pairs=len(st.log_ratios), log_ratio_mean=est.mean,
            log_ratio_se=est.se if math.isfinite(est.se) else 1e9, speedup=math.exp(est.mean),
            speedup_lo=math.exp(max(slo, -50)), speedup_hi=math.exp(min(shi, 50)),
            time_a=_median(st.ta), time_b=_median(st.tb),
        )
        row.wall_a, row.extra_a, row.idle_cpu_a = (_median([p[j] for p in st.probes["a"]]) for j in range(3))
        row.wall_b, row.extra_b, row.idle_cpu_b = (_median([p[j] for p in st.probes["b"]]) for j in range(3))
        row.probes = min(len(st.probes["a"]), len(st.probes["b"]))
        row.timed_outputs_ok, row.timed_outputs_problem = recheck(task, spec, st)
        report.shapes.append(row)
    report.speedup = math.exp(total.mean)
    report.speedup_lo = math.exp(max(lo, -50))
    report.speedup_hi = math.exp(min(hi, 50))
    return report


def refresh(spec: Spec, st: _Shape, gen: torch.Generator) -> None:
    """New input values in the same buffers and poisoned outputs, outside the timed region."""
    device = next(t for t in st.sets[0][0].values() if isinstance(t, torch.Tensor)).device
    for i, (inputs, outs_a) in enumerate(st.sets):
        fresh = spec.make_inputs(st.dims, gen, device)
        if not refill(inputs, fresh):  # the spec drew other shapes this time: new buffers for both
            st.sets[i] = (fresh, spec.make_outputs(st.dims, fresh))
            st.outs_b[i] = spec.make_outputs(st.dims, fresh)
        poison(st.sets[i][1])
    for outs in st.outs_b:
        poison(outs)
    st.called_b.clear()


def recheck(task: Task, spec: Spec, st: _Shape) -> tuple[bool, str | None]:
    """The candidate's outputs from the last timed calls on a few sets, against the reference.

    Only sets the candidate was called on since the last refresh are compared (the rest hold poison).
    """
    problems = []
    written = sorted(st.called_b)[:RECHECK_SETS]
    for i in written:
        outs = st.outs_b[i]
        ref = spec.reference(st.dims, st.sets[i][0])
        for name, want in ref.items():
            tol = task.tolerance(name)
            err = compare(name, outs.get(name), want, tol.atol, tol.rtol, tol.norm_rtol)
            if not err.passed:
                problems.append(f"set {i} output {name}: {describe_error(err)}")
    if not written:
        return False, "no timed call wrote its outputs"
    return (not problems), ("; ".join(problems) if problems else None)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])) if n else float("nan")
