"""The agent's file tools: what they allow, and every refusal (paths, links, scope, binary, caps)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools import files
from tools.files import file_tools
from tests.fakes import TOY_KERNEL as KERNEL, toy_task_env

@pytest.fixture
def env(tmp_path: Path):
    return toy_task_env(tmp_path, file_tools())


def call(env, name, **kw):
    return env.box.call(name, kw)


# ---------------------------------------------------------------------------------------------
# registry and schemas
# ---------------------------------------------------------------------------------------------


def test_tools_registered_with_schemas(env):
    names = [t.name for t in file_tools()]
    assert names == ["list_files", "read_file", "edit_file", "write_file", "notes"]
    for schema in env.box.schemas():
        assert schema["description"]
        assert schema["input_schema"]["type"] == "object"
    edit = next(s for s in env.box.schemas() if s["name"] == "edit_file")
    props = edit["input_schema"]["properties"]
    assert set(props) == {"path", "old", "new", "count"}
    assert all(p.get("description") for p in props.values())


def test_unknown_argument_rejected(env):
    r = call(env, "read_file", path="kernel.cu", bogus=1)
    assert not r.ok and "bogus" in r.text


# ---------------------------------------------------------------------------------------------
# list_files
# ---------------------------------------------------------------------------------------------


def test_list_files_roles_and_sizes(env):
    r = call(env, "list_files")
    assert r.ok
    lines = {ln.split()[0]: ln for ln in r.text.splitlines()[1:] if ln.startswith("  ")}
    assert "editable" in lines["kernel.cu"]
    assert "11 lines" in lines["kernel.cu"]
    assert f"{len(KERNEL)} B" in lines["kernel.cu"]
    assert "spec (read-only)" in lines["spec.py"]
    assert "manifest (read-only)" in lines["task.toml"]
    assert "read-only" in lines["helper.h"] and "editable" not in lines["helper.h"]
    data = {e["path"]: e for e in r.data["files"]}
    assert data["kernel.cu"]["bytes"] == len(KERNEL)


def test_list_files_marks_symlinks_and_skips_pycache(env):
    (env.root / "evil").symlink_to(env.outside)
    (env.root / "link.cu").symlink_to(env.outside / "secret.txt")
    (env.root / "__pycache__").mkdir()
    (env.root / "__pycache__" / "x.pyc").write_bytes(b"\0\1")
    r = call(env, "list_files")
    assert r.ok
    assert "secret.txt" not in r.text  # not descended into
    assert "__pycache__" not in r.text
    link_lines = [ln for ln in r.text.splitlines() if ln.strip().startswith(("evil", "link.cu"))]
    assert len(link_lines) == 2 and all("symlink" in ln for ln in link_lines)


def test_list_files_leaves_out_git_and_kloops_agent_files(env):
    """A worktree's `.git` (a file there) and the AGENTS.md / CLAUDE.md / .mcp.json kloop writes for
    the user's agent are not task files: not listed, not counted."""
    before = call(env, "list_files")
    n = int(before.text.splitlines()[0].split(": ")[1].split()[0])
    (env.root / ".git").write_text("gitdir: /somewhere/.git/worktrees/x\n")
    for name in ("AGENTS.md", "CLAUDE.md", ".mcp.json"):
        (env.root / name).write_text("kloop's\n")
    (env.root / "sub").mkdir()
    (env.root / "sub" / "CLAUDE.md").write_text("a task's own file, below the root\n")
    r = call(env, "list_files")
    listed = [e["path"] for e in r.data["files"]]
    assert not {".git", "AGENTS.md", "CLAUDE.md", ".mcp.json"} & set(listed), listed
    assert "sub/CLAUDE.md" in listed
    assert r.text.splitlines()[0].endswith(f": {n + 1} files")


