"""`RunConfig`: how a run was launched (policy and its options, budget, gate settings), typed.

Stored as the `config` of run.json, flat: {"policy", "budget", "gate", <the policy's options>...}
(e.g. "model", "seed", "claude"), so readers of run.json that look up config["model"] keep working.
Read back, and validated, on resume and replay. Records written before it (no "policy" key) load too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agent.gate import GateConfig
from agent.policies.base import Budget


RESERVED = frozenset({"policy", "budget", "gate"})  # run.json config keys that are not policy options
# gate settings that older records hold and the gate no longer has (131126d: the escape allowance is
# now from the best's probe spread); dropped when read, so GateConfig can refuse any other unknown key
RETIRED_GATE_KEYS = frozenset({"escape_abs_s", "escape_rel"})


class RunConfigError(ValueError):
    """A run.json whose config does not validate; the message names the file, field and value."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: str
    options: dict[str, Any] = Field(default_factory=dict)  # the policy's own settings (e.g. model, seed)
    budget: Budget = Field(default_factory=Budget)
    gate: GateConfig = Field(default_factory=GateConfig)

    def to_record(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        return {"policy": data["policy"], "budget": data["budget"], "gate": data["gate"], **data["options"]}

    @model_validator(mode="after")
    def _options_apart(self) -> "RunConfig":
        clash = sorted(set(self.options) & RESERVED)
        if clash:
            raise ValueError(f"policy options may not be named {', '.join(clash)}")
        return self

    @classmethod
    def from_info(cls, info: Any, where: str = "run.json") -> "RunConfig":
        """The config of a RunInfo (`info.policy`, `info.config`); records without a policy key are older."""
        raw = dict(info.config or {})
        raw.pop("policy", None)  # as launched; the run's policy (info.policy) may name its driver since (mcp:<client>)
        options = {k: v for k, v in raw.items() if k not in RESERVED and v is not None}
        try:
            config = cls.model_validate({"policy": info.policy, "options": options,
                                         "budget": raw.get("budget") or {},
                                         "gate": {k: v for k, v in (raw.get("gate") or {}).items() if k not in RETIRED_GATE_KEYS}})
        except ValidationError as exc:
            problems = "; ".join(f"config.{'.'.join(map(str, e['loc']))} = {e.get('input')!r}: {e['msg']}" for e in exc.errors())
            raise RunConfigError(f"{where}: {problems}") from None
        return config
