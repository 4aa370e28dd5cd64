"""What every agent tool is: a pydantic input model, a function, and a capped result.

The LLM sees each tool's JSON schema, generated from its input model (never written twice). A
policy calls tools only through `ToolBox.call`, which validates the raw input and turns every
failure (bad input, an exception in the tool) into an error result instead of a crash, and scrubs
every result of secret values (and their simple encodings: tools/secrets.py) before anyone sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationError

from tools.secrets import scrub, scrub_data, secret_values
from tools.task import TaskError

# one tool result must never flood the model's context
MAX_RESULT_CHARS = 12_000


class ToolInput(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolResult(BaseModel):
    ok: bool = True
    text: str  # what the model reads: a summary, capped
    data: dict[str, Any] | None = None  # structured figures for the run record, not shown to the model
    # set by tools that end the policy's turn or change the session state (submit/revert)
    event: str | None = None
    bad_input: bool = False  # the caller's input was wrong (a field, a knob value, a tool name): exit 2 from the shell


def cap(text: str, limit: int = MAX_RESULT_CHARS) -> str:
    """Keep the head and the tail of a long text, saying how much was left out."""
    if len(text) <= limit:
        return text
    head = text[: limit * 2 // 3]
    tail = text[-(limit // 3 - 80):]
    return f"{head}\n... [{len(text) - len(head) - len(tail)} characters left out] ...\n{tail}"


@dataclass
class Tool:
    name: str
    description: str
    input_model: type[ToolInput]
    fn: Callable[[Any, Any], ToolResult]  # fn(context, validated_input) -> ToolResult

    def schema(self) -> dict[str, Any]:
        schema = self.input_model.model_json_schema()
        schema.pop("title", None)
        return {"name": self.name, "description": self.description, "input_schema": schema}


@dataclass
class ToolBox:
    """The tools one policy may use, bound to one session context."""

    context: Any
    tools: dict[str, Tool] = field(default_factory=dict)

    def add(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} registered twice")
        self.tools[tool.name] = tool

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def call(self, name: str, raw_input: Any) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(ok=False, text=f"error: no tool named {name!r}; tools: {', '.join(self.tools)}",
                              bad_input=True)
        try:
            args = tool.input_model.model_validate(raw_input if raw_input is not None else {})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in exc.errors()
            )
            return ToolResult(ok=False, text=f"error: invalid input for {name}: {problems}", bad_input=True)
        secrets = secret_values()
        try:
            result = tool.fn(self.context, args)
        except TaskError as exc:  # the caller's input against the task (a knob value, say): said plainly
            return ToolResult(ok=False, text=cap(scrub(f"error: {exc}", secrets)), bad_input=True)
        except Exception as exc:  # a tool failure costs one call, never the session
            return ToolResult(ok=False, text=cap(scrub(f"error: {name} failed: {type(exc).__name__}: {exc}", secrets)))
        # scrubbed before it is cut: a secret cut in two would not be found any more
        result.text = cap(scrub(result.text, secrets))
        if result.data is not None:
            result.data = scrub_data(result.data, secrets)
        return result
