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
