"""The gate's verdict (and so the run record) carries the SASS instruction mix of what it built."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.gate import Candidate, Gate
from tools.sass import find_cuobjdump

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None or find_cuobjdump() is None, reason="needs nvcc and cuobjdump")
def test_verdict_figures_carry_the_sass_mix(tmp_path):
    task = tmp_path / "softmax"
    shutil.copytree(ROOT / "kernels" / "softmax", task)
    gate = Gate(task, ".")
    v = gate.evaluate(Candidate(task, []), best=None)  # with no GPU the check cannot run; the build is analysed anyway
    assert v.build is not None and v.build.ok, v.reason
    figures = v.figures()
    (name, mix), = figures["sass"].items()
    assert name == v.build.kernels[0].mangled and "softmax_rows" in mix["kernel"]
    assert mix["total"] == sum(mix["families"].values()) > 100
    assert mix["memory"].get("LDG.16", 0) > 0 and "LDG.128" not in mix["memory"]  # the baseline's scalar loads
    assert figures["sass_error"] is None


def test_cpu_builds_have_no_sass(tmp_path):
    task = tmp_path / "matmul_cpu"
    shutil.copytree(ROOT / "kernels" / "matmul_cpu", task)
    v = Gate(task, ".").evaluate(Candidate(task, []), best=None)
    assert v.build is not None and v.build.ok
    assert v.figures()["sass"] == {} and v.figures()["sass_error"] is None
