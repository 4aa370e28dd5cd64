"""The judge's view of one library running in its own runner: bind buffers, call, time, probe.

Timing that the runner cannot lie through: on the CPU the judge reads the runner's CPU time from the
kernel's per-process CPU clock around the round trip (after its own cache flush): every thread of the
runner counts, the time the runner waited for a core does not (so a loaded machine does not drown
the ratio), and enough calls go in one sample that the runner's message handling is small. The
judge's wall clock around the same request is kept beside it: CPU time beyond the wall means
threads working in parallel, and the integrity probes compare both for best and candidate alike. On CUDA events can only
be recorded in the process that launches, so the runner times with events, after the judge's flush
(from the judge's own context: L2 is the device's, so a runner has no flush to skip); the judge's own
wall clock around the request bounds that from above, and the integrity probes compare
the judge's wall until idle with the reported time, for best and candidate alike (a runner that
under-reports shows the difference as work outside the timed region).
"""

from __future__ import annotations

import os
import time

import torch

from tools.runner import Runner, RunnerError, SharedArena
from tools.timing import IDLE_WINDOW_S, SHORT_CALL_S, Timer

CPU_MIN_SAMPLE_S = 2e-3  # a CPU sample spans at least this much work, so message handling (~50 us) is small


class RemoteLib:
    def __init__(self, runner: Runner, arena: SharedArena, device: torch.device, timer: Timer, call_timeout: float,
                 threads: int = 1):
        self.runner, self.arena, self.device, self.timer = runner, arena, device, timer
        self.cuda = device.type == "cuda"
        self.call_timeout = call_timeout
        # CPU tasks: the runner's CPU clock, or (the manifest allows threads > 1) the judge's wall clock
        # around the request, with the runner's CPU beside it (no more than `threads` x the wall)
        self.threads = max(1, int(threads))
        self.measure = "events" if self.cuda else ("wall" if self.threads > 1 else "cpu")
        # CPU tasks: the runner is frozen between requests (SIGSTOP/SIGCONT), so no thread of it works
        # while the judge flushes, draws fresh values, poisons or re-checks: off the clock there is no clock
        runner.freeze = not self.cuda
        # runner CPU between two reads that no timed sample follows (after a probe, untimed calls): it is
        # added to the next timed sample, so every CPU-ns of the runner lands in a sample or a probe
        self._carry_ns = 0
        self.setup_ns = 0  # runner CPU of binds and warm-up calls before the first timed pass (close_setup)
        self.sample_cpu: list[tuple[float, float]] = []  # (wall, CPU within it) seconds of every CPU timed request
        # the books: runner CPU from the first read of its clock to the last, and what of it was charged
        # (to timed samples, probes, untimed calls); `unattributed_ns()` is what no bucket holds
        self._first_ns: int | None = None
        self.charged_ns = 0
        self.min_sample_s = SHORT_CALL_S if self.cuda else CPU_MIN_SAMPLE_S
        self.bound: set = set()
        # work after return: the runner's CPU time between an answer and its next request, which an
        # honest runner (blocked reading its pipe) does not use. Charged to the last timed sample.
        self.after_return_ns = 0
        # the same per timed sample (seconds per call): CPU time of background threads (the CUDA driver's)
        # comes in rare spikes, work after return in every sample, so the judge compares medians
        self.sample_leaks: list[float] = []
        # CUDA: per timed sample, seconds per call the device stayed busy after the sample's end event
        # (work left on other streams; NaN when the runner did not say)
        self.sample_trails: list[float] = []
        # CUDA: per timed sample, seconds per call of the judge's own wall clock around the request beyond the
        # times the runner reported (its pipe, spin, sync and wake-up: the same work for any library).
        # A runner whose events under-report moves exactly this, on a clock it cannot reach
        self.sample_offclock: list[float] = []
        self._idle_from: int | None = None
        self._pending: tuple[list, int, int] | None = None  # (sink, index, calls) of the last sample

    def load(self, spec_path: str, lib_path: str, timeout: float) -> None:
        """The library into this runner (prepared first where it was not pre-started)."""
        if self.runner.prepared:
            self.runner.request("load", timeout, lib_path=str(lib_path))
        else:
            self.runner.request("load", timeout, spec_path=str(spec_path), lib_path=str(lib_path), device=self.device.type)
        self.runner.loaded = str(lib_path)

    def bind(self, key, dims: dict, inputs: dict, outputs: dict, writable_inputs: bool = False) -> None:
        """Buffers for calls under `key`. Inputs are read-only in the runner (CPU files; CUDA inputs shared
        with `arena.share_dict(inputs=True)`) unless `writable_inputs` (only for the diagnosis of a fault, on copies)."""
        # buffers travel as descriptors beside the request (the pickled description holds an index)
        fds: list[int] = []

        def describe(t, writable: bool):
            desc = self.arena.describe(t, writable=writable)
            if desc[0] not in ("vmm", "fd"):
                return desc
            fds.append(desc[1])
            return (desc[0], len(fds) - 1, *desc[2:])

        try:
            ins = {k: describe(v, False) for k, v in inputs.items()}
            outs = {k: describe(v, True) for k, v in outputs.items()}
            c0 = self._gap()
            self.runner.request("bind", self.call_timeout, fds=fds, key=key, dims=dims,
                                writable_inputs=writable_inputs, inputs=ins, outputs=outs)
            # the runner ran while it mapped them (a helper thread of its library too): charged to the next sample
            self._idle_from = self.runner.cpu_ns()
            self._carry_ns += max(0, self._idle_from - c0)
        finally:
            for fd in fds:  # the runner holds its own copies (or none, if it failed)
                os.close(fd)
        self.bound.add(key)

    def _gap(self) -> int:
        """At the start of every request: CPU the runner used since the last read of its clock, charged
        to the timed sample it follows, else carried to the next one. Returns the clock's reading."""
        now = self.runner.cpu_ns()
        if self._idle_from is None:
            self._idle_from = self._first_ns = now
            return now
        leak = max(0, now - self._idle_from)
        self._idle_from = now  # read once: a second gap before the next answer charges nothing twice
        self.after_return_ns += leak
        if self._pending is not None:
            sink, i, k = self._pending
            sink[i] += leak * 1e-9 / k
            self.sample_leaks[-1] += leak * 1e-9 / k
            self.charged_ns += leak
        else:
            self._carry_ns += leak
        return now

    def close_setup(self) -> None:
        """Book the runner's CPU of the setup (binds, warm-up calls) before the first timed pass, instead of
        carrying it into the first timed sample (one side's first pass then read up to x1.8, seen on the
        2-core CPU box). Safe: the runner is frozen between requests, and every pass starts with fresh
        values, so nothing done during the setup can serve a timed call."""
        self._gap()
        self.setup_ns += self._carry_ns
        self.charged_ns += self._carry_ns
        self._carry_ns = 0
        self._pending = None

    def _answered(self) -> None:
        self._idle_from = self.runner.cpu_ns()

    def unattributed_ns(self) -> int:
        """Runner CPU between the first and the last read of its clock that no sample, probe or untimed
        call was charged with, nor carried to the next sample: 0 when the books close (a read of the
        clock that skips them, as the one after the judge's flush once did, shows here)."""
        if self._first_ns is None or self._idle_from is None:
            return 0
        return self._idle_from - self._first_ns - self.charged_ns - self._carry_ns

    def _settle(self) -> None:
        """The judge's own writes (fresh values, poison) finished before a runner reads the buffers."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def call(self, keys: list) -> None:
        """Untimed calls, in order; returns once the runner's device is idle."""
        self._settle()
        c0 = self._gap()
        self.runner.request("run", self.call_timeout, calls=list(keys))
        self._answered()
        self.charged_ns += self._idle_from - c0  # the untimed call's own

    def sample(self, keys: list, sink: list | None = None, spin_calls: int | None = None) -> float:
        """Seconds per call for the calls `keys` (in order), cache cold before them; appended to `sink`,
        where CPU the runner uses after answering is added later (work after return costs its time).
        `spin_calls` (CUDA, long requests): the spin before the start event covers this many calls' enqueue."""
        t = self._sample(keys, spin_calls) / len(keys)
        if sink is not None:
            sink.append(t)
            self.sample_leaks.append(0.0)
            self._pending = (sink, len(sink) - 1, len(keys))
        return t

    def _flush_device(self) -> None:
        """CUDA: the L2 flush before a timed or probed call, written from the judge's own context (L2 is
        the device's: the write evicts the runner's lines as well). A flush in the runner was the
        runner's to skip or shorten, for a warm cache and a shorter request."""
        self.timer.flush()  # finished before the request goes out: `_settle` follows

    def _sample(self, keys: list, spin_calls: int | None = None) -> float:
        if self.cuda:
            self._flush_device()
        self._settle()
        self._gap()
        if self.cuda:
            t0 = time.perf_counter()
            spin = {"spin_calls": spin_calls} if spin_calls else {}
            reply = self.runner.request("run", self.call_timeout, calls=list(keys), timed=True, spin=True, **spin)
            wall = time.perf_counter() - t0
            self._answered()
            t = _seconds(reply.get("times"), 0)
            self.sample_trails.append(_seconds(reply.get("trailing"), 0) / len(keys))
            self.sample_offclock.append((wall - t) / len(keys) if t == t else float("nan"))
            # events can only under-report through a lying runner; never more than the judge's own clock
            return t if t <= wall else float("nan")
        self.timer.flush()  # the runner is frozen meanwhile; what it used since its answer is charged by _gap
        c0 = self._gap()
        carry, self._carry_ns = self._carry_ns, 0
        t0 = time.perf_counter()
        self.runner.request("run", self.call_timeout, calls=list(keys))
        wall = time.perf_counter() - t0
        c1 = self.runner.cpu_ns()
        self._idle_from = c1
        self.charged_ns += c1 - c0 + carry
        cpu = (c1 - c0 + carry) * 1e-9
        self.sample_cpu.append((wall, (c1 - c0) * 1e-9))  # the request's own (carried CPU is not parallel work)
        if self.measure == "wall":  # threads allowed: the user waits for the wall; CPU off the clock costs whole
            return wall + carry * 1e-9
        return cpu

    def probe(self, key, idle_s: float = IDLE_WINDOW_S, snapshot=None) -> tuple[float, float, float, float]:
        """(wall, extra, idle_cpu, call) of one cold call, measured from outside the runner. `call`: the
        call's own time, which no sample charges (CPU: the runner's CPU time over the call, every thread;
        CUDA: its events). `snapshot` (CUDA):
        the key of a bound set that receives a stream-ordered copy of the call's outputs (Host.run).

        extra: seconds outside what the timer measures — on CUDA the judge's wall until the runner's
        device is idle minus its events; on both, the runner's CPU time beyond that wall (other threads
        working) — plus idle_cpu: the runner's CPU time in a short window after it answered (work after
        return, threads left running)."""
        if self.cuda:
            self._flush_device()
        self._settle()
        if self.cuda:
            c0 = self._gap()
            self._pending = None
        else:
            self.timer.flush()  # the runner frozen meanwhile (charged by _gap to the sample it follows)
            c0 = self._gap()
            self._pending = None
        t0 = time.perf_counter()
        # left running after its answer for the idle window: work after return shows there, then frozen
        extra = {"snapshot": snapshot} if snapshot is not None else {}
        reply = self.runner.request("run", self.call_timeout, calls=[key], timed=self.cuda, keep_running=True, **extra)
        t1 = time.perf_counter()
        c1 = self.runner.cpu_ns()
        wall = t1 - t0
        timed = _seconds(reply.get("times"), 0) if self.cuda else wall
        time.sleep(idle_s if idle_s == idle_s else IDLE_WINDOW_S)
        self._idle_from = self.runner.cpu_ns()
        self.runner.stop()
        self.charged_ns += self._idle_from - c0  # the probe's call and its idle window
        idle_cpu = (self._idle_from - c1) * 1e-9
        # CPU beyond the wall: threads working beside the call (beyond `threads` x the wall where allowed)
        beyond = max(0.0, (c1 - c0) * 1e-9 - self.threads * wall)
        call = timed if self.cuda else (c1 - c0) * 1e-9
        return wall, (wall - timed) + beyond + idle_cpu, idle_cpu, call


