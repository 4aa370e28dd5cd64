"""Git never runs outside the session worktree.

The worst case is the default layout: the worktrees live inside the user's repository (in the
git-ignored `.kloop/`), and the user has untracked and ignored files of their own. Whatever
happens to the worktree folder mid-session (deleted, emptied, switched to another branch), and
whatever the current directory or the GIT_* variables say, a destructive command refuses with a
clear error and the user's files are all still there.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.workspace import Workspace, WorkspaceError, apply_patch_to_folder, commit_log

GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


@pytest.fixture(autouse=True)
def _isolated_git(monkeypatch):
    for k, v in GIT_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "user"
    task = root / "kernels" / "demo"
    task.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "Test User")
    git(root, "config", "user.email", "test@example.com")
    (task / "task.toml").write_text('name = "demo"\n')
    (task / "kernel.cu").write_text("__global__ void k() {}\n")
    (root / ".gitignore").write_text("*.o\n")
    (root / ".git" / "info" / "exclude").write_text("/.kloop/\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "initial")
    # the user's own work that no git command of kloop may ever delete or revert
    (root / "notes.txt").write_text("untracked notes\n")
    (root / "build.o").write_text("ignored build output\n")
    (root / "kernels" / "demo" / "kernel.cu").write_text("// an uncommitted edit\n")
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every file of the user's checkout outside .git and .kloop, with its hash."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] in (".git", ".kloop") or not p.is_file():
            continue
        out[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def user_index(root: Path) -> bytes:
    return (root / ".git" / "index").read_bytes()


def workspace(repo: Path) -> Workspace:
    # kloop's default layout: worktrees inside the user's repository, in the ignored .kloop/
    return Workspace.create(repo / "kernels" / "demo", "r1", repo / ".kloop" / "runs" / "_worktrees", allow_dirty=True)


DESTRUCTIVE = {
    "restore": lambda ws: ws.restore(),
    "apply a patch": lambda ws: ws.apply_patch("diff --git a/x b/x\nnew file mode 100644\n--- /dev/null\n+++ b/x\n@@ -0,0 +1 @@\n+x\n"),
    "commit": lambda ws: ws.commit("sneaky", allow_empty=True),
    "move the branch": lambda ws: ws.reset_branch(ws.base_commit),
}


@pytest.mark.parametrize("action", sorted(DESTRUCTIVE))
@pytest.mark.parametrize("cwd_in_user_repo", [False, True])
def test_deleted_worktree_refuses_and_keeps_user_files(repo: Path, monkeypatch, action: str, cwd_in_user_repo: bool):
    ws = workspace(repo)
    (ws.task_path / "kernel.cu").write_text("// the candidate, mid-gate\n")
    before, index, head = snapshot(repo), user_index(repo), git(repo, "rev-parse", "HEAD")
    if cwd_in_user_repo:  # where GitPython used to run git when the target folder was missing
        monkeypatch.chdir(repo / "kernels" / "demo")
    shutil.rmtree(ws.path)  # the worktree disappears mid-gate
    with pytest.raises(WorkspaceError, match=f"refusing to {action}: the session worktree .* does not exist"):
        DESTRUCTIVE[action](ws)
    assert snapshot(repo) == before
    assert (repo / "notes.txt").read_text() == "untracked notes\n"
    assert (repo / "build.o").read_text() == "ignored build output\n"
    assert user_index(repo) == index and git(repo, "rev-parse", "HEAD") == head
    assert git(repo, "symbolic-ref", "HEAD").strip() == "refs/heads/main"


def test_emptied_worktree_inside_user_repo_is_not_taken_for_the_user_repo(repo: Path, monkeypatch):
    """An empty folder where the worktree was: git must not walk up into the user's repository."""
    ws = workspace(repo)
    before, index = snapshot(repo), user_index(repo)
    shutil.rmtree(ws.path)
    ws.path.mkdir()
    monkeypatch.chdir(repo)
    for action, do in DESTRUCTIVE.items():
        with pytest.raises(WorkspaceError, match=f"refusing to {action}: .* is not a git worktree"):
            do(ws)
    # a read has no guard of its own; it fails instead of reading the user's repository
    with pytest.raises(WorkspaceError):
        ws.diff()
    assert snapshot(repo) == before and user_index(repo) == index


