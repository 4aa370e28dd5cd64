"""tools.bench.time_remote: the bench figures (a session's baseline, a build's bench, the best's
recorded times the gate checks later decisions against) are seconds per call, as the A/B's are."""

from tools import bench


class FakeLib:
    """A runner handle whose every call takes `per_call` seconds: sample() answers seconds per call
    (tools.remote.RemoteLib.sample's contract) whatever the number of calls in the sample."""

    min_sample_s = 2e-3

    def __init__(self, per_call: float):
        self.per_call = per_call
        self.sampled: list[int] = []

    def bind(self, key, dims, inputs, outputs):
        pass

    def call(self, keys):
        pass

    def sample(self, keys):
        self.sampled.append(len(keys))
        return self.per_call

    def probe(self, key):
        return (self.per_call, 0.0, 0.0)


def test_a_sample_of_several_calls_is_not_divided_twice():
    lib = FakeLib(per_call=0.7e-3)  # under the 2 ms sample span: samples of several calls
    t = bench.time_remote(lib, spec=None, name="s", dims={}, sets=[({}, {})] * 4, arena=None, max_seconds=0.01,
                          flops=2e6, nbytes=None)
    assert t.calls_per_sample == 3 and max(lib.sampled) == 3
    assert t.median == 0.7e-3 and abs(t.mean - 0.7e-3) < 1e-12
    assert abs(t.tflops - 2e6 / 0.7e-3 / 1e12) < 1e-12