def test_readme_and_the_briefing_list_the_tools_the_server_serves():
    """The tool list in the README and in CLAUDE.md/AGENTS.md (prompts/external.md, filled from the
    toolbox) is the served one: `knobs` was missing from both when it was written by hand."""
    import re

    from agent.prompts import render_template
    from agent.session_service import STATUS_TOOL, tool_list
    from tools.agent_tools import session_toolbox

    box = session_toolbox(None)
    box.add(STATUS_TOOL)
    served = list(box.tools)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    m = re.search(r"the tools are `([a-z_ \n]+)`", readme)
    assert m, "README: the sentence 'the tools are `...`' is gone"
    assert m.group(1).split() == served, f"README lists {m.group(1).split()}; the server serves {served}"
    text = render_template("external", run_id="r", worktree="/w", task_folder="t", editable="*.cpp", tools=tool_list(box))
    assert all(f"`{name}`" in text for name in served) and "`knobs`" in text


# ---------------------------------------------------------------------------------------------
# read_file
# ---------------------------------------------------------------------------------------------


def test_read_whole_file_numbered(env):
    r = call(env, "read_file", path="kernel.cu")
    assert r.ok
    assert " 1| // line 1" in r.text
    assert "11| __global__ void k" in r.text
    assert "lines 1-11 of 11" in r.text


def test_read_range(env):
    r = call(env, "read_file", path="kernel.cu", start_line=3, end_line=4)
    assert r.ok
    assert " 3| // line 3" in r.text and " 4| // line 4" in r.text
    assert "line 5" not in r.text
    assert "more lines after line 4" in r.text


def test_read_readonly_files_allowed(env):
    assert call(env, "read_file", path="spec.py").ok
    assert call(env, "read_file", path="task.toml").ok
    assert call(env, "read_file", path="./kernel.cu").ok


def test_read_caps_lines_and_says_how_to_continue(env):
    (env.root / "big.cu").write_text("".join(f"x{i}\n" for i in range(1000)))
    r = call(env, "read_file", path="big.cu")
    assert r.ok
    assert f"lines 1-{files.READ_MAX_LINES} of 1000" in r.text
    assert f"start_line={files.READ_MAX_LINES + 1}" in r.text
    r2 = call(env, "read_file", path="big.cu", start_line=files.READ_MAX_LINES + 1)
    assert f"{files.READ_MAX_LINES + 1}| x{files.READ_MAX_LINES}" in r2.text


def test_read_caps_characters(env):
    (env.root / "wide.cu").write_text("".join(("y" * 300) + "\n" for _ in range(200)))
    r = call(env, "read_file", path="wide.cu")
    assert r.ok and len(r.text) < files.READ_MAX_CHARS + 1000
    assert "start_line=" in r.text


def test_read_past_end_and_bad_range(env):
    assert "past the end" in call(env, "read_file", path="kernel.cu", start_line=50).text
    assert "before start_line" in call(env, "read_file", path="kernel.cu", start_line=5, end_line=2).text
    assert not call(env, "read_file", path="kernel.cu", start_line=0).ok


def test_read_missing_file_and_folder(env):
    r = call(env, "read_file", path="nope.cu")
    assert not r.ok and "no such file" in r.text and "nope.cu" in r.text
    r = call(env, "read_file", path="extra")
    assert not r.ok and "folder" in r.text


def test_read_refuses_binary_and_non_utf8(env):
    (env.root / "blob.bin").write_bytes(b"abc\x00def")
    r = call(env, "read_file", path="blob.bin")
    assert not r.ok and "binary" in r.text
    (env.root / "latin.txt").write_bytes(b"caf\xe9\n")
    r = call(env, "read_file", path="latin.txt")
    assert not r.ok and "UTF-8" in r.text


def test_read_refuses_huge_file(env):
    (env.root / "huge.txt").write_text("a" * (files.MAX_FILE_BYTES + 10))
    r = call(env, "read_file", path="huge.txt")
    assert not r.ok and "huge.txt" in r.text and "bytes" in r.text


# ---------------------------------------------------------------------------------------------
# path refusals (read and write)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["read_file", "write_file"])
def test_refuses_absolute_path(env, tool):
    target = str(env.outside / "secret.txt")
    kw = {"content": "x"} if tool == "write_file" else {}
    r = call(env, tool, path=target, **kw)
    assert not r.ok and "absolute" in r.text and target in r.text


