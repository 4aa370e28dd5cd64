"""Work after return, per timed sample (tools/remote.RemoteLib): CPU a runner uses between its answer
and its next request is charged to the sample it follows, and kept per sample so the judge compares
medians. A rare spike (the CUDA driver's threads waking up) moves no median; work after every return does."""

import statistics

import torch

from tools.remote import RemoteLib

CALL_NS = 1_000_000  # each timed call: 1 ms of runner CPU


class ScriptedRunner:
    """A runner whose CPU clock the test drives: each request costs CALL_NS, and `idle_ns` is what it
    spends between its answer and the next request."""

    def __init__(self):
        self.t = 0
        self.idle_ns = []  # per request, consumed in order
        self._after = 0

    def cpu_ns(self) -> int:
        now = self.t
        self.t += self._after  # the judge's first read after an answer comes before the work after return
        self._after = 0
        return now

    def request(self, op, timeout, **kw):
        self.t += CALL_NS
        self._after = self.idle_ns.pop(0) if self.idle_ns else 0
        return {"ok": True}


class NoFlush:
    def flush(self):
        pass


def samples(idle_ns: list[int]) -> tuple[RemoteLib, list[float]]:
    runner = ScriptedRunner()
    runner.idle_ns = list(idle_ns)
    lib = RemoteLib(runner, arena=None, device=torch.device("cpu"), timer=NoFlush(), call_timeout=1.0)
    sink = []
    for _ in idle_ns:
        lib.sample(["k"], sink)
    lib._gap()  # the last sample's leak, settled as at the end of a pass
    return lib, sink


def test_each_sample_carries_the_cpu_used_after_its_answer():
    lib, sink = samples([0, 0, 5_000_000, 0, 0])
    assert len(lib.sample_leaks) == 5
    assert lib.sample_leaks[2] * 1e9 > 4_000_000  # the spike is on the sample it followed
    assert abs(sink[2] - sink[0] - 5e-3) < 1e-4  # and costs that sample its time


def test_a_rare_spike_moves_no_median_and_work_after_every_return_does():
    rare, _ = samples([0] * 8 + [20_000_000] + [0] * 11)
    every, _ = samples([200_000] * 20)
    assert statistics.mean(rare.sample_leaks) > 5e-4  # the mean a single spike drags up (what flagged honest CUDA runners)
    assert statistics.median(rare.sample_leaks) < 1e-5
    assert statistics.median(every.sample_leaks) > 1.5e-4  # 0.2 ms after every call: seen in full
