"""The runner's side of a Triton task: load a bundle's cubins with the CUDA driver and launch them.

`TritonModule(bundle)` is what a Triton task's `spec.launch` gets as `lib` (tools/libhost.py loads it
where a CUDA task's library would be loaded with ctypes): no Triton import, no candidate Python, only
the driver API through ctypes on the libcuda torch already loaded (cuModuleLoadData, cuModuleGetFunction,
cuFuncSetAttribute for dynamic shared memory past 48 KiB, cuLaunchKernel on the runner's stream).

The launch follows the task's trusted manifest (the bundle's records come from it): every parameter's
type, the ":16" divisibility promised at compile time (checked here before every launch: a pointer
or an integer that breaks it is an error, never a silently wrong kernel), then the pointers Triton
appends (global scratch, profile scratch: allocated here, zeroed before every launch so nothing
survives between calls in them, or NULL when the kernel needs none).
"""

from __future__ import annotations

import base64
import ctypes
import json
from pathlib import Path

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
DEFAULT_SHARED_LIMIT = 48 * 1024
_INT_TYPES = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
              "i64": ctypes.c_int64, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16, "u32": ctypes.c_uint32,
              "u64": ctypes.c_uint64}
_FLOAT_TYPES = {"fp32": ctypes.c_float, "fp64": ctypes.c_double}


class TritonLaunchError(RuntimeError):
    pass


_DRIVER = None


