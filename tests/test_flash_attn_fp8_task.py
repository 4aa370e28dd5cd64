"""The flash_attn_fwd_fp8 task: what is specific to it (manifest, quantised inputs and their descales,
the dequantising reference, the tolerance against the FP8 error model, counts, its kernels); what
every task must pass is in tests/test_kernels.py. No GPU needed."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tests.fakes import task_fixtures  # noqa: E402
from tests.kernel_builds import build_variants, every_value_once  # noqa: E402
from tools.check import compare  # noqa: E402

task, spec = task_fixtures("flash_attn_fwd_fp8")
CPU = torch.device("cpu")


def test_manifest(task):
    m = task.manifest
    assert m.target == "cuda" and m.arch == "sm_90a" and m.compute_unit == "fp8_tensor"
    assert m.sources == ["flash_attn_fwd_fp8.cu"] and task.is_editable("flash_attn_fwd_fp8.cu")
    assert set(m.knobs) == {"BLOCK_M", "BLOCK_N", "NUM_WARPS", "STAGES"}
    checks = [s.dims for s in task.check_shapes]
    assert {d["head_dim"] for d in checks} == {64, 128} and {d["causal"] for d in checks} == {True, False}
    assert {d["heads"] // d["kv_heads"] for d in checks} >= {1, 2, 3, 4}  # MHA, GQA, MQA
    assert {d.get("inputs", "normal") for d in checks} == {"normal", "large", "ramp", "outliers"}
    assert any(d["seqlen"] % 32 for d in checks) and any(d["seqlen"] == 1 for d in checks)
    for s in task.bench_shapes:
        assert s.dims["batch"] * s.dims["seqlen"] == 16384 and s.dims["heads"] * s.dims["head_dim"] == 2048
        assert not s.check


def _shape(**over):
    dims = dict(batch=2, heads=4, kv_heads=2, seqlen=37, head_dim=64, causal=False)
    dims.update(over)
    return dims


def test_inputs_are_e4m3_with_a_descale_per_batch_and_kv_head(spec):
    dims = _shape()
    x = spec.make_inputs(dims, torch.Generator().manual_seed(0), CPU)
    assert x["q"].dtype == x["k"].dtype == x["v"].dtype == torch.float8_e4m3fn
    assert x["q"].shape == (2, 4, 37, 64) and x["k"].shape == x["v"].shape == (2, 2, 37, 64)
    for name in ("q_descale", "k_descale", "v_descale"):
        assert x[name].dtype == torch.float32 and x[name].shape == (2, 2)
    # amax scaling: each (batch, kv head) group of each tensor reaches the e4m3 range
    assert float(x["k"].float().abs().amax()) == 448.0
    assert torch.equal(x["k"].float().abs().amax(dim=(2, 3)), torch.full((2, 2), 448.0))
    # the descales differ across heads and tensors: one taken from the wrong place is wrong
    for name in ("q_descale", "k_descale", "v_descale"):
        assert len(set(x[name].flatten().tolist())) == 4, name
    assert not torch.allclose(x["v_descale"], x["k_descale"], rtol=0.05)


def test_reference_dequantises_and_matches_direct_fp64(spec):
    dims = _shape(causal=True)
    x = spec.make_inputs(dims, torch.Generator().manual_seed(1), CPU)
    ref = spec.reference(dims, x)
    q, k, v = spec.module.dequantized(x, torch.float64)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(64)
    s = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(ref["o"].double(), torch.softmax(s, -1) @ v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref["lse"].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def _emulated(spec, dims, x, p_dtype, descale=True):
    """The baseline's arithmetic in torch: exact e4m3 scores in fp32 with the descales folded into the
    scale, P rounded to `p_dtype` for P V, fp32 accumulation, O to bf16. Whole rows (tiling changes
    only fp32 summation order)."""
    g = dims["heads"] // dims["kv_heads"]

    def rep(t):
        return t.repeat_interleave(g, dim=1)

    q, k, v = x["q"].float(), rep(x["k"].float()), rep(x["v"].float())
    qd, kd, vd = (rep(x[n])[:, :, None, None] if descale else 1.0 for n in ("q_descale", "k_descale", "v_descale"))
    s = (q @ k.transpose(-1, -2)) * (qd * kd / math.sqrt(dims["head_dim"]))
    if dims["causal"]:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = (p.to(p_dtype).float() @ v) * vd / l
    return {"o": o.to(torch.bfloat16), "lse": (m + torch.log(l))[..., 0]}


def _passes(task, out, ref):
    return all(compare(n, out[n], ref[n], task.tolerance(n).atol, task.tolerance(n).rtol, task.tolerance(n).norm_rtol).passed
               for n in ("o", "lse"))


@pytest.mark.parametrize("name", ["d128_s17_gqa2", "d128_s257_large", "d64_s200_outliers_causal"])
def test_tolerance_admits_p_in_e4m3_and_rejects_a_missing_descale(task, spec, name):
    """The README's error model, on check shapes: P in bf16 or e4m3 passes; no descale, or K's descale
    used for V, or one descale for every head, fails."""
    dims = task.shape(name).dims
    x = spec.make_inputs(dims, torch.Generator().manual_seed(3), CPU)
    ref = spec.reference(dims, x)
    assert _passes(task, _emulated(spec, dims, x, torch.bfloat16), ref)
    assert _passes(task, _emulated(spec, dims, x, torch.float8_e4m3fn), ref)
    assert not _passes(task, _emulated(spec, dims, x, torch.bfloat16, descale=False), ref)
    swapped = dict(x, v_descale=x["k_descale"])
    assert not _passes(task, _emulated(spec, dims, swapped, torch.bfloat16), ref)
    if x["v_descale"].numel() > 1:
        one = {n: (x[n].flatten()[:1].expand_as(x[n]).contiguous() if n.endswith("descale") else x[n]) for n in x}
        assert not _passes(task, _emulated(spec, dims, one, torch.bfloat16), ref)


def test_flops_and_bytes(spec):
    dims = {"batch": 4, "heads": 16, "kv_heads": 4, "seqlen": 4096, "head_dim": 128, "causal": False}
    assert spec.flops(dims) == 4 * 4 * 16 * 4096 * 4096 * 128
    assert spec.flops({**dims, "causal": True}) == spec.flops(dims) / 2
    tokens = 4 * 4096 * 128
    assert spec.bytes_moved(dims) == 16 * tokens + 2 * 4 * tokens + 3 * 4 * 16 + 16 * tokens * 2 + 4 * 16 * 4096 * 4
    assert set(spec.comparators) == {"sdpa_flash_bf16", "sdpa_cudnn_bf16"}


@pytest.mark.slow
def test_every_knob_value_builds_both_head_dim_kernels(task, kernel_build_cache):
    builds = build_variants(task, every_value_once(task), kernel_build_cache)
    for label, r in builds.items():
        assert r.ok, f"build failed for {label}:\n{r.error_text()}"
        names = sorted(k.name for k in r.kernels)
        assert len(names) == 2 and all("flash_attn_fwd_fp8_kernel<" in n for n in names), (label, names)
