"""The tuner, through the same gate: on the CPU task it finds the best knob setting and commits it."""

from __future__ import annotations

import git
import pytest
from rich.console import Console

from agent.gate import GateConfig
from agent.policies.base import Budget
from agent.policies.tuner import TunerPolicy
from agent.session import Session
from agent.trailers import parse_trailers
from tests.fakes import make_repo
from tools.sweep import knob_grid

pytestmark = pytest.mark.slow


@pytest.mark.long
def test_tuner_finds_and_commits_the_best_knob_setting(tmp_path):
    repo = make_repo(tmp_path)
    session = Session.start(repo / "kernels" / "matmul_cpu", "tuner", Budget(max_attempts=4), runs_root=tmp_path / "runs",
                            gate_config=GateConfig(max_seconds=3.0, min_pairs=12))
    tuner = TunerPolicy(console=Console(file=open(tmp_path / "tuner.log", "w")))
    reason = session.run(tuner)
    assert reason in ("search exhausted", "max_attempts") or "rejections" in reason
    ranking = [e for e in session.events() if e.kind == "note" and e.text == "tuner ranking"][0].data["rows"]
    assert len(ranking) == len(knob_grid(session.gate.task)) == 6
    accepted = [a for a in session.attempts() if a.accepted]
    assert accepted, [a.reason for a in session.attempts()]
    # the landed setting is the i-k-j loop order: the large effect on any CPU (column walks of B are cache-hostile)
    repo_git = git.Repo(repo)
    tip = repo_git.commit(session.record.info.branch)
    knobs = dict(parse_trailers(tip.message))["Kloop-Knobs"]
    assert "LOOP_ORDER=1" in knobs
    assert (tip.tree / "kernels" / "matmul_cpu" / "knobs.toml").data_stream.read().decode().count("LOOP_ORDER = 1") == 1
    # every accepted setting was ranked faster than the one it replaced, and nothing else landed
    commits = list(repo_git.iter_commits(f"{session.record.info.base_commit}..{session.record.info.branch}"))
    assert len(commits) == len(accepted)


@pytest.mark.long  # CI time (16 min on 2026-12-07): run with `-m long`
def test_large_knob_spaces_are_sampled_with_tpe(tmp_path, monkeypatch):
    """Past EXHAUSTIVE_MAX settings the tuner samples (optuna TPE, ask/tell), starting from the current setting."""
    import agent.policies.tuner as tuner_mod

    monkeypatch.setattr(tuner_mod, "EXHAUSTIVE_MAX", 2)
    repo = make_repo(tmp_path)
    session = Session.start(repo / "kernels" / "matmul_cpu", "tuner", Budget(max_attempts=1), runs_root=tmp_path / "runs",
                            gate_config=GateConfig(max_seconds=2.0, min_pairs=12))
    tuner = TunerPolicy(trials=4, seed=0, console=Console(file=open(tmp_path / "tuner.log", "w")))
    rows = tuner.rank(session.facade())
    assert 1 <= len(rows) <= 4 and all(r.ok for r in rows)
    assert {"LOOP_ORDER": 0, "TILE": 0} in [r.knobs for r in rows]  # the enqueued starting point
    assert rows == sorted(rows, key=lambda r: r.score)


def test_fewer_trials_than_settings_are_sampled_not_swept(monkeypatch):
    """`trials` bounds the settings evaluated even in a space under EXHAUSTIVE_MAX: 3 trials of a 6-setting
    space go to TPE (a 30-setting Triton sweep asked for 12 once ran all 30 on the H200)."""
    from agent.policies import tuner as tuner_mod

    calls = []

    class Box:
        def call(self, name, args):
            from tools.base import ToolResult

            assert name == "knobs"
            return ToolResult(text="", data={"current": {"A": 0, "B": 0}, "knobs": {"A": [0, 1, 2], "B": [0, 1]}, "space": 6})

    ctx = type("Ctx", (), {"toolbox": Box()})()
    monkeypatch.setattr(TunerPolicy, "_sweep", lambda self, c, configs: calls.append(("sweep", len(configs))) or [])
    monkeypatch.setattr(TunerPolicy, "_sample", lambda self, c, space: calls.append(("sample", self.trials)) or [])
    assert tuner_mod.EXHAUSTIVE_MAX >= 6
    TunerPolicy(trials=3).rank(ctx)
    TunerPolicy(trials=6).rank(ctx)
    assert calls == [("sample", 3), ("sweep", 6)]


def _ranked_ctx(submit):
    """A policy context whose record holds a sweep ranking of K=0 (the current setting, 3.0), K=1 (1.0)
    and K=2 (2.0); `submit(args)` answers each submit call."""
    from tools.base import ToolResult
    from tools.sweep import SweepRow

    rows = [SweepRow(knobs={"K": 0}, ok=True, score=3.0), SweepRow(knobs={"K": 1}, ok=True, score=1.0),
            SweepRow(knobs={"K": 2}, ok=True, score=2.0)]

    class Box:
        def call(self, name, args):
            if name == "knobs":
                return ToolResult(text="", data={"current": {"K": 0}, "knobs": {"K": [0, 1, 2]}, "space": 3})
            assert name == "submit"
            return submit(args)

    class Ctx:
        toolbox = Box()

        def events(self):
            return [type("E", (), {"kind": "note", "text": "tuner ranking", "data": {"rows": [r.model_dump() for r in rows]}})()]

        def attempts(self):
            return []

        def stop_reason(self):
            return None

        def log(self, *a, **k):
            pass

    return Ctx()


