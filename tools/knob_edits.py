"""A change that edits a knob's `#define` default in the source: it does nothing.

Knobs reach the compiler as `-DNAME=VALUE` (the setting in knobs.toml), so the source's own default
(`#ifndef NAME / #define NAME 4`) is never read. An agent that edits it expects a new setting and gets
the same build; it is told to pass the setting with `submit(knobs=...)` instead.
"""

from __future__ import annotations

import re
from typing import Iterable

_DEFINE = re.compile(r"^\+\s*#\s*define\s+([A-Za-z_]\w*)\s*(.*?)\s*(?://.*|/\*.*)?$")


def knob_define_edits(patch: str, knobs: Iterable[str]) -> dict[str, str]:
    """{knob: the value the patch writes into its `#define`} for the knobs whose define lines the
    unified diff `patch` adds or changes ('' when the line defines no value)."""
    names = set(knobs)
    out: dict[str, str] = {}
    for line in patch.splitlines():
        if line.startswith("+++"):
            continue
        m = _DEFINE.match(line)
        if m and m.group(1) in names:
            out[m.group(1)] = m.group(2)
    return out


def _names_and_setting(edits: dict[str, str]) -> tuple[str, str]:
    """The knobs' names, and how to pass their settings both ways in: MCP's `submit(knobs={...})` and the
    shell's `kloop submit --knob NAME=VALUE` (a shell user once read only the MCP form)."""
    names = ", ".join(sorted(edits))
    setting = ", ".join(f'"{k}": {v}' if re.fullmatch(r"-?\d+", v or "") else f'"{k}": {v!r}' for k, v in sorted(edits.items()))
    flags = " ".join(f"--knob {k}={v}" for k, v in sorted(edits.items()))
    return names, f"submit(knobs={{{setting}}}) (from the shell: kloop submit {flags})"


def knob_edit_advice(edits: dict[str, str]) -> str:
    """What to tell the agent about `knob_define_edits` when they are the whole change."""
    names, setting = _names_and_setting(edits)
    return (f"this change edits the #define default of the knob{'s' if len(edits) > 1 else ''} {names} in the source; knobs "
            "reach the compiler as -DNAME=VALUE (the setting in knobs.toml), so that default is never used and the "
            "build is the best's own code. Revert the edit and pass the setting instead: "
            + setting + " (the `knobs` tool lists each knob's allowed values)")


def knob_edit_note(edits: dict[str, str]) -> str:
    """What to tell the agent when a judged change also edits knob defaults (that part did nothing)."""
    names, setting = _names_and_setting(edits)
    return (f"Note: this change also edits the #define default of the knob{'s' if len(edits) > 1 else ''} {names} in "
            "the source, which does nothing (knobs reach the compiler as -DNAME=VALUE, the setting in knobs.toml): "
            "what was judged is the rest of the change. To try that setting, pass it: " + setting)