@pytest.mark.parametrize("path", ["../outside/secret.txt", "extra/../../outside/secret.txt", "..", "a/../kernel.cu"])
@pytest.mark.parametrize("tool", ["read_file", "write_file", "edit_file"])
def test_refuses_dotdot(env, tool, path):
    kw = {"read_file": {}, "write_file": {"content": "x"}, "edit_file": {"old": "a", "new": "b"}}[tool]
    r = call(env, tool, path=path, **kw)
    assert not r.ok and "'..'" in r.text and path in r.text


def test_refuses_empty_and_root(env):
    assert "empty path" in call(env, "read_file", path="  ").text
    assert "task folder itself" in call(env, "read_file", path="./").text


def test_refuses_git_metadata(env):
    r = call(env, "read_file", path=".git/config")
    assert not r.ok and ".git" in r.text


def test_planted_symlink_to_outside_file_refused_for_read(env):
    (env.root / "ref.txt").symlink_to(env.outside / "secret.txt")
    r = call(env, "read_file", path="ref.txt")
    assert not r.ok and "symbolic link" in r.text and "ref.txt" in r.text
    assert "reference answer" not in r.text


def test_planted_symlink_folder_refused_anywhere_along_path(env):
    (env.root / "extra" / "sub").symlink_to(env.outside)
    r = call(env, "read_file", path="extra/sub/secret.txt")
    assert not r.ok and "goes through 'extra/sub', a symbolic link" in r.text
    r = call(env, "write_file", path="extra/sub/new.cu", content="pwned")
    assert not r.ok and "symbolic link" in r.text
    assert not (env.outside / "new.cu").exists()


def test_symlink_inside_folder_also_refused(env):
    (env.root / "alias.cu").symlink_to(env.root / "kernel.cu")
    r = call(env, "read_file", path="alias.cu")
    assert not r.ok and "symbolic link" in r.text


def test_write_through_existing_symlink_refused(env):
    # an editable name that is a link to a file outside: writing must not touch the target
    (env.root / "evil.cuh").symlink_to(env.outside / "secret.txt")
    r = call(env, "write_file", path="evil.cuh", content="overwritten")
    assert not r.ok and "symbolic link" in r.text and "evil.cuh" in r.text
    r = call(env, "edit_file", path="evil.cuh", old="reference", new="nothing")
    assert not r.ok and "symbolic link" in r.text
    assert (env.outside / "secret.txt").read_text() == "the reference answer\n"


def test_dangling_symlink_refused_for_write(env):
    (env.root / "dangling.cuh").symlink_to(env.outside / "does_not_exist.txt")
    r = call(env, "write_file", path="dangling.cuh", content="x")
    assert not r.ok and "symbolic link" in r.text
    assert not (env.outside / "does_not_exist.txt").exists()


def test_write_through_hard_link_refused(env):
    target = env.outside / "secret.txt"
    os.link(target, env.root / "shared.cuh")
    r = call(env, "write_file", path="shared.cuh", content="x")
    assert not r.ok and "hard link" in r.text
    assert target.read_text() == "the reference answer\n"


def test_helper_resolve_path_directly(env):
    p, rel = files.resolve_path(env.root, "extra/new.cu")
    assert rel == "extra/new.cu" and p == env.root / "extra" / "new.cu"
    with pytest.raises(files.PathError, match="NUL"):
        files.resolve_path(env.root, "a\x00b")
    with pytest.raises(files.PathError, match="absolute"):
        files.resolve_path(env.root, "C:/x")
    with pytest.raises(files.PathError, match="is a file, not a folder"):
        files.resolve_path(env.root, "kernel.cu/x")


# ---------------------------------------------------------------------------------------------
# write scope
# ---------------------------------------------------------------------------------------------


