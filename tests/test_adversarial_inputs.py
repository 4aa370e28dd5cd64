"""Adversarial check inputs (issue 10, item 4) for matmul_cpu, flash_attn_fwd and paged_decode, on the CPU.

Each of these tasks has check shapes whose `inputs` dim names an adversarial kind (spec.py says what
each does). For each task:

- the adversarial shapes are in the manifest, checked and never timed (the bench shapes are untouched);
- the spec draws them from the generator alone (same seed, same inputs) and they have their property
  (scores near +-100, a late max, denormals, ...); the reference on them is finite;
- honest torch versions of the kernel (fp32 math, as the baselines do it) pass them under the task's own
  tolerance and comparison (tools.check.compare, as the gate uses it);
- the hazards are also planted in every shape, the timed ones included, at positions drawn from the
  generator (tools.spec.adversarial_rows): a shortcut kept off the adversarial check shapes, or off
  softmax's old fixed rows (row % 8), fails the ordinary and timed shapes too;
- the key property: a *shortcut* (no max subtraction, a stale running max, an exp2 that wraps, fp16
  pieces of fp32 values, denormals flushed to zero, one owning sequence per KV page) passes every ordinary check shape (those without
  `inputs`; for paged_decode the small ones: the bench shapes it also checks are too large for a CPU
  test) and FAILS every adversarial shape of the kinds it is listed against. So each row is effective:
  the ordinary shapes alone would let that shortcut through.

The CUDA baselines cannot run here: the new rows are for the device (tests/gpu and the gate run every
check shape), and `kloop eval kernels/matmul_cpu --no-bench` runs the real CPU baseline on them
(tests/test_kernels.py::test_starter_passes_its_check does it in CI).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from tests.fakes import KERNELS  # noqa: E402
from tools.check import compare  # noqa: E402
from tools.spec import SpecError, load_spec  # noqa: E402
from tools.task import load_task  # noqa: E402

CPU = torch.device("cpu")
# the adversarial check shapes each task must have: name -> input kind
ADVERSARIAL = {
    "matmul_cpu": {"range": "range", "denormal": "denormal"},
    "flash_attn_fwd": {"d64_s257_large": "large", "d128_s200_large_causal": "large",
                       "d64_s257_ramp": "ramp", "d128_s300_ramp_causal": "ramp"},
    "paged_decode": {"b5_gqa4_large": "large", "b6_gqa4_late": "late", "b4_mha_d64_p8_late_ramp": "late",
                     "b5_gqa4_shared": "shared"},
}
_LOADED: dict = {}


def _load(name: str):
    if name not in _LOADED:
        task = load_task(KERNELS / name)
        _LOADED[name] = (task, load_spec(task.spec_path))
    return _LOADED[name]


def _inputs(name: str, dims: dict, seed: int = 7) -> dict:
    _, spec = _load(name)
    return spec.make_inputs(dims, torch.Generator().manual_seed(seed), CPU)


_CASES: dict = {}


def _case(name: str, shape, seed: int):
    """(inputs, reference) of one check shape and seed, computed once for the whole module."""
    key = (name, shape.name, seed)
    if key not in _CASES:
        x = _inputs(name, shape.dims, seed)
        _CASES[key] = (x, _load(name)[1].reference(shape.dims, x))
    return _CASES[key]


def _passes(name: str, dims: dict, inputs: dict, outputs: dict, ref: dict | None = None) -> bool:
    """The gate's rule (tools.check.compare per reference output, the task's tolerance for it)."""
    task, spec = _load(name)
    ref = spec.reference(dims, inputs) if ref is None else ref
    results = []
    for out, want in ref.items():
        tol = task.tolerance(out)
        results.append(compare(out, outputs.get(out), want, tol.atol, tol.rtol, tol.norm_rtol).passed)
    return all(results)


def _ordinary(name: str):
    task, _ = _load(name)
    shapes = [s for s in task.check_shapes if "inputs" not in s.dims]
    if name == "paged_decode":  # the checked bench shapes and the 32k context are too large here
        shapes = [s for s in shapes if not s.bench and s.dims["batch"] * s.dims["ctx"] <= 16384]
    assert len(shapes) >= 4
    return shapes


def _adversarial(name: str, kinds=None):
    task, _ = _load(name)
    shapes = [s for s in task.check_shapes if "inputs" in s.dims]
    return [s for s in shapes if kinds is None or s.dims["inputs"] in kinds]


# ---- the rows are in the manifests, checked, never timed -----------------------------------------

@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_rows_are_check_shapes(name):
    task, spec = _load(name)
    found = {s.name: s.dims["inputs"] for s in task.manifest.shapes if "inputs" in s.dims}
    assert found == ADVERSARIAL[name]
    for s in task.manifest.shapes:
        if "inputs" in s.dims:
            assert s.check and not s.bench, s.name
            assert s.dims["inputs"] in spec.module.INPUT_KINDS
    assert all("inputs" not in s.dims for s in task.bench_shapes)  # the timed shapes are unchanged
    with pytest.raises(SpecError, match="inputs = 'bogus'"):
        spec.make_inputs(dict(_adversarial(name)[0].dims, inputs="bogus"), torch.Generator().manual_seed(0), CPU)


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_inputs_are_deterministic_and_the_reference_finite(name):
    _, spec = _load(name)
    for s in _adversarial(name):
        a, b, c = _inputs(name, s.dims, 3), _inputs(name, s.dims, 3), _inputs(name, s.dims, 4)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), s.name
        assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point()), s.name
        for t in a.values():
            assert torch.isfinite(t.float()).all(), s.name  # adversarial, but every input a number
        ref = spec.reference(s.dims, a)
        assert all(torch.isfinite(r).all() for r in ref.values()), s.name


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_ordinary_inputs_are_unchanged(name):
    """`inputs` absent = "normal": the same values as before the adversarial kinds existed."""
    _, spec = _load(name)
    dims = dict(_ordinary(name)[0].dims)
    plain = _inputs(name, dims, 9)
    again = _inputs(name, dict(dims, inputs="normal"), 9)
    assert all(torch.equal(plain[k], again[k]) for k in plain)


# ---- what each kind looks like -------------------------------------------------------------------

def _attention_scores(q, k, scale):
    return (q.float() @ k.float().transpose(-1, -2)) * scale


def test_flash_large_and_ramp_scores():
    large = _inputs("flash_attn_fwd", _load("flash_attn_fwd")[0].shape("d64_s257_large").dims)
    s = _attention_scores(large["q"], large["k"], 1 / 8)
    assert s.abs().max() > 89  # past exp's fp32 range
    assert 20 < s.std() < 40
    ramp_shape = _load("flash_attn_fwd")[0].shape("d64_s257_ramp").dims
    ramp = _inputs("flash_attn_fwd", ramp_shape)
    s = _attention_scores(ramp["q"], ramp["k"], 1 / 8)
    row_max = s.amax(-1)
    first_tile = s[..., :128].amax(-1)
    assert (row_max - first_tile > 89).float().mean() > 0.75  # a stale max from any tile size overflows
    assert (s.argmax(-1) >= 192).all()  # the max is in the last key tiles


def test_paged_large_and_late_scores():
    task, spec = _load("paged_decode")
    for name in ("b5_gqa4_large", "b6_gqa4_late"):
        dims = task.shape(name).dims
        x = _inputs("paged_decode", dims)
        scores = _paged_scores(x, dims)  # [b, qh, T], -inf past each length
        finite = scores[torch.isfinite(scores)]
        if name.endswith("large"):
            assert finite.abs().max() > 89 and 20 < finite.std() < 40
        else:
            lens = x["context_lens"].long()
            assert (scores.argmax(-1) == (lens - 1)[:, None]).all()  # the last token wins, every head
            lead = scores.amax(-1) - torch.where(
                torch.arange(scores.shape[-1])[None, None, :] < (lens - 1)[:, None, None], scores,
                torch.full_like(scores, float("-inf"))).amax(-1)
            assert (lead[lens > 1] > 89).all()
            assert (lens > 256).any() and (lens % dims["page_size"] != 0).any()


def test_paged_shared_pages():
    task, spec = _load("paged_decode")
    dims = task.shape("b5_gqa4_shared").dims
    x = _inputs("paged_decode", dims)
    bt = x["block_table"]
    half = bt.shape[1] // 2
    assert half >= 2 and (bt[:, :half] == bt[0, :half]).all()
    rest = bt[:, half:].flatten().tolist() + bt[0, :half].tolist()
    assert len(set(rest)) == len(rest)  # the other entries stay distinct
    # the reference reads a shared page once per sequence: the same as attention over each sequence alone
    ref = spec.reference(dims, x)["out"]
    for i in range(bt.shape[0]):
        one = {k: (v[i : i + 1] if k in ("q", "block_table", "context_lens") else v) for k, v in x.items()}
        alone = spec.reference(dict(dims, batch=1), one)["out"]
        torch.testing.assert_close(ref[i : i + 1], alone)


def test_matmul_range_and_denormal_inputs():
    task, _ = _load("matmul_cpu")
    x = _inputs("matmul_cpu", task.shape("range").dims)
    assert (x["a"] > 0).all() and (x["b"] > 0).all()
    assert x["a"].max() > 65504 and x["b"].min() < 2.0**-24  # beyond fp16 at both ends
    x = _inputs("matmul_cpu", task.shape("denormal").dims)
    tiny = torch.finfo(torch.float32).tiny
    den = (x["a"] != 0) & (x["a"].abs() < tiny)
    assert den.any(dim=0).sum() >= 1 and (x["a"] == 0).all(dim=1).sum() >= 1  # zero rows of A (drawn)
    cols = den.any(dim=0)
    assert (x["a"][:, cols].abs() < tiny).all()  # a denormal column holds no normal value (no overflow)
    assert x["b"][cols].abs().min() > 1e37 and torch.isfinite(x["b"]).all()


# ---- honest fp32 versions pass the adversarial rows; shortcuts pass the ordinary rows only --------

def _attention(q, k, v, causal, scale, *, max_of=None, exp=torch.exp):
    """Softmax attention in fp32 with P rounded to bf16 before P@V (as the baseline): max_of(scores)
    gives the max subtracted (None: the row max; 0: no subtraction), exp the exponential."""
    s = _attention_scores(q, k, scale)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True) if max_of is None else max_of(s)
    p = exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = (p.bfloat16().float() @ v.float()) / l
    return o.bfloat16(), (m + torch.log(l)).squeeze(-1)


def _wrapping_exp(x):
    """exp via 2^floor * 2^frac with the exponent field built by bits and no clamp (Schraudolph style):
    exact in fp32's normal range, wraps around below 2^-126 (x - max < -87)."""
    y = x * math.log2(math.e)
    finite = torch.isfinite(y)
    y = torch.where(finite, y, torch.zeros_like(y))
    i = torch.floor(y)
    bits = ((i.to(torch.int64) + 127) & 0xFF) << 23
    out = torch.exp2(y - i) * bits.to(torch.int32).view(torch.float32)
    return torch.where(finite, out, torch.exp(x))


