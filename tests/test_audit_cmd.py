"""`kloop audit RUN|BRANCH`: today's gate over a run's accepted commits.

The session branches here are made by hand (commits with kloop's trailers, and a run record naming
them), so no test depends on a timing gain: the verdicts that decide the exit code are scope, static
rules, build, audit of what was built and check, which noise cannot change (`--no-timing`).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import git
import pytest
from typer.testing import CliRunner

from agent.cli import app
from agent.records import RunInfo, RunRecord
from agent.trailers import format_commit_message
from tests.fakes import make_repo

runner = CliRunner()
RUN_ID = "20261201-120000-matmul-cpu-a1b2"
BRANCH = f"kloop/{RUN_ID}"
TASK_REL = "kernels/matmul_cpu"
CHEATS = Path(__file__).resolve().parent / "cheats"

# a kernel the scope and the source rules let through, but whose build imports getenv (spelled by token
# pasting, so no source pattern names it): only the audit of what was built catches it
AUDIT_CHEAT = """
#include <cstdlib>
#define GLUE(a, b) a##b
extern "C" int kloop_probe_env() { return GLUE(get, env)("HOME") != nullptr; }
"""
# a pointer cache: same buffers as the last call -> return the old output (the check's second call, new
# values in the same buffers, catches it)
CACHE_CHEAT = """
static const float* last_a = nullptr;
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (A == last_a) return 0;
  last_a = A;
"""


def invoke(*args: str, cwd: Path | None = None):
    import os

    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        return runner.invoke(app, list(args), env={"COLUMNS": "200"})
    finally:
        os.chdir(old)


def _commit(r: git.Repo, title: str, attempt: int | None, speedup: float = 1.5) -> str:
    r.git.add(A=True)
    trailers = [] if attempt is None else [
        ("Kloop-Speedup", f"{speedup:.4f}"), ("Kloop-Speedup-CI95", f"{speedup * 0.98:.4f}..{speedup * 1.02:.4f}"),
        ("Kloop-Device", "a CPU"), ("Kloop-Run", RUN_ID), ("Kloop-Attempt", str(attempt))]
    r.index.commit(format_commit_message(title, "made by the test", trailers))
    return r.head.commit.hexsha


def session_repo(tmp: Path, cheats: list[str] = (), record: bool = True) -> dict:
    """A user's repository on main with the CPU task, and a session branch kloop/<RUN_ID> of accepted-looking
    commits: an honest knob change (LOOP_ORDER=1), then each named cheat. Returns repo, base, commits, runs."""
    repo = make_repo(tmp)
    r = git.Repo(repo)
    r.git.branch("-M", "main")
    base = r.head.commit.hexsha
    r.git.checkout("-b", BRANCH)
    task = repo / TASK_REL
    (task / "knobs.toml").write_text("LOOP_ORDER = 1\n")
    commits = [_commit(r, "Loop order i-k-j", 1)]
    src = task / "matmul.cpp"
    honest = src.read_text()
    for n, cheat in enumerate(cheats, start=2):  # each cheat on the honest source (one kind per commit)
        text = honest
        if cheat == "pragma":
            src.write_text('#pragma GCC optimize("O3")\n' + text)
            title = "Optimise harder"
        elif cheat == "audit":
            src.write_text(text + AUDIT_CHEAT)
            title = "Add an environment probe"
        elif cheat == "cache":
            head = 'extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {\n'
            assert head in text
            src.write_text(text.replace(head, CACHE_CHEAT))
            title = "Reuse the last product"
        elif cheat == "e2e":  # inside the check's tolerance, biased: only the end-to-end training check sees it
            src.write_text((CHEATS / "e2e_round_down.cpp").read_text())
            title = "Round the sums"
        elif cheat == "spec":
            src.write_text(text)
            (task / "spec.py").write_text((task / "spec.py").read_text() + "\n# looser\n")
            title = "Touch the spec"
        else:
            raise AssertionError(cheat)
        commits.append(_commit(r, title, n, speedup=3.0))
    r.git.checkout("main")
    runs = tmp / "runs"
    if record:
        info = RunInfo(run_id=RUN_ID, task="matmul_cpu", task_rel=TASK_REL, task_path=task, policy="tuner",
                       base_commit=base, branch=BRANCH, repo_root=repo, worktree=runs / "_worktrees" / RUN_ID,
                       config={"policy": "tuner", "gate": {"max_seconds": 0.5, "min_pairs": 4}})
        rec = RunRecord.create(runs, info)
        rec.log("session_started")
        for i, sha in enumerate(commits, start=1):
            rec.log("attempt_started", attempt=i, title=f"attempt {i}")
            rec.log("verdict", attempt=i, accepted=True, reason="faster", figures={"speedup": 1.5, "stage": "accepted"})
            rec.log("committed", attempt=i, commit=sha)
        rec.log("session_ended", reason="done")
    return {"repo": repo, "base": base, "commits": commits, "runs": runs}


def snapshot(repo: Path) -> tuple:
    """What the user sees of their checkout: HEAD, branches, status, index and every file's bytes."""
    g = lambda *a: subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True, check=True).stdout
    files = {p.relative_to(repo).as_posix(): p.read_bytes() for p in sorted(repo.rglob("*"))
             if p.is_file() and ".git" not in p.relative_to(repo).parts}
    return (g("rev-parse", "HEAD"), g("symbolic-ref", "HEAD"), g("for-each-ref"), g("status", "--porcelain", "--ignored"),
            g("ls-files", "-s"), g("worktree", "list"), g("stash", "list"), files)