def test_refuses_writing_manifest_and_spec(env):
    r = call(env, "write_file", path="task.toml", content="name = 'x'")
    assert not r.ok and "manifest" in r.text and "task.toml" in r.text
    r = call(env, "write_file", path="spec.py", content="")
    assert not r.ok and "spec" in r.text and "spec.py" in r.text
    r = call(env, "edit_file", path="spec.py", old="the spec", new="a lie")
    assert not r.ok and "spec" in r.text
    assert (env.root / "spec.py").read_text() == "# the spec\n"


def test_refuses_writing_non_editable(env):
    r = call(env, "write_file", path="helper.h", content="x")
    assert not r.ok and "not editable" in r.text and "helper.h" in r.text and "kernel.cu" in r.text
    r = call(env, "edit_file", path="helper.h", old="#pragma once", new="")
    assert not r.ok and "not editable" in r.text
    assert (env.root / "helper.h").read_text() == "#pragma once\n"


def test_write_creates_and_overwrites(env):
    r = call(env, "write_file", path="tile.cuh", content="#define TILE 64\n")
    assert r.ok and "created tile.cuh" in r.text and r.data["created"]
    assert (env.root / "tile.cuh").read_text() == "#define TILE 64\n"
    r = call(env, "write_file", path="tile.cuh", content="#define TILE 128\n")
    assert r.ok and "overwrote" in r.text
    assert (env.root / "tile.cuh").read_text() == "#define TILE 128\n"


def test_write_creates_parent_folder(env):
    r = call(env, "write_file", path="extra/deep/more.cu", content="// more\n")
    # 'extra/*.cu' matches extra/deep/more.cu too (fnmatch '*' spans '/'), as the gate sees it
    assert r.ok, r.text
    assert (env.root / "extra" / "deep" / "more.cu").read_text() == "// more\n"


def test_write_refuses_nul_content(env):
    r = call(env, "write_file", path="kernel.cu", content="a\x00b")
    assert not r.ok and "NUL" in r.text
    assert (env.root / "kernel.cu").read_text() == KERNEL


def test_write_refuses_oversized_content(env):
    r = call(env, "write_file", path="kernel.cu", content="a" * (files.MAX_FILE_BYTES + 1))
    assert not r.ok and "at most" in r.text
    assert (env.root / "kernel.cu").read_text() == KERNEL


def test_write_unicode_roundtrip(env):
    r = call(env, "write_file", path="kernel.cu", content="// µs and ≤\n")
    assert r.ok
    assert (env.root / "kernel.cu").read_bytes() == "// µs and ≤\n".encode("utf-8")
    assert "µs and ≤" in call(env, "read_file", path="kernel.cu").text


# ---------------------------------------------------------------------------------------------
# edit_file
# ---------------------------------------------------------------------------------------------


def test_edit_success_shows_context(env):
    r = call(env, "edit_file", path="kernel.cu", old="x[0] = 1.0f;", new="x[0] = 2.0f;")
    assert r.ok, r.text
    assert "replaced 1 occurrence" in r.text
    assert "11| __global__ void k(float* x) { x[0] = 2.0f; }" in r.text
    assert " 8| // line 8" in r.text  # three lines of context before
    assert " 7| // line 7" not in r.text
    assert "x[0] = 2.0f;" in (env.root / "kernel.cu").read_text()


def test_edit_multiline_and_delete(env):
    r = call(env, "edit_file", path="kernel.cu", old="// line 2\n// line 3\n", new="")
    assert r.ok
    text = (env.root / "kernel.cu").read_text()
    assert "// line 2\n" not in text and "// line 1\n// line 4\n" in text


def test_edit_missing_old(env):
    r = call(env, "edit_file", path="kernel.cu", old="does not exist", new="x")
    assert not r.ok and "not found" in r.text and "nothing was changed" in r.text
    assert (env.root / "kernel.cu").read_text() == KERNEL


def test_edit_missing_old_whitespace_hint(env):
    r = call(env, "edit_file", path="kernel.cu", old="x[0]  =   1.0f;", new="y")
    assert not r.ok and "whitespace" in r.text