def _flash(max_of=None, exp=torch.exp):
    def run(dims, x):
        o, lse = _attention(x["q"], x["k"], x["v"], bool(dims["causal"]), 1 / math.sqrt(dims["head_dim"]),
                            max_of=max_of, exp=exp)
        return {"o": o, "lse": lse}
    return run


def _first_tile_max(tile):
    return lambda s: s[..., :tile].amax(-1, keepdim=True)


def _paged_scores(x, dims):
    q, kc, bt, lens = x["q"], x["k_cache"], x["block_table"].long(), x["context_lens"].long()
    b, qh, d = q.shape
    kvh, ps = kc.shape[2], kc.shape[1]
    k = kc[bt].reshape(b, -1, kvh, d).float()  # [b, T, kvh, d]
    s = torch.einsum("bhgd,bthd->bhgt", q.float().reshape(b, kvh, qh // kvh, d), k).reshape(b, qh, -1) / math.sqrt(d)
    valid = torch.arange(s.shape[-1])[None, :] < lens[:, None]
    return s.masked_fill(~valid[:, None, :], float("-inf"))


def _paged(max_of=None, exp=torch.exp, owned_pages_only=False):
    def run(dims, x):
        s = _paged_scores(x, dims)
        if owned_pages_only:  # pool-order kernel: each page credited to the last table entry naming it
            bt = x["block_table"].long()
            owner = torch.full((x["k_cache"].shape[0],), -1, dtype=torch.long)
            owner[bt.flatten()] = torch.arange(bt.numel())  # with repeated pages, one entry wins
            mine = (owner[bt] == torch.arange(bt.numel()).reshape(bt.shape))  # [b, pages]
            ps = x["k_cache"].shape[1]
            s = s.masked_fill(~mine.repeat_interleave(ps, dim=1)[:, None, :], float("-inf"))
        b, qh, d = x["q"].shape
        kvh = x["v_cache"].shape[2]
        v = x["v_cache"][x["block_table"].long()].reshape(b, -1, kvh, d).float()
        m = s.amax(-1, keepdim=True) if max_of is None else max_of(s)
        p = exp(s - m)
        pv = torch.einsum("bhgt,bthd->bhgd", p.reshape(b, kvh, qh // kvh, -1), v).reshape(b, qh, d)
        return {"out": (pv / p.sum(-1, keepdim=True)).bfloat16()}
    return run


def _matmul_seq(dims, x):
    """The baseline's order: one fp32 sum per output, k in order."""
    a, b = x["a"], x["b"]
    c = torch.zeros(a.shape[0], b.shape[1])
    for kk in range(a.shape[1]):
        c = c + a[:, kk : kk + 1] * b[kk : kk + 1, :]
    return {"c": c}


def _fp16_pieces(dims, x):
    """fp32 emulated by fp16 hi + lo pieces (three products, fp32 sums): ~22 mantissa bits, fp16's range."""
    def split(t):
        hi = t.half().float()
        return hi, (t - hi).half().float()
    ah, al = split(x["a"])
    bh, bl = split(x["b"])
    return {"c": ah @ bh + (ah @ bl + al @ bh)}


def _flush_denormals(dims, x):
    tiny = torch.finfo(torch.float32).tiny
    a, b = (torch.where(t.abs() < tiny, torch.zeros_like(t), t) for t in (x["a"], x["b"]))
    return {"c": a @ b}


HONEST = [
    ("flash_attn_fwd", "fp32_row_max", _flash()),
    ("flash_attn_fwd", "fp32_exp2", _flash(exp=lambda t: torch.exp2(t * math.log2(math.e)))),
    ("paged_decode", "fp32_row_max", _paged()),
    ("matmul_cpu", "fp32_in_order", _matmul_seq),
    ("matmul_cpu", "fp32_torch", lambda dims, x: {"c": x["a"] @ x["b"]}),
]

# (task, shortcut, implementation, the input kinds it must fail on)
SHORTCUTS = [
    ("flash_attn_fwd", "no_max_subtraction", _flash(max_of=lambda s: torch.zeros_like(s[..., :1])), {"large", "ramp"}),
    ("flash_attn_fwd", "stale_max_tile64", _flash(max_of=_first_tile_max(64)), {"ramp"}),
    ("flash_attn_fwd", "stale_max_tile128", _flash(max_of=_first_tile_max(128)), {"ramp"}),
    ("flash_attn_fwd", "wrapping_exp2", _flash(exp=_wrapping_exp), {"large", "ramp"}),
    ("paged_decode", "no_max_subtraction", _paged(max_of=lambda s: torch.zeros_like(s[..., :1])), {"large", "late"}),
    ("paged_decode", "stale_max_first_page", _paged(max_of=_first_tile_max(8)), {"late"}),
    ("paged_decode", "stale_max_first_partition", _paged(max_of=_first_tile_max(256)), {"late"}),
    ("paged_decode", "wrapping_exp2", _paged(exp=_wrapping_exp), {"large"}),
    ("paged_decode", "one_owner_per_page", _paged(owned_pages_only=True), {"shared"}),
    ("matmul_cpu", "fp16_pieces", _fp16_pieces, {"range", "denormal"}),
    ("matmul_cpu", "flush_denormals", _flush_denormals, {"denormal"}),
]


@pytest.mark.parametrize("name,label,impl", HONEST, ids=[f"{n}-{lbl}" for n, lbl, _ in HONEST])
def test_honest_versions_pass_every_row(name, label, impl):
    for s in _ordinary(name) + _adversarial(name):
        for seed in (1, 2):
            x, ref = _case(name, s, seed)
            assert _passes(name, s.dims, x, impl(s.dims, x), ref), (label, s.name, seed)


# input kinds the specs also plant in every shape, the timed ones included, at positions drawn from the
# secret-seeded generator (tools.spec.adversarial_rows): a shortcut they catch fails ordinary shapes too
PLANTED = {"matmul_cpu": {"range", "denormal"}, "flash_attn_fwd": {"large", "ramp"}, "paged_decode": {"large", "late"}}


@pytest.mark.parametrize("name,label,impl,kinds", SHORTCUTS, ids=[f"{n}-{lbl}" for n, lbl, _, _ in SHORTCUTS])
def test_shortcut_fails_adversarial_rows_and_planted_ordinary_ones(name, label, impl, kinds):
    targets = _adversarial(name, kinds)
    assert targets
    for s in targets:
        for seed in (1, 2, 3):
            x, ref = _case(name, s, seed)
            assert not _passes(name, s.dims, x, impl(s.dims, x), ref), f"{label} passes adversarial {s.name} (seed {seed})"
    passed = [s.name for s in _ordinary(name) if _passes(name, s.dims, *(lambda c: (c[0], impl(s.dims, c[0]), c[1]))(_case(name, s, 1)))]
    if kinds & PLANTED[name]:  # no longer only where the check shapes are known to be adversarial
        assert len(passed) < len(_ordinary(name)), f"{label} passes every ordinary shape: {passed}"
    else:
        assert len(passed) == len(_ordinary(name)), f"{label} already fails ordinary shapes"


def _unless_check_only(shortcut, honest, check_only_dims):
    """A kernel that knows the manifest: exact on the adversarial check shapes (by their sizes), the
    shortcut everywhere else, the timed shapes included."""
    def run(dims, x):
        key = tuple(sorted((k, v) for k, v in dims.items() if k != "inputs"))
        return honest(dims, x) if key in check_only_dims else shortcut(dims, x)
    return run


@pytest.mark.parametrize("label,shortcut", [("fp16_pieces", _fp16_pieces), ("flush_denormals", _flush_denormals)])
def test_a_matmul_shortcut_kept_off_the_adversarial_check_shapes_fails_the_timed_ones(label, shortcut):
    """Before the hazards were planted in every shape, such a kernel passed every check (the adversarial
    shapes got the exact path) and the re-checks of its timed calls (the bench shapes held N(0,1) only)."""
    task, _ = _load("matmul_cpu")
    check_only = {tuple(sorted((k, v) for k, v in s.dims.items() if k != "inputs")) for s in _adversarial("matmul_cpu")}
    kernel = _unless_check_only(shortcut, lambda d, x: {"c": x["a"] @ x["b"]}, check_only)
    for s in _adversarial("matmul_cpu"):
        x, ref = _case("matmul_cpu", s, 1)
        assert _passes("matmul_cpu", s.dims, x, kernel(s.dims, x), ref), s.name
    for s in task.bench_shapes:
        for seed in (1, 2, 3):
            x, ref = _case("matmul_cpu", s, seed)
            assert not _passes("matmul_cpu", s.dims, x, kernel(s.dims, x), ref), f"{label} passes timed {s.name} (seed {seed})"


def test_a_softmax_shortcut_kept_off_the_old_fixed_rows_fails():
    """softmax's adversarial rows sat at row % 8 in (1, 2, 3), which the agent can read in spec.py: a
    kernel taking the safe path there and skipping the max subtraction elsewhere passed. The rows now
    sit where the secret seed puts them, in every shape (the bench shapes' timed calls too)."""
    task = load_task(KERNELS / "softmax")
    spec = load_spec(task.spec_path)
    tol = task.tolerance("y")

    def kernel(x):
        xf = x.float()
        safe = torch.softmax(xf, -1)
        e = torch.exp(xf)  # no max subtraction: overflows on large and flat rows
        fast = e / e.sum(-1, keepdim=True)
        old_rows = (torch.arange(x.shape[0]) % 8 >= 1) & (torch.arange(x.shape[0]) % 8 <= 3)
        return torch.where(old_rows[:, None], safe, fast).bfloat16()

    shapes = [s for s in task.check_shapes if s.dims["rows"] * s.dims["cols"] <= 1 << 20 and s.dims["rows"] >= 8]
    assert shapes
    failed = 0
    for s in shapes:
        x = spec.make_inputs(s.dims, torch.Generator().manual_seed(11), CPU)
        failed += not compare("y", kernel(x["x"]), spec.reference(s.dims, x)["y"], tol.atol, tol.rtol, tol.norm_rtol).passed
    assert failed == len(shapes), f"the old-position shortcut passed {len(shapes) - failed} of {len(shapes)} shapes"
