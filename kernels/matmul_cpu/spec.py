"""matmul_cpu: fp32 C = A @ B, reference in float64."""

import ctypes

import torch

from tools.spec import check_status, ptr


def make_inputs(shape, gen, device):
    m, n, k = shape["m"], shape["n"], shape["k"]
    a = torch.randn(m, k, generator=gen, device=gen.device, dtype=torch.float32).to(device)
    b = torch.randn(k, n, generator=gen, device=gen.device, dtype=torch.float32).to(device)
    return {"a": a, "b": b}


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
