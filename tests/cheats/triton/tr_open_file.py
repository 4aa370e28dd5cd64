"""kind: static. expect: a literal or tl.constexpr(literal). A file read at import: its text compiled into the kernel."""
import triton
import triton.language as tl

LEAK = tl.constexpr(open('/etc/hostname').read())


@triton.jit
def add_rmsnorm(X, R, W, H, Y, hidden, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * hidden
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
