"""`kloop new`: a task folder a user can fill in, correct and evaluable from the first minute.

The starter kernel is a scaled vector add (y = alpha * x + y0): trivial, but it exercises the whole
path (manifest, spec, ctypes call, check, timing) so the user changes one working thing at a time.
"""

from __future__ import annotations

from pathlib import Path

MANIFEST = """\
name = "{name}"
description = "TODO: what the kernel computes. Starter: out = alpha * x + y (fp32)."
target = "{target}"
{arch_line}spec = "spec.py"
sources = ["{source}"]
editable = ["{source}", "*.h", "*.cuh"]
flags = ["-O3", "-std=c++17"]
min_gain = 0.01        # a change must be at least 1% faster (the lower bound of the workload speedup) to land
max_regression = 0.03  # no bench shape may get more than 3% slower
timeout_s = 120

# knobs: tunable constants passed as -DNAME=VALUE; the first value is the default
[knobs]
{knob_name} = {knob_values}

[tolerance]
atol = 1e-6
rtol = 1e-5

# check shapes: include sizes that are not multiples of any tile or vector width
[[shapes]]
name = "tiny"
dims = {{ n = 1 }}

[[shapes]]
name = "odd"
dims = {{ n = 1001 }}

[[shapes]]
name = "big"
dims = {{ n = {big} }}
bench = true
"""

SPEC = '''\
"""Spec of task {name}: inputs, reference, the call into the built library, FLOP/byte counts."""

import ctypes

import torch

from tools.spec import check_status, ptr


def make_inputs(shape, gen, device):
    n = shape["n"]
    x = torch.randn(n, generator=gen, device=gen.device).to(device)
    y = torch.randn(n, generator=gen, device=gen.device).to(device)
    return {{"x": x, "y": y}}


def make_outputs(shape, inputs):
    return {{"out": torch.empty_like(inputs["x"])}}


ALPHA = 1.5


def reference(shape, inputs):
    return {{"out": ALPHA * inputs["x"].double() + inputs["y"].double()}}


def setup(lib):
    lib.kloop_axpy.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    lib.kloop_axpy.restype = ctypes.c_int


def launch(lib, shape, inputs, outputs, stream):
    status = lib.kloop_axpy(ptr(inputs["x"]), ptr(inputs["y"]), ptr(outputs["out"]), ALPHA, shape["n"],
                            ctypes.c_void_p(stream))
    check_status(status, "kloop_axpy")


def flops(shape):
    return 2.0 * shape["n"]


def bytes_moved(shape):
    return 3 * 4.0 * shape["n"]  # read x and y, write out


def _torch(shape, inputs, outputs):
    torch.add(inputs["y"], inputs["x"], alpha=ALPHA, out=outputs["out"])


COMPARATORS = {{"torch.add": _torch}}
'''

CUDA_SOURCE = """\
// Starter kernel: out = alpha * x + y. Replace with yours; keep the extern "C" entry point.
#include <cuda_runtime.h>

#ifndef THREADS
#define THREADS 256
#endif

__global__ void axpy_kernel(const float* __restrict__ x, const float* __restrict__ y, float* __restrict__ out,
                            float alpha, int n) {
  for (long i = blockIdx.x * (long)THREADS + threadIdx.x; i < n; i += (long)gridDim.x * THREADS)
    out[i] = alpha * x[i] + y[i];
}

extern "C" int kloop_axpy(const float* x, const float* y, float* out, float alpha, int n, cudaStream_t stream) {
  if (n <= 0) return 0;
  int blocks = (int)((n + THREADS - 1) / THREADS);
  if (blocks > 65535 * 8) blocks = 65535 * 8;
  axpy_kernel<<<blocks, THREADS, 0, stream>>>(x, y, out, alpha, n);
  return (int)cudaGetLastError();
}
"""

CPU_SOURCE = """\
// Starter kernel: out = alpha * x + y. Replace with yours; keep the extern "C" entry point.
#ifndef UNROLL
#define UNROLL 1
#endif

extern "C" int kloop_axpy(const float* x, const float* y, float* out, float alpha, int n, void* /*stream*/) {
  if (n < 0) return 1;
  int i = 0;
  for (; i + UNROLL <= n; i += UNROLL)
    for (int u = 0; u < UNROLL; ++u) out[i + u] = alpha * x[i + u] + y[i + u];
  for (; i < n; ++i) out[i] = alpha * x[i] + y[i];
  return 0;
}
"""

README = """\
# {name}

Scaffolded by `kloop new`. Fill in, then `kloop eval {folder}`.

- `task.toml`: what may change (`editable`), how to build (`flags`, `knobs`), the shapes (checked and timed),
  the tolerance and the gate's thresholds (`min_gain`, `max_regression`).
- `spec.py` (read-only for agents): inputs from a seeded generator, the reference in higher precision, the
  ctypes call into the built library, FLOP and byte counts, comparators.
- `{source}`: the kernel, with a plain `extern "C"` entry point.
"""


def scaffold(folder: Path, target: str, name: str | None = None) -> list[Path]:
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder}: exists and is not empty; pick a new folder")
    name = name or folder.resolve().name
    if not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
        raise ValueError(f"task name {name!r}: use letters, digits, '_', '-' and '.'")
    cuda = target == "cuda"
    source = "kernel.cu" if cuda else "kernel.cpp"
    files = {
        "task.toml": MANIFEST.format(
            name=name, target=target, source=source, arch_line='arch = "sm_90a"\n' if cuda else "",
            knob_name="THREADS" if cuda else "UNROLL", knob_values="[256, 128, 512, 1024]" if cuda else "[1, 4, 8]",
            big=1 << 26 if cuda else 1 << 20),
        "spec.py": SPEC.format(name=name),
        source: CUDA_SOURCE if cuda else CPU_SOURCE,
        "README.md": README.format(name=name, folder=folder, source=source),
    }
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for rel, text in files.items():
        path = folder / rel
        path.write_text(text)
        written.append(path)
    return written
