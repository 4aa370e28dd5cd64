"""The session as shell commands, driven by a bash script the way an agent with only a shell would:
start, check, a no-op and an out-of-scope submit refused (exit 1), a real gain accepted (exit 0) that
lands as one commit, status, end; then the session continued on "another machine" from a copy of
the run folder and a bundle of the branch fetched into a fresh clone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import git
import pytest

from agent.records import RunRecord
from tests.session_repo import KEY, ROOT, accepted_commits, make_repo

pytestmark = pytest.mark.slow

SCRIPT = r"""
set -u
kloop() { "$PY" -m agent.cli "$@"; }
expect() { want=$1; shift; "$@"; got=$?; if [ "$got" -ne "$want" ]; then echo "FAILED: exit $got, wanted $want: $*" >&2; exit 99; fi; }

cd "$TASK"
kloop session start . --gate-seconds 3 --max-attempts 6 --json > "$OUT/start.json" || exit 10
WT=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["worktree"])' "$OUT/start.json")
cd "$WT" || exit 11
test -f AGENTS.md -a -f CLAUDE.md || exit 12

expect 0 kloop status
expect 0 kloop check > "$OUT/check0.txt"
expect 3 kloop submit -m "Nothing changed"                 > "$OUT/noop.txt"
echo "# tampered" >> kernels/matmul_cpu/spec.py
expect 1 kloop submit -m "Touch the spec" --json           > "$OUT/scope.json"
git diff --quiet || exit 13   # the rejected attempt left the tree at best

sed -i '/waste [123]/d' kernels/matmul_cpu/matmul.cpp
expect 0 kloop build                                       > "$OUT/build.txt"
expect 0 kloop check                                       > "$OUT/check1.txt"
expect 0 kloop submit -m "Compute the product once" --rationale "the baseline computed it four times" --json > "$OUT/gain.json"
expect 0 kloop status --json                               > "$OUT/status.json"
expect 0 kloop session end                                 > "$OUT/end.txt"
test ! -d "$WT" || exit 14
cd "$OUT"
expect 3 kloop status --run last                          > "$OUT/status-ended.txt" 2>&1
"""

CONTINUE = r"""
set -u
kloop() { "$PY" -m agent.cli "$@"; }
expect() { want=$1; shift; "$@"; got=$?; if [ "$got" -ne "$want" ]; then echo "FAILED: exit $got, wanted $want: $*" >&2; exit 99; fi; }
cd "$CLONE"
expect 0 kloop session resume "$RUN2" --json > "$OUT/resume.json"
WT=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["worktree"])' "$OUT/resume.json")
cd "$WT" || exit 20
expect 0 kloop status --json > "$OUT/status2.json"
expect 3 kloop submit -m "Nothing changed here either" > "$OUT/noop2.txt"
expect 0 kloop session end > /dev/null
"""


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLOOP_")}
    env.update(PY=sys.executable, PYTHONPATH=str(ROOT), ANTHROPIC_API_KEY=KEY,
               KLOOP_CACHE=os.environ.get("KLOOP_CACHE", str(tmp / "cache")), KLOOP_RUNS=str(tmp / "runs"))
    env.update(extra)
    return env


def _bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.long
def test_shell_session_end_to_end_and_on_another_machine(tmp_path):
    task = make_repo(tmp_path)
    repo = task.parents[1]
    out = tmp_path / "out"
    out.mkdir()
    env = _env(tmp_path, TASK=str(task), OUT=str(out))
    proc = _bash(SCRIPT, env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"

    start = json.loads((out / "start.json").read_text())
    run_dir = Path(start["run_dir"])
    info = RunRecord.open(run_dir).info
    assert info.policy == "cli"

    assert "not run: nothing changed against the best" in (out / "noop.txt").read_text()  # refused, no attempt
    scope = json.loads((out / "scope.json").read_text())
    assert scope["event"] == "rejected" and scope["data"]["stage"] == "scope"
    assert "kernels/matmul_cpu/spec.py" in scope["text"]
    gain = json.loads((out / "gain.json").read_text())
    assert gain["event"] == "accepted" and gain["data"]["speedup"] > 2.0, gain["text"]
    status = json.loads((out / "status.json").read_text())["data"]
    assert status["attempts"] == 2 and status["accepted"] == 1 and status["left"]["attempts"] == 4
    assert "ended" in (out / "status-ended.txt").read_text()
    end = (out / "end.txt").read_text()  # ended from inside the worktree: where the branch is, and where to go
    assert f"1 accepted change on {info.branch} in {info.repo_root}" in end, end
    assert "was removed: cd out of it" in end, end

    # exactly one commit landed, with its evidence; kloop's AGENTS.md/CLAUDE.md are not in it
    assert accepted_commits(repo, info.branch, info.base_commit) == ["Compute the product once"]
    tip = git.Repo(repo).commit(info.branch)
    assert "Kloop-Speedup:" in tip.message and "Kloop-Attempt: 2" in tip.message
    assert sorted(tip.stats.files) == ["kernels/matmul_cpu/matmul.cpp"]
    # the user's checkout is untouched
    assert git.Repo(repo).active_branch.name in ("master", "main") and not git.Repo(repo).is_dirty(untracked_files=True)

    # every command's call is in the record, and the key is nowhere
    calls = [e.name for e in RunRecord.open(run_dir).events() if e.kind == "tool_call"]
    assert calls.count("submit") == 3 and calls.count("check") == 2 and "build" in calls
    assert "status" not in calls  # reading leaves the record alone
    everything = proc.stdout + proc.stderr + "".join(p.read_text() for p in out.iterdir())
    everything += "".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())
    assert KEY not in everything

    # another machine: the run folder copied, the branch bundled into a fresh clone; the original is gone
    bundle = tmp_path / "session.bundle"
    git.Repo(repo).git.bundle("create", str(bundle), info.branch)
    clone = tmp_path / "elsewhere" / "clone"
    git.Repo.clone_from(repo, clone)
    git.Repo(clone).git.fetch(str(bundle), f"{info.branch}:{info.branch}")
    run2 = tmp_path / "elsewhere" / "runs" / info.run_id
    shutil.copytree(run_dir, run2, ignore=shutil.ignore_patterns("*.lock"))
    repo.rename(tmp_path / "userrepo-gone")
    env2 = _env(tmp_path, CLONE=str(clone), RUN2=str(run2), OUT=str(out), KLOOP_RUNS=str(run2.parent))
    proc2 = _bash(CONTINUE, env2)
    assert proc2.returncode == 0, f"stdout:\n{proc2.stdout}\nstderr:\n{proc2.stderr}"
    resumed = json.loads((out / "resume.json").read_text())
    assert Path(resumed["worktree"]).parent == run2.parent / "_worktrees"
    status2 = json.loads((out / "status2.json").read_text())["data"]
    assert status2["accepted"] == 1 and status2["best_speedup"] > 2.0
    info2 = RunRecord.open(run2).info
    assert Path(info2.repo_root) == clone.resolve()
    assert accepted_commits(clone, info2.branch, info2.base_commit) == ["Compute the product once"]
    assert len([e for e in RunRecord.open(run2).events() if e.kind == "attempt_started"]) == 2  # the two no-op submits were refused, not attempts
