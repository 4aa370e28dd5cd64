"""The shipped CPU demo's gain is structural, not luck: with every C++ compiler on this machine, at the
manifest's flags, the i-k-j knob compiles to packed SIMD arithmetic and the baseline to scalar code.

No timing here (a timed gain is noise on a loaded machine); the gate's own trials measure it
(`bench/gate_cpu_trials.py` in CI).
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tools.build import build
from tools.task import load_task

ROOT = Path(__file__).resolve().parents[1]
COMPILERS = [c for c in ("g++", "clang++") if shutil.which(c)]
PACKED = re.compile(r"\b(v?(mul|add|fmadd\d*)ps)\b")  # packed single-precision multiply/add/FMA
SCALAR = re.compile(r"\b(v?(mul|add|fmadd\d*)ss)\b")


def kernel_asm(lib: str) -> str:
    """The disassembly of the library's code (the kernel is its only non-trivial function)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    return subprocess.run([objdump, "-d", "--no-show-raw-insn", lib], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(not COMPILERS, reason="no C++ compiler")
@pytest.mark.parametrize("cxx", COMPILERS)
def test_ikj_knob_vectorises_and_baseline_does_not(cxx, tmp_path, monkeypatch):
    if platform.machine() != "x86_64":
        pytest.skip("the instruction names checked are x86-64's")
    monkeypatch.setenv("CXX", cxx)
    task = load_task(ROOT / "kernels" / "matmul_cpu")
    base = build(task, {"LOOP_ORDER": 0}, cache_dir=tmp_path)
    fast = build(task, {"LOOP_ORDER": 1}, cache_dir=tmp_path)
    assert base.ok and fast.ok, (base.error_text(), fast.error_text())
    base_asm, fast_asm = kernel_asm(base.lib), kernel_asm(fast.lib)
    assert PACKED.search(fast_asm), f"{cxx}: the i-k-j knob did not vectorise"
    assert not PACKED.search(base_asm) and SCALAR.search(base_asm), f"{cxx}: the baseline is not the scalar loop"

