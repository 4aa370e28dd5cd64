"""matmul_cpu: fp32 C = A @ B, reference in float64 (adversarial input kinds: below)."""

import ctypes

import torch

from tools.spec import check_status, ptr


# Inputs are N(0, 1) unless the shape's `inputs` dim names an adversarial kind (check shapes only):
#     "range"     every entry positive (uniform in [0.5, 1)), the rows of A and the columns of B each scaled
#                 by a power of two drawn from 2^-40..2^40: products span ~2^-80..2^80, far outside fp16's
#                 range (a kernel that splits fp32 into fp16 pieces, or converts to fp16 anywhere, gets inf
#                 or zeros). Positive entries: no cancellation, so an honest fp32 kernel keeps its usual
#                 relative error (~1e-6) at every scale and the tolerance is unchanged.
#     "denormal"  an eighth of A's columns are fp32 denormals (~1e-39) and the matching rows of B are
#                 ~1e38, so each of those products is 0.025..0.1: a kernel that flushes denormals to zero
#                 (FTZ/DAZ, fast-math) loses them; every seventh row of A is zero (its row of C must be 0).
#                 No product of a normal A entry with a huge B entry exists, so nothing overflows in fp32.
# Power-of-two scales are exact in fp32, and the float64 reference sees the very same fp32 values.
INPUT_KINDS = ("normal", "range", "denormal")
RANGE_EXP = 40  # rows of A / columns of B scaled by 2^e, e uniform in [-RANGE_EXP, RANGE_EXP]
DENORMAL = 1e-39  # below fp32's smallest normal (1.18e-38)
HUGE = 1e38  # below fp32's largest (3.4e38); DENORMAL * HUGE = 0.1


def input_kind(shape) -> str:
    kind = str(shape.get("inputs", "normal"))
    if kind not in INPUT_KINDS:
        raise ValueError(f"inputs = {kind!r}: expected one of {INPUT_KINDS}")
    return kind


def make_inputs(shape, gen, device):
    m, n, k = shape["m"], shape["n"], shape["k"]
    kind = input_kind(shape)
    gd = gen.device
    a = torch.randn(m, k, generator=gen, device=gd, dtype=torch.float32)
    b = torch.randn(k, n, generator=gen, device=gd, dtype=torch.float32)
    if kind == "range":
        a = torch.rand(m, k, generator=gen, device=gd).mul_(0.5).add_(0.5)
        b = torch.rand(k, n, generator=gen, device=gd).mul_(0.5).add_(0.5)
        a.mul_(torch.exp2(torch.randint(-RANGE_EXP, RANGE_EXP + 1, (m, 1), generator=gen, device=gd).float()))
        b.mul_(torch.exp2(torch.randint(-RANGE_EXP, RANGE_EXP + 1, (1, n), generator=gen, device=gd).float()))
    elif kind == "denormal":
        cols = torch.randperm(k, generator=gen, device=gd)[: max(1, k // 8)]
        mag_a = torch.rand(m, len(cols), generator=gen, device=gd).mul_(0.5).add_(0.5)
        mag_b = torch.rand(len(cols), n, generator=gen, device=gd).mul_(0.5).add_(0.5)
        a[:, cols] = torch.where(a[:, cols] < 0, -mag_a, mag_a) * DENORMAL
        b[cols, :] = torch.where(b[cols, :] < 0, -mag_b, mag_b) * HUGE
        a[1::7] = 0
    return {"a": a.to(device), "b": b.to(device)}


def make_outputs(shape, inputs):
    return {"c": torch.empty(shape["m"], shape["n"], dtype=torch.float32, device=inputs["a"].device)}


def reference(shape, inputs):
    return {"c": (inputs["a"].double() @ inputs["b"].double())}


def setup(lib):
    lib.kloop_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    lib.kloop_matmul.restype = ctypes.c_int


def launch(lib, shape, inputs, outputs, stream):
    status = lib.kloop_matmul(ptr(inputs["a"]), ptr(inputs["b"]), ptr(outputs["c"]), shape["m"], shape["n"], shape["k"])
    check_status(status, "kloop_matmul")


def flops(shape):
    return 2.0 * shape["m"] * shape["n"] * shape["k"]


def bytes_moved(shape):
    m, n, k = shape["m"], shape["n"], shape["k"]
    return 4.0 * (m * k + k * n + m * n)


def _torch_matmul(shape, inputs, outputs):
    torch.matmul(inputs["a"], inputs["b"], out=outputs["c"])


COMPARATORS = {"torch.matmul": _torch_matmul}
