"""The judge's one-pass comparison (tools/fused_compare) on a real GPU: it warms, it agrees with the torch
version of tools.check.compare on every case, and a judge's stages say it was in use."""

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    return torch.device("cuda")


def test_warm_then_every_case_agrees_with_the_torch_version(cuda):
    from tests.fused_compare_cases import disagreements
    from tools import fused_compare

    fused_compare.warm(cuda)
    assert fused_compare.usable_on(cuda), fused_compare._BROKEN
    assert disagreements("cuda") == []
    assert fused_compare.usable_on(cuda), fused_compare._BROKEN  # no case broke it


def test_a_large_output_one_element_off_is_caught(cuda):
    """268M elements (the gate bench's softmax output): passing and one element off, both read right."""
    from tools import fused_compare
    from tools.check import compare

    fused_compare.warm(cuda)
    want = torch.rand(65536, 4096, device=cuda)
    got = want.to(torch.bfloat16)
    assert compare("y", got, want, 1e-2, 1e-2, None).passed
    got[40000, 17] += 1.0
    err = compare("y", got, want, 1e-2, 1e-2, None)
    assert not err.passed and err.mismatches == 1 and err.worst_index == [40000, 17]
