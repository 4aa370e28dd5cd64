"""The Triton kernel of tools/fused_compare.py, in a module of its own: imported only where it is used
(importing triton costs the CLI and CPU judges about a second)."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])
def compare_kernel(g_ptr, w_ptr, out_ptr, n, atol, rtol, scale_floor, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    inf = float("inf")
    aw = tl.abs(w)
    ref_finite = (w == w) & (aw != inf)
    got_finite = (g == g) & (tl.abs(g) != inf)
    matched = (~ref_finite) & (g == w)
    nonfinite = (~got_finite) & (~matched) & inside
    d = tl.abs(g - w)
    d = tl.where(d == d, d, inf)  # a NaN difference is an infinite error
    diff = tl.where(ref_finite, d, tl.where(matched, 0.0, inf))
    bound = atol + rtol * tl.where(ref_finite, aw, 0.0)
    bad = (diff > bound) & inside
    finite_diff = tl.where(ref_finite & inside, diff, 0.0)
    rel = finite_diff / tl.maximum(aw, scale_floor)
    wf = tl.where(ref_finite & inside, w, 0.0).to(tl.float64)
    fd = finite_diff.to(tl.float64)
    base = out_ptr + pid.to(tl.int64) * 7  # _FIGURES
    tl.store(base + 0, tl.sum(nonfinite.to(tl.float64), axis=0))
    tl.store(base + 1, tl.sum(bad.to(tl.float64), axis=0))
    tl.store(base + 2, tl.max(finite_diff, axis=0).to(tl.float64))
    tl.store(base + 3, tl.max(rel, axis=0).to(tl.float64))
    tl.store(base + 4, tl.sum(wf * wf, axis=0))
    tl.store(base + 5, tl.sum(fd * fd, axis=0))
    tl.store(base + 6, tl.sum((ref_finite & inside).to(tl.float64), axis=0))
