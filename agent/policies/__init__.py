"""Policies behind one registry: name -> how to make one. The CLI (and any other entry point) picks
from here; a new policy is one entry.

A factory takes keyword options (`model`, `seed`, `console`, `run_dir`...) and uses those it knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from agent.policies.base import Policy


class PolicyError(ValueError):
    """An unknown policy name, or options a policy cannot start from."""


@dataclass(frozen=True)
class PolicySpec:
    name: str
    summary: str
    factory: Callable[..., Policy]
    needs_api_key: bool = False  # talks to the Messages API
    interactive: bool = True  # can drive `kloop optimize` (replay re-runs a recorded session instead)


CLAUDE_SETTINGS = ("max_tokens", "effort", "thinking", "context_limit", "context_window", "keep_tool_results",
                   "retry_hours", "max_retry_wait_s")


def _claude(model: str | None = None, claude: dict | None = None, **_: Any) -> Policy:
    """`claude`: settings as `ClaudePolicy.settings()` records them (None is ignored; an unknown key is an error)."""
    from agent.policies.claude import ClaudePolicy

    unknown = sorted(set(claude or {}) - set(CLAUDE_SETTINGS) - {"model"})  # settings() records the model too
    if unknown:
        raise PolicyError(f"unknown Claude setting(s) {', '.join(map(repr, unknown))}; known: {', '.join(CLAUDE_SETTINGS)}")
    settings = {k: v for k, v in (claude or {}).items() if k in CLAUDE_SETTINGS and v is not None}
    if isinstance(settings.get("thinking"), dict):  # as recorded: the request parameter
        recorded = settings["thinking"]
        settings["thinking"] = {"adaptive": "adaptive", "disabled": "off"}.get(recorded.get("type"),
                                                                                recorded.get("budget_tokens"))
    try:
        return ClaudePolicy(model=model, **settings) if model else ClaudePolicy(**settings)
    except (KeyError, ValueError) as exc:
        raise PolicyError(str(exc).strip("'\"")) from None


def _tuner(seed: int | None = None, console: Any = None, workers: int = 1, **_: Any) -> Policy:
    from agent.policies.tuner import TunerPolicy

    return TunerPolicy(seed=seed, console=console, workers=workers)


def _replay(run_dir: Any = None, on_row: Any = None, **_: Any) -> Policy:
    from agent.policies.replay import ReplayPolicy

    if run_dir is None:
        raise PolicyError("the replay policy re-submits a recorded session's patches: run `kloop replay RUN`")
    return ReplayPolicy.from_record(run_dir, on_row=on_row)


REGISTRY: dict[str, PolicySpec] = {s.name: s for s in (
    PolicySpec("claude", "Claude over the Messages API: reads, edits, builds, profiles and submits", _claude, needs_api_key=True),
    PolicySpec("tuner", "searches the task's knobs (exhaustive or TPE) and submits the settings that rank faster", _tuner),
    PolicySpec("replay", "re-submits a recorded session's patches, in order, to a gate on this machine", _replay, interactive=False),
)}


def policy_spec(name: str) -> PolicySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise PolicyError(f"no policy named {name!r}; known: {', '.join(REGISTRY)}") from None


# the options a front end may pass to any factory; each takes its own and ignores the others' (`**_`)
OPTIONS = frozenset({"model", "seed", "console", "claude", "run_dir", "on_row", "workers"})


def make_policy(name: str, **options: Any) -> Policy:
    """A policy by its registry name; PolicyError names what is wrong (an unknown option included)."""
    unknown = sorted(set(options) - OPTIONS)
    if unknown:
        raise PolicyError(f"unknown policy option(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(OPTIONS))}")
    return policy_spec(name).factory(**options)
