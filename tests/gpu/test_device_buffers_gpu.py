"""On the GPU (H200): every device buffer a runner maps is a VMM allocation of its own, outputs too
(issue 20, item 8): the runner writes its outputs through it, the judge reads them, and the
descriptor covers exactly the granule-rounded tensor. Run: `python -m pytest -m gpu tests/gpu -s`."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_softmax_outputs_reach_the_judge_through_vmm():
    from tools.build import build
    from tools.remote import LibSession
    from tools.spec import load_spec
    from tools.task import load_task
    from tools import vmm

    task = load_task(KERNELS / "softmax")
    built = build(task)
    assert built.ok, built.error_text()
    spec = load_spec(task.spec_path)
    dims = {"rows": 33, "cols": 1001}
    with LibSession(task, [built.lib]) as s:
        x = s.arena.share_dict(spec.make_inputs(dims, torch.Generator(device="cuda").manual_seed(1), s.device), inputs=True)
        y = s.arena.share_dict(spec.make_outputs(dims, x))
        buf = s.arena.exported[y["y"].untyped_storage().data_ptr()]()
        assert isinstance(buf, vmm.ExportedBuffer) and buf.size == max(buf.granularity, -(-buf.nbytes // buf.granularity) * buf.granularity)
        y["y"].fill_(float("nan"))
        s.libs[0].bind("k", dims, x, y)
        s.libs[0].call(["k"])
        torch.cuda.synchronize()
        ref = spec.reference(dims, x)["y"]
        assert torch.isfinite(y["y"].float()).all()
        torch.testing.assert_close(y["y"].float(), ref, atol=2e-3, rtol=2e-2)
        with pytest.raises(ValueError, match="whole allocator segment"):  # never an IPC handle
            s.arena.describe(torch.empty(16, device="cuda"), writable=True)
