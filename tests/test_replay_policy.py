"""Replay is a policy: it re-submits recorded patches through `submit` and follows the recorded path.

Only verdicts that do not depend on timing noise are used (scope, build and check rejections), so
these tests hold on a loaded machine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agent.gate import GateConfig
from agent.policies import REGISTRY, PolicyError, make_policy
from agent.policies.base import Budget
from agent.policies.replay import RecordedAttempt, ReplayPolicy
from agent.replay import replay
from agent.session import Session
from tests.fakes import make_repo
from tests.test_gate_session import edit
from tools.base import ToolResult


class FakeTools:
    def __init__(self, verdicts):
        self.calls, self.verdicts = [], list(verdicts)

    def call(self, name, args):
        self.calls.append(name)
        if name == "apply_patch":
            return ToolResult(ok="BAD" not in args["patch"], text="patch does not apply: corrupt patch")
        if name == "submit":
            return ToolResult(text="", data=self.verdicts.pop(0))
        return ToolResult(text="ok")


def test_the_policy_follows_the_recorded_path_not_this_gates():
    attempts = [RecordedAttempt(number=1, title="a", accepted=True, patch="p1"),
                RecordedAttempt(number=2, title="bb", accepted=False, patch="BAD"),
                RecordedAttempt(number=3, title="ccc", accepted=False, patch="p3")]
    tools = FakeTools([{"accepted": False, "stage": "timing", "reason": "noisy"},
                       {"accepted": True, "stage": "accepted", "reason": "faster", "speedup": 1.3, "speedup_lo": 1.2, "speedup_hi": 1.4}])
    policy = ReplayPolicy(attempts)
    ctx = SimpleNamespace(toolbox=tools, stop_reason=lambda: None)
    assert policy.run(ctx) == "replayed 3 attempts"
    # accepted when recorded: adopted even though rejected here; a patch that fails is dropped; a recorded reject is dropped
    assert tools.calls == ["apply_patch", "submit", "adopt", "apply_patch", "revert", "apply_patch", "submit", "revert"]
    rows = policy.rows
    assert [r.agrees for r in rows] == [False, True, False]
    assert rows[1].replayed_stage == "patch" and "does not apply" in rows[1].replayed_reason
    assert rows[2].replayed_speedup == 1.3 and rows[2].replayed_lo == 1.2
    assert not any(r.broken for r in rows)  # a timing reject of a recorded accept is noise, not breakage


def test_registry_names_every_policy():
    assert {"claude", "tuner", "replay"} <= set(REGISTRY)
    assert make_policy("tuner", seed=3).name == "tuner"
    with pytest.raises(PolicyError, match="known: claude, tuner, replay"):
        make_policy("nope")
    with pytest.raises(PolicyError, match="kloop replay"):
        make_policy("replay")


@pytest.mark.long
@pytest.mark.slow
def test_replay_of_a_recorded_session_agrees_and_catches_a_broken_accept(tmp_path):
    repo = make_repo(tmp_path)
    s = Session.start(repo / "kernels" / "matmul_cpu", "test", Budget(), runs_root=tmp_path / "runs",
                      gate_config=GateConfig(max_seconds=1.0, min_pairs=4))
    s.establish_baseline()
    edit(s, "float acc = 0.f;", "float acc = 0.f\n")
    assert s.submit("Typo", "").stage == "build"
    edit(s, "for (int k = 0; k < K; ++k) acc +=", "for (int k = 0; k + 1 < K; ++k) acc +=")
    assert s.submit("Skip the last k", "").stage == "check"
    spec = s.ws.task_path / "spec.py"
    spec.write_text(spec.read_text() + "\n# tampered\n")
    assert s.submit("Touch the spec", "").stage == "scope"
    s.ws.remove()
    rows = []
    report = replay(s.record.dir, on_row=rows.append)
    assert [r.replayed_stage for r in report.rows] == ["build", "check", "scope"] and rows == report.rows
    assert all(r.agrees for r in report.rows) and report.ok
    # a record that claims the typo was accepted: the replay says it no longer builds here
    s.log("verdict", attempt=1, accepted=True, reason="forged", figures={"speedup": 1.5})
    report = replay(s.record.dir)
    assert report.rows[0].broken and not report.ok
    # later attempts were made on the clean tree; on the recorded (broken) path they are all rejected
    assert [r.replayed_accepted for r in report.rows[1:]] == [False, False]


def test_a_recorded_undecided_is_no_claim_a_replay_can_flip():
    """'undecided' (a loaded machine) claimed nothing: replayed as accepted or not faster, it is not a flip;
    a decided rejection replayed as accepted, and an accept replayed as rejected, are."""
    from agent.policies.replay import ReplayRow

    def row(recorded, reason, replayed):
        return ReplayRow(attempt=1, title="t", recorded_accepted=recorded, recorded_reason=reason, replayed_accepted=replayed)

    assert not row(False, "undecided (noisy machine): workload time ratio x3.96", True).flipped
    assert not row(False, "undecided: best slower than its baseline (...)", True).flipped
    assert row(False, "not measurably faster: workload time ratio x1.002", True).flipped
    assert row(True, "faster: workload time ratio x3.9", False).flipped
    assert not row(False, "interrupted: stopped by the user", True).flipped
