"""A session on a machine without the task's device (a CUDA task on a GPU-less workstation): it starts
with the baseline *pending* (said so, recorded in run.json), build/sass/files work, and the device tools
(check, bench, sweep, profile, submit) answer "not run" (exit 3) naming the way on, never a traceback;
the same through MCP. Resumed where the device is, the baseline is measured then.

The CUDA subprocesses run with CUDA_VISIBLE_DEVICES="" so that these tests hold on a GPU machine too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import git
import pytest

from agent.records import RunRecord
from tests.session_repo import KEY, ROOT, make_repo

pytestmark = pytest.mark.slow

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA task builds)")


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLOOP_")}
    env.update(PYTHONPATH=str(ROOT), ANTHROPIC_API_KEY=KEY, CUDA_VISIBLE_DEVICES="",
               KLOOP_CACHE=os.environ.get("KLOOP_CACHE", str(tmp / "cache")), KLOOP_RUNS=str(tmp / "runs"))
    env.update(extra)
    return env


def kloop(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.long  # CI time (16 min on 2026-12-07): run with `-m long`
@needs_nvcc
def test_cuda_session_without_a_device_starts_pending(tmp_path):
    env = _env(tmp_path)
    start = kloop(["session", "start", "softmax", "--json"], tmp_path, env)
    assert start.returncode == 0, start.stdout + start.stderr
    out = json.loads(start.stdout)
    assert out["baseline_pending"] == "no CUDA device here"
    run_dir, wt = Path(out["run_dir"]), Path(out["worktree"])
    assert RunRecord.open(run_dir).info.baseline_pending == "no CUDA device here"
    assert not [e for e in RunRecord.open(run_dir).events() if e.kind == "baseline"]
    assert (wt / "AGENTS.md").is_file()

    human = kloop(["session", "start", "softmax"], tmp_path, env)  # a second one, for the words people read
    assert human.returncode == 0, human.stderr
    said = " ".join(human.stderr.split())
    assert "baseline pending: no CUDA device here" in said and "build, sass and the audit work" in said
    assert "kloop resume" in said and "GPU machine" in said

    build = kloop(["build"], wt, env)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "build ok" in build.stdout and "softmax_rows" in build.stdout
    for args in (["check"], ["bench"], ["profile"], ["submit", "-m", "a change"], ["tool", "sweep", "{}"]):
        res = kloop(args, wt, env)
        assert res.returncode == 3, (args, res.stdout, res.stderr)
        assert res.stdout.startswith("not run:") and "no CUDA device here" in res.stdout, res.stdout
        assert f"kloop resume {run_dir.name}" in res.stdout
        assert "Traceback" not in res.stdout + res.stderr
    status = kloop(["status", "--json"], wt, env)
    assert status.returncode == 0 and json.loads(status.stdout)["data"]["baseline_pending"] == "no CUDA device here"
    # nothing was attempted: the refused submit cost no attempt
    assert not [e for e in RunRecord.open(run_dir).events() if e.kind == "attempt_started"]

    from tools.sass import find_cuobjdump

    if find_cuobjdump() is not None:
        sass = kloop(["sass"], wt, env)
        assert sass.returncode == 0 and "instructions" in sass.stdout, sass.stdout + sass.stderr


@needs_nvcc
def test_mcp_without_a_device(tmp_path):
    import mcp_types as types
    from mcp import Client, StdioServerParameters

    env = _env(tmp_path)
    params = StdioServerParameters(command=sys.executable, cwd=str(tmp_path), args=["-m", "agent.cli", "mcp", "softmax"],
                                   env={k: env[k] for k in ("PYTHONPATH", "ANTHROPIC_API_KEY", "CUDA_VISIBLE_DEVICES",
                                                            "KLOOP_CACHE", "KLOOP_RUNS", "PATH")})

    def text(r) -> str:
        return "\n".join(c.text for c in r.content if isinstance(c, types.TextContent))

    async def drive() -> dict:
        async with Client(params, client_info=types.Implementation(name="pytest", version="1"), mode="legacy",
                          read_timeout_seconds=600) as client:
            out = {"briefing": (await client.read_resource("kloop://briefing")).contents[0].text}
            for name in ("build", "check", "bench", "submit", "status"):
                args = {"title": "a change"} if name == "submit" else {}
                out[name] = await client.call_tool(name, args)
            return out

    out = anyio.run(drive)
    assert "kloop session" in out["briefing"]
    assert not out["build"].is_error and "build ok" in text(out["build"])
    for name in ("check", "bench", "submit"):
        assert out[name].is_error and text(out[name]).startswith("not run:"), text(out[name])
        assert "kloop resume" in text(out[name])
    assert "baseline pending" in text(out["status"])
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if (p / "run.json").is_file()]
    assert RunRecord.open(run_dir).info.baseline_pending == "no CUDA device here"


@pytest.mark.long  # CI time (16 min on 2026-12-07): run with `-m long`
def test_resumed_where_the_device_is_the_baseline_is_measured(tmp_path, monkeypatch):
    """Started 'without the device' (the check made to say so, on a CPU task), resumed in a process
    where the device is there: `kloop session resume` measures the baseline and clears the pending mark."""
    import tools.device
    from agent.policies.base import Budget
    from agent.session_service import SessionService

    task = make_repo(tmp_path)
    monkeypatch.setenv("KLOOP_CACHE", os.environ.get("KLOOP_CACHE", str(tmp_path / "cache")))
    monkeypatch.setattr(tools.device, "missing_device", lambda target: "no CUDA device here")
    service = SessionService.start(task, "cli", Budget(), runs_root=tmp_path / "runs")
    try:
        assert service.ensure_best() == "no CUDA device here"
        assert service.call("check", {}).event == "no_device"
        assert service.call("build", {}).ok
    finally:
        service.close()
    run_dir = service.run_dir
    assert RunRecord.open(run_dir).info.baseline_pending == "no CUDA device here"
    monkeypatch.undo()

    env = _env(tmp_path)
    env.pop("CUDA_VISIBLE_DEVICES")
    res = kloop(["session", "resume", str(run_dir), "--json"], tmp_path, env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["baseline_pending"] is None
    record = RunRecord.open(run_dir)
    assert record.info.baseline_pending is None
    assert [e for e in record.events() if e.kind == "baseline"]
    wt = Path(json.loads(res.stdout)["worktree"])
    check = kloop(["check"], wt, env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert git.Repo(wt).active_branch.name == record.info.branch
