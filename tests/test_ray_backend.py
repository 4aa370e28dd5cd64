"""The Ray backend (agent/parallel.py) on the CPU task, on a real local Ray: two judges, each holding one
CPU slot, judge two candidates against the same best at once; the record names the worker of each
verdict; at most one commit lands (the branch stays a chain); a judge killed -9 mid-decision, or one
that never answers, gives an interrupted attempt and a fresh judge, never a verdict; a session killed
while its judges run resumes with those attempts interrupted. Outcomes asserted here are structural
(which worker, how many commits, what the record says), never a measured gain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.gate import GateConfig
from agent.policies.base import Budget
from agent.session import Session
from tests.fakes import make_repo

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]
GATE = GateConfig(max_seconds=2.0, min_pairs=8, standby=False)
pytestmark = [pytest.mark.slow, pytest.mark.long]  # CI time: a Ray cluster per module (~25 s) and judges at once; run with `-m long`


@pytest.fixture(scope="module")
def ray_local():
    from agent.parallel import _no_secrets_in_environ

    with _no_secrets_in_environ():
        ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def session(ray_local, tmp_path_factory):
    from agent.parallel import RayPool

    tmp = tmp_path_factory.mktemp("ray")
    repo = make_repo(tmp, timeout_s=120)
    s = Session.start(repo / "kernels" / "matmul_cpu", "test", Budget(), runs_root=tmp / "runs", gate_config=GATE)
    s.establish_baseline()
    s.pool = RayPool("local", 2, s.gate, timeout_s=120)
    yield s
    s.close()


def _pid(worker: str) -> int:
    return int(worker.split("@", 1)[1].split(":", 1)[1].split()[0])


def _verdicts(session, numbers):
    return {e.attempt: e for e in session.events() if e.kind == "verdict" and e.attempt in numbers}


def test_two_candidates_judged_at_once_by_two_workers(session):
    names = session.pool.names
    assert len(names) == 2 and names[0].startswith("judge-0@") and names[1].startswith("judge-1@")
    head = session.ws.head()
    first = session.attempts_made() + 1
    out = session.submit_batch([{"title": "Loop order i-k-j", "knobs": {"LOOP_ORDER": 1}},
                                {"title": "Blocking 16", "knobs": {"TILE": 16}}])
    assert len(out) == 2 and all(not isinstance(o, str) for o in out)
    events = _verdicts(session, {first, first + 1})
    assert set(events) == {first, first + 1}
    assert {events[first].worker, events[first + 1].worker} == set(names)  # one judge each, at the same time
    accepted = [n for n, e in events.items() if e.accepted]
    commits = session.ws.commits_since_base()
    assert len(accepted) <= 1 and len(commits) == len(accepted) + (0 if head == session.ws.base_commit else 1)
    starts = {e.attempt: e for e in session.events() if e.kind == "attempt_started" and e.attempt in events}
    assert {e.best_commit for e in starts.values()} == {head}  # both against the same best
    for n, e in events.items():
        if not e.accepted and out[n - first].accepted:
            raise AssertionError("an accepted verdict must be recorded as accepted or superseded")
        if e.figures.get("stage") == "superseded":
            assert "superseded" in e.reason and accepted
    assert session.ws.changed_paths(against=session.best_commit) == []  # tree at the (new) best


def _kill_during(session, sig, after_s: float, items):
    """Run submit_batch; `after_s` in, send `sig` to the judge busy with the first item."""
    result = {}
    names = session.pool.names
    t = threading.Thread(target=lambda: result.setdefault("out", session.submit_batch(items)))
    t.start()
    time.sleep(after_s)
    os.kill(_pid(names[0]), sig)
    t.join(timeout=300)
    assert not t.is_alive()
    return result["out"], names


def test_a_judge_killed_mid_decision_gives_an_interrupted_attempt(session):
    first = session.attempts_made() + 1
    head = session.ws.head()
    out, names = _kill_during(session, signal.SIGKILL, 1.5, [{"title": "Blocking 64", "knobs": {"TILE": 64}},
                                                            {"title": "Blocking 64, i-j-k", "knobs": {"TILE": 64, "LOOP_ORDER": 0}}])
    e = _verdicts(session, {first})[first]
    assert not e.accepted and e.figures["stage"] == "interrupted" and "died mid-decision" in e.reason
    assert e.worker == names[0]
    assert session.pool.names[0] != names[0]  # replaced by a fresh judge
    assert session.ws.changed_paths(against=session.best_commit) == []
    assert len(session.ws.commits_since_base()) <= 1 + (head != session.ws.base_commit)


def test_a_judge_that_never_answers_is_killed_and_its_attempt_interrupted(session):
    session.pool.timeout_s = 6.0
    first = session.attempts_made() + 1
    try:
        out, names = _kill_during(session, signal.SIGSTOP, 0.5, [{"title": "Blocking 16, i-j-k", "knobs": {"TILE": 16, "LOOP_ORDER": 0}}])
    finally:
        session.pool.timeout_s = 120
    e = _verdicts(session, {first})[first]
    assert not e.accepted and e.figures["stage"] == "interrupted" and "did not answer within 6 s" in e.reason
    assert session.pool.names[0] != names[0]


@pytest.mark.long
def test_a_session_killed_while_judges_run_resumes(tmp_path):
    repo = make_repo(tmp_path, timeout_s=120)
    runs = tmp_path / "runs"
    env = {**os.environ, "KLOOP_RUNS": str(runs), "COLUMNS": "200"}
    env.pop("ANTHROPIC_API_KEY", None)
    cmd = [sys.executable, "-m", "agent.cli", "optimize", str(repo / "kernels" / "matmul_cpu"), "--agent", "tuner",
           "--ray", "local", "--workers", "2", "--gate-seconds", "3", "--runs-dir", str(runs)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    events_path = None
    deadline = time.monotonic() + 400
    open_attempts: set[int] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(runs.glob("*/events.jsonl"))
        if found:
            events_path = found[0]
            evs = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
            started = {e["attempt"] for e in evs if e["kind"] == "attempt_started"}
            judged = {e["attempt"] for e in evs if e["kind"] == "verdict"}
            open_attempts = started - judged
            if len(open_attempts) >= 2:
                break
        time.sleep(0.2)
    assert len(open_attempts) >= 2, (proc.poll(), proc.stdout.read().decode()[-3000:] if proc.poll() is not None else "")
    os.kill(proc.pid, signal.SIGKILL)  # the session process alone: its judges are Ray's
    proc.wait(timeout=30)
    run_id = events_path.parent.name
    res = subprocess.run([sys.executable, "-m", "agent.cli", "resume", run_id, "--runs-dir", str(runs), "--max-attempts",
                          str(max(open_attempts))], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    for n in sorted(open_attempts):
        assert f"marked attempt {n}" in out and "as interrupted" in out
    evs = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    for n in open_attempts:
        v = [e for e in evs if e["kind"] == "verdict" and e["attempt"] == n]
        assert v and v[0]["figures"]["stage"] == "interrupted"
