"""Fused residual add + RMSNorm in Triton, bf16 (the "fused_add_rms_norm" of a decoder layer):

    h = x + residual                          (bf16 out: the next layer's residual)
    y = h / sqrt(mean(h^2) + eps) * weight    (bf16 out), h and the statistics in fp32

A plain baseline: one program per row, two passes over the row in chunks of BLOCK columns. Pass 1
adds, stores h and accumulates the sum of squares; pass 2 loads x and residual again, recomputes h in
fp32 and writes y. The launch is the task's (task.toml [triton], spec.py): grid = (rows,), rows of
`hidden` contiguous elements. Knobs: BLOCK (constexpr), NUM_WARPS, ROW_IN_REGISTERS (constexpr: where
the row fits one chunk, keep h in registers and skip the second read of x and residual).
"""

import triton
import triton.language as tl


@triton.jit
def add_rmsnorm(X, R, W, H, Y, hidden, eps, BLOCK: tl.constexpr, ROW_IN_REGISTERS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * hidden
    if ROW_IN_REGISTERS:
        if hidden <= BLOCK:  # the row in one chunk: h stays in registers, x and residual are read once
            one_chunk(X, R, W, H, Y, base, hidden, eps, BLOCK)
        else:
            two_passes(X, R, W, H, Y, base, hidden, eps, BLOCK)
    else:
        two_passes(X, R, W, H, Y, base, hidden, eps, BLOCK)


@triton.jit
def one_chunk(X, R, W, H, Y, base, hidden, eps, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    h = tl.load(X + base + cols, mask=ok, other=0.0).to(tl.float32) + tl.load(R + base + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(H + base + cols, h.to(tl.bfloat16), mask=ok)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / hidden + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + base + cols, (h * rstd * w).to(tl.bfloat16), mask=ok)


@triton.jit
def two_passes(X, R, W, H, Y, base, hidden, eps, BLOCK: tl.constexpr):
    sumsq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < hidden
        h = tl.load(X + base + cols, mask=ok, other=0.0).to(tl.float32) + tl.load(R + base + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(H + base + cols, h.to(tl.bfloat16), mask=ok)
        sumsq += h * h
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, 0) / hidden + eps)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < hidden
        h = tl.load(X + base + cols, mask=ok, other=0.0).to(tl.float32) + tl.load(R + base + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + base + cols, (h * rstd * w).to(tl.bfloat16), mask=ok)
