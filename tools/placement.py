"""Where a CPU task's runners run: both sides of a timed pair on the CPU the judge's thread is on.

The CPUs of one machine are not equally fast, and not steadily so: a virtual CPU whose sibling
hyperthread a neighbour keeps busy runs slower than its twin for seconds at a time (on the 2-vCPU CI
box a fixed loop pinned to one vCPU read 0.93-1.15x the other over 1 s windows). The scheduler tends
to keep each runner on the CPU it last ran on, so the best and the candidate could spend a whole
decision on different CPUs, and pairing by pass cancels drift in time, not a difference between the
two processes' CPUs: an A/A change was accepted at x1.056 [1.017, 1.098] in CI (2026-12-07), 5
passes of a steady offset. So before each pair the judge pins both runners (every thread) to the CPU
its own thread is on: what that CPU costs, both sides pay in the same pair. The judge itself is not
pinned: it sleeps through every sample, so the scheduler re-places it at each wake-up (off a CPU a
neighbour keeps busy, mostly), and the next pair follows it; on CPU tasks its cache flush before a
sample runs there too, as a rule.

Measured (bench/placement_ab.py, matmul_cpu A/A, 4 s cap, decisions of each mode in turn, 2-vCPU KVM
Xeon): beside one CPU hog the decisions' log ratio spread (rms) 0.0087 placed against 0.0589
unplaced, per-pass 0.023 against 0.067, intervals 0.014 against 0.042 (half, in log), as many passes;
quiet, 0.0043 against 0.0118. Those runs also pinned the judge's thread for a whole pass; leaving it
free (what this does) measured the same beside the hog (rms 0.0067 against 0.0059, per-pass 0.0234
against 0.0230, 6 decisions each) and does not hold a judge on one CPU while another judge shares
it. A CPU drawn at random per pair was tried too: half its pairs shared the hog's CPU (biased, slower).

Runners cannot move themselves where the sandbox's seccomp filter runs (tools/sandbox.py denies a CPU
runner sched_setaffinity; a session says at its start whether it runs, and run.json records it). A
side with `threads = N` gets the judge's CPU and N - 1 more drawn at random. CUDA tasks are not
placed by default: their timed region is the device's, and pinning the driver's threads was never measured on a
GPU host. `GateConfig.cuda_placement = "current"` places them too, as a measurement aid only (the host side
of a request, which the judge's clock around it holds): a CUDA runner may still move its own threads (the
sandbox allows the driver that), so there it is no defence against a runner that wants another CPU. Where the judge may use only as many CPUs as a side's threads (a `kloop parallel` slot, a
one-CPU container), there is nothing to choose and nothing is pinned.
"""

from __future__ import annotations

import errno
import os
import random


class Placement:
    """Pins every thread of the given runners to the judge's CPU (set), anew for every pair."""

    def __init__(self, runners: list, threads: int = 1, rng: random.Random | None = None):
        self.runners = list(runners)
        self.home = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        self.size = max(1, int(threads))
        self.rng = rng or random.Random()
        self.active = len(self.home) > self.size
        self.pinned = 0  # pairs placed
        self.error: str | None = None  # why placement stopped, where the host refused it

    def draw(self) -> frozenset[int] | None:
        """Pin the runners to the CPU the judge's thread is on (and, for threaded sides, more drawn at
        random); None (nothing done) when inactive.

        Where the host refuses (a container's policy: EPERM or EINVAL), the decision goes on unplaced, as before
        placement existed, and the report says why (`placement_error`); should a runner then stay pinned
        while the other floats, the sides would no longer be alike, and the decision stops instead."""
        if not self.active:
            return None
        cpus = self._choose()
        try:
            for r in self.runners:
                r.pin(cpus)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EINVAL):
                raise  # not a refusal (a runner gone, say): the caller's error, not a reason to go on unplaced
            self.active, self.error = False, f"CPU placement refused: {exc}"
            try:
                for r in self.runners:
                    r.pin(self.home)
            except OSError as undo:
                raise RuntimeError(f"{self.error}; and a runner could not be put back on every CPU ({undo}): "
                                   "its samples would not be alike the other side's") from undo
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
