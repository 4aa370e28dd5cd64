"""Device buffers reach a runner as descriptors on their own socket (tools/vmm.py): the runner takes
them in the order of the descriptions and keeps none open, whether or not the mapping succeeds, so a
library it loads later never finds one to map writable."""

import os

import pytest

from tools.runner import Runner, RunnerError


def _fd_targets(pid: int) -> set[str]:
    base = f"/proc/{pid}/fd"
    out = set()
    for name in os.listdir(base):
        try:
            out.add(os.readlink(f"{base}/{name}"))
        except OSError:
            pass
    return out


def test_a_buffer_descriptor_is_received_and_never_kept(tmp_path):
    runner = Runner(tmp_path, "fds")
    r, w = os.pipe()  # stands in for an exported device buffer: the import fails, the descriptor must still go
    try:
        pipe = os.readlink(f"/proc/self/fd/{r}")
        with pytest.raises(RunnerError) as err:
            runner.request("bind", 60, fds=[r], key="k", dims={},
                           inputs={"x": ("vmm", 0, 2 << 20, "torch.float32", (4,))}, outputs={})
        assert err.value.kind == "call", err.value  # answered: it read the descriptor, it did not hang
        assert "cuMem" in str(err.value) or "CUDA driver" in str(err.value), err.value
        assert pipe not in _fd_targets(runner.proc.pid)
        runner.request("unbind", 10, keys=["k"])  # and the runner still serves
    finally:
        os.close(r)
        os.close(w)
        runner.close()


class _Arena:
    """Describes every tensor as a device buffer with a fresh descriptor, as SharedArena does on CUDA."""

    def __init__(self):
        self.made = []

    def describe(self, t, writable=False):
        r, w = os.pipe()
        os.close(w)
        self.made.append(r)
        return ("vmm", r, 2 << 20, "torch.float32", (4,))


class _Runner:
    def __init__(self, fail: bool):
        self.fail, self.sent = fail, None

    def cpu_ns(self) -> int:  # the judge reads the runner's CPU clock around every request
        return 0

    def request(self, op, timeout, fds=(), **kw):
        self.sent = (list(fds), kw)
        if self.fail:
            raise RunnerError("crash", "runner died")
        return {"ok": True}


@pytest.mark.parametrize("fail", [False, True])
def test_the_judge_closes_each_descriptor_once_sent(fail):
    import torch

    from tools.remote import RemoteLib

    arena = _Arena()
    lib = RemoteLib(_Runner(fail), arena, torch.device("cpu"), timer=None, call_timeout=1.0)
    try:
        lib.bind("k", {}, {"x": object(), "y": object()}, {"out": object()})
    except RunnerError:
        assert fail
    fds, kw = lib.runner.sent
    assert fds == arena.made and len(fds) == 3
    # the descriptions carry indexes into the descriptors sent, never a descriptor number
    assert [d[1] for d in (*kw["inputs"].values(), *kw["outputs"].values())] == [0, 1, 2]
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed in the judge
