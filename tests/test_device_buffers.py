"""CUDA buffers reach a runner only as tools/vmm.py allocations of their own (issue 20, item 8): an
output as well as an input, never a CUDA IPC handle of torch's caching allocator (which maps a whole
segment of the judge's, other tensors with it). The CUDA calls cannot run here: SharedArena's choices
are tested with a fake VMM (tests/gpu/test_device_buffers_gpu.py runs them on the H200)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from tools import vmm  # noqa: E402
from tools.runner import SharedArena  # noqa: E402

GRANULE = 2 << 20


class FakeBuffer:
    """An ExportedBuffer over host memory: same sizes (the granule), `export()` a real descriptor."""
    made: list = []

    def __init__(self, nbytes: int, device: int = 0):
        self.granularity = GRANULE
        self.size = max(GRANULE, -(-nbytes // GRANULE) * GRANULE)
        self.nbytes = nbytes
        self.mem = torch.empty(self.size, dtype=torch.uint8)
        self.ptr = self.mem.data_ptr()
        FakeBuffer.made.append(self)

    def export(self) -> int:
        r, w = os.pipe()
        os.close(w)
        return r


def _as_tensor(buf, dtype, shape):
    n = 1
    for s in shape:
        n *= int(s)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return buf.mem[: n * itemsize].view(dtype).view(tuple(shape))


@pytest.fixture
def arena(monkeypatch, tmp_path):
    monkeypatch.setattr(vmm, "ExportedBuffer", FakeBuffer)
    monkeypatch.setattr(vmm, "as_tensor", _as_tensor)
    a = SharedArena(torch.device("cpu"), root=tmp_path)
    a.cuda = True  # the CUDA branches, on host memory
    FakeBuffer.made = []
    yield a
    a.close()


def test_outputs_go_through_vmm_like_inputs(arena):
    inputs = arena.share_dict({"x": torch.randn(64, 33)}, inputs=True)
    outputs = arena.share_dict({"y": torch.empty(64, 33), "lse": torch.empty(64), "none": torch.empty(0)})
    assert len(FakeBuffer.made) == 3  # x, y, lse: each in a buffer of its own
    for t, writable in ((inputs["x"], False), (outputs["y"], True), (outputs["lse"], True)):
        desc = arena.describe(t, writable=writable)
        try:
            assert desc[0] == "vmm" and desc[2] == GRANULE, desc  # the tensor's own buffer, nothing more
        finally:
            os.close(desc[1])
    assert arena.describe(outputs["none"], writable=True)[0] == "empty"


def test_a_tensor_of_the_allocator_is_never_sent(arena):
    """No IPC fallback: a tensor the arena did not export (as torch's allocator would hand out) is refused."""
    with pytest.raises(ValueError, match="whole allocator segment"):
        arena.describe(torch.randn(8), writable=True)


def test_a_view_into_a_larger_buffer_is_refused(arena):
    """A mapping must hold the tensor and nothing else: a buffer larger than its tensor's granule is refused."""
    out = arena.share_dict({"y": torch.empty(16)})["y"]
    buf = FakeBuffer.made[-1]
    buf.size = 4 * GRANULE  # as if the buffer held more than this tensor
    with pytest.raises(ValueError, match="nothing else"):
        arena.describe(out, writable=True)


def test_cpu_buffers_are_one_unlinked_file_each_of_the_tensors_size(tmp_path):
    """The CPU equivalent: every tensor in a shared-memory file of its own, unlinked at once, exactly
    its size; a runner gets a descriptor of that file and nothing else of the judge's memory."""
    a = SharedArena(torch.device("cpu"), root=tmp_path)
    try:
        shared = a.share_dict({"x": torch.randn(7, 3), "y": torch.empty(5)})
        assert not any(a.dir.iterdir())  # no name left to reopen
        for t in shared.values():
            desc = a.describe(t, writable=True)
            try:
                assert desc[0] == "fd" and os.fstat(desc[1]).st_size == t.numel() * t.element_size() == desc[4]
            finally:
                os.close(desc[1])
    finally:
        a.close()
