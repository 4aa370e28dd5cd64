"""Quick, non-gating timings of one build per bench shape, beside the comparators.

Runs in the judge (the library in its own runner): warm-up, rotated input sets, L2 flushed before every sample,
median and spread, achieved TFLOP/s and GB/s from the spec's counts. Comparators (the library ops
the kernel would replace) are timed the same way in the same process.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from tools.draws import SecretDraws
from tools.fmt import fmt_rate, fmt_time
from tools.task import Task
from tools.protocol import BenchReport, ShapeBench, Timing
from tools.spec import Spec
from tools.timing import Timer, calibrate, summarize, tensors_bytes

MIN_SAMPLES = 10
MAX_SAMPLES = 500


def make_sets(spec: Spec, dims: dict, draws: SecretDraws | torch.Generator, device: torch.device, timer: Timer):
    """Rotated input sets (and an output set for each): enough that no call finds a warm cache.
    `draws`: a SecretDraws (each set from a generator of its own: what a verdict uses) or one generator
    drawn in sequence (calibrations in bench/)."""
    gen = draws if callable(draws) else (lambda: draws)
    first_in = spec.make_inputs(dims, gen(), device)
    first_out = spec.make_outputs(dims, first_in)
    n = timer.input_sets(tensors_bytes(first_in) + tensors_bytes(first_out))
    sets = [(first_in, first_out)]
    for _ in range(n - 1):
        inp = spec.make_inputs(dims, gen(), device)
        sets.append((inp, spec.make_outputs(dims, inp)))
    return sets


def time_callable(timer: Timer, call_on_set: Callable[[int], None], n_sets: int, max_seconds: float,
                  flops: float | None, nbytes: float | None) -> Timing:
    """Median seconds per call of `call_on_set(i)`, rotating i over the input sets."""
    for i in range(min(n_sets, 3)):  # warm-up: module load, first-touch, clocks ramping
        call_on_set(i)
    timer.sync()
    k, single = calibrate(lambda i: timer.run([lambda: call_on_set(i % n_sets)])[0])
    counter = iter(range(1 << 62))

    def sample() -> None:
        for _ in range(k):
            call_on_set(next(counter) % n_sets)

    times: list[float] = []
    deadline = time.monotonic() + max_seconds
    batch = max(1, min(50, int(0.05 / max(single * k, 1e-7))))
    while len(times) < MAX_SAMPLES and (len(times) < MIN_SAMPLES or time.monotonic() < deadline):
        times.extend(t / k for t in timer.run([sample] * batch))
    wall = [timer.wall(lambda: call_on_set(0)) for _ in range(3)]
    s = summarize(times)
    return Timing(
        **s, calls_per_sample=k, input_sets=n_sets,
        tflops=flops / s["median"] / 1e12 if flops else None,
        gbps=nbytes / s["median"] / 1e9 if nbytes else None,
        wall_median=sorted(wall)[1],
    )


def bench_in_process(task: Task, spec: Spec, lib, shapes: list[str], seed: int, device: torch.device,
                     max_seconds: float, comparators: bool, arena=None, timer: Timer | None = None) -> BenchReport:
    """`lib`: a tools.remote.RemoteLib (the library runs in its runner); comparators run here (trusted)."""
    started = time.monotonic()
    draws = SecretDraws(seed, device, "bench")
    timer = timer or Timer(device)
    report = BenchReport()
    for name in shapes:
        dims = task.shape(name).dims
        row = ShapeBench(shape=name, dims=dims, flops=spec.flops(dims), bytes=spec.bytes_moved(dims))
        try:
            sets = make_sets(spec, dims, draws, device, timer)
            if lib is not None:
                row.kernel = time_remote(lib, spec, name, dims, sets, arena, max_seconds, row.flops, row.bytes)
            if comparators:
                for cname, fn in spec.comparators.items():
                    try:
                        row.comparators[cname] = time_callable(
                            timer, lambda i, fn=fn: fn(dims, sets[i][0], sets[i][1]),
                            len(sets), max_seconds / 2, row.flops, row.bytes)
                    except Exception as exc:  # e.g. a backend not available on this GPU
                        row.comparator_errors[cname] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                        timer.sync()
            del sets
        except Exception as exc:
            row.error = f"{type(exc).__name__}: {exc}"
            if type(exc).__name__ == "RunnerError" and exc.kind != "call":
                report.shapes.append(row)
                break  # the runner is gone
        report.shapes.append(row)
    report.seconds = round(time.monotonic() - started, 3)
    return report


def time_remote(lib, spec: Spec, name: str, dims: dict, sets, arena, max_seconds: float,
                flops: float | None, nbytes: float | None) -> Timing:
    """Median seconds per call of the library in its runner, rotating over the input sets."""
    share = arena.share_dict if arena is not None else (lambda d, inputs=False: d)
    keys = []
    for i, (inp, out) in enumerate(sets):
        inp, out = share(inp, inputs=True), share(out)
        lib.bind(("bench", name, i), dims, inp, out)
        keys.append(("bench", name, i))
    lib.call(keys[:3])  # warm-up: first touch, clocks ramping
    k, _ = calibrate(lambda i: lib.sample([keys[i % len(keys)]]), lib.min_sample_s)
    counter = iter(range(1 << 62))
    times: list[float] = []
    deadline = time.monotonic() + max_seconds
    while len(times) < MAX_SAMPLES and (len(times) < MIN_SAMPLES or time.monotonic() < deadline):
        times.append(lib.sample([keys[next(counter) % len(keys)] for _ in range(k)]))  # already per call
    wall = [lib.probe(keys[0])[0] for _ in range(3)]
    s = summarize(times)
    return Timing(
        **s, calls_per_sample=k, input_sets=len(keys),
        tflops=flops / s["median"] / 1e12 if flops else None,
        gbps=nbytes / s["median"] / 1e9 if nbytes else None,
        wall_median=sorted(wall)[1],
    )


def format_bench(report: BenchReport, where: str = "") -> str:
    head = f"{'shape':<18} {'what':<14} {'median':>10} {'p10..p90':>21} {'TFLOP/s':>8} {'GB/s':>8} {'n':>5}"
    rows = [f"timing{(' on ' + where) if where else ''}", head]
    for s in report.shapes:
        if s.error:
            rows.append(f"{s.shape:<18} error: {s.error}")
            continue
        entries = ([("kernel", s.kernel)] if s.kernel else []) + list(s.comparators.items())
        for what, t in entries:
            rows.append(
                f"{s.shape:<18} {what:<14} {fmt_time(t.median):>10} {fmt_time(t.p10) + '..' + fmt_time(t.p90):>21} "
                f"{fmt_rate(t.tflops):>8} {fmt_rate(t.gbps):>8} {t.samples:>5}"
            )
        for what, err in s.comparator_errors.items():
            rows.append(f"{s.shape:<18} {what:<14} unavailable: {err}")
    return "\n".join(rows)
