"""The flash_attn_bwd task: what is specific to it (manifest, inputs with the forward's O and LSE,
the chunked autograd reference, the tolerance against a bf16 backward's arithmetic, counts, its
kernels per mode); what every task must pass is in tests/test_kernels.py. No GPU needed."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tests.fakes import task_fixtures  # noqa: E402
from tests.kernel_builds import build_variants, one_knob_at_a_time  # noqa: E402
from tools.attention_ref import attention_backward  # noqa: E402
from tools.check import compare  # noqa: E402

task, spec = task_fixtures("flash_attn_bwd")
CPU = torch.device("cpu")


def test_manifest(task):
    m = task.manifest
    assert m.target == "cuda" and m.arch == "sm_90a" and m.compute_unit == "bf16_tensor"
    assert m.sources == ["flash_attn_bwd.cu"] and task.is_editable("flash_attn_bwd.cu")
    assert set(m.knobs) == {"BLOCK_M", "BLOCK_N", "NUM_WARPS", "KV_OUTER", "DQ_ATOMIC"}
    checks = [s.dims for s in task.check_shapes]
    assert {d["head_dim"] for d in checks} == {64, 128} and {d["causal"] for d in checks} == {True, False}
    assert {d["heads"] // d["kv_heads"] for d in checks} >= {1, 2, 3, 4}
    assert any(d.get("inputs") == "large" for d in checks)
    assert all(d["seqlen"] > 1 for d in checks)  # seqlen 1: dQ = dK = 0, no norm-relative bound
    for s in task.bench_shapes:
        assert s.dims["batch"] * s.dims["seqlen"] == 16384 and s.dims["heads"] * s.dims["head_dim"] == 2048


def _shape(**over):
    dims = dict(batch=2, heads=4, kv_heads=2, seqlen=29, head_dim=64, causal=True)
    dims.update(over)
    return dims


def test_inputs_carry_the_forward_and_outputs_the_workspaces(spec):
    dims = _shape()
    x = spec.make_inputs(dims, torch.Generator().manual_seed(0), CPU)
    assert {n: tuple(t.shape) for n, t in x.items()} == {
        "q": (2, 4, 29, 64), "k": (2, 2, 29, 64), "v": (2, 2, 29, 64), "o": (2, 4, 29, 64), "do": (2, 4, 29, 64),
        "lse": (2, 4, 29)}
    assert x["o"].dtype == torch.bfloat16 and x["lse"].dtype == torch.float32
    # O and LSE are the forward's: softmax(Q K^T / sqrt(d)) V with GQA, causal
    k, v = (x[n].double().repeat_interleave(2, dim=1) for n in ("k", "v"))
    s = x["q"].double() @ k.transpose(-1, -2) / 8
    s = s.masked_fill(torch.ones(29, 29, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(x["o"].double(), (torch.softmax(s, -1) @ v).bfloat16().double(), atol=1e-2, rtol=0)
    torch.testing.assert_close(x["lse"].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)
    out = spec.make_outputs(dims, x)
    assert {n: (tuple(t.shape), t.dtype) for n, t in out.items() if not n.startswith("ws_")} == {
        "dq": ((2, 4, 29, 64), torch.bfloat16), "dk": ((2, 2, 29, 64), torch.bfloat16), "dv": ((2, 2, 29, 64), torch.bfloat16)}
    assert out["ws_dq"].dtype == out["ws_dk"].dtype == torch.float32 and out["ws_delta"].shape == (2, 4, 29)


def test_reference_is_autograd_of_the_fp64_forward_summed_over_the_group(spec):
    """With the given O equal to the exact one, the reference is plain autograd (dK, dV summed over
    each kv head's group, through repeat_interleave); chunking changes nothing."""
    dims = _shape()
    x = spec.make_inputs(dims, torch.Generator().manual_seed(1), CPU)
    q, k, v = (x[n].double().requires_grad_(True) for n in ("q", "k", "v"))
    s = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 8
    s = s.masked_fill(torch.ones(29, 29, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, -1) @ v.repeat_interleave(2, dim=1)
    want = torch.autograd.grad(o, (q, k, v), x["do"].double())
    got = attention_backward(x["q"], x["k"], x["v"], x["do"], True, 1 / 8, torch.float64, o=o.detach())
    chunked = attention_backward(x["q"], x["k"], x["v"], x["do"], True, 1 / 8, torch.float64, o=o.detach(),
                                 chunk_bytes=4 * 29 * 8 * 5)  # 5 query rows per chunk
    for a, b, c in zip(got, chunked, want):
        torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(b, c, atol=1e-10, rtol=1e-10)


def _emulated(dims, x, dk_gain=1.0, group_sum=True):
    """The baseline's arithmetic in torch: P, dS rounded to bf16 for the matmuls, Delta from the given
    (bf16) O, fp32 accumulation, outputs to bf16."""
    g = dims["heads"] // dims["kv_heads"]
    sc = 1 / math.sqrt(dims["head_dim"])
    q, do, o = (x[n].float() for n in ("q", "do", "o"))
    k, v = (x[n].float().repeat_interleave(g, dim=1) for n in ("k", "v"))
    p = torch.exp(q @ k.transpose(-1, -2) * sc - x["lse"][..., None])
    if dims["causal"]:
        n = p.shape[-1]
        p = p.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), 0)
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    pb, dsb = p.bfloat16().float(), ds.bfloat16().float()
    b, h, s, d = q.shape

    def per_kv(t):
        t = t.reshape(b, h // g, g, s, d)
        return t.sum(2) if group_sum else t[:, :, -1]

    return {"dq": (sc * dsb @ k).bfloat16(), "dk": (dk_gain * per_kv(sc * dsb.transpose(-1, -2) @ q)).bfloat16(),
            "dv": per_kv(pb.transpose(-1, -2) @ do).bfloat16()}


def _passes(task, out, ref):
    tol = task.tolerance("dq")
    return all(compare(n, out[n], ref[n], tol.atol, tol.rtol, tol.norm_rtol).passed for n in ("dq", "dk", "dv"))


@pytest.mark.parametrize("name", ["d64_s17_gqa2", "d128_s200_large_gqa2_causal"])
def test_tolerance_admits_a_bf16_backward_and_rejects_a_wrong_one(task, spec, name):
    dims = task.shape(name).dims
    x = spec.make_inputs(dims, torch.Generator().manual_seed(2), CPU)
    ref = spec.reference(dims, x)
    assert _passes(task, _emulated(dims, x), ref)
    assert not _passes(task, _emulated(dims, x, group_sum=False), ref)  # dK/dV from one head of the group
    assert not _passes(task, _emulated(dims, x, dk_gain=1.05), ref)  # a 5% scaled dK


def test_flops_and_bytes(spec):
    dims = {"batch": 4, "heads": 16, "kv_heads": 4, "seqlen": 4096, "head_dim": 128, "causal": False}
    assert spec.flops(dims) == 2.5 * 4 * 4 * 16 * 4096 * 4096 * 128
    assert spec.flops({**dims, "causal": True}) == spec.flops(dims) / 2
    ql, kvl = 4 * 16 * 4096 * 128, 4 * 4 * 4096 * 128
    assert spec.bytes_moved(dims) == 2 * (3 * ql + 2 * kvl) + 4 * 4 * 16 * 4096 + 2 * (ql + 2 * kvl)
    assert set(spec.comparators) == {"sdpa_flash_bwd", "sdpa_cudnn_bwd"}


@pytest.mark.slow
def test_each_mode_builds_its_kernels_for_both_head_dims(task, kernel_build_cache):
    """Which kernels a build holds follows the mode knobs (so `build`/`sass` and the trailers name
    several per build); the default mode does not spill."""
    builds = build_variants(task, one_knob_at_a_time(task), kernel_build_cache)
    for label, r in builds.items():
        assert r.ok, f"build failed for {label}:\n{r.error_text()}"
    from tools.fmt import kernel_names

    def names(r):
        return sorted(kernel_names([k.name for k in r.kernels]))

    assert names(builds["defaults"]) == ["bwd_dkdv<128,false>", "bwd_dkdv<64,false>", "bwd_dq<128,false>",
                                         "bwd_dq<64,false>", "bwd_preprocess<128>", "bwd_preprocess<64>", "to_bf16"]
    assert "bwd_dkdv<128,true>" in names(builds["DQ_ATOMIC=1"]) and "bwd_dq<128,false>" not in names(builds["DQ_ATOMIC=1"])
    assert "bwd_dq<128,true>" in names(builds["KV_OUTER=0"]) and not any("dkdv" in n for n in names(builds["KV_OUTER=0"]))
    assert not any(k.spill_store_bytes or k.spill_load_bytes or k.stack_bytes for k in builds["defaults"].kernels)


def test_comparator_cache_is_per_input_set_and_shape():
    """The comparators' cache (tools/attention_ref.PerInputCache): an input set's derived tensors are
    reused across the bench's rotation; a freed set's addresses reused by an equally sized tensor of
    another shape are a miss (the FP8 SDPA comparator once met such a stale entry at 16k and failed)."""
    from tools.attention_ref import PerInputCache

    cache, made = PerInputCache(size=2), []
    storage = torch.zeros(64)
    a = {"q": storage[:32].view(4, 8)}
    b = {"q": storage[:32].view(8, 4)}  # same address, another shape
    c = {"q": torch.zeros(3)}

    def get(x):
        return cache.get(x, ("q",), (), lambda: made.append(tuple(x["q"].shape)) or len(made))

    assert [get(a), get(a), get(b), get(a)] == [1, 1, 2, 1]
    assert get(c) == 3 and get(b) == 4  # size 2: b was the least recently used, dropped for c
    assert made == [(4, 8), (8, 4), (3,), (8, 4)]
