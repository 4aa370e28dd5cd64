"""A tool call's bad input (tools/base.ToolBox.call) is said plainly and marked `bad_input` (not an
event: it changes no session state), which the shell commands exit 2 on, as everywhere else in kloop (a newcomer's `kloop submit --knob TILE=7` once
exited 1 with 'submit failed: TaskError: ...')."""

from __future__ import annotations

from tools.base import Tool, ToolBox, ToolInput, ToolResult
from tools.task import TaskError


class Knob(ToolInput):
    value: int


def _box() -> ToolBox:
    def set_knob(ctx, args: Knob) -> ToolResult:
        if args.value not in (0, 16, 64):
            raise TaskError(f"task.toml: knob TILE={args.value} is not allowed (allowed values: [0, 16, 64])")
        return ToolResult(text="ok")

    def crash(ctx, args: Knob) -> ToolResult:
        raise RuntimeError("disk on fire")

    box = ToolBox(context=None)
    box.add(Tool("set_knob", "", Knob, set_knob))
    box.add(Tool("crash", "", Knob, crash))
    return box


def test_a_task_error_is_bad_input_said_plainly():
    r = _box().call("set_knob", {"value": 7})
    assert not r.ok and r.bad_input and r.event is None
    assert r.text == "error: task.toml: knob TILE=7 is not allowed (allowed values: [0, 16, 64])"


def test_invalid_fields_and_unknown_tools_are_bad_input_too():
    box = _box()
    for r in (box.call("set_knob", {"value": "seven"}), box.call("set_knob", {"valu": 1}), box.call("nosuch", {})):
        assert not r.ok and r.bad_input and r.event is None, r


def test_a_tool_failure_is_not_bad_input():
    r = _box().call("crash", {"value": 1})
    assert not r.ok and not r.bad_input and "RuntimeError: disk on fire" in r.text
    assert _box().call("set_knob", {"value": 16}).ok


def test_a_whitespace_title_is_refused_before_the_gate_runs():
    """Hypothesis found it (2026-12-07): a title of 3+ whitespace characters passed the length check, the
    gate judged the change, and only the commit message then failed ("commit title is empty")."""
    from tools.agent_tools import SubmitInput

    def submit(ctx, args: SubmitInput) -> ToolResult:
        raise AssertionError("the gate ran")

    box = ToolBox(context=None)
    box.add(Tool("submit", "", SubmitInput, submit))
    for title in ("\r\r\r", "   ", " a \n "):
        r = box.call("submit", {"title": title})
        assert not r.ok and r.bad_input and "title" in r.text and "visible characters" in r.text, r.text
    assert SubmitInput(title=" tile 64 ").title == " tile 64 "  # a real title is kept as given