def test_a_refused_submit_is_skipped_not_fatal(tmp_path):
    """A setting the session refuses without judging (e.g. one that builds to the best's own code) costs
    nothing and the tuner goes on to the next ranked setting."""
    from tools.base import ToolResult

    submitted = []

    def submit(args):
        submitted.append(args["knobs"])
        if args["knobs"] == {"K": 1}:
            return ToolResult(ok=False, text="not run: builds to the same code as the best", event="refused")
        return ToolResult(text="accepted", event="accepted", data={"accepted": True})

    reason = TunerPolicy(console=Console(file=open(tmp_path / "tuner.log", "w"))).run(_ranked_ctx(submit))
    assert submitted == [{"K": 1}, {"K": 2}] and reason == "search exhausted"


def test_an_undecided_verdict_is_resubmitted_once_with_the_seconds_the_gate_named(tmp_path):
    """On a loaded machine the gate may say undecided and name the timing that would decide; the tuner
    re-submits that setting once with it (a second undecided is a miss, not a loop)."""
    from tools.base import ToolResult

    submitted = []

    def submit(args):
        submitted.append((args["knobs"], args.get("gate_seconds")))
        if args["knobs"] == {"K": 1} and args.get("gate_seconds") == 9:
            return ToolResult(text="accepted", event="accepted", data={"accepted": True, "stage": "accepted"})
        return ToolResult(text="undecided", event="rejected",
                          data={"accepted": False, "stage": "undecided", "decide_seconds": 9})

    TunerPolicy(console=Console(file=open(tmp_path / "tuner.log", "w"))).run(_ranked_ctx(submit))
    # K=1 decided on its second look and became the best; K=2 (ranked slower than it) is not tried
    assert submitted == [({"K": 1}, None), ({"K": 1}, 9)]


def test_a_sweep_where_every_setting_failed_is_not_recorded(tmp_path):
    """The best itself failing in the sweep means the sweep measured nothing (e.g. the worktree
    vanished): no ranking and no 'search exhausted' go into the record; a resume sweeps again, also
    over such a ranking recorded before this rule."""
    from agent.policies.tuner import RANKING_NOTE, PolicyToolError
    from tools.base import ToolResult
    from tools.sweep import SweepRow

    failed = [SweepRow(knobs={"K": k}, ok=False, error=f"build failed: no such file (K={k})") for k in (0, 1)]
    calls, logged = [], []

    class Box:
        def call(self, name, args):
            calls.append(name)
            if name == "knobs":
                return ToolResult(text="", data={"current": {"K": 0}, "knobs": {"K": [0, 1]}, "space": 2})
            assert name == "sweep"
            return ToolResult(text="", data={"rows": [r.model_dump() for r in failed]})

    class Ctx:
        toolbox = Box()
        recorded: list = []

        def events(self):
            return self.recorded

        def attempts(self):
            return []

        def stop_reason(self):
            return None

        def log(self, kind, **k):
            logged.append((kind, k.get("text")))

    tuner = TunerPolicy(console=Console(file=open(tmp_path / "tuner.log", "w")))
    with pytest.raises(PolicyToolError, match="every one of the 2 settings failed"):
        tuner.run(Ctx())
    assert logged == [] and "sweep" in calls
    old = Ctx()
    old.recorded = [type("E", (), {"kind": "note", "text": RANKING_NOTE, "data": {"rows": [r.model_dump() for r in failed]}})()]
    assert TunerPolicy.recorded_ranking(old) is None


def test_tools_refuse_a_vanished_worktree(tmp_path):
    """With the worktree gone, knobs and sweep answer an error naming it (and `kloop resume`), never
    a ranking of builds that failed for want of files."""
    import shutil

    repo = make_repo(tmp_path)
    session = Session.start(repo / "kernels" / "matmul_cpu", "tuner", Budget(), runs_root=tmp_path / "runs")
    try:
        shutil.rmtree(session.ws.path)
        for name, args in (("knobs", {}), ("sweep", {"configs": [{"LOOP_ORDER": 1}]})):
            res = session.toolbox.call(name, args)
            assert not res.ok and "does not exist" in res.text and "kloop resume" in res.text, (name, res.text)
        assert not [e for e in session.events() if e.kind == "note" and e.text == "tuner ranking"]
    finally:
        session.close()


def test_a_setting_that_regresses_a_shape_beyond_its_allowance_is_tried_last():
    """The sweep's fastest workload can be slower on one bench shape than the gate allows there (the gate
    judges every shape): such a setting goes behind the others, in order, and is still tried."""
    import io

    from tools.sweep import SweepRow

    def row(knob, big, small):
        return SweepRow(knobs={"K": knob}, ok=True, times={"big": big, "small": small}, score=big + 0.5 * small)

    base, fast_but_regresses, faster, slower = row(0, 500, 50), row(1, 380, 60), row(2, 420, 50), row(3, 510, 50)
    ranked = sorted([base, fast_but_regresses, faster, slower], key=lambda r: r.score)
    tuner = TunerPolicy(console=Console(file=io.StringIO()))
    out = tuner._regressions_last(ranked, {"K": 0}, {"big": 0.03, "small": 0.05})
    assert [r.knobs["K"] for r in out] == [2, 0, 3, 1]
    assert "slower than the best on small" in tuner.console.file.getvalue()
    # inside the allowance (50 -> 52: 4% < 5%) nothing moves; without allowances nothing moves
    within = row(1, 380, 52)
    assert tuner._regressions_last([within, base], {"K": 0}, {"big": 0.03, "small": 0.05})[0] is within
    assert tuner._regressions_last(ranked, {"K": 0}, {}) == ranked
