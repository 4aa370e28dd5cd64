"""Commit messages that carry their evidence as git trailers.

An accepted change lands as

    Unroll the row loop by 4                          <- title, one line, <= 72 characters

    Rationale, wrapped at 72 columns. Lists and       <- rationale paragraphs
    indented blocks are kept as written.

    Kloop-Speedup: 1.084                              <- trailers: the last paragraph, `Key: value`
    Kloop-Speedup-CI: 1.061..1.109
    Kloop-Time-n-4096: 12.31us -> 11.36us
    Kloop-Run: 20261129-0915-softmax-3fa2

so that `git log`, `git interpret-trailers --parse` and `git log --format=%(trailers)` all read the
evidence. Git's trailer keys may only hold letters, digits and '-' (a key with '_' or '.' is not a
trailer to git), so keys are sanitised: use `trailer_key("Kloop-Time", shape.name)` to build one
and to look one up. Values are single-line: newlines and runs of whitespace become one space.
`parse_trailers` follows git's rules (see trailer.c), and the tests hold it to `git interpret-trailers`.
"""

from __future__ import annotations

import re
import textwrap

TITLE_MAX = 72
WRAP = 72

# git's own trailers; a last paragraph with one of these only needs 25% trailer lines
_GIT_GENERATED = ("Signed-off-by: ", "(cherry picked from commit ")
_KEY_OK = re.compile(r"[A-Za-z0-9-]")


