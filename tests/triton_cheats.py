"""The Triton cheat corpus (tests/cheats/triton/tr_*.py): each file replaces the rmsnorm_triton task's
rmsnorm.py. Its docstring starts `kind: static|audit|check. expect: TEXT`: the gate layer that must
reject it, and a phrase of the reason. Shared by the CPU test (static and audit kinds rejected there,
check kinds get past both) and the GPU test (check kinds rejected at the check on the H200).

Kinds that a Triton kernel cannot express, so have no file: work on another stream, a host thread,
work after return, a graph, a persisting-L2 window (there is no host code: the launch is the trusted
runner's, tools/triton_launch.py), and a cache in Triton's global scratch (zeroed before every launch;
tests/test_triton_tasks.py shows it).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "kernels" / "rmsnorm_triton"
TR_CHEATS = sorted((Path(__file__).resolve().parent / "cheats" / "triton").glob("tr_*.py"))


def kind_of(path: Path) -> tuple[str, str]:
    m = re.search(r'^"""kind: (\w+)\. expect: ([^.]+)\.', path.read_text(), re.M)
    assert m, f"{path}: no 'kind: ... expect: ...' docstring"
    return m.group(1), m.group(2)


def candidates(gate, tmp: Path, cheats: list[Path]) -> dict:
    """name -> gate Candidate of each cheat (the shipped task with the cheat as rmsnorm.py)."""
    from agent.gate import Candidate

    out = {}
    for p in cheats:
        folder = tmp / p.stem
        shutil.copytree(TASK, folder)
        shutil.copyfile(p, folder / "rmsnorm.py")
        out[p.stem] = Candidate(task_dir=folder, changed=[f"{gate.task_rel}/rmsnorm.py"])
    return out
