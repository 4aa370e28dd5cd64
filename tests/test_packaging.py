"""`pip install .` works: the shipped tasks and prompts come with the package, records go beside
the user's repository (never into site-packages or kloop's checkout), and a shipped task runs
from any directory in a repository of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from agent import locations
from agent.locations import default_runs_root, prepare_runs_root, task_repo_for

ROOT = Path(__file__).resolve().parents[1]
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_AUTHOR_NAME": "T", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "T", "GIT_COMMITTER_EMAIL": "t@x"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def user_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("mine\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "initial")
    return path


def test_every_package_is_listed():
    """pyproject lists its packages (for the package-data mapping): a new subpackage must be added."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {p.parent.relative_to(ROOT).as_posix().replace("/", ".")
             for top in ("agent", "tools") for p in (ROOT / top).rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"


# -- where records go ------------------------------------------------------------------------------

def test_runs_root_defaults(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("KLOOP_RUNS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    mine = user_repo(tmp_path / "mine")
    (mine / "kernels" / "t").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shipped = locations.shipped_tasks_dir() / "matmul_cpu"

    # a task of the user's: its repository, wherever the command runs
    assert default_runs_root(mine / "kernels" / "t", cwd=elsewhere) == mine.resolve() / ".kloop" / "runs"
    # a shipped task or no task: the current directory's repository, else ~/.kloop/runs
    assert default_runs_root(shipped, cwd=mine / "kernels") == mine.resolve() / ".kloop" / "runs"
    assert default_runs_root(None, cwd=mine) == mine.resolve() / ".kloop" / "runs"
    assert default_runs_root(shipped, cwd=elsewhere) == tmp_path / "home" / ".kloop" / "runs"
    monkeypatch.setenv("KLOOP_RUNS", str(tmp_path / "r"))
    assert default_runs_root(mine / "kernels" / "t") == (tmp_path / "r").resolve()


def test_runs_root_is_git_ignored_through_info_exclude(tmp_path: Path):
    mine = user_repo(tmp_path / "mine")
    (mine / ".gitignore").write_text("*.o\n")
    git(mine, "add", ".gitignore")
    git(mine, "commit", "-q", "-m", "ignore")
    runs = prepare_runs_root(mine / ".kloop" / "runs")
    (runs / "r1").mkdir()
    (runs / "r1" / "run.json").write_text("{}")
    prepare_runs_root(mine / ".kloop" / "runs")  # twice: one rule
    assert git(mine, "status", "--porcelain", "--untracked-files=all") == ""
    assert (mine / ".git" / "info" / "exclude").read_text().count("/.kloop/") == 1
    assert (mine / ".gitignore").read_text() == "*.o\n"  # the user's .gitignore is not edited


def test_shipped_task_gets_a_repository_of_its_own(tmp_path: Path, monkeypatch):
    shipped = tmp_path / "shipped"
    (shipped / "demo").mkdir(parents=True)
    (shipped / "demo" / "task.toml").write_text('name = "demo"\n')
    (shipped / "demo" / "__pycache__").mkdir()
    (shipped / "demo" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    monkeypatch.setattr(locations, "shipped_tasks_dir", lambda: shipped)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    runs = tmp_path / "runs"

    repo = task_repo_for(shipped / "demo", runs)
    assert repo == (runs / "_tasks" / "demo").resolve()
    assert git(repo, "ls-files").split() == ["task.toml"]
    first = git(repo, "rev-parse", "HEAD")
    (repo / "__pycache__").mkdir()
    (repo / "__pycache__" / "spec.cpython-311.pyc").write_bytes(b"\0")  # a spec imported from the copy
    assert git(repo, "status", "--porcelain") == ""
    assert task_repo_for(shipped / "demo", runs) == repo and git(repo, "rev-parse", "HEAD") == first  # reused
    (shipped / "demo" / "task.toml").write_text('name = "demo"\n# v2\n')  # kloop ships a newer version
    task_repo_for(shipped / "demo", runs)
    assert git(repo, "rev-parse", "HEAD^") == first and "# v2" in (repo / "task.toml").read_text()
    (repo / "task.toml").write_text("the user's own edit\n")  # a dirty copy is left as the user made it
    task_repo_for(shipped / "demo", runs)
    assert (repo / "task.toml").read_text() == "the user's own edit\n"
    user_task = tmp_path / "mine" / "t"
    assert task_repo_for(user_task, runs) == user_task.resolve()  # a user's task runs where it is


# -- a real install ---------------------------------------------------------------------------------

INSTALLED_CHECK = r"""
import json, os, sys
from pathlib import Path
import agent, agent.prompts as prompts
from agent.locations import default_runs_root, shipped_tasks_dir
from agent.policies.base import Budget
from agent.session import Session
out = {"agent": agent.__file__, "prompts_dir": str(prompts.PROMPTS_DIR),
       "system_cpu": prompts.system_prompt("cpu")[:200], "briefing_fields": prompts.template_fields(),
       "runs_root_here": str(default_runs_root(shipped_tasks_dir() / "matmul_cpu"))}
s = Session.start(shipped_tasks_dir() / "matmul_cpu", "test", Budget())   # from a user's repository
out.update(record=str(s.record.dir), task_repo=str(s.ws.repo_root), branch=s.ws.branch, worktree=str(s.ws.path))
s.close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """kloop built and installed (not editable) into a folder of its own, from a copy of the sources."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    for name in ("agent", "tools", "kernels", "prompts"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    target = tmp / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-compile", "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return target


def run_installed(target: Path, cwd: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KLOOP_RUNS", "PYTHONPATH")}
    env.update(GIT_ENV, PYTHONPATH=str(target), HOME=str(home))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # ~15 s: a real build and install
def test_installed_package_ships_tasks_and_prompts(installed: Path, tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    proc = run_installed(installed, work, home, "-m", "agent.cli", "tasks", "--json")
    assert proc.returncode == 0, proc.stderr
    tasks = {t["name"]: t for t in json.loads(proc.stdout)}
    assert {"matmul_cpu", "softmax", "flash_attn_fwd", "paged_decode"} <= set(tasks)
    assert all(Path(t["path"]).is_relative_to(installed) for t in tasks.values())

    mine = user_repo(tmp_path / "mine")
    proc = run_installed(installed, mine, home, "-c", INSTALLED_CHECK)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["agent"]).is_relative_to(installed)  # the installed copy, not this checkout
    assert Path(out["prompts_dir"]) == installed / "agent" / "_shipped" / "prompts"
    assert out["system_cpu"] == (ROOT / "prompts" / "system.md").read_text()[:200]
    assert "task_name" in out["briefing_fields"]
    runs = mine.resolve() / ".kloop" / "runs"
    assert Path(out["runs_root_here"]) == runs
    assert Path(out["record"]).parent == runs and (Path(out["record"]) / "run.json").is_file()
    assert Path(out["task_repo"]) == runs / "_tasks" / "matmul_cpu"
    assert git(Path(out["task_repo"]), "rev-parse", "--verify", out["branch"])
    assert not any(Path(out[k]).is_relative_to(installed) for k in ("record", "task_repo", "worktree"))
    assert git(mine, "status", "--porcelain", "--untracked-files=all") == ""  # .kloop/ is ignored
    assert git(mine, "branch", "--list").split() == ["*", "main"]  # no branch in the user's repository

    # outside any repository: ~/.kloop/runs
    proc = run_installed(installed, tmp_path / "work", home, "-c",
                         "from agent.locations import default_runs_root; print(default_runs_root())")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == home / ".kloop" / "runs"


def test_every_flag_kloop_suggests_is_in_the_readme():
    """An error that says 'pass --allow-dirty' points at a flag a reader can look up."""
    import re

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    suggested = set()
    for path in sorted((root / "agent").glob("*.py")) + sorted((root / "tools").glob("*.py")):
        suggested |= set(re.findall(r"\b(?:pass|use|with) (--[a-z][a-z-]+)", path.read_text()))
    assert "--allow-dirty" in suggested
    assert not {f for f in suggested if f not in readme}