def trailer_key(*parts: str) -> str:
    """A git-valid trailer key from parts: `trailer_key("Kloop-Time", "n_4096")` -> 'Kloop-Time-n-4096'."""
    raw = "-".join(p for p in parts if p)
    key = "".join(c if _KEY_OK.fullmatch(c) else "-" for c in raw)
    key = re.sub(r"-{2,}", "-", key).strip("-")
    if not key:
        raise ValueError(f"trailer key from {parts!r} is empty")
    return key


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _shorten_title(title: str) -> tuple[str, bool]:
    line = _one_line(title)
    if not line:
        raise ValueError("commit title is empty")
    if len(line) <= TITLE_MAX:
        return line, False
    cut = line[: TITLE_MAX - 3]
    if " " in cut[TITLE_MAX // 2:]:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip() + "...", True


def _is_verbatim_block(lines: list[str]) -> bool:
    """Lists, indented/code blocks and tables keep their lines as written."""
    for ln in lines:
        s = ln.lstrip()
        if ln[:1] in (" ", "\t") or s.startswith(("```", "|", "- ", "* ", "+ ")) or re.match(r"\d+[.)] ", s):
            return True
    return False


def _wrap_rationale(rationale: str) -> list[str]:
    paragraphs: list[str] = []
    text = rationale.replace("\r\n", "\n").replace("\r", "\n").strip("\n")
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [ln.rstrip() for ln in block.split("\n")]
        lines = [ln for ln in lines if ln.strip()] if not _is_verbatim_block(lines) else lines
        if not lines:
            continue
        if _is_verbatim_block(lines):
            out = lines
        else:
            out = textwrap.wrap(
                " ".join(ln.strip() for ln in lines), WRAP, break_long_words=False, break_on_hyphens=False
            )
        # a line starting with '---' ends the message for git (the patch separator) and would
        # hide the trailers; indent it by one space
        out = [(" " + ln) if ln.startswith("---") else ln for ln in out]
        paragraphs.append("\n".join(out))
    return paragraphs


def format_commit_message(title: str, rationale: str, trailers: list[tuple[str, str]]) -> str:
    """Title (one line, <= 72 characters; a longer title is cut and kept whole in the body),
    wrapped rationale, then the trailers as the last paragraph. Ends with a newline."""
    head, cut = _shorten_title(title)
    body = []
    if cut:
        body.append("\n".join(textwrap.wrap(_one_line(title), WRAP, break_long_words=False)))
    body += _wrap_rationale(rationale or "")
    block = []
    for key, value in trailers:
        k = trailer_key(key)
        block.append(f"{k}: {_one_line(value)}".rstrip())
    parts = [head, *body]
    if block:
        parts.append("\n".join(block))
    return "\n\n".join(parts) + "\n"


def _find_separator(line: str) -> int:
    """Index of the ':' separator of a trailer line, or -1 (git's find_separator)."""
    whitespace_found = False
    for i, c in enumerate(line):
        if c == ":":
            return i
        if not whitespace_found and (c.isascii() and (c.isalnum() or c == "-")):
            continue
        if i != 0 and c in " \t":
            whitespace_found = True
            continue
        break
    return -1


def _is_blank(line: str) -> bool:
    return not line.strip()


def parse_trailers(message: str) -> list[tuple[str, str]]:
    """The trailers of a commit message, as `git interpret-trailers --parse` finds them.

    Git's rules (trailer.c): the message ends before the first line starting with '---' and a
    space (the patch divider) and trailing blank/comment lines are ignored; the trailer block is
    the last paragraph, never the title paragraph; it counts when all its lines are trailers (or
    their indented continuation lines, which are unfolded), or when it holds a git-generated
    trailer (Signed-off-by, cherry-picked) and at least 25% trailer lines. Comment lines ('#') are
    skipped. Keys and values come back as written, values stripped.
    """
    lines = message.replace("\r\n", "\n").split("\n")
    # the trailing "" of a final newline is not a line
    if lines and lines[-1] == "":
        lines.pop()
        terminated = True
    else:
        terminated = False
    for i, ln in enumerate(lines):
        if ln.startswith("---"):
            rest = ln[3:]
            if (rest and rest[0].isspace()) or (not rest and (i < len(lines) - 1 or terminated)):
                lines = lines[:i]
                break
    while lines and (_is_blank(lines[-1]) or lines[-1].startswith("#")):
        lines.pop()

    end_title = 0
    while end_title < len(lines):
        if lines[end_title].startswith("#"):
            end_title += 1
            continue
        if _is_blank(lines[end_title]):
            break
        end_title += 1

    # scan back from the end, as git does, for the start of the trailer block
    trailer_lines = non_trailer_lines = possible_continuation = 0
    recognized = False
    only_spaces = True
    start = None
    for idx in range(len(lines) - 1, end_title - 1, -1):
        ln = lines[idx]
        if ln.startswith("#"):
            non_trailer_lines += possible_continuation
            possible_continuation = 0
            continue
        if _is_blank(ln):
            if only_spaces:
                continue
            non_trailer_lines += possible_continuation
            if (recognized and trailer_lines * 3 >= non_trailer_lines) or (trailer_lines and not non_trailer_lines):
                start = idx + 1
            break
        only_spaces = False
        if ln.startswith(_GIT_GENERATED):
            trailer_lines += 1
            possible_continuation = 0
            recognized = True
            continue
        if _find_separator(ln) >= 1 and not ln[0].isspace():
            trailer_lines += 1
            possible_continuation = 0
        elif ln[0].isspace():
            possible_continuation += 1
        else:
            non_trailer_lines += 1 + possible_continuation
            possible_continuation = 0
    if start is None:
        return []

    # group continuation lines with the trailer above them, then keep `Key: value` entries
    entries: list[str] = []
    last_is_trailer = False
    for ln in lines[start:]:
        if ln.startswith("#"):
            continue
        if last_is_trailer and ln[:1].isspace():
            entries[-1] += "\n" + ln
            continue
        entries.append(ln)
        last_is_trailer = _find_separator(ln) >= 1
    out = []
    for e in entries:
        sep = _find_separator(e)
        if sep < 1:
            continue
        value = re.sub(r"\n\s*", " ", e[sep + 1:]).strip()
        out.append((e[:sep].strip(), value))
    return out


def trailer_dict(message: str) -> dict[str, str]:
    """Trailers as a dict (the last value of a repeated key wins)."""
    return dict(parse_trailers(message))
