"""Registers of a warp-specialised kernel: besides the entry count of `ptxas -v`, the SASS summary and
the build show what `setmaxnreg` sets (USETMAXREG), e.g. "168 regs at entry; setmaxnreg 40 / 232".
Compiled here for sm_90a (no GPU needed); needs nvcc and cuobjdump (the [sass] extra)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import os

import pytest

from tests.session_repo import ROOT
from tools.sass import find_cuobjdump, format_mix, parse_sass

WS_KERNEL = r'''
extern "C" __global__ void __launch_bounds__(384, 1) ws_kernel(float* out) {
  int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    out[threadIdx.x] = 1.f;
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    out[threadIdx.x] = 2.f;
  }
}
'''

LISTING = """
	code for sm_90a
		Function : ws_kernel
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0060*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;
        /*00c0*/                   USETMAXREG.DEALLOC.CTAPOOL 0x28 ;
        /*00d0*/                   EXIT ;
"""


def test_setmaxnreg_values_from_a_listing():
    (k,) = parse_sass(LISTING).values()
    assert k.summary.setmaxnreg == [40, 232]
    assert "registers: setmaxnreg 40 / 232" in format_mix({"ws_kernel": k.summary})


needs_tools = pytest.mark.skipif(shutil.which("nvcc") is None or find_cuobjdump() is None,
                                 reason="needs nvcc and cuobjdump (pip install -e '.[sass]')")


@needs_tools
def test_setmaxnreg_in_the_sass_and_the_build(tmp_path):
    from tools.build import build, format_build
    from tools.sass import sass_mix
    from tools.task import load_task

    task_dir = tmp_path / "t"
    subprocess.run([sys.executable, "-m", "agent.cli", "new", str(task_dir), "--target", "cuda"], check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    task = load_task(task_dir)
    src = task_dir / task.manifest.sources[0]
    src.write_text(WS_KERNEL + src.read_text())

    r = build(task, cache_dir=tmp_path / "cache")
    assert r.ok, r.error_text()
    (k,) = [k for k in r.kernels if k.mangled == "ws_kernel"]
    assert k.setmaxnreg == [40, 232], k
    assert f"ws_kernel: {k.registers} regs at entry; setmaxnreg 40 / 232, " in format_build(r)
    assert all(not other.setmaxnreg for other in r.kernels if other is not k)
    again = build(task, cache_dir=tmp_path / "cache")  # cached: the values are kept with the build
    assert again.cached and [x.setmaxnreg for x in again.kernels] == [x.setmaxnreg for x in r.kernels]

    mix = sass_mix(r.lib)
    assert mix["ws_kernel"].setmaxnreg == [40, 232]
    assert "registers: setmaxnreg 40 / 232" in format_mix(mix)


def test_setmaxnreg_in_the_commit_trailer():
    from agent.session import evidence_trailers

    figures = {"build": {"kernels": [{"name": "void (anonymous namespace)::attn<128>(float*)", "registers": 168,
                                      "spill_store_bytes": 0, "spill_load_bytes": 0, "setmaxnreg": [40, 232]},
                                     {"name": "other(float*)", "registers": 32, "spill_store_bytes": 0,
                                      "spill_load_bytes": 0}]}}
    regs = {k: v for k, v in evidence_trailers(figures, None, "run", 1) if k.startswith("Kloop-Regs")}
    assert sorted(regs.values()) == ["168 regs, spills 0/0 B, setmaxnreg 40 / 232", "32 regs, spills 0/0 B"]
