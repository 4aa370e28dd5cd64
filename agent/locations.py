"""Where kloop finds what it ships (tasks, prompts) and where it keeps a user's run records.

Shipped files: in a checkout (and an editable install) they are the top-level `kernels/` and
`prompts/` folders beside `agent/`; a built install (`pip install .`) carries the same folders as
package data under `agent/_shipped/` (pyproject.toml maps them there).

Run records (first that applies):

1. `--runs-dir`, then `$KLOOP_RUNS`;
2. `<repo>/.kloop/runs`, where `<repo>` is the git repository holding the task (a task of your
   own in your repository);
3. for a shipped task (named like `matmul_cpu`, which lives inside kloop, not in a repository of
   yours) and for commands without a task (`kloop runs`, `log`, `show`, ...): `<repo>/.kloop/runs`
   of the repository holding the current directory;
4. otherwise `~/.kloop/runs`.

kloop adds `/.kloop/` to that repository's `.git/info/exclude` (never to your `.gitignore`), so the
records and the session worktrees (`<runs>/_worktrees/<run-id>`) never show as untracked.

A session needs a repository to commit to, and kloop's own files are never it: a shipped task is
copied into a repository of its own, `<runs>/_tasks/<name>` (created on first use, brought up to
date when kloop ships a newer version), and its `kloop/<run-id>` branches live there.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
WORKTREES = "_worktrees"  # <runs>/_worktrees/<run-id>: a session's worktree
RUNS_ENV = "KLOOP_RUNS"
KLOOP_DIR = ".kloop"
SHIPPED_TASKS_REPOS = "_tasks"
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")


def shipped(name: str) -> Path:
    """The shipped folder `name` ('kernels' or 'prompts'): installed package data, else the checkout's."""
    installed = PACKAGE_DIR / "_shipped" / name
    return installed if installed.is_dir() else PACKAGE_DIR.parent / name


def shipped_tasks_dir() -> Path:
    return shipped("kernels")


def prompts_dir() -> Path:
    return shipped("prompts")


def is_shipped_task(task_dir: Path) -> bool:
    return Path(task_dir).resolve().is_relative_to(shipped_tasks_dir().resolve())


def default_runs_root(task_dir: Path | None = None, cwd: Path | None = None) -> Path:
    """Where run records go when no --runs-dir is given (see the module docstring)."""
    from agent.workspace import find_repo

    env = os.environ.get(RUNS_ENV)
    if env:
        return Path(env).expanduser().resolve()
    # inside a session's worktree (where a shell session works), the runs folder that holds it: the
    # worktree is a repository too, with no records of its own
    here = session_runs_root(Path(cwd or Path.cwd()))
    if here is not None:
        return here
    if task_dir is not None and not is_shipped_task(task_dir) and Path(task_dir).exists():
        repo = find_repo(Path(task_dir))
        if repo is not None:
            return repo / KLOOP_DIR / "runs"
    repo = find_repo(Path(cwd or Path.cwd()))
    if repo is not None:
        return repo / KLOOP_DIR / "runs"
    return Path.home() / KLOOP_DIR / "runs"


def session_runs_root(path: Path) -> Path | None:
    """The runs folder whose session worktree (`<runs>/_worktrees/<run-id>`) holds `path`, or None."""
    try:
        path = Path(path).resolve()
    except OSError:
        return None
    for inner in (path, *path.parents):
        outer = inner.parent
        if outer.name == WORKTREES and outer.parent != outer and (outer.parent / inner.name / "run.json").is_file():
            return outer.parent
    return None


class RunsFolderError(Exception):
    """The runs folder cannot be made or written (a user's error: exit 2); the message names it."""


def prepare_runs_root(runs_root: Path) -> Path:
    """Create the runs folder; when it lies in a repository's `.kloop/`, make git ignore `.kloop/`
    there (through `.git/info/exclude`)."""
    from agent.workspace import ensure_excluded, find_repo

    runs_root = Path(runs_root).expanduser().resolve()
    try:
        runs_root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=runs_root).close()  # writable (a read-only mount, another user's folder)
    except OSError as exc:
        raise RunsFolderError(f"the runs folder {runs_root} cannot be written ({exc.strerror or exc}); "
                              "pass --runs-dir a folder you can write to") from None
    repo = find_repo(runs_root)
    if repo is not None:
        rel = runs_root.relative_to(repo)
        if rel.parts and rel.parts[0] == KLOOP_DIR:
            ensure_excluded(repo, f"/{KLOOP_DIR}/")
    return runs_root


def task_repo_for(task_dir: Path, runs_root: Path) -> Path:
    """The folder a session of `task_dir` runs on: the task itself, or for a shipped task its
    copy in a repository of its own under the runs folder (see the module docstring)."""
    task_dir = Path(task_dir).resolve()
    if not is_shipped_task(task_dir):
        return task_dir
    from agent import __version__
    from agent.workspace import commit_all, ensure_excluded, init_repo, is_clean

    repo = Path(runs_root).resolve() / SHIPPED_TASKS_REPOS / task_dir.name
    fresh = not (repo / ".git").exists()
    if fresh:
        repo.mkdir(parents=True, exist_ok=True)
        init_repo(repo)
        ensure_excluded(repo, "__pycache__/")  # a spec imported from here must not make the task dirty
    if fresh or (is_clean(repo) and not _same_files(task_dir, repo)):
        for child in repo.iterdir():  # replace the task's files, keep the repository
            if child.name != ".git":
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        shutil.copytree(task_dir, repo, symlinks=True, ignore=_SKIP, dirs_exist_ok=True)
        commit_all(repo, f"Shipped task {task_dir.name} as of kloop {__version__}\n\n"
                         f"Copied from {task_dir}; kloop/<run-id> branches hold the sessions' accepted changes.\n")
    return repo


def _same_files(a: Path, b: Path) -> bool:
    """Whether folders a and b hold the same files (kloop's bookkeeping and caches aside)."""
    cmp = filecmp.dircmp(a, b, ignore=[".git", "__pycache__"])

    def same(c: filecmp.dircmp) -> bool:
        if c.left_only or c.right_only or c.funny_files:
            return False
        _, mismatch, errors = filecmp.cmpfiles(c.left, c.right, c.common_files, shallow=False)
        return not mismatch and not errors and all(same(s) for s in c.subdirs.values())

    return same(cmp)