def test_edit_count_mismatch_says_how_many(env):
    r = call(env, "edit_file", path="kernel.cu", old="// line", new="// LINE")
    assert not r.ok
    assert "occurs 10 times" in r.text and "count=1" in r.text and "count=10" in r.text
    assert (env.root / "kernel.cu").read_text() == KERNEL
    r = call(env, "edit_file", path="kernel.cu", old="x[0]", new="x[1]", count=2)
    assert not r.ok and "occurs 1 times" in r.text and "count=2" in r.text


def test_edit_count_replaces_all(env):
    r = call(env, "edit_file", path="kernel.cu", old="// line", new="// LINE", count=10)
    assert r.ok and "replaced 10 occurrences" in r.text
    assert "more changed places not shown" in r.text
    text = (env.root / "kernel.cu").read_text()
    assert text.count("// LINE") == 10 and "// line" not in text


def test_edit_identical_and_empty_old(env):
    r = call(env, "edit_file", path="kernel.cu", old="x[0]", new="x[0]")
    assert not r.ok and "identical" in r.text
    r = call(env, "edit_file", path="kernel.cu", old="", new="x")
    assert not r.ok and "old" in r.text
    r = call(env, "edit_file", path="kernel.cu", old="x", new="y", count=0)
    assert not r.ok and "count" in r.text


def test_edit_crlf_file(env):
    (env.root / "win.cuh").write_bytes(b"int a;\r\nint b;\r\n")
    r = call(env, "edit_file", path="win.cuh", old="int a;\nint b;", new="int a;\nint c;")
    assert r.ok, r.text
    assert (env.root / "win.cuh").read_bytes() == b"int a;\r\nint c;\r\n"


def test_edit_binary_refused(env):
    (env.root / "bin.cuh").write_bytes(b"a\x00b")
    r = call(env, "edit_file", path="bin.cuh", old="a", new="b")
    assert not r.ok and "binary" in r.text


def test_edit_nul_in_new_refused(env):
    r = call(env, "edit_file", path="kernel.cu", old="x[0]", new="x\x00")
    assert not r.ok and "NUL" in r.text
    assert (env.root / "kernel.cu").read_text() == KERNEL


# ---------------------------------------------------------------------------------------------
# notes
# ---------------------------------------------------------------------------------------------


def test_notes_read_append_replace(env):
    r = call(env, "notes", action="read")
    assert r.ok and "empty" in r.text
    assert call(env, "notes", action="append", text="idea 1: vectorise loads").ok
    assert call(env, "notes", action="append", text="idea 2: bigger tile").ok
    r = call(env, "notes", action="read")
    assert "idea 1" in r.text and "idea 2" in r.text
    assert env.ctx.notes_path.read_text() == "idea 1: vectorise loads\nidea 2: bigger tile\n"
    assert call(env, "notes", action="replace", text="summary: tiles of 128 win").ok
    assert env.ctx.notes_path.read_text() == "summary: tiles of 128 win\n"


def test_notes_need_text(env):
    r = call(env, "notes", action="append")
    assert not r.ok and "text" in r.text
    r = call(env, "notes", action="replace", text="   ")
    assert not r.ok
    r = call(env, "notes", action="delete", text="x")
    assert not r.ok and "action" in r.text


def test_notes_cap(env):
    big = "n" * (files.MAX_NOTES_BYTES - 100)
    assert call(env, "notes", action="replace", text=big).ok
    r = call(env, "notes", action="append", text="m" * 200)
    assert not r.ok and "capped" in r.text and "replace" in r.text
    assert env.ctx.notes_path.read_text() == big + "\n"
    r = call(env, "notes", action="replace", text="z" * (files.MAX_NOTES_BYTES + 1))
    assert not r.ok and "capped" in r.text
    assert env.ctx.notes_path.read_text() == big + "\n"


def test_notes_refuse_nul(env):
    r = call(env, "notes", action="append", text="a\x00b")
    assert not r.ok and "NUL" in r.text
