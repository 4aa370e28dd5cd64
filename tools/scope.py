"""What may change in a task folder: one rule for the gate's scope stage and the agent's file tools.

A candidate may change only files matching the manifest's `editable` globs (never the manifest,
the spec or the e2e script, whatever the globs say) and `knobs.toml`, which only `submit(knobs=...)` writes (so the
file tools refuse it). No path may go through a symbolic link.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from tools.task import KNOBS_FILE, MANIFEST, Task


def change_refusal(task: Task, rel: str, *, by_submit: bool) -> str | None:
    """Why the task-relative path `rel` may not change, or None when it may. `by_submit`: the change
    comes through submit (which alone writes knobs.toml), not through a file tool."""
    rel = PurePosixPath(rel.replace("\\", "/")).as_posix()
    if rel == MANIFEST:
        return f"the manifest ({MANIFEST}) is read-only: the gate trusts it"
    if rel == PurePosixPath(task.manifest.spec).as_posix():
        return "the spec is read-only: it holds the reference and the inputs the gate trusts"
    if task.manifest.e2e and rel == PurePosixPath(task.manifest.e2e.script).as_posix():
        return "the e2e script is read-only: the gate trusts its model, data and optimiser"
    if rel == KNOBS_FILE:
        return None if by_submit else f"{KNOBS_FILE} is written only by submit(knobs=...), which validates the settings"
    if not task.is_editable(rel):
        return f"not editable; only files matching the editable globs may be changed ({', '.join(task.manifest.editable)})"
    return None


def symlink_component(root: Path, rel: str) -> str | None:
    """The first component of `rel` under `root` (as 'a/b') that is a symbolic link, or None."""
    parts = PurePosixPath(rel.replace("\\", "/")).parts
    cur = Path(root)
    for i, part in enumerate(parts):
        cur = cur / part
        if cur.is_symlink():
            return "/".join(parts[: i + 1])
    return None
