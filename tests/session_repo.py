"""A user's repository for the outside-agent tests (MCP, shell commands): a copy of matmul_cpu whose
baseline computes the product four times, so that dropping copies is a gain of x2 or more at any
machine load (never a small, noisy one), with small bench shapes so the gate decides in seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import git

from tests.fakes import commit_all

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "kernels" / "matmul_cpu"
KEY = "sk-test-kloop-never-shown-0123456789abcdef"  # set as ANTHROPIC_API_KEY in servers' environments

ONCE = "  matmul_ijk(A, B, C, M, N, K);\n"
WASTE = [f"  matmul_ijk(A, B, C, M, N, K);  // waste {i}\n" for i in (1, 2, 3)]


def make_repo(tmp: Path) -> Path:
    """tmp/userrepo with kernels/matmul_cpu committed; returns the task folder."""
    repo = tmp / "userrepo"
    task = repo / "kernels" / "matmul_cpu"
    shutil.copytree(TASK, task)
    src = task / "matmul.cpp"
    text = src.read_text()
    assert "#else\n" + ONCE + "#endif" in text
    src.write_text(text.replace("#else\n" + ONCE + "#endif", "#else\n" + ONCE + "".join(WASTE) + "#endif"))
    manifest = task / "task.toml"
    text = manifest.read_text()
    for old, new in [("m = 192, n = 192, k = 192", "m = 48, n = 64, k = 48"), ("m = 96, n = 320, k = 128", "m = 32, n = 96, k = 40")]:
        assert old in text
        text = text.replace(old, new)
    manifest.write_text(text.replace("timeout_s = 120", "timeout_s = 60"))
    (repo / ".gitignore").write_text("runs/\n")
    commit_all(repo)
    return task


def drop_waste(text: str, which: list[int]) -> str:
    """The kernel source without the given waste lines (1, 2, 3)."""
    for i in which:
        assert WASTE[i - 1] in text
        text = text.replace(WASTE[i - 1], "")
    return text


def accepted_commits(repo: Path, branch: str, base: str) -> list[str]:
    return [c.summary for c in git.Repo(repo).iter_commits(f"{base}..{branch}")]
