"""The paged_decode task: what is specific to it (manifest, scattered pages, reference, byte counts,
its three head-dim kernels); what every task must pass is in tests/test_kernels.py.

No GPU needed: the reference and the comparator run on the CPU, the kernel is only compiled
(for sm_90a, with ptxas -v) when nvcc is on the PATH.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tests.fakes import task_fixtures  # noqa: E402
from tests.kernel_builds import build_variants  # noqa: E402

task, spec = task_fixtures("paged_decode")


def tiny(**over):
    dims = dict(batch=3, q_heads=8, kv_heads=2, head_dim=16, page_size=4, ctx=13, lens="random")
    dims.update(over)
    return dims


def test_manifest(task):
    m = task.manifest
    assert m.target == "cuda" and m.arch == "sm_90a"
    assert m.sources == ["paged_decode.cu"]
    assert task.is_editable("paged_decode.cu")
    assert set(m.knobs) == {"THREADS", "QHEADS_PER_BLOCK", "VEC", "PARTITION_SIZE"}
    assert len(task.bench_shapes) >= 4
    for s in task.bench_shapes:
        d = s.dims
        assert (d["q_heads"], d["kv_heads"], d["head_dim"], d["page_size"]) == (32, 8, 128, 16)
        assert d["lens"] in ("fixed", "ramp")  # exact byte counts for the timed shapes
    checks = [s.dims for s in task.check_shapes]
    assert {d["q_heads"] // d["kv_heads"] for d in checks} >= {1, 4, 8}
    assert {d["head_dim"] for d in checks} >= {64, 128}
    assert any(d["batch"] == 1 for d in checks) and any(d["ctx"] == 1 for d in checks)
    assert any(d["ctx"] >= 32768 and not s.bench for s, d in zip(task.check_shapes, checks))


def test_inputs_are_scattered_pages(spec):
    dims = tiny(batch=4, ctx=29)
    gen = torch.Generator().manual_seed(0)
    x = spec.make_inputs(dims, gen, torch.device("cpu"))
    bt, lens = x["block_table"], x["context_lens"]
    mp = math.ceil(29 / 4)
    assert bt.dtype == torch.int32 and bt.shape == (4, mp) and lens.dtype == torch.int32
    assert x["q"].dtype == x["k_cache"].dtype == torch.bfloat16
    assert x["k_cache"].shape[1:] == (4, 2, 16) and x["k_cache"].shape == x["v_cache"].shape
    pool = x["k_cache"].shape[0]
    assert pool > bt.numel()  # spare pages: the pool is larger than what the tables name
    flat = bt.flatten().tolist()
    assert len(set(flat)) == len(flat) and min(flat) >= 0 and max(flat) < pool
    assert flat != sorted(flat)  # a random permutation, not a contiguous layout
    assert all(1 <= n <= 29 for n in lens.tolist())
    assert x["k_cache"].abs().sum() > 0 and x["v_cache"].abs().sum() > 0
    # the generator alone decides the inputs
    y = spec.make_inputs(dims, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert all(torch.equal(x[k], y[k]) for k in x)


def _direct_attention(q, k, v, lens, kv_heads):
    """float64, one sequence, one head at a time, over contiguous K/V [b, T, kv_heads, d]."""
    b, qh, d = q.shape
    group = qh // kv_heads
    out = torch.zeros(b, qh, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        for h in range(qh):
            kk = k[i, :n, h // group].double()
            vv = v[i, :n, h // group].double()
            w = torch.softmax((kk @ q[i, h].double()) / math.sqrt(d), dim=0)
            out[i, h] = w @ vv
    return out


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (4, 4), (8, 1)])
def test_reference_matches_direct_float64_on_contiguous_kv(spec, q_heads, kv_heads):
    # contiguous K/V scattered into a page pool through a random block table, then the spec's
    # reference over the pages must agree with plain attention over the contiguous tensors
    b, d, ps, ctx = 3, 16, 4, 14
    g = torch.Generator().manual_seed(7)
    T = math.ceil(ctx / ps) * ps
    k = torch.randn(b, T, kv_heads, d, generator=g).bfloat16()
    v = torch.randn(b, T, kv_heads, d, generator=g).bfloat16()
    q = torch.randn(b, q_heads, d, generator=g).bfloat16()
    lens = torch.tensor([14, 1, 9], dtype=torch.int32)  # 1, a full length, one that ends mid-page
    mp = T // ps
    pool = b * mp + 5
    perm = torch.randperm(pool, generator=g)
    bt = perm[: b * mp].reshape(b, mp).to(torch.int32)
    kc = torch.randn(pool, ps, kv_heads, d, generator=g).bfloat16()  # spare pages hold noise
    vc = torch.randn(pool, ps, kv_heads, d, generator=g).bfloat16()
    for i in range(b):
        for p in range(mp):
            kc[bt[i, p]] = k[i, p * ps:(p + 1) * ps]
            vc[bt[i, p]] = v[i, p * ps:(p + 1) * ps]
    assert bt.flatten().tolist() != list(range(b * mp))
    dims = dict(batch=b, q_heads=q_heads, kv_heads=kv_heads, head_dim=d, page_size=ps, ctx=ctx, lens="random")
    inputs = dict(q=q, k_cache=kc, v_cache=vc, block_table=bt, context_lens=lens)
    ref = spec.reference(dims, inputs)["out"]
    direct = _direct_attention(q, k, v, lens, kv_heads)
    assert ref.dtype == torch.float32 and ref.shape == (b, q_heads, d)
    torch.testing.assert_close(ref.double(), direct, atol=1e-5, rtol=1e-5)
    # a single token attends to itself only: out = v of token 0
    group = q_heads // kv_heads
    torch.testing.assert_close(ref[1].double(), v[1, 0].double().repeat_interleave(group, 0), atol=1e-6, rtol=0)


def test_reference_on_generated_inputs_matches_token_by_token_gather(spec):
    dims = tiny(batch=2, q_heads=6, kv_heads=3, ctx=11)
    x = spec.make_inputs(dims, torch.Generator().manual_seed(3), torch.device("cpu"))
    b, ps = 2, 4
    T = int(x["context_lens"].max())
    k = torch.zeros(b, T, 3, 16, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    for i in range(b):
        for t in range(int(x["context_lens"][i])):
            page = int(x["block_table"][i, t // ps])
            k[i, t] = x["k_cache"][page, t % ps]
            v[i, t] = x["v_cache"][page, t % ps]
    ref = spec.reference(dims, x)["out"]
    torch.testing.assert_close(ref.double(), _direct_attention(x["q"], k, v, x["context_lens"], 3), atol=1e-5, rtol=1e-5)


def test_comparator_agrees_with_reference(spec, task):
    dims = tiny(ctx=21)
    x = spec.make_inputs(dims, torch.Generator().manual_seed(5), torch.device("cpu"))
    ref = spec.reference(dims, x)["out"]
    outs = spec.make_outputs(dims, x)
    outs["out"].fill_(float("nan"))
    spec.comparators["gather_sdpa"](dims, x, outs)
    tol = task.tolerance("out")
    diff = (outs["out"].float() - ref).abs()
    assert bool((diff <= tol.atol + tol.rtol * ref.abs()).all())
    assert float(diff.norm() / ref.norm()) <= tol.norm_rtol


def test_bytes_and_flops(spec, task):
    def formula(lens, b, qh, kvh, d, ps):
        pages = sum(math.ceil(n / ps) for n in lens)
        return sum(lens) * kvh * d * 2 * 2 + 2 * b * qh * d * 2 + pages * 4 + b * 4

    d = dict(batch=4, q_heads=32, kv_heads=8, head_dim=128, page_size=16, ctx=1000, lens="fixed")
    assert spec.bytes_moved(d) == formula([1000] * 4, 4, 32, 8, 128, 16)
    assert spec.flops(d) == 4 * 4000 * 32 * 128
    ramp = dict(d, lens="ramp")
    lens = [1000 - (i * 999) // 8 for i in range(4)]
    assert lens == spec.module.fixed_lengths(ramp) and len(set(lens)) == 4
    assert spec.bytes_moved(ramp) == formula(lens, 4, 32, 8, 128, 16)
    x = spec.make_inputs(ramp | dict(batch=4, q_heads=4, kv_heads=1, head_dim=8), torch.Generator().manual_seed(0),
                         torch.device("cpu"))
    assert x["context_lens"].tolist() == lens
    # random: the expectation over len ~ U{1..ctx}
    r = dict(d, lens="random", ctx=5, page_size=2, batch=3)
    exp_pages = 3 * sum(math.ceil(n / 2) for n in range(1, 6)) / 5
    assert spec.bytes_moved(r) == pytest.approx(3 * 3.0 * 8 * 128 * 4 + 2 * 3 * 32 * 128 * 2 + exp_pages * 4 + 12)


# ---- the default build holds one kernel per head dim ----------------------------------------------

def test_defaults_build_one_kernel_per_head_dim(task, kernel_build_cache):
    r = build_variants(task, [task.knob_defaults()], kernel_build_cache)["defaults"]
    assert r.ok, r.error_text()
    kernels = [k.name for k in r.kernels]
    assert len(kernels) == 3 and all("paged_decode_kernel" in n for n in kernels), kernels  # head_dim 64, 128, 256
    assert not r.errors and "error" not in r.log_tail.lower()
