"""`RunConfig`: how a run was launched (policy and its options, budget, gate settings), typed.

Stored as the `config` of run.json; read back, and validated, on resume and replay. Run records
written before it (config = {"budget", "gate", "model"}) still load: `from_info` reads both shapes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.gate import GateConfig
from agent.policies.base import Budget


class RunConfigError(ValueError):
    """A run.json whose config does not validate; the message names the file, field and value."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: str
    options: dict[str, Any] = Field(default_factory=dict)  # the policy's own settings (e.g. model, seed)
    budget: Budget = Field(default_factory=Budget)
    gate: GateConfig = Field(default_factory=GateConfig)

    def to_record(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_info(cls, info: Any, where: str = "run.json") -> "RunConfig":
        """The config of a RunInfo (`info.policy`, `info.config`), old shape or new."""
        raw = dict(info.config or {})
        if "policy" not in raw:  # written before RunConfig: options were top-level keys beside budget/gate
            options = {k: v for k, v in raw.items() if k not in ("budget", "gate") and v is not None}
            raw = {"policy": info.policy, "options": options, "budget": raw.get("budget", {}), "gate": raw.get("gate", {})}
        try:
            config = cls.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(f"config.{'.'.join(map(str, e['loc']))} = {e.get('input')!r}: {e['msg']}" for e in exc.errors())
            raise RunConfigError(f"{where}: {problems}") from None
        if config.policy != info.policy:
            raise RunConfigError(f"{where}: config.policy = {config.policy!r} but the run's policy is {info.policy!r}")
        return config
