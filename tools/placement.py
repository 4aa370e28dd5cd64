"""Where a CPU task's runners run: both sides of a timed pair on the CPU the judge's thread is on.

The CPUs of one machine are not equally fast, and not steadily so: a virtual CPU whose sibling
hyperthread a neighbour keeps busy runs slower than its twin for seconds at a time (on the 2-vCPU CI
box a fixed loop pinned to one vCPU read 0.93-1.15x the other over 1 s windows). The scheduler tends
to keep each runner on the CPU it last ran on, so the best and the candidate could spend a whole
decision on different CPUs, and pairing by pass cancels drift in time, not a difference between the
two processes' CPUs: an A/A change was accepted at x1.056 [1.017, 1.098] in CI (2026-12-07), 5
passes of a steady offset. So for each pair the judge pins both runners, and its own thread, to the
CPU its thread is on: what that CPU costs, both sides pay in the same pair. On CPU tasks the judge
flushes the cache from that thread before every sample, so the flush also evicts the private caches
of the CPU the sample runs on. The judge's thread is released after the pairs and the probes of a
pass, so the scheduler moves it (and the next pass's pairs) off a CPU a neighbour keeps busy.

Measured (bench/placement_ab.py, matmul_cpu A/A, 4 s cap, 10 interleaved decisions per mode, 2-vCPU
KVM Xeon): beside one CPU hog the decision's log ratio spread (rms) 0.0049 placed against 0.0130
unplaced, per-pass 0.027 against 0.072, 31 passes against 23, intervals 0.013 against 0.033 (half,
in log); quiet, 0.0035 against 0.0067, 32 passes against 29. Drawing the CPU at random per pair
instead (tried) was biased under the hog (-0.005) and slower (24 passes): half its pairs shared the
hog's CPU.

Runners cannot move themselves: tools/sandbox.py denies sched_setaffinity. CUDA tasks are not
placed: their timed region is the device's, and pinning the driver's threads was never measured
on a GPU host. Where the judge may use only as many CPUs as a side's threads (a `kloop parallel`
slot, a one-CPU container), there is nothing to choose and nothing is pinned.
"""

from __future__ import annotations

import os
import random


class Placement:
    """Draws a CPU set per pair and pins the judge's thread and every thread of the given runners to it."""

    def __init__(self, runners: list, threads: int = 1, rng: random.Random | None = None):
        self.runners = list(runners)
        self.home = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        self.size = max(1, int(threads))
        self.rng = rng or random.Random()
        self.active = len(self.home) > self.size
        self.pinned = 0  # pairs placed
        self.error: str | None = None  # why placement stopped, where the host refused it

    def draw(self) -> frozenset[int] | None:
        """Pin the judge's thread and the runners to a fresh random CPU set; None (nothing done) when inactive."""
        if not self.active:
            return None
        cpus = self._choose()
        try:
            os.sched_setaffinity(0, cpus)  # this thread only: the judge's other threads keep theirs
            for r in self.runners:
                r.pin(cpus)
        except OSError as exc:
            # refused here (a container's policy): the decision goes on unplaced, as before placement existed, and
            # the report says so; everything goes back on the judge's CPUs
            self.active, self.error = False, f"CPU placement refused: {exc}"
            for r in self.runners:
                try:
                    r.pin(self.home)
                except OSError:
                    pass
            self.release()
            return None
        self.pinned += 1
        return cpus

    def _choose(self) -> frozenset[int]:
        """The CPU this thread is on (where the scheduler put the judge: under a busy neighbour, mostly not
        its CPU), and as many more at random as a side has threads beyond one; at random where unknown."""
        here = _current_cpu()
        if here is None or here not in self.home:
            return frozenset(self.rng.sample(sorted(self.home), self.size))
        others = sorted(self.home - {here})
        return frozenset([here, *self.rng.sample(others, self.size - 1)])

    def release(self) -> None:
        """The judge's thread back on its own CPUs (the runners stay where they are: frozen, they use none)."""
        if self.home:
            try:
                os.sched_setaffinity(0, self.home)
            except OSError:
                pass


def _current_cpu() -> int | None:
    """sched_getcpu() of the calling thread (glibc), or None."""
    global _GETCPU
    if _GETCPU is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None).sched_getcpu
            fn.restype = ctypes.c_int
            _GETCPU = fn
        except (OSError, AttributeError):
            _GETCPU = False
    if not _GETCPU:
        return None
    cpu = _GETCPU()
    return cpu if cpu >= 0 else None


_GETCPU = None
