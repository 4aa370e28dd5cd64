"""The agent's file tools: list, read, edit, write files of the task folder, and keep notes.

Every path the agent names is relative to the task folder and must stay inside it: absolute paths,
`..` components and symbolic links anywhere along the path are refused (a link planted in the tree
could point at the harness, the reference or the user's home). Reads may look at any file in the
task folder; writes only at files matching the manifest's `editable` globs, never the manifest or
the spec. Files are UTF-8 text; binary content (NUL bytes, invalid UTF-8) is refused both ways.

The context is a `tools.port.SessionPort`: these tools use its `task` (the manifest: what is
editable), `files_root` (the candidate's task folder, where paths resolve) and `notes_path`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import Field

from tools.task import MANIFEST
from tools.base import Tool, ToolInput, ToolResult
from tools.port import SessionPort
from tools.scope import change_refusal, symlink_component

READ_MAX_LINES = 400  # lines shown per read_file call
READ_MAX_CHARS = 10_000  # characters shown per read_file call (stays under the ToolBox cap)
LINE_MAX_CHARS = 400  # a longer line is shown cut, with a marker
MAX_FILE_BYTES = 1_000_000  # largest file read_file/edit_file/write_file handle
MAX_NOTES_BYTES = 20_000  # the notes file never grows past this
LIST_MAX_ENTRIES = 300
EDIT_CONTEXT_LINES = 3  # lines shown before/after each change
EDIT_MAX_REGIONS_SHOWN = 3
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
# not task files: git's (a worktree's `.git` is a file) and the files kloop writes at a worktree's root
# for the user's agent (agent/workspace.py AGENT_FILES); never listed
SKIP_FILES = {".git"}
SKIP_ROOT_FILES = {".mcp.json", "AGENTS.md", "CLAUDE.md"}


class PathError(Exception):
    """A path the agent may not use; the message names the path and why."""


# ---------------------------------------------------------------------------------------------
# path safety
# ---------------------------------------------------------------------------------------------


def _clean_relpath(path: str) -> PurePosixPath:
    """Lexical checks: relative, no '..', no NUL; returns the normalised relative path."""
    raw = path
    if not isinstance(path, str) or not path.strip():
        raise PathError("empty path: name a file relative to the task folder, e.g. 'kernel.cu'")
    if "\x00" in path:
        raise PathError(f"{raw!r}: a path must not contain NUL characters")
    p = path.strip().replace("\\", "/")
    if p.startswith("/") or p.startswith("~") or (len(p) >= 2 and p[1] == ":"):
        raise PathError(f"{raw!r}: absolute paths are not allowed; give a path relative to the task folder")
    parts = [c for c in p.split("/") if c not in ("", ".")]
    if not parts:
        raise PathError(f"{raw!r}: names the task folder itself, not a file")
    if ".." in parts:
        raise PathError(f"{raw!r}: '..' is not allowed; paths must stay inside the task folder")
    if ".git" in parts:
        raise PathError(f"{raw!r}: git metadata is off limits")
    return PurePosixPath(*parts)


def resolve_path(root: Path, path: str) -> tuple[Path, str]:
    """(absolute path, '/'-separated relative path) for `path` inside `root`, or PathError.

    Refuses absolute paths, '..', and a symbolic link at any component (the file itself or any
    folder above it), whether the link points inside or outside the folder.
    """
    rel = _clean_relpath(path)
    root = Path(root)
    link = symlink_component(root, rel.as_posix())
    if link is not None:
        where = "is a symbolic link" if link == rel.as_posix() else f"goes through {link!r}, a symbolic link"
        raise PathError(f"{path!r} {where}; links are never followed (not even inside the task folder)")
    cur = root
    for i, part in enumerate(rel.parts):
        cur = cur / part
        if i < len(rel.parts) - 1 and cur.exists() and not cur.is_dir():
            shown = "/".join(rel.parts[: i + 1])
            raise PathError(f"{path!r}: {shown!r} is a file, not a folder")
    # belt and braces: whatever exists must resolve to inside the root
    real_root = root.resolve()
    real = cur.resolve()
    if not real.is_relative_to(real_root):
        raise PathError(f"{path!r}: resolves outside the task folder")
    return cur, rel.as_posix()


def _role(task: Any, rel: str) -> str:
    if rel == MANIFEST:
        return "manifest (read-only)"
    if rel == PurePosixPath(task.manifest.spec).as_posix():
        return "spec (read-only)"
    if task.is_editable(rel):
        return "editable"
    if rel in {PurePosixPath(s).as_posix() for s in task.manifest.sources}:
        return "source (read-only)"
    return "read-only"


def _check_writable(task: Any, rel: str, path: str) -> None:
    why = change_refusal(task, rel, by_submit=False)
    if why:
        raise PathError(f"{path!r}: {why}")


def _read_text(file: Path, shown: str) -> str:
    """The UTF-8 text of a regular file (not following a final symlink), or PathError."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise PathError(f"{shown!r}: no such file (list_files shows what exists)") from None
    except IsADirectoryError:
        raise PathError(f"{shown!r}: is a folder, not a file") from None
    except OSError as exc:
        raise PathError(f"{shown!r}: cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise PathError(f"{shown!r}: is a folder, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise PathError(f"{shown!r}: not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise PathError(f"{shown!r}: {st.st_size} bytes; files over {MAX_FILE_BYTES} bytes are not handled")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return _decode(data, shown)


def _decode(data: bytes, shown: str) -> str:
    if b"\x00" in data:
        raise PathError(f"{shown!r}: binary file (contains NUL bytes); only text files can be read or edited")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PathError(f"{shown!r}: not valid UTF-8 text (byte {exc.start}); only UTF-8 text files are handled") from None


def _write_text(root: Path, file: Path, rel: str, content: str) -> bool:
    """Write `content` to `file` (already checked); returns True when the file was created."""
    # make missing parent folders one at a time, refusing links (a race planting one is refused too)
    parent = root
    for part in PurePosixPath(rel).parts[:-1]:
        parent = parent / part
        if parent.is_symlink():
            raise PathError(f"{rel!r}: {parent.relative_to(root).as_posix()!r} is a symbolic link")
        if not parent.exists():
            parent.mkdir()
    created = not os.path.lexists(file)
    # no O_TRUNC: nothing is changed before the opened file is known to be a plain, unshared file
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(file, flags, 0o644)
    except OSError as exc:
        raise PathError(f"{rel!r}: cannot write: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PathError(f"{rel!r}: not a regular file")
        if st.st_nlink > 1:
            raise PathError(f"{rel!r}: has {st.st_nlink} hard links (it may be shared with a file outside the task folder); refusing to write through it")
        os.ftruncate(fd, 0)
        with os.fdopen(fd, "wb", closefd=False) as fh:
            fh.write(content.encode("utf-8"))
    finally:
        os.close(fd)
    return created


def _check_content(content: str, shown: str) -> None:
    if "\x00" in content:
        raise PathError(f"{shown!r}: content contains NUL characters; only text can be written")
    try:
        n = len(content.encode("utf-8"))
    except UnicodeEncodeError:
        raise PathError(f"{shown!r}: content is not encodable as UTF-8 (lone surrogate characters)") from None
    if n > MAX_FILE_BYTES:
        raise PathError(f"{shown!r}: content is {n} bytes; at most {MAX_FILE_BYTES} bytes may be written")


def _number(lines: list[str], first: int, width: int | None = None) -> str:
    """Lines numbered from `first` (1-based), cat -n style; long lines cut with a marker."""
    last = first + len(lines) - 1
    w = width or max(4, len(str(last)))
    out = []
    for i, line in enumerate(lines):
        if len(line) > LINE_MAX_CHARS:
            line = line[:LINE_MAX_CHARS] + f" ... [{len(line) - LINE_MAX_CHARS} more characters on this line]"
        out.append(f"{first + i:>{w}}| {line}")
    return "\n".join(out)


def _err(exc: Exception) -> ToolResult:
    return ToolResult(ok=False, text=f"error: {exc}")


def _task_root(ctx: SessionPort) -> Path:
    return Path(ctx.files_root)


# ---------------------------------------------------------------------------------------------
# list_files
# ---------------------------------------------------------------------------------------------


class ListFilesInput(ToolInput):
    """No arguments: lists the whole task folder."""


def list_files(ctx: Any, args: ListFilesInput) -> ToolResult:
    task = ctx.task
    root = _task_root(ctx)
    rows: list[tuple[str, str, str]] = []
    entries: list[dict[str, Any]] = []
    truncated = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        base = Path(dirpath)
        names = sorted(filenames) + [d for d in dirnames if (base / d).is_symlink()]
        names = [n for n in names if n not in SKIP_FILES and not (base == root and n in SKIP_ROOT_FILES)]
        for name in sorted(names):
            p = base / name
            rel = p.relative_to(root).as_posix()
            if len(rows) >= LIST_MAX_ENTRIES:
                truncated += 1
                continue
            if p.is_symlink():
                role, size = "symlink (not followed; cannot be read or written)", ""
            else:
                try:
                    nbytes = p.stat().st_size
                except OSError:
                    continue
                role = _role(task, rel)
                size = _size_text(p, nbytes)
                entries.append({"path": rel, "bytes": nbytes, "role": role})
            rows.append((rel, size, role))
    if not rows:
        return ToolResult(text="the task folder is empty")
    w1 = max(len(r[0]) for r in rows)
    w2 = max(len(r[1]) for r in rows)
    lines = [f"task folder ({task.name}): {len(rows)} files"]
    lines += [f"  {r[0]:<{w1}}  {r[1]:>{w2}}  {r[2]}" for r in rows]
    if truncated:
        lines.append(f"  ... and {truncated} more files not listed")
    lines.append(f"editable globs: {', '.join(task.manifest.editable)} (only matching files can be written)")
    return ToolResult(text="\n".join(lines), data={"files": entries})


def _size_text(p: Path, nbytes: int) -> str:
    text = f"{nbytes} B"
    if nbytes <= MAX_FILE_BYTES:
        try:
            data = p.read_bytes()
        except OSError:
            return text
        if b"\x00" in data:
            return text + ", binary"
        n = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
        text += f", {n} line{'' if n == 1 else 's'}"
    return text


# ---------------------------------------------------------------------------------------------
# read_file
# ---------------------------------------------------------------------------------------------


class ReadFileInput(ToolInput):
    path: str = Field(description="File to read, relative to the task folder (e.g. 'kernel.cu'). Any file in the task folder may be read.")
    start_line: int | None = Field(
        default=None, ge=1, description="First line to show (1-based, inclusive). Default: 1."
    )
    end_line: int | None = Field(
        default=None,
        ge=1,
        description=f"Last line to show (inclusive). Default: the end of the file. At most {READ_MAX_LINES} lines are shown per call.",
    )


def read_file(ctx: Any, args: ReadFileInput) -> ToolResult:
    try:
        file, rel = resolve_path(_task_root(ctx), args.path)
        text = _read_text(file, rel)
    except PathError as exc:
        return _err(exc)
    lines = text.splitlines()
    total = len(lines)
    if total == 0:
        return ToolResult(text=f"{rel}: empty file", data={"path": rel, "lines": 0})
    start = args.start_line or 1
    end = min(args.end_line or total, total)
    if start > total:
        return ToolResult(ok=False, text=f"error: {rel!r} has {total} lines; start_line={start} is past the end")
    if end < start:
        return ToolResult(ok=False, text=f"error: end_line={args.end_line} is before start_line={start}")
    shown: list[str] = []
    chars = 0
    for line in lines[start - 1 : end]:
        cost = min(len(line), LINE_MAX_CHARS + 50) + 8
        if shown and (len(shown) >= READ_MAX_LINES or chars + cost > READ_MAX_CHARS):
            break
        shown.append(line)
        chars += cost
    last = start + len(shown) - 1
    header = f"{rel} (lines {start}-{last} of {total}; editable: {'yes' if ctx.task.is_editable(rel) else 'no'})"
    body = _number(shown, start, width=len(str(total)))
    parts = [header, body]
    if last < end:
        parts.append(f"[showing lines {start}-{last}; the rest was cut by the per-call limit. "
                     f"Call read_file(path={rel!r}, start_line={last + 1}) to read on.]")
    elif last < total:
        parts.append(f"[{total - last} more lines after line {last}]")
    parts.append("(line numbers and '| ' are not part of the file: leave them out of edit_file's `old`)")
    return ToolResult(text="\n".join(parts), data={"path": rel, "start": start, "end": last, "lines": total})


# ---------------------------------------------------------------------------------------------
# edit_file
# ---------------------------------------------------------------------------------------------


class EditFileInput(ToolInput):
    path: str = Field(description="Editable file to change, relative to the task folder.")
    old: str = Field(
        min_length=1,
        description="The exact text to replace, character for character, including indentation and line "
        "breaks, without read_file's line numbers. Include enough surrounding lines to make it unique.",
    )
    new: str = Field(description="The replacement text (may be empty to delete `old`).")
    count: int = Field(
        default=1,
        ge=1,
        description="How many times `old` must occur in the file; every occurrence is replaced. The edit fails "
        "(and changes nothing) when the actual number of occurrences differs.",
    )


def edit_file(ctx: Any, args: EditFileInput) -> ToolResult:
    root = _task_root(ctx)
    try:
        file, rel = resolve_path(root, args.path)
        _check_writable(ctx.task, rel, args.path)
        text = _read_text(file, rel)
        _check_content(args.new, rel)
    except PathError as exc:
        return _err(exc)
    old, new = args.old, args.new
    if old == new:
        return ToolResult(ok=False, text="error: `old` and `new` are identical; nothing to change")
    found = text.count(old)
    if found == 0 and "\r\n" in text and "\n" in old and "\r\n" not in old:
        # the file has Windows line endings; the model wrote '\n'
        old, new = old.replace("\n", "\r\n"), new.replace("\n", "\r\n")
        found = text.count(old)
    if found == 0:
        hint = _not_found_hint(text, old)
        return ToolResult(ok=False, text=f"error: `old` not found in {rel!r}; nothing was changed.{hint}")
    if found != args.count:
        return ToolResult(
            ok=False,
            text=f"error: `old` occurs {found} times in {rel!r} but count={args.count}; nothing was changed. "
            + (
                "Add surrounding lines to `old` to pick one occurrence, or "
                if found > args.count
                else ""
            )
            + f"set count={found} to replace all of them.",
        )
    # replace, remembering where each new text lands
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    out_len = 0
    while True:
        i = text.find(old, pos)
        if i < 0:
            break
        pieces.append(text[pos:i])
        out_len += i - pos
        spans.append((out_len, out_len + len(new)))
        pieces.append(new)
        out_len += len(new)
        pos = i + len(old)
    pieces.append(text[pos:])
    result = "".join(pieces)
    try:
        _check_content(result, rel)
        _write_text(root, file, rel, result)
    except PathError as exc:
        return _err(exc)
    return ToolResult(
        text=f"edited {rel}: replaced {found} occurrence{'s' if found > 1 else ''}\n" + _context(result, spans),
        data={"path": rel, "replaced": found},
    )


def _not_found_hint(text: str, old: str) -> str:
    squash = lambda s: " ".join(s.split())  # noqa: E731
    if squash(old) and squash(old) in squash(text):
        return " The text exists with different whitespace or indentation: copy it exactly from read_file (without the line numbers)."
    first = next((ln.strip() for ln in old.splitlines() if ln.strip()), "")
    if first:
        hits = [i + 1 for i, ln in enumerate(text.splitlines()) if first in ln]
        if hits:
            shown = ", ".join(map(str, hits[:5]))
            return f" Its first line occurs at line(s) {shown}; the lines after it differ. Read them again."
    return " Read the file again: it may have changed."


def _context(text: str, spans: list[tuple[int, int]]) -> str:
    lines = text.splitlines()
    total = len(lines)
    width = len(str(max(total, 1)))
    blocks = []
    for a, b in spans[:EDIT_MAX_REGIONS_SHOWN]:
        first = text.count("\n", 0, a)  # 0-based line of the change's start
        last = text.count("\n", 0, max(a, b - 1)) if b > a else first
        lo = max(0, first - EDIT_CONTEXT_LINES)
        hi = min(total, last + EDIT_CONTEXT_LINES + 1)
        blocks.append(_number(lines[lo:hi], lo + 1, width=width) if hi > lo else "(file is now empty)")
    out = "\n---\n".join(blocks)
    if len(spans) > EDIT_MAX_REGIONS_SHOWN:
        out += f"\n[{len(spans) - EDIT_MAX_REGIONS_SHOWN} more changed places not shown]"
    return out


# ---------------------------------------------------------------------------------------------
# write_file
# ---------------------------------------------------------------------------------------------


class WriteFileInput(ToolInput):
    path: str = Field(
        description="Editable file to create or overwrite, relative to the task folder; it must match the "
        "manifest's editable globs. Missing parent folders are created."
    )
    content: str = Field(description="The whole new content of the file (UTF-8 text). Prefer edit_file for small changes.")


def write_file(ctx: Any, args: WriteFileInput) -> ToolResult:
    root = _task_root(ctx)
    try:
        file, rel = resolve_path(root, args.path)
        _check_writable(ctx.task, rel, args.path)
        _check_content(args.content, rel)
        if file.exists() and not file.is_file():
            raise PathError(f"{rel!r}: is a folder, not a file")
        created = _write_text(root, file, rel, args.content)
    except PathError as exc:
        return _err(exc)
    n = len(args.content.splitlines())
    nbytes = len(args.content.encode("utf-8"))
    return ToolResult(
        text=f"{'created' if created else 'overwrote'} {rel} ({n} lines, {nbytes} bytes)",
        data={"path": rel, "created": created, "bytes": nbytes},
    )


# ---------------------------------------------------------------------------------------------
# notes
# ---------------------------------------------------------------------------------------------


class NotesInput(ToolInput):
    action: Literal["read", "append", "replace"] = Field(
        description="'read' shows your notes; 'append' adds `text` at the end; 'replace' overwrites them with `text` "
        "(use it to condense when they grow long)."
    )
    text: str | None = Field(
        default=None,
        description=f"The text to append or the new notes (required for append/replace). The notes are capped at "
        f"{MAX_NOTES_BYTES} bytes; keep them short: hypotheses, measurements, what failed and why, what to try next.",
    )


def notes(ctx: Any, args: NotesInput) -> ToolResult:
    path = Path(ctx.notes_path)
    current = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    cur_bytes = len(current.encode("utf-8"))
    if args.action == "read":
        if not current.strip():
            return ToolResult(text="(your notes are empty)", data={"bytes": 0})
        return ToolResult(text=f"your notes ({cur_bytes} of {MAX_NOTES_BYTES} bytes):\n{current}", data={"bytes": cur_bytes})
    if args.text is None or not args.text.strip():
        return ToolResult(ok=False, text=f"error: notes action {args.action!r} needs a non-empty `text`")
    if "\x00" in args.text:
        return ToolResult(ok=False, text="error: notes must be text (NUL characters are not allowed)")
    if args.action == "append":
        sep = "" if not current or current.endswith("\n") else "\n"
        new = current + sep + args.text.rstrip("\n") + "\n"
    else:
        new = args.text.rstrip("\n") + "\n"
    try:
        new_bytes = len(new.encode("utf-8"))
    except UnicodeEncodeError:
        return ToolResult(ok=False, text="error: notes text is not encodable as UTF-8")
    if new_bytes > MAX_NOTES_BYTES:
        what = "appending this would make them" if args.action == "append" else "the new notes are"
        return ToolResult(
            ok=False,
            text=f"error: notes are capped at {MAX_NOTES_BYTES} bytes and {what} {new_bytes} bytes; nothing was "
            "changed. Condense them with action='replace' (keep conclusions, drop raw logs).",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)
    verb = "appended to" if args.action == "append" else "replaced"
    return ToolResult(text=f"{verb} your notes ({new_bytes} of {MAX_NOTES_BYTES} bytes used)", data={"bytes": new_bytes})


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


def file_tools() -> list[Tool]:
    return [
        Tool(
            name="list_files",
            description="List the task folder's files with their size, line count and role: editable (you may "
            "change it), source/read-only, spec (read-only: inputs, reference, call glue), manifest (read-only).",
            input_model=ListFilesInput,
            fn=list_files,
        ),
        Tool(
            name="read_file",
            description=f"Read a text file of the task folder with line numbers, at most {READ_MAX_LINES} lines per "
            "call; pass start_line/end_line to read a range or to continue where the last call stopped.",
            input_model=ReadFileInput,
            fn=read_file,
        ),
        Tool(
            name="edit_file",
            description="Replace exact text in an editable file: `old` must occur exactly `count` times (default "
            "once), otherwise nothing changes and the error says how many times it occurs. Shows the changed lines "
            "with context. Prefer this over write_file for local changes.",
            input_model=EditFileInput,
            fn=edit_file,
        ),
        Tool(
            name="write_file",
            description="Create or overwrite an editable file with the given content (UTF-8 text). Only paths "
            "matching the manifest's editable globs can be written; the manifest and spec never.",
            input_model=WriteFileInput,
            fn=write_file,
        ),
        Tool(
            name="notes",
            description=f"Your notebook, kept across turns and shown again when old context is dropped: read it, "
            f"append to it, or replace it (capped at {MAX_NOTES_BYTES} bytes). Record hypotheses, measurements, "
            "failed ideas and why they failed.",
            input_model=NotesInput,
            fn=notes,
        ),
    ]
