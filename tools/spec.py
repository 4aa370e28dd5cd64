"""The read-only spec module of a task, and the helpers spec authors use.

A spec module (`spec.py` in the task folder) defines:

    make_inputs(shape: dict, gen: torch.Generator, device: torch.device) -> dict[str, Tensor]
        fresh random inputs for one shape; draw from `gen` only (it is seeded by the harness)
    make_outputs(shape: dict, inputs: dict) -> dict[str, Tensor]
        allocate the outputs the kernel writes (the harness poisons them before every call)
    reference(shape: dict, inputs: dict) -> dict[str, Tensor]
        the expected outputs, computed in higher precision; keys match make_outputs
    launch(lib: ctypes.CDLL, shape: dict, inputs: dict, outputs: dict, stream: int) -> None
        one call into the built library (stream is the cudaStream_t handle, 0 on CPU); it must not
        synchronize, and should raise if the entry point returns an error code

and optionally:

    flops(shape) -> float          floating-point operations of one call (for TFLOP/s)
    bytes_moved(shape) -> float    the fewest bytes one call must move through memory (for GB/s)
    COMPARATORS: dict[str, Callable[[shape, inputs, outputs], None]]
        library ops the kernel would replace, timed the same way (e.g. "torch.softmax")
    setup(lib) -> None             called once after loading the library (argtypes, attributes)

`shape` is the shape's `dims` table from the manifest.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

REQUIRED = ("make_inputs", "make_outputs", "reference", "launch")
OPTIONAL_CALLABLES = ("flops", "bytes_moved", "setup")


class SpecError(Exception):
    """A spec module that cannot be used, or that failed while running; names file and attribute."""


@dataclass
class Spec:
    path: Path
    module: ModuleType
    comparators: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def make_inputs(self, shape, gen, device):
        return self._call("make_inputs", shape, gen, device)

    def make_outputs(self, shape, inputs):
        return self._call("make_outputs", shape, inputs)

    def reference(self, shape, inputs):
        return self._call("reference", shape, inputs)

    def launch(self, lib, shape, inputs, outputs, stream):
        return self.module.launch(lib, shape, inputs, outputs, stream)

    def setup(self, lib) -> None:
        if hasattr(self.module, "setup"):
            self._call("setup", lib)

    def flops(self, shape) -> float | None:
        return float(self._call("flops", shape)) if hasattr(self.module, "flops") else None

    def bytes_moved(self, shape) -> float | None:
        return float(self._call("bytes_moved", shape)) if hasattr(self.module, "bytes_moved") else None

    def _call(self, name: str, *args):
        try:
            return getattr(self.module, name)(*args)
        except SpecError:
            raise
        except Exception as exc:
            raise SpecError(f"{_where(exc, self.path)}: {name}() raised {type(exc).__name__}: {exc}") from exc


def _where(exc: BaseException, path: Path) -> str:
    """`spec.py:LINE` of the innermost frame of the traceback inside the spec file (else the path)."""
    if isinstance(exc, SyntaxError) and exc.lineno and exc.filename and Path(exc.filename).resolve() == Path(path).resolve():
        return f"{path}:{exc.lineno}"
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == Path(path).resolve():
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{path}:{line}" if line else str(path)


def load_spec(path: str | Path) -> Spec:
    """Import the spec module at `path` under a private name and check its interface."""
    path = Path(path).resolve()
    if not path.is_file():
        raise SpecError(f"{path}: spec module does not exist")
    mod_name = f"kloop_spec_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # never a __pycache__ in a task folder
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise SpecError(f"{_where(exc, path)}: importing the spec raised {type(exc).__name__}: {exc}") from exc
    finally:
        sys.dont_write_bytecode = saved
    for name in REQUIRED:
        if not callable(getattr(module, name, None)):
            raise SpecError(f"{path}: attribute {name!r} is missing or not a function (a spec must define {', '.join(REQUIRED)})")
    for name in OPTIONAL_CALLABLES:
        if hasattr(module, name) and not callable(getattr(module, name)):
            raise SpecError(f"{path}: attribute {name!r} must be a function")
    comparators = getattr(module, "COMPARATORS", {}) or {}
    if not isinstance(comparators, dict) or not all(isinstance(k, str) and callable(v) for k, v in comparators.items()):
        raise SpecError(f"{path}: attribute 'COMPARATORS' must be a dict of name -> function(shape, inputs, outputs)")
    return Spec(path=path, module=module, comparators=dict(comparators))


# ---- helpers for spec authors -----------------------------------------------------------------

def ptr(t) -> ctypes.c_void_p:
    """The data pointer of a tensor as a ctypes argument."""
    return ctypes.c_void_p(t.data_ptr())


def check_status(status: int, what: str) -> None:
    """Raise when a kernel entry point returned a non-zero error code (e.g. a cudaError_t)."""
    if status != 0:
        raise RuntimeError(f"{what} returned error code {status}")


def adversarial_rows(gen, n: int, fraction: float, kinds: int = 1) -> list:
    """`kinds` disjoint index tensors into range(n) (rows, columns, heads, sequences...), each about
    `fraction` of n and at least one while n leaves a plain one beside them, at positions drawn from
    `gen`. The harness seeds `gen` with the gate's secret and draws every call's inputs from it, the
    bench shapes' timed calls included: a kernel cannot tell which positions are adversarial in any
    call, so a shortcut that is unsafe there fails the check or the re-check of a timed call.
    (Positions fixed in the spec, like `row % 8`, are read by the agent and skipped by such a kernel.)
    The permutation is drawn whatever n, so a shape's draws stay in step."""
    import torch

    if not 0 < fraction <= 1 or kinds < 1:
        raise ValueError(f"adversarial_rows: fraction {fraction!r} must be in (0, 1] and kinds {kinds!r} >= 1")
    perm = torch.randperm(max(int(n), 0), generator=gen, device=gen.device)
    each = max(1, round(n * fraction))
    room = max(0, n - 1)  # one position stays plain
    return [perm[min(i * each, room):min((i + 1) * each, room)] for i in range(kinds)]
