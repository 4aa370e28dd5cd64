"""RunConfig: how a run was launched, typed in run.json; old run.json files (config without a policy) still resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from agent.config import RunConfig, RunConfigError
from agent.gate import GateConfig
from agent.policies.base import Budget
from agent.session import Session, SessionError
from tests.fakes import make_repo


def info(policy: str, config: dict) -> SimpleNamespace:
    return SimpleNamespace(policy=policy, config=config)


def test_old_config_shape_loads():
    old = {"budget": {"max_turns": 100, "max_cost_usd": 20.0, "max_hours": None, "max_attempts": None},
           "gate": {"max_seconds": 2.5, "min_pairs": 20}, "model": "claude-x"}
    cfg = RunConfig.from_info(info("claude", old))
    assert cfg.policy == "claude" and cfg.options == {"model": "claude-x"}
    assert cfg.budget == Budget(max_turns=100, max_cost_usd=20.0) and cfg.gate.max_seconds == 2.5
    assert RunConfig.from_info(info("tuner", {})) == RunConfig(policy="tuner")  # the oldest: no config at all


def test_bad_config_names_file_field_and_value():
    bad = RunConfig(policy="tuner").to_record()
    bad["budget"]["max_turns"] = "many"
    with pytest.raises(RunConfigError, match=r"runs/x/run.json: config.budget.max_turns = 'many'"):
        RunConfig.from_info(info("tuner", bad), where="runs/x/run.json")
    bad = RunConfig(policy="tuner").to_record()
    bad["gate"]["min_pairs"] = [20]
    with pytest.raises(RunConfigError, match="config.gate.min_pairs"):
        RunConfig.from_info(info("tuner", bad))
    with pytest.raises(ValueError, match="may not be named budget"):
        RunConfig(policy="tuner", options={"budget": 1})
    # the run's policy may name its driver since launch (an MCP client): the record's policy wins
    assert RunConfig.from_info(info("mcp:client/1", RunConfig(policy="mcp").to_record())).policy == "mcp:client/1"


def test_run_json_holds_the_run_config_and_resume_validates_it(tmp_path):
    repo = make_repo(tmp_path)
    s = Session.start(repo / "kernels" / "matmul_cpu", "tuner", Budget(max_attempts=2), runs_root=tmp_path / "runs",
                      config={"seed": 7, "model": None}, gate_config=GateConfig(max_seconds=1.5))
    s.ws.remove()
    path = s.record.dir / "run.json"
    stored = json.loads(path.read_text())["config"]
    assert stored["policy"] == "tuner" and stored["seed"] == 7 and "model" not in stored  # flat: options beside budget/gate
    assert RunConfig.from_info(info("tuner", stored)) == RunConfig(policy="tuner", options={"seed": 7},
                                                                   budget=Budget(max_attempts=2), gate=GateConfig(max_seconds=1.5))
    # a run.json written before RunConfig resumes with its budget and gate settings
    data = json.loads(path.read_text())
    data["config"] = {"budget": {"max_attempts": 2}, "gate": {"max_seconds": 1.5}, "model": None}
    path.write_text(json.dumps(data))
    resumed = Session.resume(s.record.dir)
    assert resumed.budget == Budget(max_attempts=2) and resumed.gate_config.max_seconds == 1.5
    resumed.ws.remove()
    data["config"]["budget"] = {"max_attempts": "two"}
    path.write_text(json.dumps(data))
    with pytest.raises(SessionError, match="config.budget.max_attempts"):
        Session.resume(s.record.dir)


def test_configs_refuse_unknown_keys():
    """A misspelt setting is an error naming it, not a silent default (GateConfig, the Claude
    settings, the policy options)."""
    from agent.policies import PolicyError, make_policy

    with pytest.raises(RunConfigError, match="gate.max_secnds"):
        RunConfig.from_info(info("tuner", {"gate": {"max_secnds": 2}}), where="run.json")
    # settings the gate had once (in the shipped showcase records) still load
    assert RunConfig.from_info(info("tuner", {"gate": {"escape_abs_s": 3e-5, "escape_rel": 0.25}})).gate == GateConfig()
    with pytest.raises(PolicyError, match="'max_token'"):
        make_policy("claude", claude={"max_token": 100})
    with pytest.raises(PolicyError, match="'sede'"):
        make_policy("tuner", sede=3)
    recorded = {"model": "claude-sonnet-4-5", "max_tokens": 16000, "effort": None}  # settings() records the model
    make_policy("claude", model="claude-sonnet-4-5", claude=recorded)