def test_an_honest_run_audits_clean(tmp_path):
    s = session_repo(tmp_path)
    res = invoke("audit", RUN_ID, "--runs-dir", str(s["runs"]), "--no-timing", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["rejected"] == 0 and out["total"] == 1 and out["source"] == "run record"
    row = out["rows"][0]
    assert row["commit"] == s["commits"][0] and row["attempt"] == 1 and not row["rejected"]
    assert row["stages"] == {"scope": "ok", "static": "ok", "build": "ok", "audit": "ok", "check": "ok", "timing": "not run", "e2e": "ok"}  # e2e after the check, timing or not
    assert "--no-timing" in out["not_run"] and out["upto"] == "check" and out["summary"] == "0 of 1 accepted commits would now be rejected by the layers run here"


@pytest.mark.long  # CI time (16 min on 2026-12-07): run with `-m long`
def test_cheats_on_the_branch_are_listed_with_their_reasons(tmp_path):
    s = session_repo(tmp_path, cheats=["pragma", "audit", "spec", "cache"])
    before = snapshot(s["repo"])
    record_before = {p: p.read_bytes() for p in sorted(s["runs"].rglob("*")) if p.is_file()}
    res = invoke("audit", RUN_ID, "--runs-dir", str(s["runs"]), "--no-timing")
    assert res.exit_code == 1, res.output
    assert "4 of 5 accepted commits would now be rejected" in res.stdout
    res = invoke("audit", RUN_ID, "--runs-dir", str(s["runs"]), "--no-timing", "--json")
    assert res.exit_code == 1
    rows = json.loads(res.stdout)["rows"]
    assert [r["rejected"] for r in rows] == [False, True, True, True, True]
    honest, pragma, audit, spec, cache = rows
    assert pragma["stages"]["static"] == "FAIL" and pragma["stages"]["build"] == "not run"
    assert "#pragma GCC optimize" in pragma["reason"]
    assert audit["stages"]["static"] == "ok" and audit["stages"]["build"] == "ok" and audit["stages"]["audit"] == "FAIL"
    assert "audit of what was built" in audit["reason"] and "getenv" in audit["reason"]
    assert spec["stages"]["scope"] == "FAIL" and f"{TASK_REL}/spec.py" in spec["reason"]
    assert cache["stages"]["audit"] == "ok" and cache["stages"]["check"] == "FAIL" and "wrong results" in cache["reason"]
    assert snapshot(s["repo"]) == before  # the checkout, its index, branches and files are untouched
    assert {p: p.read_bytes() for p in sorted(s["runs"].rglob("*")) if p.is_file()} == record_before  # and the record


def test_a_branch_without_its_record_is_read_from_its_trailers(tmp_path):
    s = session_repo(tmp_path, cheats=["pragma"], record=False)
    r = git.Repo(s["repo"])
    r.git.checkout(BRANCH)  # the user has the session branch checked out, with an edit of their own
    (s["repo"] / "notes.txt").write_text("mine\n")
    before = snapshot(s["repo"])
    res = invoke("audit", BRANCH, "--no-timing", "--json", cwd=s["repo"] / "kernels")
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["source"] == "branch trailers" and out["base"] == s["base"] and out["task_rel"] == TASK_REL
    assert [r["rejected"] for r in out["rows"]] == [False, True]
    assert out["rows"][1]["stages"]["static"] == "FAIL"
    assert snapshot(s["repo"]) == before


def test_a_commit_made_by_hand_after_the_session_is_audited_and_noted(tmp_path):
    s = session_repo(tmp_path)
    r = git.Repo(s["repo"])
    r.git.checkout(BRANCH)
    (s["repo"] / TASK_REL / "matmul.cpp").write_text('#pragma GCC optimize("O3")\n' + (s["repo"] / TASK_REL / "matmul.cpp").read_text())
    _commit(r, "Tweak by hand", None)
    r.git.checkout("main")
    res = invoke("audit", RUN_ID, "--runs-dir", str(s["runs"]), "--no-timing", "--json")
    assert res.exit_code == 1, res.output
    rows = json.loads(res.stdout)["rows"]
    assert [r["rejected"] for r in rows] == [False, True] and not rows[1]["gate_commit"]
    assert "not made by the gate" in rows[1]["note"] and "no accepted verdict" in rows[1]["note"]


def test_a_branch_with_its_record_uses_the_record(tmp_path):
    s = session_repo(tmp_path)
    res = invoke("audit", BRANCH, "--repo", str(s["repo"]), "--runs-dir", str(s["runs"]), "--no-timing", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["source"] == "run record"


def test_a_branch_in_another_repository_is_found_through_its_record(tmp_path):
    """A shipped task's session branch lives in kloop's copy of the task (<runs>/_tasks/<name>), not in the
    checkout a user runs `kloop audit kloop/<run-id>` from: the run record names its repository."""
    s = session_repo(tmp_path)
    checkout = tmp_path / "checkout"
    git.Repo.init(checkout)
    res = invoke("audit", BRANCH, "--repo", str(checkout), "--runs-dir", str(s["runs"]), "--no-timing", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["source"] == "run record" and out["total"] == 1 and out["repo"] == str(s["repo"].resolve())


@pytest.mark.parametrize("args, words", [
    (["no-such-run"], "no run 'no-such-run'"),
    (["kloop/nope"], "no branch 'kloop/nope'"),
])
def test_bad_input_is_a_clear_error(tmp_path, args, words):
    s = session_repo(tmp_path)
    res = invoke("audit", *args, "--runs-dir", str(s["runs"]), "--repo", str(s["repo"]))
    assert res.exit_code == 2, res.output
    assert words in " ".join(res.output.split())
    assert "Traceback" not in res.output


def test_a_run_whose_branch_is_gone_is_a_clear_error(tmp_path):
    s = session_repo(tmp_path)
    git.Repo(s["repo"]).git.branch("-D", BRANCH)
    res = invoke("audit", RUN_ID, "--runs-dir", str(s["runs"]), "--no-timing")
    assert res.exit_code == 2 and BRANCH in " ".join(res.output.split())


def test_a_branch_without_kloop_commits_is_a_clear_error(tmp_path):
    s = session_repo(tmp_path, record=False)
    r = git.Repo(s["repo"])
    r.git.branch("kloop/other", "main")
    res = invoke("audit", "kloop/other", "--repo", str(s["repo"]), "--no-timing")
    assert res.exit_code == 2 and "no commit carries kloop's trailers" in " ".join(res.output.split())


def test_a_cuda_task_without_a_gpu_is_audited_as_far_as_it_can_run(tmp_path):
    """On this machine (no GPU) a CUDA run still gets scope, static rules, build and the audit of what was
    built; the report says check and timing were not run, and exits on what did run."""
    pytest.importorskip("torch")
    import shutil

    import torch

    if torch.cuda.is_available() or shutil.which("nvcc") is None:
        pytest.skip("needs nvcc and no GPU (on a GPU machine this is the full audit)")
    from tests.fakes import KERNELS

    repo = make_repo(tmp_path, task=KERNELS / "softmax")
    r = git.Repo(repo)
    home = r.active_branch.name
    r.git.checkout("-b", BRANCH)
    task = repo / "kernels" / "softmax"
    (task / "knobs.toml").write_text("VEC = 8\n")
    _commit(r, "128-bit loads", 1)
    src = task / "softmax.cu"
    src.write_text(src.read_text() + "\nstatic cudaStream_t side;\nextern \"C\" int kloop_side() { return cudaStreamCreate(&side); }\n")
    _commit(r, "A stream of its own", 2)
    r.git.checkout(home)
    res = invoke("audit", BRANCH, "--repo", str(repo), "--json")
    out = json.loads(res.stdout)
    assert out["upto"] == "audit" and "no CUDA GPU" in out["not_run"], res.output
    honest, cheat = out["rows"]
    assert honest["stages"] == {"scope": "ok", "static": "ok", "build": "ok", "audit": "ok", "check": "not run",
                                "timing": "not run", "e2e": "not run"} and not honest["rejected"]
    assert cheat["rejected"] and "FAIL" in (cheat["stages"]["static"], cheat["stages"]["audit"])
    assert res.exit_code == 1


def _ab(speedup, noise=0.002, **shape):
    """A synthetic report: 12 passes at `speedup`, each off by `noise` (seeded); the gate estimates from them."""
    import random

    from tools.protocol import ABReport, ShapeAB

    rng = random.Random(f"{speedup}/{noise}")
    pass_a = [1e-3 * (1 + noise * rng.gauss(0, 1)) for _ in range(12)]
    pass_b = [1e-3 / speedup * (1 + noise * rng.gauss(0, 1)) for _ in range(12)]
    s = dict(shape="sq192", weight=1.0, pairs=100, speedup=speedup, speedup_lo=speedup, speedup_hi=speedup,
             time_a=1e-3, time_b=1e-3 / speedup, pass_a=pass_a, pass_b=pass_b, wall_a=1.02e-3, wall_b=1.02e-3 / speedup,
             extra_a=0.0, extra_b=0.0, extra_a_se=0.2e-6, idle_cpu_a=0.0, idle_cpu_b=0.0, probes=10) | shape
    return ABReport(shapes=[ShapeAB(**s)], passes=12, pairs=100, timing_seconds=1.0)


@pytest.mark.parametrize("ab, rejected, holds, words", [
    (_ab(1.5), False, True, "x1.50"),  # reproduced
    (_ab(1.0), False, False, "gain does not hold: the whole interval at or below x1.010"),  # counted apart
    (_ab(0.8), False, False, "gain does not hold: a regression"),
    (_ab(1.0105, noise=0.001), False, None, "gain not reproduced (x1.01"),  # straddles min_gain: shown, not counted
    (_ab(1.2, noise=0.2), False, None, "undecided"),  # noise decides nothing
    (_ab(10.0, extra_b=0.9e-3), True, None, "outside the timed region"),  # escaped work: a cheat
    (_ab(2.0, timed_outputs_ok=False, timed_outputs_problem="7 wrong"), True, None, "outputs of timed calls"),
    (_ab(2.0, probes=0), True, None, "integrity probes missing"),
])
def test_the_gain_is_rejudged_and_only_a_gain_that_does_not_hold_counts(ab, rejected, holds, words):
    """Timing verdicts sorted the audit's way (deterministic: synthetic reports through today's Gate.judge)."""
    from agent.gate import Gate
    from agent.reaudit import AuditRow, _classify
    from tests.fakes import CPU_TASK

    gate = Gate(CPU_TASK, TASK_REL)
    row = AuditRow(commit="0" * 40, title="t", recorded_speedup=1.5)
    _classify(row, gate.judge(ab), gate, "timing")
    assert row.rejected == rejected
    assert row.gain_holds == holds, row
    assert words in (row.reason if rejected else row.gain), row
    assert row.stages["check"] == "ok" and row.stages["timing"] == ("FAIL" if rejected else "ok")
    if not rejected:
        assert "recorded x1.500" in row.gain


def test_a_timed_audit_shows_the_gain_measured_here(tmp_path):
    """With timing (a short one): every layer runs; what the gain comes to on this machine is not asserted."""
    s = session_repo(tmp_path)
    res = invoke("audit", RUN_ID, "--runs-dir", str(s["runs"]), "--seconds", "0.5", "--json")
    out = json.loads(res.stdout)
    row = out["rows"][0]
    assert out["upto"] == "timing" and out["not_run"] == "" and out["machine"]
    assert all(row["stages"][k] == "ok" for k in ("scope", "static", "build", "audit", "check")), row
    assert row["stages"]["timing"] in ("ok", "FAIL")
    assert row["verdict_stage"] in ("accepted", "timing", "undecided")
    if row["stages"]["timing"] == "ok":
        assert row["gain"].startswith(("x", "gain not reproduced", "undecided")) and res.exit_code == 0
        # matmul_cpu declares an e2e check (when = "export"): a timed audit runs it on every commit that passes
        assert row["stages"]["e2e"] == "ok" and row["e2e"].startswith("pass, last-10 mean loss"), row