def _seconds(xs, i: int) -> float:
    try:
        x = float(xs[i])
    except (TypeError, ValueError, IndexError):
        return float("nan")
    return x if x >= 0 else float("nan")


def start_runners(names: list[str], scratch, pidns: bool = True) -> dict[str, Runner]:
    """Start the runners early: their torch import overlaps the judge's own set-up. `pidns`: see
    tools.runner.spawn_runner."""
    return {n: Runner(scratch, n, pidns=pidns) for n in names}


__all__ = ["RemoteLib", "Runner", "RunnerError", "SharedArena", "start_runners", "CPU_MIN_SAMPLE_S"]


class LibSession:
    """Runners for a set of libraries, with their arena and timer: `with LibSession(task, [paths]) as s:`
    (the gate benchmark keeps runners alive across many trials, as a pre-started judge would)."""

    def __init__(self, task, lib_paths: list[str], names: list[str] | None = None, call_timeout: float = 60.0):
        import tempfile
        from pathlib import Path

        self.device = torch.device("cuda" if task.on_gpu else "cpu")
        self._scratch = tempfile.TemporaryDirectory(prefix="kloop-libs-")
        names = names or [f"lib{i}" for i in range(len(lib_paths))]
        self.runners = start_runners(names, Path(self._scratch.name))
        self.arena = SharedArena(self.device)
        self.timer = Timer(self.device)
        threads = getattr(task.manifest, "threads", 1)
        self.libs = [RemoteLib(self.runners[n], self.arena, self.device, self.timer, call_timeout, threads) for n in names]
        for lib, path in zip(self.libs, lib_paths):
            lib.load(task.spec_path, path, 120.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for r in self.runners.values():
            r.close()
        self.arena.close()
        self._scratch.cleanup()
