"""Spec of the `softmax` task: row softmax of a bf16 matrix (read-only: the gate trusts this file).

    y[r, :] = softmax(x[r, :]) = exp(x[r, :] - max(x[r, :])) / sum(exp(x[r, :] - max(x[r, :])))

x and y are contiguous row-major (rows, cols) bf16 tensors. The reference is computed in fp32 from
the same bf16 inputs; the kernel's bf16 outputs are compared with it using the task's tolerance.

Entry point (softmax.cu):
    extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols,
                                 cudaStream_t stream);   // returns a cudaError_t, 0 on success
"""

from __future__ import annotations

import ctypes

import torch

from tools.spec import adversarial_rows, check_status, ptr

# Inputs are N(0, 1) * INPUT_SCALE. With a spread of 4 a row's largest terms dominate (the top
# probability of a 4096-wide row is typically 0.1 to 0.9) while the rest span ~1e-16 to 1e-3: the
# softmax is far from flat, and far from a one-hot too. Every value stays a normal fp32/bf16 number.
INPUT_SCALE = 4.0


def _dims(shape: dict) -> tuple[int, int]:
    return int(shape["rows"]), int(shape["cols"])


# Adversarial rows, so range and precision shortcuts fail the check, in every shape and call (bench
# shapes' timed calls included, whose outputs the gate re-checks at random): about an eighth of the rows
# each, at positions drawn from the secret-seeded generator (tools.spec.adversarial_rows: a kernel
# cannot know which rows they are; one row always stays plain, and a 1-row matrix is plain):
#   large: N(0,1)*1000: x - max reaches several thousand below 0, far below exp's fp32 range (-87): an
#      exp that wraps there, or a softmax without the max subtraction, fails;
#   flat: every entry the same value N(0,1)*100: every output 1/cols, exactly the case where a sum kept
#      in bf16 stalls (256 + 1 == 256) and exp(x) without the max overflows;
#   masked: about a quarter of the entries -inf, one random entry always finite: exp(-inf) must give 0,
#      never NaN.
# Every honest fp32 kernel (expf, exp2f/ex2.approx with a pre-scaled log2(e), online softmax) computes
# these as the reference does up to bf16 rounding, so the task's tolerance is unchanged.
ADVERSARIAL_FRACTION = 1 / 8
LARGE_SCALE = 1000.0
FLAT_SCALE = 100.0
MASKED_FRACTION = 0.25


def make_inputs(shape: dict, gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    rows, cols = _dims(shape)
    x = torch.randn((rows, cols), generator=gen, device=gen.device, dtype=torch.float32)
    x.mul_(INPUT_SCALE)
    if rows > 1 and cols > 0:
        large, flat, masked = adversarial_rows(gen, rows, ADVERSARIAL_FRACTION, kinds=3)
        x[large] *= LARGE_SCALE / INPUT_SCALE
        x[flat] = (torch.randn((len(flat), 1), generator=gen, device=gen.device) * FLAT_SCALE).expand(len(flat), cols)
        n = len(masked)
        drop = torch.rand((n, cols), generator=gen, device=gen.device) < MASKED_FRACTION
        keep = torch.randint(0, cols, (n, 1), generator=gen, device=gen.device)
        drop.scatter_(1, keep, False)
        x[masked] = x[masked].masked_fill_(drop, float("-inf"))
    return {"x": x.to(device=device, dtype=torch.bfloat16).contiguous()}


def make_outputs(shape: dict, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    rows, cols = _dims(shape)
    return {"y": torch.empty((rows, cols), dtype=torch.bfloat16, device=inputs["x"].device)}


def reference(shape: dict, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # fp32 math on the bf16 inputs: its error (~1e-7 relative) is far below bf16 output rounding (2^-9)
    return {"y": torch.softmax(inputs["x"].float(), dim=-1)}


def setup(lib: ctypes.CDLL) -> None:
    fn = lib.kloop_softmax
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int


def launch(lib: ctypes.CDLL, shape: dict, inputs: dict, outputs: dict, stream: int) -> None:
    rows, cols = _dims(shape)
    status = lib.kloop_softmax(ptr(inputs["x"]), ptr(outputs["y"]), rows, cols, ctypes.c_void_p(stream or None))
    check_status(status, "kloop_softmax")


def flops(shape: dict) -> float:
    # per element: max compare, subtract, exp, add to the sum, multiply by 1/sum (exp counted as one op)
    rows, cols = _dims(shape)
    return 5.0 * rows * cols


def bytes_moved(shape: dict) -> float:
    # the minimum: read x once, write y once, 2 bytes each
    rows, cols = _dims(shape)
    return 2.0 * 2.0 * rows * cols


def _torch_softmax(shape: dict, inputs: dict, outputs: dict) -> None:
    # torch.softmax(x, -1) on bf16 (fp32 math inside), written straight into y (no extra copy)
    torch.ops.aten._softmax.out(inputs["x"], -1, False, out=outputs["y"])


COMPARATORS = {"torch.softmax": _torch_softmax}
