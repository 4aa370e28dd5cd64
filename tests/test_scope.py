"""One path rule: the gate's scope stage and the agent's file tools agree on what may change."""

from __future__ import annotations

import os

import pytest

from agent.gate import Candidate, Gate
from tests.fakes import toy_task_env
from tools.files import file_tools

@pytest.fixture
def env(tmp_path):
    return toy_task_env(tmp_path, file_tools())


def call(env, name, **kw):
    return env.box.call(name, kw)


PATHS = ["kernel.cu", "tile.cuh", "extra/a.cu", "helper.h", "task.toml", "spec.py", "knobs.toml", "extra/sub/b.cu", "other.txt"]


def test_gate_and_file_tools_share_the_rule(env):
    gate = Gate(env.root, ".")
    for rel in PATHS:
        gate_ok = not gate.out_of_scope(Candidate(env.root, [rel]))
        tool_ok = call(env, "write_file", path=rel, content="x\n").ok
        if rel == "knobs.toml":  # only submit writes the knob settings, and the gate accepts them
            assert gate_ok and not tool_ok
            assert "submit" in call(env, "write_file", path=rel, content="x\n").text
        else:
            assert gate_ok == tool_ok, rel
    assert [p for p in PATHS if not gate.out_of_scope(Candidate(env.root, [p]))] == ["kernel.cu", "tile.cuh", "extra/a.cu", "knobs.toml", "extra/sub/b.cu"]


def test_gate_refuses_a_path_through_a_link(env, tmp_path):
    os.symlink(tmp_path, env.root / "linked")
    gate = Gate(env.root, ".")
    assert gate.out_of_scope(Candidate(env.root, ["linked/kernel.cu"])) == ["linked/kernel.cu"]  # not editable either
    os.symlink(env.root / "kernel.cu", env.root / "alias.cuh")
    assert gate.out_of_scope(Candidate(env.root, ["alias.cuh"])) == ["alias.cuh (symlink)"]


def test_nothing_changed_is_the_gates_call(env):
    v = Gate(env.root, ".").evaluate(Candidate(env.root, []), best=object())
    assert not v.accepted and v.stage == "scope" and v.reason == "nothing changed against the best"
