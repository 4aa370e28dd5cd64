"""The prompt texts in `prompts/` (Markdown, not code): loading them and filling the task briefing.

    load_prompt("system")            -> the rules of the game (prompts/system.md)
    load_prompt("hopper")            -> a playbook
    system_prompt("cuda", "sm_90a")  -> system.md followed by the playbook for that target
    render_briefing(task_name=..., ...) -> prompts/briefing.md filled (str.format style)

briefing.md opens with an HTML comment documenting every placeholder; it is stripped before
rendering. Every placeholder is required, and no unknown field is accepted: a template and its
caller that drift apart fail loudly, naming the fields.
"""

from __future__ import annotations

import re
import string
from typing import Any

from agent.locations import prompts_dir

PROMPTS_DIR = prompts_dir()  # the checkout's prompts/, or the installed package data
_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")
_LEADING_COMMENT = re.compile(r"\A\s*<!--.*?-->\s*", re.S)


class PromptError(Exception):
    """A prompt that cannot be loaded or rendered; the message names the file and the fields."""


class PromptNotFound(PromptError, FileNotFoundError):
    """No prompts/<name>.md (also a FileNotFoundError, for callers that treat playbooks as optional)."""


def load_prompt(name: str) -> str:
    """The text of prompts/<name>.md (name without the suffix, e.g. 'system')."""
    stem = name[:-3] if name.endswith(".md") else name
    if not _NAME.match(stem):
        raise PromptError(f"prompt name {name!r}: use a bare name like 'system' (letters, digits, '_', '-')")
    path = PROMPTS_DIR / f"{stem}.md"
    if not path.is_file():
        have = sorted(p.stem for p in PROMPTS_DIR.glob("*.md"))
        raise PromptNotFound(f"no prompt {stem!r}: {path} does not exist (have: {', '.join(have)})")
    return path.read_text(encoding="utf-8")


def playbook_name(target: str, arch: str | None = None) -> str | None:
    """The playbook for a task's target: 'hopper' for CUDA on sm_90/sm_90a, 'cpu' for CPU tasks."""
    if target == "cpu":
        return "cpu"
    if target in ("cuda", "triton") and (arch is None or arch.startswith("sm_90")):
        return "hopper"
    return None


def system_prompt(target: str | None = None, arch: str | None = None) -> str:
    """system.md, followed by the playbook for the target when there is one."""
    text = load_prompt("system").rstrip() + "\n"
    book = playbook_name(target, arch) if target else None
    if book:
        text += "\n---\n\n" + load_prompt(book).rstrip() + "\n"
    return text


def _template(name: str) -> str:
    return _LEADING_COMMENT.sub("", load_prompt(name), count=1)


def template_fields(name: str = "briefing") -> list[str]:
    """The placeholders of a template, in order of first appearance."""
    fields: list[str] = []
    try:
        parsed = list(string.Formatter().parse(_template(name)))
    except ValueError as exc:
        raise PromptError(f"prompts/{name}.md is not a valid template: {exc}") from None
    for _, field, _, _ in parsed:
        if field is None:
            continue
        if not field.isidentifier():
            raise PromptError(f"prompts/{name}.md: placeholder {{{field}}} must be a plain name")
        if field not in fields:
            fields.append(field)
    return fields


def render_briefing(**fields: Any) -> str:
    """prompts/briefing.md with every placeholder filled (values are used as text, as given).

    Raises PromptError naming any missing placeholder, or any field the template does not have.
    """
    return render_template("briefing", **fields)


def render_template(name: str, **fields: Any) -> str:
    wanted = template_fields(name)
    missing = [f for f in wanted if f not in fields]
    unknown = sorted(set(fields) - set(wanted))
    problems = []
    if missing:
        problems.append("missing field" + ("s" if len(missing) > 1 else "") + ": " + ", ".join(missing))
    if unknown:
        problems.append("unknown field" + ("s" if len(unknown) > 1 else "") + " (not in the template): " + ", ".join(unknown))
    if problems:
        raise PromptError(f"prompts/{name}.md: " + "; ".join(problems))
    return _template(name).format(**{k: str(v) for k, v in fields.items()})
