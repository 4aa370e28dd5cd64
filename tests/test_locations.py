"""Where run records are found (agent/locations.py): from inside a session's worktree, the runs folder
that holds it (a newcomer's `kloop log last` there once looked in the worktree's own empty `.kloop/runs`)."""

from __future__ import annotations

import git

from agent.locations import default_runs_root, session_runs_root


def _layout(tmp):
    repo = tmp / "repo"
    git.Repo.init(repo)
    runs = repo / ".kloop" / "runs"
    run_id = "20261207-031545-matmul-cpu-f99b"
    (runs / run_id).mkdir(parents=True)
    (runs / run_id / "run.json").write_text("{}")
    worktree = runs / "_worktrees" / run_id
    (worktree / "kernels" / "matmul_cpu").mkdir(parents=True)
    git.Repo.init(worktree)  # a worktree is a repository of its own to find_repo
    return repo, runs, worktree


def test_inside_a_session_worktree_the_runs_folder_holding_it(tmp_path, monkeypatch):
    monkeypatch.delenv("KLOOP_RUNS", raising=False)
    repo, runs, worktree = _layout(tmp_path)
    for where in (worktree, worktree / "kernels" / "matmul_cpu"):
        assert session_runs_root(where) == runs.resolve()
        assert default_runs_root(cwd=where) == runs.resolve()
    assert default_runs_root(cwd=repo) == runs.resolve()  # the checkout itself, as before


def test_a_folder_named_like_one_without_its_run_is_not_a_session(tmp_path, monkeypatch):
    monkeypatch.delenv("KLOOP_RUNS", raising=False)
    _, runs, worktree = _layout(tmp_path)
    (runs / worktree.name / "run.json").unlink()
    assert session_runs_root(worktree) is None
    assert default_runs_root(cwd=worktree) == (worktree / ".kloop" / "runs").resolve()


def test_kloop_runs_still_wins(tmp_path, monkeypatch):
    _, _, worktree = _layout(tmp_path)
    monkeypatch.setenv("KLOOP_RUNS", str(tmp_path / "elsewhere"))
    assert default_runs_root(cwd=worktree) == (tmp_path / "elsewhere").resolve()
