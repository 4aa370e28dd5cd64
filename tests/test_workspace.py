"""agent.workspace against real git repositories in tmp_path: the user's checkout never moves."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from agent.workspace import Workspace, WorkspaceError

GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}


def git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    out = subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, input=input, env={**os.environ, **GIT_ENV}
    )
    return out.stdout.decode()


@pytest.fixture(autouse=True)
def _isolated_git(monkeypatch):
    # the user's ~/.gitconfig (signing, hooks, aliases) must not leak into the tests
    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "user repo"  # a space in the path on purpose
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "Test User")
    git(root, "config", "user.email", "test@example.com")
    task = root / "kernels" / "demo"
    task.mkdir(parents=True)
    (task / "task.toml").write_text('name = "demo"\n')
    (task / "spec.py").write_text("REF = 1\n")
    (task / "kernel.cu").write_text("__global__ void k() {}\n")
    (root / "README.md").write_text("hello\n")
    (root / ".gitignore").write_text("/worktrees/\n*.o\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "initial")
    return root


def user_state(root: Path) -> dict:
    """Everything of the user's checkout that kloop must leave as it was."""
    files = {}
    for p in sorted(root.rglob("*")):
        if ".git" in p.relative_to(root).parts or "worktrees" in p.relative_to(root).parts:
            continue
        if p.is_file():
            files[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    gitdir = root / ".git"
    return {
        "HEAD": (gitdir / "HEAD").read_bytes(),
        "head_sha": git(root, "rev-parse", "HEAD"),
        "main": git(root, "rev-parse", "refs/heads/main"),
        "index": (gitdir / "index").read_bytes(),
        "status": git(root, "--no-optional-locks", "status", "--porcelain", "--untracked-files=all"),
        "files": files,
    }


def make_dirty_outside_task(root: Path) -> None:
    (root / "README.md").write_text("hello, edited but not committed\n")
    (root / "scratch.txt").write_text("untracked\n")
    (root / "staged.txt").write_text("staged\n")
    git(root, "add", "staged.txt")


# -- create ------------------------------------------------------------------------------------


def test_create_leaves_user_checkout_untouched(repo: Path, tmp_path: Path):
    make_dirty_outside_task(repo)
    before = user_state(repo)
    ws = Workspace.create(repo / "kernels" / "demo", "r1", tmp_path / "wt")

    assert ws.repo_root == repo.resolve()
    assert ws.base_commit == before["head_sha"].strip()
    assert ws.branch == "kloop/r1"
    assert ws.path == (tmp_path / "wt" / "r1").resolve()
    assert ws.task_rel == "kernels/demo"
    assert ws.task_path == ws.path / "kernels" / "demo"
    assert (ws.task_path / "kernel.cu").read_text() == "__global__ void k() {}\n"
    assert ws.head() == ws.base_commit
    # changes outside the task folder are not part of the base
    assert (ws.path / "README.md").read_text() == "hello\n"
    assert not (ws.path / "scratch.txt").exists()

    # work in the worktree: edit, commit, edit, restore
    (ws.task_path / "kernel.cu").write_text("__global__ void k() { /* faster */ }\n")
    sha = ws.commit("faster")
    (ws.task_path / "junk.cu").write_text("junk\n")
    ws.restore()
    assert git(repo, "rev-parse", "refs/heads/kloop/r1").strip() == sha
    assert user_state(repo) == before


def test_not_a_git_repo(tmp_path: Path):
    folder = tmp_path / "loose"
    folder.mkdir()
    with pytest.raises(WorkspaceError, match="not inside a git repository"):
        Workspace.create(folder, "r1", tmp_path / "wt")


def test_dirty_task_refused_naming_files(repo: Path, tmp_path: Path):
    (repo / "kernels" / "demo" / "kernel.cu").write_text("edited\n")
    (repo / "kernels" / "demo" / "new helper.cuh").write_text("new\n")
    (repo / "kernels" / "demo" / "build.o").write_text("ignored\n")
    before = user_state(repo)
    with pytest.raises(WorkspaceError) as err:
        Workspace.create(repo / "kernels" / "demo", "r1", tmp_path / "wt")
    msg = str(err.value)
    assert "kernels/demo/kernel.cu" in msg
    assert "kernels/demo/new helper.cuh" in msg
    assert "build.o" not in msg  # ignored files are not part of the task
    assert "--allow-dirty" in msg
    assert "kloop/r1" not in git(repo, "branch", "--list")
    assert user_state(repo) == before


def test_allow_dirty_snapshots_task_folder(repo: Path, tmp_path: Path):
    task = repo / "kernels" / "demo"
    (task / "kernel.cu").write_text("dirty content\n")
    (task / "extra.cuh").write_text("untracked content\n")
    (task / "spec.py").unlink()
    make_dirty_outside_task(repo)
    before = user_state(repo)
    head = before["head_sha"].strip()

    ws = Workspace.create(task, "r2", tmp_path / "wt", allow_dirty=True)

    assert ws.base_commit != head
    assert git(repo, "rev-parse", f"{ws.base_commit}^").strip() == head
    assert git(repo, "show", f"{ws.base_commit}:kernels/demo/kernel.cu") == "dirty content\n"
    assert git(repo, "show", f"{ws.base_commit}:kernels/demo/extra.cuh") == "untracked content\n"
    assert "spec.py" not in git(repo, "ls-tree", "--name-only", ws.base_commit, "kernels/demo/")
    # only the task folder is snapshot: staged/dirty files elsewhere are not
    assert git(repo, "show", f"{ws.base_commit}:README.md") == "hello\n"
    assert "staged.txt" not in git(repo, "ls-tree", "--name-only", ws.base_commit)
    assert (ws.task_path / "kernel.cu").read_text() == "dirty content\n"
    assert ws.head() == ws.base_commit
    assert user_state(repo) == before  # index bytes, HEAD, branch, files


def test_task_at_repo_root_and_branch_reuse(repo: Path, tmp_path: Path):
    ws = Workspace.create(repo, "root", tmp_path / "wt")
    assert ws.task_rel == "."
    assert ws.task_path == ws.path
    with pytest.raises(WorkspaceError, match="already exists"):
        Workspace.create(repo, "root", tmp_path / "wt2")


def test_worktree_location_checks(repo: Path, tmp_path: Path):
    with pytest.raises(WorkspaceError, match="not ignored"):
        Workspace.create(repo / "kernels" / "demo", "r1", repo / "kernels")
    with pytest.raises(WorkspaceError, match="inside"):
        Workspace.create(repo / "kernels" / "demo", "r1", repo / ".git" / "kloop-worktrees")
    # an ignored folder inside the repository is fine
    ws = Workspace.create(repo / "kernels" / "demo", "r1", repo / "worktrees")
    assert ws.path == (repo / "worktrees" / "r1").resolve()
    assert git(repo, "status", "--porcelain") == ""


# -- diff, changes, restore, apply ---------------------------------------------------------------


@pytest.fixture
def ws(repo: Path, tmp_path: Path) -> Workspace:
    return Workspace.create(repo / "kernels" / "demo", "w", tmp_path / "wt")


def edit_everything(ws: Workspace) -> None:
    t = ws.task_path
    (t / "kernel.cu").write_text("__global__ void k() { int x = 1; }\n")
    (t / "new.cuh").write_text("#pragma once\n")
    (t / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (t / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))  # not UTF-8
    (t / "spec.py").unlink()
    (t / "link.cu").symlink_to("kernel.cu")
    (t / "sub").mkdir()
    (t / "sub" / "deep.cu").write_text("deep\n")
    (t / "ignored.o").write_text("object file\n")


def test_diff_and_changes_include_untracked(ws: Workspace):
    assert ws.diff() == ""
    assert ws.changed_paths() == []
    edit_everything(ws)
    d = ws.diff()
    assert "diff --git a/kernels/demo/new.cuh b/kernels/demo/new.cuh" in d
    assert "new file mode" in d
    assert "GIT binary patch" in d
    assert "deleted file mode" in d
    assert "ignored.o" not in d
    paths = ws.changed_paths()
    assert sorted(paths) == sorted(
        f"kernels/demo/{p}" for p in ["kernel.cu", "new.cuh", "blob.bin", "latin1.txt", "spec.py", "link.cu", "sub/deep.cu"]
    )
    by_path = {c.path: c for c in ws.changes()}
    assert by_path["kernels/demo/link.cu"].is_symlink
    assert by_path["kernels/demo/link.cu"].new_mode == "120000"
    assert by_path["kernels/demo/spec.py"].status == "D"
    assert by_path["kernels/demo/new.cuh"].status == "A"
    assert by_path["kernels/demo/kernel.cu"].status == "M"
    assert not by_path["kernels/demo/kernel.cu"].is_symlink
    # reading does not stage anything in the worktree's index
    assert git(ws.path, "diff", "--cached", "--name-only") == ""
    # limited to paths
    assert ws.changed_paths(paths=["kernels/demo/sub"]) == ["kernels/demo/sub/deep.cu"]


def test_restore_removes_untracked_and_reverts(ws: Workspace):
    edit_everything(ws)
    ws.restore()
    assert ws.changed_paths() == []
    t = ws.task_path
    assert not (t / "new.cuh").exists()
    assert not (t / "sub").exists()
    assert not (t / "ignored.o").exists()
    assert not (t / "link.cu").is_symlink()
    assert (t / "spec.py").read_text() == "REF = 1\n"
    assert (t / "kernel.cu").read_text() == "__global__ void k() {}\n"


def test_restore_to_older_commit_keeps_branch(ws: Workspace):
    (ws.task_path / "kernel.cu").write_text("v2\n")
    (ws.task_path / "added.cu").write_text("added\n")
    sha = ws.commit("v2")
    ws.restore(ws.base_commit)
    assert ws.head() == sha  # the branch did not move
    assert (ws.task_path / "kernel.cu").read_text() == "__global__ void k() {}\n"
    assert not (ws.task_path / "added.cu").exists()
    assert ws.changed_paths(ws.base_commit) == []
    ws.restore()
    assert (ws.task_path / "kernel.cu").read_text() == "v2\n"


def test_apply_patch_round_trip(ws: Workspace):
    edit_everything(ws)
    patch = ws.diff()
    expected = {p: (ws.path / p).read_bytes() if not (ws.path / p).is_symlink() else os.readlink(ws.path / p)
                for p in ws.changed_paths() if (ws.path / p).exists() or (ws.path / p).is_symlink()}
    ws.restore()
    ws.apply_patch(patch)
    assert ws.diff() == patch
    for p, content in expected.items():
        f = ws.path / p
        assert (os.readlink(f) if f.is_symlink() else f.read_bytes()) == content
    assert (ws.task_path / "latin1.txt").read_bytes() == "caf\xe9\n".encode("latin-1")
    assert not (ws.task_path / "spec.py").exists()


def test_apply_patch_that_does_not_apply(ws: Workspace):
    (ws.task_path / "kernel.cu").write_text("one\n")
    patch = ws.diff()
    ws.restore()
    (ws.task_path / "kernel.cu").write_text("something else entirely\n")
    with pytest.raises(WorkspaceError, match="does not apply"):
        ws.apply_patch(patch)
    assert (ws.task_path / "kernel.cu").read_text() == "something else entirely\n"  # all or nothing
    ws.apply_patch("")  # empty patch: nothing to do


# -- commit, export, open/remove -------------------------------------------------------------------


def test_commit_all_and_limited_paths(repo: Path, ws: Workspace):
    user_head = git(repo, "rev-parse", "HEAD")
    (ws.task_path / "kernel.cu").write_text("v2\n")
    (ws.task_path / "new.cu").write_text("new\n")
    (ws.task_path / "spec.py").unlink()
    message = "Title\n\n#include <cuda.h> stays\n\nKloop-Run: w\n"
    sha = ws.commit(message, paths=["kernels/demo/kernel.cu", "kernels/demo/spec.py"])
    assert sha == ws.head()
    assert git(repo, "log", "-1", "--format=%B", sha).rstrip("\n") == message.rstrip("\n")
    assert git(repo, "show", "--name-status", "--format=", sha).split() == [
        "M", "kernels/demo/kernel.cu", "D", "kernels/demo/spec.py",
    ]
    assert ws.changed_paths() == ["kernels/demo/new.cu"]  # not in the list: still uncommitted
    sha2 = ws.commit("the rest")
    assert git(repo, "rev-parse", f"{sha2}^").strip() == sha
    assert ws.changed_paths() == []
    with pytest.raises(WorkspaceError, match="nothing to commit"):
        ws.commit("empty")
    assert git(repo, "rev-parse", "HEAD") == user_head


def test_commit_skips_hooks(repo: Path, ws: Workspace):
    hooks = repo / ".git" / "hooks"
    hooks.mkdir(exist_ok=True)
    marker = repo.parent / "hook-ran"
    for name in ("pre-commit", "commit-msg", "post-commit", "post-checkout"):
        (hooks / name).write_text(f"#!/bin/sh\ntouch '{marker}'\nexit 1\n")
        (hooks / name).chmod(0o755)
    (ws.task_path / "kernel.cu").write_text("v2\n")
    ws.commit("accepted by the gate, not by a hook")
    ws.restore()
    Workspace.create(repo / "kernels" / "demo", "other", ws.path.parent)
    assert not marker.exists()


def test_export_tree(ws: Workspace, tmp_path: Path):
    (ws.task_path / "kernel.cu").write_text("candidate\n")  # the working tree is not exported
    dest = ws.export_tree(ws.base_commit, tmp_path / "base", subdir="kernels/demo")
    assert sorted(p.name for p in dest.iterdir()) == ["kernel.cu", "spec.py", "task.toml"]
    assert (dest / "kernel.cu").read_text() == "__global__ void k() {}\n"
    full = ws.export_tree(ws.base_commit, tmp_path / "full")
    assert (full / "README.md").read_text() == "hello\n"
    assert (full / "kernels" / "demo" / "spec.py").exists()
    with pytest.raises(WorkspaceError, match="new or empty"):
        ws.export_tree(ws.base_commit, tmp_path / "full")
    with pytest.raises(WorkspaceError, match="no folder"):
        ws.export_tree(ws.base_commit, tmp_path / "nope", subdir="kernels/missing")


def test_remove_and_open_recreates(repo: Path, ws: Workspace, tmp_path: Path):
    (ws.task_path / "kernel.cu").write_text("accepted\n")
    sha = ws.commit("accepted")
    ws.remove()
    assert not ws.path.exists()
    assert git(repo, "rev-parse", "refs/heads/kloop/w").strip() == sha  # branch kept

    again = Workspace.open(repo, "w", tmp_path / "wt", "kernels/demo", ws.base_commit)
    assert again.path == ws.path and again.head() == sha
    assert (again.task_path / "kernel.cu").read_text() == "accepted\n"

    # reattach to an existing worktree; and a folder deleted behind git's back is recreated
    same = Workspace.open(repo, "w", tmp_path / "wt", "kernels/demo", ws.base_commit)
    assert same.path == again.path
    import shutil

    shutil.rmtree(again.path)
    third = Workspace.open(repo, "w", tmp_path / "wt", "kernels/demo", ws.base_commit)
    assert third.head() == sha and (third.task_path / "kernel.cu").exists()

    with pytest.raises(WorkspaceError, match="does not exist"):
        Workspace.open(repo, "nope", tmp_path / "wt", "kernels/demo", ws.base_commit)


def test_same_size_edit_right_after_restore_is_seen(ws: Workspace):
    """An edit of the same size in the second a restore wrote the file looks clean to git's stat cache;
    git's racy-entry rule catches it only if the index keeps its own mtime, so the snapshot copy must too
    (a fresh copy made "nothing changed against the best" of a real edit, seen in test_gate_session)."""
    import time

    p = ws.task_path / "kernel.cu"
    ws.restore()
    st = p.stat()
    p.write_text(p.read_text().replace("{}", "{;"))  # same size, other bytes
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # what a write in the same second looks like
    time.sleep(1.1)  # the snapshot index is made in a later second
    assert [c.rsplit("/", 1)[-1] for c in ws.changed_paths()] == ["kernel.cu"]
    assert "{;" in ws.diff()