def driver():
    """libcuda (the copy torch loaded: RTLD_NOLOAD first), with the few entry points used here typed."""
    global _DRIVER
    if _DRIVER is None:
        import os

        try:
            lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
        except OSError:
            lib = ctypes.CDLL("libcuda.so.1")
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, args in (("cuModuleLoadData", [ctypes.POINTER(vp), ctypes.c_char_p]),
                           ("cuModuleGetFunction", [ctypes.POINTER(vp), vp, ctypes.c_char_p]),
                           ("cuFuncSetAttribute", [vp, ctypes.c_int, ctypes.c_int]),
                           ("cuFuncGetAttribute", [ctypes.POINTER(ctypes.c_int), ctypes.c_int, vp]),
                           ("cuLaunchKernel", [vp, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                               ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, vp,
                                               ctypes.POINTER(vp), ctypes.POINTER(vp)]),
                           ("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        if hasattr(lib, "cuFuncGetParamInfo"):  # CUDA >= 12.4: each parameter's offset and size
            lib.cuFuncGetParamInfo.argtypes = [vp, sz, ctypes.POINTER(sz), ctypes.POINTER(sz)]
            lib.cuFuncGetParamInfo.restype = ctypes.c_int
        _DRIVER = lib
    return _DRIVER


def _check(status: int, what: str) -> None:
    if status != 0:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(status, ctypes.byref(msg))
        raise TritonLaunchError(f"{what}: CUDA error {status} ({(msg.value or b'?').decode()})")


def param_sizes(function) -> list[int] | None:
    """The byte size of each parameter the loaded kernel takes (None where the driver cannot say)."""
    lib = driver()
    if not hasattr(lib, "cuFuncGetParamInfo"):
        return None
    sizes = []
    off, size = ctypes.c_size_t(), ctypes.c_size_t()
    while lib.cuFuncGetParamInfo(function, len(sizes), ctypes.byref(off), ctypes.byref(size)) == 0:
        sizes.append(size.value)
        if len(sizes) > 4096:
            break
    return sizes


def _size_of(ty: str) -> int:
    base = ty.partition(":")[0]
    if base.startswith("*"):
        return 8
    return ctypes.sizeof(_INT_TYPES.get(base) or _FLOAT_TYPES[base])


class TritonKernel:
    """One compiled variant: `constexprs` (knobs and variant values it was built with), `launch`."""

    def __init__(self, record: dict, device):
        import torch

        self.record = record
        self.label = record["label"]
        self.constexprs = dict(record["constexprs"])
        self.num_warps = int(record["num_warps"])
        self.types = list(record["types"])
        self.shared = int(record["shared"])
        self.extra = int(record["extra_params"])
        self.device = device
        self._module, self._function = ctypes.c_void_p(), ctypes.c_void_p()
        data = base64.b64decode(record["cubin"])
        self._image = ctypes.create_string_buffer(data, len(data))  # kept alive with the module
        _check(driver().cuModuleLoadData(ctypes.byref(self._module), self._image), f"{self.label}: cuModuleLoadData")
        _check(driver().cuModuleGetFunction(ctypes.byref(self._function), self._module, record["kernel"].encode()),
               f"{self.label}: cuModuleGetFunction")
        if self.shared > DEFAULT_SHARED_LIMIT:
            _check(driver().cuFuncSetAttribute(self._function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                               self.shared), f"{self.label}: {self.shared} B of dynamic shared memory")
        want = [_size_of(t) for t in self.types] + [8] * self.extra
        have = param_sizes(self._function)
        if have is not None and have != want:
            raise TritonLaunchError(f"{self.label}: the cubin's kernel takes parameters of {have} bytes; "
                                    f"the task's signature makes {want}")
        self._scratch = {}  # (size, align, grid) -> tensor
        self._torch = torch

    def _scratch_ptr(self, per_program: int, align: int, programs: int, slot: str) -> int:
        if per_program <= 0:
            return 0
        key = (slot, programs)
        buf = self._scratch.get(key)
        n = per_program * programs + max(align, 1)
        if buf is None or buf.numel() < n:
            buf = self._torch.empty(n, dtype=self._torch.uint8, device=self.device)
            self._scratch[key] = buf
        buf.zero_()  # on the current (the runner's) stream: nothing a kernel left here reaches its next call
        p = buf.data_ptr()
        return p + (-p) % max(align, 1)

    def launch(self, grid, args: list, stream: int) -> None:
        """Launch over `grid` (1 to 3 ints) with `args` in the signature's order (tensors for pointers)."""
        grid = [int(g) for g in grid] + [1] * (3 - len(grid))
        if len(grid) != 3 or min(grid) < 0:
            raise TritonLaunchError(f"{self.label}: bad grid {grid}")
        if len(args) != len(self.types):
            raise TritonLaunchError(f"{self.label}: {len(args)} arguments for {len(self.types)} parameters")
        if 0 in grid:
            return
        values = []
        for i, (ty, a) in enumerate(zip(self.types, args)):
            base, _, div = ty.partition(":")
            if base.startswith("*"):
                v = a.data_ptr() if hasattr(a, "data_ptr") else int(a)
                if hasattr(a, "device") and a.device.type != self.device.type:
                    raise TritonLaunchError(f"{self.label}: argument {i} is on {a.device}, not {self.device}")
                c = ctypes.c_uint64(v)
            elif base in _INT_TYPES:
                v = int(a)
                c = _INT_TYPES[base](v)
                if c.value != v:
                    raise TritonLaunchError(f"{self.label}: argument {i} = {v} does not fit {base}")
            else:
                v = float(a)
                c = _FLOAT_TYPES[base](v)
            if div and v % int(div):
                raise TritonLaunchError(f"{self.label}: argument {i} = {v:#x} is not divisible by {div}, as the "
                                        "signature promised the compiler")
            values.append(c)
        programs = grid[0] * grid[1] * grid[2]
        r = self.record
        scratch = [self._scratch_ptr(r["global_scratch_size"], r["global_scratch_align"], programs, "global"),
                   self._scratch_ptr(r["profile_scratch_size"], r["profile_scratch_align"], programs, "profile")]
        values += [ctypes.c_uint64(p) for p in scratch[:self.extra]]
        params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        _check(driver().cuLaunchKernel(self._function, grid[0], grid[1], grid[2], 32 * self.num_warps, 1, 1,
                                       self.shared, ctypes.c_void_p(stream or None), params, None),
               f"{self.label}: cuLaunchKernel")


class TritonModule:
    """A loaded bundle (tools/triton_build.py): `kernel(name, **variant)` picks a compiled variant."""

    def __init__(self, path: str | Path, device=None):
        import torch

        data = json.loads(Path(path).read_text())
        if data.get("format") != "kloop-triton-1":
            raise TritonLaunchError(f"{path}: not a kloop Triton bundle")
        self.path = str(path)
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":
            torch.cuda.current_stream()  # the primary context current on this thread before the driver calls
        self.knobs = data.get("knobs", {})
        self.kernels = [TritonKernel(r, self.device) for r in data["kernels"]]

    def kernel(self, name: str, **variant) -> TritonKernel:
        for k in self.kernels:
            if k.record["kernel"] == name and all(_same(k.record["variant"].get(n), v) for n, v in variant.items()) \
                    and set(variant) == set(k.record["variant"]):
                return k
        have = [k.label for k in self.kernels]
        raise TritonLaunchError(f"no compiled variant {name}{variant} (built: {have})")


def _same(a, b) -> bool:
    return a == b and (isinstance(a, bool) == isinstance(b, bool))
