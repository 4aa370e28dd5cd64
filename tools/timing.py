"""Timers: CUDA events with the L2 flushed before every timed call, or a monotonic clock on the CPU.

Also the input-set rotation (so repeated calls do not time a warm cache) and the calls-per-sample
batching that keeps launch jitter out of the timings of very short kernels.
"""

from __future__ import annotations

import ctypes
import math
import time
from typing import Callable

import torch

from tools.stats import quantile

CPU_CACHE_BYTES = 32 << 20  # no portable way to read the LLC size; a generous guess
SET_MEMORY_CAP = {"cuda": 8 << 30, "cpu": 512 << 20}  # bytes all rotated input sets may take
SHORT_CALL_S = 50e-6
CALLS_CAP = 64  # calls in one timed sample (or long CUDA request: tools/ab.py), at most
IDLE_WINDOW_S = 2e-3  # after an integrity probe: how long to watch the idle process for CPU use  # below this, several calls go in one timed sample


def tensors_bytes(d: dict) -> int:
    return sum(t.numel() * t.element_size() for t in d.values() if isinstance(t, torch.Tensor))


HOLD_BASE_S = 30e-6  # device spin before a timed sample: the host's enqueue of the sample fits under it
HOLD_PER_CALL_S = 15e-6
HOLD_MAX_S = 10e-3  # never longer (a sample holds up to 64 calls; a Triton launcher takes up to ~80 us each): the
# spin costs wall time only, it sits before the start event on the same in-order stream
SPIN_HZ = 2.0e9  # cycles per second assumed for the spin (Hopper boosts to ~2 GHz; a longer spin is harmless)


def hold_seconds(calls: int, enqueue_per_call_s: float = 0.0) -> float:
    """The spin for `calls` launches whose host enqueue was last seen to take `enqueue_per_call_s` each: twice
    that (a Triton launcher's Python takes tens of us, and it jitters), at least the fixed allowance, at most
    HOLD_MAX_S. The runner passes an enqueue time only where the launch code is kloop's (tools/libhost.py):
    host time spent in a candidate's own entry point must stay inside the timed region."""
    return min(HOLD_MAX_S, HOLD_BASE_S + calls * max(HOLD_PER_CALL_S, 2.0 * enqueue_per_call_s))


def hold_device(calls: int, enqueue_per_call_s: float = 0.0) -> None:
    """Keep the current stream busy (a spin kernel, no memory traffic) while the host enqueues the
    start event and `calls` launches: otherwise the start event fires at once and the sample also
    times the host's launch gaps (Python and ctypes jitter), noise that swamps short kernels. (On the H200
    a 2 us rmsnorm_triton call read 14-80 us under the fixed 15 us per call: its launcher took longer.)"""
    spin = getattr(torch.cuda, "_sleep", None)
    if spin is not None:
        spin(int(hold_seconds(calls, enqueue_per_call_s) * SPIN_HZ))


def flush_l2(buf) -> None:
    """The L2 flush before a timed sample. Persisting lines go back to normal first
    (cudaCtxResetPersistingL2Cache), then writing `buf` (twice the L2) evicts them with everything else:
    in the other order, lines that a persisting window or an evict_last policy kept through the
    write would stay in L2, merely demoted, and the next call would still read them from there.
    The judge flushes from its own context: L2 is the device's, shared by every context on it, so the
    write evicts the runner's lines too (`tests/gpu/test_cheats_cuda.py`, the L2 probes), and a runner cannot skip it."""
    _reset_persisting_l2()
    buf.zero_()


_CUDART = None
CUDA_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06  # cudaLimitPersistingL2CacheSize


def cudart():
    """The CUDA runtime torch loaded (by soname, so the same instance), or None."""
    global _CUDART
    if _CUDART is None:
        _CUDART = False
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):  # torch's soname first
            try:
                lib = ctypes.CDLL(name)
                lib.cudaCtxResetPersistingL2Cache.restype = ctypes.c_int
                lib.cudaDeviceSetLimit.restype = ctypes.c_int
                lib.cudaDeviceSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
                _CUDART = lib
                break
            except (OSError, AttributeError):
                continue
    return _CUDART or None


def _reset_persisting_l2() -> None:
    """cudaCtxResetPersistingL2Cache: lines a persisting access window kept go back to normal before the write."""
    rt = cudart()
    if rt is not None:
        rt.cudaCtxResetPersistingL2Cache()