def test_git_location_variables_are_ignored(repo: Path, monkeypatch):
    """GIT_DIR/GIT_WORK_TREE pointing at the user's repository (e.g. kloop started from a hook)."""
    ws = workspace(repo)
    before = snapshot(repo)
    monkeypatch.setenv("GIT_DIR", str(repo / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(repo))
    monkeypatch.chdir(repo)
    (ws.task_path / "scratch.cu").write_text("junk\n")
    ws.restore()  # acts on the worktree only
    assert not (ws.task_path / "scratch.cu").exists()
    assert snapshot(repo) == before
    shutil.rmtree(ws.path)
    with pytest.raises(WorkspaceError, match="does not exist"):
        ws.restore()
    assert snapshot(repo) == before


def test_worktree_on_another_branch_refuses_commit(repo: Path):
    ws = workspace(repo)
    git(ws.path, "checkout", "-q", "-b", "elsewhere")
    (ws.task_path / "kernel.cu").write_text("// accepted change\n")
    with pytest.raises(WorkspaceError, match="refusing to commit: .* not on 'refs/heads/kloop/r1'"):
        ws.commit("accepted")
    assert git(repo, "rev-parse", "refs/heads/elsewhere") == git(repo, "rev-parse", "refs/heads/kloop/r1")
    git(ws.path, "checkout", "-q", "--detach")
    with pytest.raises(WorkspaceError, match="detached HEAD"):
        ws.restore()


def test_path_that_is_another_repository_refuses(repo: Path, tmp_path: Path):
    ws = workspace(repo)
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q", "-b", "kloop/r1")
    git(other, "-c", "user.name=U", "-c", "user.email=u@x", "commit", "-q", "--allow-empty", "-m", "x")
    (other / "precious.txt").write_text("keep me\n")
    ws.path = other
    with pytest.raises(WorkspaceError, match="belongs to the repository"):
        ws.restore()
    assert (other / "precious.txt").is_file()


def test_work_as_usual_from_inside_the_user_repo(repo: Path, monkeypatch):
    """The current directory does not matter: from inside the user's repository (and from a
    folder of it), kloop's commands act on the worktree and the branch only."""
    monkeypatch.chdir(repo / "kernels")
    ws = workspace(repo)
    before, index = snapshot(repo), user_index(repo)
    (ws.task_path / "kernel.cu").write_text("// faster\n")
    assert ws.changed_paths() == ["kernels/demo/kernel.cu"]
    sha = ws.commit("faster")
    (ws.task_path / "junk.cu").write_text("junk\n")
    ws.restore()
    assert not (ws.task_path / "junk.cu").exists()
    assert [s for s, _ in ws.commits_since_base()] == [sha]
    assert [c.summary for c in commit_log(repo, f"{ws.base_commit}..kloop/r1")] == ["faster"]
    ws.reset_branch(ws.base_commit)
    assert ws.head() == ws.base_commit
    assert snapshot(repo) == before and user_index(repo) == index
    assert git(repo, "symbolic-ref", "HEAD").strip() == "refs/heads/main"


def test_reset_branch_only_to_its_own_commits(repo: Path):
    ws = workspace(repo)
    git(repo, "commit", "-q", "--allow-empty", "-m", "user's later work")
    with pytest.raises(WorkspaceError, match="not a commit of the branch"):
        ws.reset_branch(git(repo, "rev-parse", "HEAD").strip())


def test_apply_patch_to_folder_inside_a_repository(repo: Path):
    """Replay's scratch copies: a patch applies to the folder, not to a repository around it."""
    folder = repo / ".kloop" / "scratch"
    (folder / "kernels" / "demo").mkdir(parents=True)
    (folder / "kernels" / "demo" / "kernel.cu").write_text("a\n")
    patch = ("diff --git a/kernels/demo/kernel.cu b/kernels/demo/kernel.cu\n--- a/kernels/demo/kernel.cu\n"
             "+++ b/kernels/demo/kernel.cu\n@@ -1 +1 @@\n-a\n+b\n")
    before = snapshot(repo)
    assert apply_patch_to_folder(folder, patch) is None
    assert (folder / "kernels" / "demo" / "kernel.cu").read_text() == "b\n"
    assert apply_patch_to_folder(folder, patch)  # no longer applies: git's complaint
    assert snapshot(repo) == before


def test_session_whose_worktree_vanishes_mid_gate(tmp_path: Path, monkeypatch):
    """The reported data loss, end to end: a session in the default layout (records and worktree in
    the user's repository's .kloop/), run from inside that repository; the worktree is deleted while
    the gate runs. The restore after the verdict raises and the user's files are all there."""
    from agent.gate import Verdict
    from agent.policies.base import Budget
    from agent.session import Session

    monkeypatch.delenv("KLOOP_RUNS", raising=False)
    root = tmp_path / "user"
    shutil.copytree(Path(__file__).resolve().parents[1] / "kernels" / "matmul_cpu", root / "kernels" / "matmul_cpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "Test User")
    git(root, "config", "user.email", "test@example.com")
    (root / ".gitignore").write_text("*.o\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "task")
    (root / "notes.txt").write_text("untracked notes\n")
    (root / "build.o").write_text("ignored build output\n")
    monkeypatch.chdir(root / "kernels")

    s = Session.start(root / "kernels" / "matmul_cpu", "test", Budget())
    assert s.ws.path.is_relative_to(root / ".kloop" / "runs")  # the default layout
    s.best_build = SimpleNamespace(ok=False, lib="")  # skip the baseline: no build needed to show the point

    def gate_while_the_worktree_vanishes(candidate, best, **_):
        shutil.rmtree(s.ws.path)
        return Verdict(accepted=False, stage="check", reason="wrong results")

    monkeypatch.setattr(s.gate, "evaluate", gate_while_the_worktree_vanishes)
    (s.ws.task_path / "matmul.cpp").write_text("// the candidate\n")
    before, index = snapshot(root), user_index(root)
    with pytest.raises(WorkspaceError, match="refusing to restore: the session worktree .* does not exist"):
        s.submit("A candidate", "")
    assert snapshot(root) == before and user_index(root) == index
    assert (root / "notes.txt").is_file() and (root / "build.o").is_file()
    assert git(root, "status", "--porcelain", "--untracked-files=all").split() == ["??", "notes.txt"]
    assert git(root, "symbolic-ref", "HEAD").strip() == "refs/heads/main"
    s.close()


def test_no_git_child_sees_a_secret(repo: Path, tmp_path: Path, monkeypatch):
    """Every git that kloop starts (a session's worktree, a commit, locating a run from a worktree)
    gets the allow-listed environment: a `git` first on PATH records what each one was given."""
    import agent.workspace as workspace
    from agent.session_service import ServiceError, run_of_worktree

    log = tmp_path / "git-env.log"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "git"
    wrapper.write_text(f'#!/bin/sh\nenv >> "{log}"\necho "--- end" >> "{log}"\nexec {shutil.which("git")} "$@"\n')
    wrapper.chmod(0o755)
    secret = "sk-ant-api03-not-a-real-key-0123456789"
    monkeypatch.setenv("ANTHROPIC_API_KEY", secret)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(workspace, "GIT", str(wrapper))

    ws = Workspace.create(repo / "kernels" / "demo", "secret-probe", repo / ".kloop" / "wt", allow_dirty=True)
    (ws.task_path / "kernel.cu").write_text("// faster\n")
    ws.commit("a change")
    assert workspace.holds(ws.path, ws.branch, ws.head())
    with pytest.raises(ServiceError, match="run record"):
        run_of_worktree(ws.task_path)  # reads the branch through git, then finds no record
    ws.remove()

    text = log.read_text()
    assert text.count("--- end") >= 5, "the wrapper saw too few git runs to mean anything"
    assert secret not in text and "ANTHROPIC_API_KEY" not in text
