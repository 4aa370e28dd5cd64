"""Invariant 6: a policy acts only through tools. What it is handed (the facade) and what the tools are
bound to (the session port) lead by no public attribute path to the gate, the workspace, the run
record or a seed; a policy cannot write the session's own events (verdicts, commits) to the record.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest

from agent.gate import Gate
from agent.policies.base import Budget, PolicyFacade
from agent.records import RunRecord
from agent.session import Session, SessionTools
from agent.workspace import Workspace
from tests.fakes import make_repo
from tools.port import SessionPort

FORBIDDEN = (Gate, Workspace, Session, RunRecord)


@pytest.fixture
def session(tmp_path):
    repo = make_repo(tmp_path)
    return Session.start(repo / "kernels" / "matmul_cpu", "test", Budget(max_attempts=3), runs_root=tmp_path / "runs")


def reachable(root, depth: int = 6):
    """Every object reachable from `root` through public attributes (and a bound method's `__self__`),
    containers included, as (path, object)."""
    seen, out, todo = set(), [], [("ctx", root, 0)]
    while todo:
        path, obj, d = todo.pop()
        if id(obj) in seen or d > depth:
            continue
        seen.add(id(obj))
        out.append((path, obj))
        if isinstance(obj, (str, bytes, int, float, bool, type(None), Path, type)) or inspect.ismodule(obj):
            continue
        if isinstance(obj, dict):
            todo += [(f"{path}[{k!r}]", v, d + 1) for k, v in obj.items()]
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            todo += [(f"{path}[{i}]", v, d + 1) for i, v in enumerate(obj)]
            continue
        if inspect.ismethod(obj):
            todo.append((f"{path}.__self__", obj.__self__, d + 1))
            continue
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            continue
        for name in dir(obj):
            if name.startswith("_"):
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # pydantic's deprecated instance attributes
                    value = getattr(obj, name)
            except Exception:
                continue
            todo.append((f"{path}.{name}", value, d + 1))
    return out


def test_the_facade_leads_to_no_gate_workspace_record_or_seed(session):
    ctx = session.facade()
    assert isinstance(ctx, PolicyFacade)
    found = reachable(ctx)
    assert any(isinstance(o, SessionTools) for _, o in found)  # the tools are reachable, through the port
    leaks = [p for p, o in found if isinstance(o, FORBIDDEN)]
    assert not leaks, leaks
    seeds = [p for p, _ in found if "seed" in p.rsplit(".", 1)[-1].lower()]
    assert not seeds, seeds
    for name in ("gate", "ws", "record", "session", "port", "best_commit", "submit", "revert"):
        assert not hasattr(ctx, name), name


def test_the_facade_and_the_port_hold_no_dict_and_take_no_attributes(session):
    ctx, port = session.facade(), session.toolbox.context
    assert isinstance(port, SessionTools) and isinstance(port, SessionPort)
    for obj in (ctx, port):
        assert not hasattr(obj, "__dict__")
        with pytest.raises(AttributeError):
            obj.gate = session.gate
    assert [p for p, o in reachable(port) if isinstance(o, FORBIDDEN)] == []
    # the port answers the tools' questions from the trusted copy and the candidate's folder
    assert port.task.root == session.gate.trusted_dir and port.files_root == session.ws.task_path


def test_a_policy_logs_only_its_own_kinds_of_events(session):
    ctx = session.facade()
    for kind in ("verdict", "committed", "attempt_started", "restored", "baseline", "session_ended"):
        with pytest.raises(PermissionError):
            ctx.log(kind, attempt=1, accepted=True, reason="forged", figures={})
    ctx.log("note", text="a policy's note")
    assert [e.kind for e in session.events()][-1] == "note"
    assert not [e for e in session.events() if e.kind == "verdict"]


def test_a_budget_handed_out_is_a_copy(session):
    budget = session.facade().budget
    with pytest.raises(Exception):
        budget.max_attempts = 10**6
    assert session.budget.max_attempts == 3


def test_session_run_hands_its_policy_the_facade(session):
    seen = {}

    class Spy:
        name = "spy"

        def run(self, ctx):
            seen["ctx"] = ctx
            seen["tools"] = sorted(ctx.toolbox.tools)
            return "done"

    session.best_build = object()  # skip the baseline: this test is about what the policy gets
    assert session.run(Spy()) == "done"
    assert type(seen["ctx"]) is PolicyFacade
    assert {"submit", "sweep", "knobs", "read_file", "edit_file", "revert"} <= set(seen["tools"])


def test_the_facade_reads_the_record_for_what_was_already_spent(session):
    """A resumed Claude policy sums the turns and cost already recorded (its budgets survive resume)."""
    from agent.policies.claude import spent_so_far

    ctx = session.facade()
    ctx.log("llm_turn", turn=1, usage={}, cost_usd=0.25, stop_reason="tool_use")
    ctx.log("llm_turn", turn=2, usage={}, cost_usd=0.5, stop_reason="tool_use")
    spent = spent_so_far(ctx)
    assert spent.turns == 2 and spent.cost_usd == 0.75
