"""The CUDA runtime cheat corpus (tests/cheats/cu_*.cu): each file replaces the softmax task's
softmax.cu. Shared by the CPU test (they build and get past the static rules and the audit) and the
GPU test (a naive harness is fooled, the gate is not).

A cheat's task folder is the shipped task with the cheat as softmax.cu, plus three headers (the task's
`*.cuh` are editable): `cu_common.cuh` (tests/cheats), `softmax_baseline.cuh`, the shipped
softmax.cu itself, which the cheats that need the baseline bit for bit include under another entry
point name, `libc_resolve.cuh` (tests/cheats/rt_libc_resolve.h: any libc function without an import) and
`side_tail.cuh` (the side-stream tail both cu_side_tail cheats share).
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "kernels" / "softmax"
CHEATS = Path(__file__).resolve().parent / "cheats"
CU_CHEATS = sorted(CHEATS.glob("cu_*.cu"))
HEADERS = {"cu_common.cuh": CHEATS / "cu_common.cuh", "softmax_baseline.cuh": TASK / "softmax.cu",
           "libc_resolve.cuh": CHEATS / "rt_libc_resolve.h", "side_tail.cuh": CHEATS / "cu_side_tail.cuh"}


def kind_of(path: Path) -> str:
    m = re.search(r"^// kind: (\S+)", path.read_text(), re.M)
    assert m, f"{path}: no '// kind: ...' line"
    return m.group(1)


def cheat_tree(dest: Path, cheat: Path) -> Path:
    """The shipped task folder with `cheat` as its softmax.cu and the corpus' headers beside it."""
    shutil.copytree(TASK, dest)
    shutil.copyfile(cheat, dest / "softmax.cu")
    for name, src in HEADERS.items():
        shutil.copyfile(src, dest / name)
    return dest


def candidates(gate, tmp: Path, cheats: list[Path]):
    """name -> gate Candidate of each cheat (its changed files: softmax.cu and the headers)."""
    from agent.gate import Candidate

    out = {}
    for p in cheats:
        folder = cheat_tree(tmp / p.stem, p)
        changed = [f"{gate.task_rel}/{n}" for n in ("softmax.cu", *HEADERS)]
        out[p.stem] = Candidate(task_dir=folder, changed=changed)
    return out


def build_all(gate, cands: dict, jobs: int | None = None) -> dict:
    """name -> BuildResult, built in parallel through the gate's own build (trusted tree + editable files)."""
    names = list(cands)
    with ThreadPoolExecutor(max_workers=jobs or min(8, max(2, os.cpu_count() or 2))) as pool:
        results = list(pool.map(lambda n: gate.build(cands[n]), names))
    return dict(zip(names, results))
