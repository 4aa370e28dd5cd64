"""kind: check. expect: large. The sum of squares accumulated in fp16: close enough on randn rows, inf on the "large" ones (~3e4 each)."""
import triton
import triton.language as tl


@triton.jit
def add_rmsnorm(X, R, W, H, Y, hidden, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * hidden
    sumsq = tl.zeros([BLOCK], dtype=tl.float16)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < hidden
        h = tl.load(X + base + cols, mask=ok, other=0.0).to(tl.float32) + tl.load(R + base + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(H + base + cols, h.to(tl.bfloat16), mask=ok)
        sumsq += (h * h).to(tl.float16)
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq.to(tl.float32), 0) / hidden + eps)
    for start in range(0, hidden, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < hidden
        h = tl.load(X + base + cols, mask=ok, other=0.0).to(tl.float32) + tl.load(R + base + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + base + cols, (h * rstd * w).to(tl.bfloat16), mask=ok)
