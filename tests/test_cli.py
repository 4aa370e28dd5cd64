"""The CLI's everyday edges, without running a gate: --version, budget flags, run ids (full, by
unique prefix, ambiguous), `show RUN N --diff`, `log --json` numbers, replay's flip rule, errors
without tracebacks, worker scratch clean-up and the private request file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from agent import __version__
from agent.cli import _numbers, app
from agent.records import RunInfo, RunRecord
from agent.replay import ReplayReport, ReplayRow
from agent.session import evidence_trailers
from agent.trailers import parse_trailers, format_commit_message
from tools.judge_handle import SCRATCH_PREFIX, remove_stale_scratch

ROOT = Path(__file__).resolve().parents[1]
MATMUL = ROOT / "kernels" / "matmul_cpu"
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "60"})


def kloop(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}, timeout=300)


def fake_run(root: Path, run_id: str, patch: str = "") -> RunRecord:
    info = RunInfo(run_id=run_id, task="matmul_cpu", task_rel="kernels/matmul_cpu", task_path=root / "t",
                   policy="tuner", base_commit="0" * 40, branch=f"kloop/{run_id}", repo_root=root, worktree=root / "w")
    record = RunRecord.create(root, info)
    record.log("session_started")
    if patch:
        path = record.write_patch(1, patch)
        record.log("attempt_started", attempt=1, title="Unroll k", patch=str(path.relative_to(record.dir)))
        record.log("verdict", attempt=1, accepted=False, reason="not measurably faster", figures={"speedup": 1.001})
    return record


def test_version():
    res = invoke("--version")
    assert res.exit_code == 0 and res.output.strip() == f"kloop {__version__}"


@pytest.mark.parametrize("flag, value, words", [
    ("--max-cost", "-5", "greater than 0"), ("--max-attempts", "0", "at least 1"),
    ("--max-turns", "0", "at least 1"), ("--max-hours", "-1", "greater than 0"), ("--max-cost", "0", "greater than 0"),
])
@pytest.mark.parametrize("command", ["optimize", "resume"])
def test_budget_flags_are_validated(command, flag, value, words):
    target = "matmul_cpu" if command == "optimize" else "some-run"
    res = invoke(command, target, flag, value)
    assert res.exit_code == 2, res.output
    assert flag in res.output and words in res.output


def test_runs_prints_full_ids_and_commands_take_a_unique_prefix(tmp_path):
    ids = ["20261201-070000-matmul-cpu-aaaa", "20261201-070001-matmul-cpu-bbbb", "20261202-080000-matmul-cpu-cccc"]
    for run_id in ids:
        fake_run(tmp_path, run_id, patch="diff --git a/x b/x\n")
    res = invoke("runs", "--runs-dir", str(tmp_path))  # a narrow terminal must not cut the ids
    assert res.exit_code == 0
    for run_id in ids:
        assert run_id in res.output
    res = invoke("show", "20261202", "--runs-dir", str(tmp_path))
    assert res.exit_code == 0 and "20261202-080000-matmul-cpu-cccc" in res.output
    res = invoke("show", "20261201-07", "--runs-dir", str(tmp_path))
    assert res.exit_code == 2 and "ambiguous" in res.output
    assert ids[0] in res.output and ids[1] in res.output and ids[2] not in res.output
    res = invoke("show", "2025", "--runs-dir", str(tmp_path))
    assert res.exit_code == 2 and "no run '2025'" in res.output


def test_show_attempt_diff_prints_the_recorded_patch(tmp_path):
    patch = ("diff --git a/kernels/matmul_cpu/matmul.cpp b/kernels/matmul_cpu/matmul.cpp\n"
             "--- a/kernels/matmul_cpu/matmul.cpp\n+++ b/kernels/matmul_cpu/matmul.cpp\n"
             "@@ -1 +1 @@\n-int x = 0;\n+int x = 1;\n")
    record = fake_run(tmp_path, "20261201-070000-matmul-cpu-dddd", patch=patch)
    res = invoke("show", record.info.run_id, "1", "--diff", "--runs-dir", str(tmp_path))
    assert res.exit_code == 0 and res.output == patch
    table = invoke("show", record.info.run_id, "--runs-dir", str(tmp_path))
    assert table.exit_code == 0 and "Unroll k" in table.output and "rejected" in table.output
    one = invoke("show", record.info.run_id, "1", "--runs-dir", str(tmp_path))
    assert "not measurably faster" in one.output and "--diff" in one.output
    missing = invoke("show", record.info.run_id, "7", "--diff", "--runs-dir", str(tmp_path))
    assert missing.exit_code == 2 and "no attempt 7" in missing.output
    assert invoke("show", record.info.run_id, "--diff", "--runs-dir", str(tmp_path)).exit_code == 2


def test_log_json_numbers_are_numbers():
    figures = {"speedup": 1.2345, "speedup_lo": 1.2, "speedup_hi": 1.27,
               "ab": {"shapes": [{"shape": "sq192", "time_a": 0.00123, "time_b": 0.001, "speedup": 1.23,
                                  "speedup_lo": 1.2, "speedup_hi": 1.26, "pairs": 24}], "pairs": 24,
                      "timing_seconds": 3.0, "stopped_because": "interval", "alpha": 0.0061, "look": 2},
               "build": {"kernels": [{"name": "kloop_matmul", "registers": 80, "spill_store_bytes": 0, "spill_load_bytes": 4}]}}
    message = format_commit_message("Unroll", "because", evidence_trailers(figures, None, "run-1", 3))
    trailers = parse_trailers(message)
    t = dict(trailers)
    row = {"commit": "abc", "title": "Unroll", "attempt": t["Kloop-Attempt"], "speedup": t["Kloop-Speedup"],
           "interval": t["Kloop-Speedup-Interval"], "run": t["Kloop-Run"],
           "times": {k.removeprefix("Kloop-Time-"): v for k, v in trailers if k.startswith("Kloop-Time-")},
           "registers": {k.removeprefix("Kloop-Regs-"): v for k, v in trailers if k.startswith("Kloop-Regs-")}}
    out = json.loads(json.dumps(_numbers(row)))
    assert out["attempt"] == 3 and out["speedup"] == pytest.approx(1.2345)
    assert out["interval"] == [pytest.approx(1.2), pytest.approx(1.27)]
    # the interval is the gate's (each bound one-sided at the look's level), and the commit says so
    assert "Kloop-Speedup-CI95" not in t and t["Kloop-Speedup-Level"] == "one-sided 0.61% per bound, timed look 2 at its best"
    sq = out["times"]["sq192"]
    assert sq["best_ms"] == pytest.approx(1.23) and sq["candidate_ms"] == pytest.approx(1.0) and sq["pairs"] == 24
    assert sq["interval"] == [pytest.approx(1.2), pytest.approx(1.26)]
    assert out["registers"]["kloop-matmul"] == {"registers": 80, "registers_before": 80,
                                                "spill_store_bytes": 0, "spill_load_bytes": 4}


def test_replay_flips_either_way_fail_but_interrupted_rejections_do_not():
    def row(n, recorded, replayed, reason=""):
        return ReplayRow(attempt=n, title="t", recorded_accepted=recorded, recorded_reason=reason,
                         replayed_accepted=replayed, replayed_stage="timing" if not replayed else "accepted")

    agree = ReplayReport(run_id="r", recorded_machine="m", rows=[row(1, True, True), row(2, False, False)])
    assert agree.ok
    assert not ReplayReport(run_id="r", recorded_machine="m", rows=[row(1, True, False)]).ok
    up = ReplayReport(run_id="r", recorded_machine="m", rows=[row(1, False, True, "not measurably faster")])
    assert not up.ok and up.counts()["rejected -> accepted"] == 1
    cut = ReplayReport(run_id="r", recorded_machine="m", rows=[row(1, False, True, "interrupted: the session stopped")])
    assert cut.ok and cut.counts()["interrupted (not compared)"] == 1


def test_an_accept_undecided_on_a_noisy_replay_is_unconfirmed_not_flipped():
    """A loaded replay machine that cannot decide neither confirms nor contradicts: not ok, not a flip."""
    noisy = ReplayRow(attempt=1, title="t", recorded_accepted=True, recorded_reason="faster: x4.1",
                      replayed_accepted=False, replayed_stage="timing",
                      replayed_reason="undecided (noisy machine): workload time ratio x4.2 ... (half-width 0.1 in log)")
    assert noisy.unconfirmed and not noisy.flipped
    report = ReplayReport(run_id="r", recorded_machine="m", rows=[noisy])
    assert not report.ok and not report.contradicted
    assert report.counts()["accepted, undecided here"] == 1 and report.counts()["accepted -> rejected"] == 0
    slower = noisy.model_copy(update={"replayed_reason": "not measurably faster: workload time ratio x1.0"})
    assert slower.flipped and not slower.unconfirmed
    assert ReplayReport(run_id="r", recorded_machine="m", rows=[slower]).contradicted
    # a rejection undecided here was never a claim of a gain: it agrees with a recorded rejection
    rejected = noisy.model_copy(update={"recorded_accepted": False, "recorded_reason": "not measurably faster"})
    assert rejected.agrees and not rejected.flipped and ReplayReport(run_id="r", recorded_machine="m", rows=[rejected]).ok


def test_replay_passes_its_gate_seconds_over_the_recorded_ones():
    from agent.policies.replay import RecordedAttempt, ReplayPolicy
    from tools.agent_tools import SubmitInput

    seen = []

    class Box:  # the submit tool's own input model: an argument it would refuse fails here too
        def call(self, name, args):
            if name == "submit":
                SubmitInput(**args)
            seen.append((name, args))
            return SimpleNamespace(ok=True, data={"accepted": True, "stage": "accepted"}, text="")

    ctx = SimpleNamespace(stop_reason=lambda: None, toolbox=Box())
    attempts = [RecordedAttempt(number=1, title="one", accepted=True, patch="p", gate_seconds=2.0),
                RecordedAttempt(number=2, title="two", accepted=False, patch="p")]
    ReplayPolicy(attempts).run(ctx)
    assert [a.get("gate_seconds") for n, a in seen if n == "submit"] == [2.0, None]
    seen.clear()
    ReplayPolicy(attempts, gate_seconds=8.0).run(ctx)
    assert [a.get("gate_seconds") for n, a in seen if n == "submit"] == [8.0, 8.0]
    # the command's bounds are the submit tool's: a cap it would refuse is a usage error, not a "flip"
    res = CliRunner().invoke(app, ["replay", "last", "--gate-seconds", "60"])
    assert res.exit_code == 2 and "--gate-seconds" in res.output


def test_bad_task_bad_spec_and_bad_run_are_one_paragraph(tmp_path):
    res = kloop("eval", str(tmp_path / "nothere"))
    assert res.returncode == 2 and "no task" in res.stderr and "Traceback" not in res.stderr
    task = tmp_path / "matmul_cpu"
    shutil.copytree(MATMUL, task)
    spec = task / "spec.py"
    lines = spec.read_text().splitlines()
    lines.insert(3, "def broken(:")
    spec.write_text("\n".join(lines) + "\n")
    res = kloop("eval", str(task), "--no-bench")
    assert res.returncode == 2 and "Traceback" not in res.stderr + res.stdout
    assert f"{spec}:4" in res.stderr.replace("\n", "") and "SyntaxError" in res.stderr
    lines[3] = "raise ValueError('no such dtype')"
    spec.write_text("\n".join(lines) + "\n")
    res = kloop("optimize", str(task), "--agent", "tuner", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{spec}:4" in res.stderr.replace("\n", "") and "no such dtype" in res.stderr
    assert not (tmp_path / "runs").exists()
    res = kloop("resume", "nosuchrun", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 2 and "no run 'nosuchrun'" in res.stderr and "Traceback" not in res.stderr


def test_stale_worker_scratch_is_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{SCRATCH_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-def"
    for d in (stale, live):
        d.mkdir()
        (d / "request.json").write_text('{"seed": 1}')
    removed = remove_stale_scratch(tmp_path)
    assert removed == [stale] and not stale.exists() and live.exists()


def test_worker_scratch_is_named_after_its_owner_and_the_request_is_private():
    """The request (it holds the gate's seed) is owner-only from the start; the scratch folder names
    this process, so the next start can tell a dead owner's folder."""
    from tools.protocol import WorkerRequest
    from tools.judge_handle import run_worker

    wrap = ["sh", "-c", 'echo "SEEN $(stat -c %a "$4") $4"; exit 3', "sh"]  # in place of the worker
    res = run_worker(WorkerRequest(kind="probe", task_dir=str(MATMUL)), timeout=120, prefix=wrap)
    assert not res.ok and "exited with status 3" in res.error
    mode, path = res.error.split("SEEN ", 1)[1].split()[:2]
    assert mode == "600", res.error
    assert Path(path).parent.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
    assert not Path(path).parent.exists()  # removed when the worker is done
    assert Path(tempfile.gettempdir()) == Path(path).parent.parent


def test_loading_a_spec_writes_nothing_in_the_task_folder(tmp_path):
    """The CLI imports the spec up front (clear errors): that must not leave a __pycache__ behind,
    which would make the user's task folder dirty."""
    from tools.spec import load_spec

    task = tmp_path / "matmul_cpu"
    shutil.copytree(MATMUL, task, ignore=shutil.ignore_patterns("__pycache__"))
    load_spec(task / "spec.py")
    assert sorted(p.name for p in task.iterdir()) == ["e2e.py", "matmul.cpp", "spec.py", "task.toml"]


def test_optimize_cuda_task_without_gpu_says_where_to_go(tmp_path):
    """No GPU: refused before any worktree or record, naming the GPU-free way in (session start)."""
    from tools.device import missing_device

    if missing_device("cuda") is None:
        pytest.skip("a CUDA device is visible here")
    runs = tmp_path / "runs"
    res = invoke("optimize", "softmax", "--agent", "tuner", "--runs-dir", str(runs))
    assert res.exit_code == 1, res.output
    said = " ".join(res.stderr.split())  # rich wraps at 60 columns
    assert "no CUDA device here" in said and "kloop session start softmax" in said
    assert not runs.exists() or not any(runs.iterdir())


def test_printed_hints_work_as_printed(tmp_path, monkeypatch):
    """`kloop VERB RUN` hints (resume, log, show) carry --runs-dir, quoted, when the run is not where
    kloop looks by default, and run as printed; none where it is (issue 27)."""
    import shlex

    from agent.cli import run_command

    runs = tmp_path / "my runs"
    record = fake_run(runs, "20261201-070000-matmul-cpu-hint", patch="diff --git a/x b/x\n")
    monkeypatch.delenv("KLOOP_RUNS", raising=False)
    for verb in ("resume", "log", "show"):
        argv = shlex.split(run_command(verb, record.dir))
        assert argv == ["kloop", verb, record.info.run_id, "--runs-dir", str(runs)]
    res = invoke(*shlex.split(run_command("show", record.dir))[1:])
    assert res.exit_code == 0 and "Unroll k" in res.output
    monkeypatch.setenv("KLOOP_RUNS", str(runs))  # where kloop looks by default: no --runs-dir needed
    assert run_command("resume", record.dir) == f"kloop resume {record.info.run_id}"


def test_a_second_stop_names_what_was_running(tmp_path, monkeypatch):
    """A second Ctrl-C while the policy waits on the API: 'stopped now' names that, never a killed
    evaluation (issue 27); with a gate evaluation killed, it names the evaluation."""
    import io
    from types import SimpleNamespace

    import typer
    from rich.console import Console

    import agent.cli as cli

    run_dir = fake_run(tmp_path / "runs", "20261201-070000-matmul-cpu-stop").dir

    class Stopped:
        killed = None
        record = SimpleNamespace(dir=run_dir)

        def run(self, policy):
            raise KeyboardInterrupt("stopped now (SIGINT)")

    for killed, doing, said in [(None, "the API request of turn 3", "the API request of turn 3 was cut off (no evaluation"),
                                ("the gate's evaluation of attempt 2", "the tool call submit of turn 3",
                                 "the gate's evaluation of attempt 2 was killed")]:
        out = io.StringIO()
        monkeypatch.setattr(cli, "err_console", Console(file=out, width=300))
        session = Stopped()
        session.killed = killed
        with pytest.raises(typer.Exit) as exc:
            cli._run_session(session, SimpleNamespace(doing=doing))
        assert exc.value.exit_code == cli.EXIT_INTERRUPTED
        text = out.getvalue()
        assert "stopped now" in text and said in text and "--runs-dir" in text
        assert killed or "killed" not in text