class Timer:
    """Times batches of calls on one device, the cache cold before each sample."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            props = torch.cuda.get_device_properties(device)
            self.cache_bytes = int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))
        else:
            self.cache_bytes = CPU_CACHE_BYTES
        self._flush = None  # allocated on first use

    def flush(self) -> None:
        if self._flush is None:
            # writing twice the cache evicts whatever the previous call left there
            size = max(256 << 20, 2 * self.cache_bytes) if self.cuda else 2 * self.cache_bytes
            self._flush = torch.empty(size, dtype=torch.uint8, device=self.device)
        if self.cuda:
            flush_l2(self._flush)
        else:
            self._flush.zero_()

    def run(self, calls: list[Callable[[], None]], flush: bool = True) -> list[float]:
        """Seconds taken by each call, in order, each after an L2 flush."""
        if not self.cuda:
            out = []
            for call in calls:
                if flush:
                    self.flush()
                t0 = time.perf_counter_ns()
                call()
                out.append((time.perf_counter_ns() - t0) * 1e-9)
            return out
        events = []
        for call in calls:
            if flush:
                self.flush()
            hold_device(1)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1e-3 for s, e in events]

    def wall(self, call: Callable[[], None]) -> float:
        """Host seconds for the call and *all* device work it caused (every stream)."""
        self.sync()
        t0 = time.perf_counter_ns()
        call()
        self.sync()
        return (time.perf_counter_ns() - t0) * 1e-9

    def probe(self, call: Callable[[], None], idle_s: float = IDLE_WINDOW_S) -> tuple[float, float, float]:
        """One cold call measured for escapes: (wall, extra, idle_cpu) in seconds.

        Cold like the timed samples (flush first). wall: host time from the call until the device is
        idle. extra: time outside what the timer measures — on CUDA wall minus the events, on the CPU
        the process's CPU time beyond the wall time (other threads working during the call) — plus
        idle_cpu: CPU time the process used in a short idle window after the call returned (work
        after return, host threads). Honest kernels have extra <= ~0 on the CPU whatever their speed.
        """
        self.flush()
        self.sync()
        c0 = time.process_time_ns()
        t0 = time.perf_counter_ns()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            self.sync()
        else:
            call()
        t1 = time.perf_counter_ns()
        c1 = time.process_time_ns()
        wall = (t1 - t0) * 1e-9
        timed = start.elapsed_time(end) * 1e-3 if self.cuda else wall
        cpu_beyond = max(0.0, (c1 - c0) * 1e-9 - wall) if not self.cuda else 0.0
        time.sleep(idle_s)
        idle_cpu = (time.process_time_ns() - c1) * 1e-9
        return wall, (wall - timed) + cpu_beyond + idle_cpu, idle_cpu

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def input_sets(self, bytes_per_set: int) -> int:
        """How many input sets to rotate so that consecutive calls never find their data cached."""
        want = max(2, math.ceil(3 * self.cache_bytes / max(bytes_per_set, 1)))
        cap = SET_MEMORY_CAP["cuda" if self.cuda else "cpu"] // max(bytes_per_set, 1)
        return int(max(1, min(want, 16, cap)))


def calibrate(sample_one: Callable[[int], float], min_sample_s: float = SHORT_CALL_S, tries: int = 3) -> tuple[int, float]:
    """(calls per timed sample, seconds of one call): the fastest of `tries` single-call samples
    (`sample_one(i)`: seconds of one call on input set i). The one calibration of every timing
    (the A/B decision, the bench of a build and of the comparators)."""
    single = min(sample_one(i) for i in range(tries))
    return calls_per_sample(single, short_s=min_sample_s), single


def set_memory_cap(device, long_requests: bool = False) -> int:
    """Bytes every rotated input set of one shape may take. CUDA requests of many calls (GateConfig.cuda_request_s)
    need a set per call: there, up to a fifth of the device's memory (at most half of what is free), never
    less than the usual cap."""
    kind = "cuda" if getattr(device, "type", device) == "cuda" else "cpu"
    if kind != "cuda" or not long_requests:
        return SET_MEMORY_CAP[kind]
    free, total = torch.cuda.mem_get_info(device)
    return max(SET_MEMORY_CAP["cuda"], min(total // 5, free // 2))


def calls_per_sample(single_call_s: float, cap: int = CALLS_CAP, short_s: float = SHORT_CALL_S) -> int:
    """Calls per timed sample so one sample spans at least `short_s` (launch and pipe jitter stay small)."""
    if not math.isfinite(single_call_s) or single_call_s <= 0 or single_call_s >= short_s:
        return 1
    return int(min(cap, math.ceil(short_s / single_call_s)))


def summarize(times: list[float]) -> dict:
    return {
        "median": quantile(times, 0.5),
        "p10": quantile(times, 0.1),
        "p90": quantile(times, 0.9),
        "mean": sum(times) / len(times),
        "samples": len(times),
    }
