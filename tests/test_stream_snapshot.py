"""Outputs must be finished when the call's stream is: the probe's stream-ordered copy against the
outputs once the device is idle (tools/ab.unfinished_outputs). The GPU side (the copy really enqueued
on the call's stream, a side-stream cheat caught on every call size) is tests/gpu/test_cheats_cuda.py."""

from __future__ import annotations

import pytest
import torch

from tools.ab import unfinished_outputs
from tools.check import differing_elements, poison
from tools.libhost import Host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
                                   torch.uint8, torch.bool])
def test_differing_elements_counts_elements_bit_for_bit(dtype):
    a = (torch.arange(24) % 3).to(dtype).reshape(2, 3, 4)
    b = a.clone()
    assert differing_elements(a, b) == 0
    b[1, 2, 3] = 1 if dtype != torch.bool else (not bool(b[1, 2, 3]))
    b[0, 0, 0] = 1 if dtype != torch.bool else (not bool(b[0, 0, 0]))
    assert differing_elements(a, b) == 2


def test_nan_equals_nan_but_signed_zeros_differ():
    a = torch.tensor([float("nan"), 0.0, 1.0])
    assert differing_elements(a, a.clone()) == 0  # a poisoned element left poisoned is no change
    assert differing_elements(a, torch.tensor([float("nan"), -0.0, 1.0])) == 1


def test_shape_or_dtype_mismatch_counts_everything():
    a = torch.zeros(4, 5)
    assert differing_elements(a, torch.zeros(5, 4)) == 20
    assert differing_elements(a, torch.zeros(4, 5, dtype=torch.float64)) == 20


def test_outputs_finished_with_their_stream_pass():
    final = {"y": torch.randn(8, 16), "lse": torch.randn(8)}
    copy = {k: v.clone() for k, v in final.items()}
    assert unfinished_outputs(copy, final) is None


def test_rows_written_after_the_stream_finished_are_named():
    """What a side stream that the call's stream does not wait for leaves: the copy made on the call's
    stream still holds the poison in the rows written later."""
    final = {"y": torch.randn(8, 16)}
    at_stream_end = {"y": final["y"].clone()}
    poison(at_stream_end)
    at_stream_end["y"][:4] = final["y"][:4]  # the first half done on the call's stream
    problem = unfinished_outputs(at_stream_end, final)
    assert problem is not None
    assert "output y: 64 of 128 elements" in problem and "another stream" in problem


def test_a_snapshot_is_taken_of_one_cuda_call_only():
    host = Host.__new__(Host)  # no pipes: run() refuses before it touches any
    host.device = torch.device("cpu")
    host.sets = {}
    with pytest.raises(ValueError, match="one CUDA call"):
        host.run([("s", 0)], snapshot=("s", "snapshot"))


def test_the_snapshot_buffers_follow_the_outputs_shapes():
    """A probe set's outputs drawn anew in another shape get snapshot buffers of that shape, bound in the
    runner again; the same shapes reuse the bound ones."""
    from tools.ab import _Shape, _snapshot_like

    class Lib:
        def __init__(self):
            self.binds = []

        def bind(self, key, dims, inputs, outputs):
            self.binds.append((key, {k: tuple(v.shape) for k, v in outputs.items()}))

    st, lib = _Shape("s", {"n": 4}, 1.0, 0.03), Lib()
    first = _snapshot_like(st, "b", {"y": torch.zeros(4, 8), "lse": torch.zeros(4)}, lambda d: d, lib)
    assert _snapshot_like(st, "b", {"y": torch.ones(4, 8), "lse": torch.ones(4)}, lambda d: d, lib) is first
    again = _snapshot_like(st, "b", {"y": torch.zeros(5, 8), "lse": torch.zeros(5)}, lambda d: d, lib)
    assert again["y"].shape == (5, 8) and again is not first
    assert lib.binds == [(("s", "snapshot"), {"y": (4, 8), "lse": (4,)}), (("s", "snapshot"), {"y": (5, 8), "lse": (5,)})]
