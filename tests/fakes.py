"""Shared test doubles and fixtures' building blocks: a user's repository holding a task, a session
port for the agent tools, a toy CUDA task folder. (The fake Messages API lives in tests/fake_anthropic.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import git
import pytest

from tools.base import ToolBox
from tools.spec import load_spec
from tools.task import Task, load_task

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
CPU_TASK = KERNELS / "matmul_cpu"


def make_repo(tmp: Path, timeout_s: int = 20, task: Path = CPU_TASK) -> Path:
    """A user's repository holding a copy of a task (default the CPU task) under kernels/<name>,
    committed; a short worker timeout so that hang tests end quickly."""
    repo = tmp / "userrepo"
    shutil.copytree(task, repo / "kernels" / task.name)
    manifest = repo / "kernels" / task.name / "task.toml"
    manifest.write_text(manifest.read_text().replace("timeout_s = 120", f"timeout_s = {timeout_s}"))
    (repo / ".gitignore").write_text("runs/\n")
    commit_all(repo)
    return repo


def commit_all(repo: Path, message: str = "task") -> git.Repo:
    """`git init` (if needed) with a test identity, then commit everything in `repo`."""
    r = git.Repo.init(repo)
    with r.config_writer() as cw:
        cw.set_value("user", "name", "Test User")
        cw.set_value("user", "email", "test@example.invalid")
    r.git.add(A=True)
    r.index.commit(message)
    return r


def fake_port(task: Task, notes_path: Path, files_root: Path | None = None, **more) -> SimpleNamespace:
    """A `tools.port.SessionPort` for tool tests: the task doubles as its trusted copy."""
    return SimpleNamespace(task=task, trusted_dir=task.root, files_root=files_root or task.root, notes_path=notes_path,
                           device=None, **more)


TOY_MANIFEST = """
name = "toy"
description = "a toy task"
target = "cuda"
sources = ["kernel.cu"]
editable = ["kernel.cu", "*.cuh", "extra/*.cu"]

[[shapes]]
name = "small"
dims = { n = 16 }
bench = true
"""

TOY_KERNEL = "".join(f"// line {i}\n" for i in range(1, 11)) + "__global__ void k(float* x) { x[0] = 1.0f; }\n"


def toy_task_env(tmp_path: Path, tools) -> SimpleNamespace:
    """A toy CUDA task folder (kernel.cu editable, helper.h read-only, an `outside` folder beside it)
    with `tools` bound to a fake port: box, root, outside, ctx."""
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    (task_dir / "task.toml").write_text(TOY_MANIFEST)
    (task_dir / "spec.py").write_text("# the spec\n")
    (task_dir / "kernel.cu").write_text(TOY_KERNEL)
    (task_dir / "helper.h").write_text("#pragma once\n")
    (task_dir / "extra").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the reference answer\n")
    task = load_task(task_dir)
    ctx = fake_port(task, tmp_path / "run" / "notes.md")
    box = ToolBox(ctx)
    for t in tools:
        box.add(t)
    return SimpleNamespace(box=box, root=task.root, outside=outside, ctx=ctx)


def task_fixtures(name: str):
    """Module-scoped `task` and `spec` fixtures for the shipped task kernels/<name>:
    `task, spec = task_fixtures("softmax")` at the top of a task's test file."""

    @pytest.fixture(scope="module")
    def task():
        return load_task(KERNELS / name)

    @pytest.fixture(scope="module")
    def spec(task):
        return load_spec(task.spec_path)

    return task, spec
