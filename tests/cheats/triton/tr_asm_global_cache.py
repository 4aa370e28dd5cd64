"""kind: audit. expect: device-state. An output cache across calls: a module-scope .global counter declared in inline PTX
(call counting: honest for the first calls, then skip). The cubin audit refuses any module-scope device data."""
import triton
import triton.language as tl


@triton.jit
def add_rmsnorm(X, R, W, H, Y, hidden, eps, BLOCK: tl.constexpr):
    n = tl.inline_asm_elementwise("{ .global .align 4 .u32 kloop_calls; .reg .u32 t; ld.global.u32 t, [kloop_calls]; add.u32 t, t, 1; st.global.u32 [kloop_calls], t; mov.b32 $0, t; }", "=r,r", [tl.program_id(0)], dtype=tl.int32, is_pure=False, pack=1)
    if n > 1000000:
        return
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
