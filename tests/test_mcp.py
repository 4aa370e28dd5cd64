"""`kloop mcp`: an MCP client from the official SDK drives a session, over stdio (the initialize
handshake, as Claude Code does) and over streamable HTTP (behind the bearer token): the tool list is
the ToolBox's, files are read and edited, an out-of-scope edit and a no-op submit are refused, real
gains land as one commit each, two submits at once get one 'busy', a request without the token gets
403 naming the token file (no OAuth: a 401 sends clients into OAuth discovery; it is noted in the record), and the API key never appears in what the client is shown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import git
import mcp_types as types
import pytest
from mcp import Client, StdioServerParameters

from agent.records import RunRecord
from agent.session_service import STATUS_TOOL
from tests.session_repo import KEY, ROOT, WASTE, accepted_commits, make_repo
from tools.agent_tools import session_toolbox

pytestmark = pytest.mark.slow

CLIENT = types.Implementation(name="pytest-mcp", version="0.9")
TIMEOUT = 600


def server_env(tmp: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "ANTHROPIC_API_KEY": KEY,
            "KLOOP_CACHE": os.environ.get("KLOOP_CACHE", str(tmp / "cache")), "KLOOP_RUNS": str(tmp / "runs")}


def expected_tools() -> dict[str, dict]:
    box = session_toolbox(None)
    box.add(STATUS_TOOL)
    return {s["name"]: s for s in box.schemas()}


class Transcript:
    """Every text the client was shown (to prove the key is never among them)."""

    def __init__(self, client: Client):
        self.client = client
        self.texts: list[str] = []

    async def call(self, name: str, args: dict | None = None, progress: list | None = None) -> types.CallToolResult:
        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.append((done, total, message))

        result = await self.client.call_tool(name, args or {}, progress_callback=on_progress if progress is not None else None)
        self.texts += [c.text for c in result.content if isinstance(c, types.TextContent)]
        if result.structured_content:
            self.texts.append(json.dumps(result.structured_content))
        return result


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


def model_sees(result: types.CallToolResult) -> str:
    """What Claude Code puts before its model: the structuredContent when there is one (then the text
    content is not shown), else the text."""
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return text_of(result)


@pytest.fixture(scope="module")
def stdio_run(tmp_path_factory):
    """A session started by `kloop mcp TASK` over stdio and driven to one accepted gain."""
    tmp = tmp_path_factory.mktemp("mcp")
    task = make_repo(tmp)
    params = StdioServerParameters(
        command=sys.executable, cwd=str(tmp),
        args=["-m", "agent.cli", "mcp", str(task), "--gate-seconds", "6", "--max-attempts", "8"],
        env=server_env(tmp))
    shown: list[str] = []

    async def drive() -> dict:
        async with Client(params, client_info=CLIENT, mode="legacy", read_timeout_seconds=TIMEOUT) as client:
            t = Transcript(client)
            out: dict = {"instructions": client.instructions}
            out["tools"] = {tool.name: tool for tool in (await client.list_tools()).tools}
            brief = await client.read_resource("kloop://briefing")
            out["briefing"] = brief.contents[0].text
            prompt = await client.get_prompt("briefing")
            out["prompt"] = prompt.messages[0].content.text
            out["list"] = text_of(await t.call("list_files"))
            source = await t.call("read_file", {"path": "matmul.cpp"})
            out["source"] = text_of(source)
            out["write_spec"] = await t.call("write_file", {"path": "spec.py", "content": "# mine now\n"})
            out["edit_manifest"] = await t.call("edit_file", {"path": "task.toml", "old": "min_gain", "new": "max_gain"})
            out["escape"] = await t.call("read_file", {"path": "../../README.md"})
            out["noop"] = await t.call("submit", {"title": "Nothing changed"})
            out["broken_edit"] = await t.call("edit_file", {"path": "matmul.cpp", "old": WASTE[2],
                                                            "new": WASTE[2] + "  C[0] += 1.0f;\n"})
            out["broken"] = await t.call("submit", {"title": "Off by one in the corner"})
            out["edit"] = await t.call("edit_file", {"path": "matmul.cpp", "old": WASTE[1] + WASTE[2], "new": ""})
            out["check"] = await t.call("check")
            out["gain_progress"] = []
            out["gain"] = await t.call("submit", {"title": "Compute the product twice, not four times",
                                                   "rationale": "two of the four products were thrown away"},
                                       progress=out["gain_progress"])
            out["status"] = await t.call("status")
            shown.extend(t.texts + [out["briefing"], out["prompt"], out["instructions"] or ""])
            return out

    out = anyio.run(drive)
    runs = tmp / "runs"
    (run_dir,) = [p for p in runs.iterdir() if (p / "run.json").is_file()]
    return {"tmp": tmp, "task": task, "repo": task.parents[1], "run_dir": run_dir, "shown": shown, **out}


def test_stdio_tools_are_the_toolbox(stdio_run):
    want = expected_tools()
    got = stdio_run["tools"]
    assert set(got) == set(want)
    for name, tool in got.items():
        assert tool.description == want[name]["description"]
        assert tool.input_schema == want[name]["input_schema"], name
    for name in ("list_files", "read_file", "edit_file", "write_file", "build", "sass", "check", "bench", "sweep",
                 "profile", "notes", "history", "submit", "revert", "status"):
        assert name in got


def test_stdio_briefing_and_files(stdio_run):
    for text in (stdio_run["briefing"], stdio_run["prompt"]):
        assert "kloop session" in text and "matmul_cpu" in text and "Edit only the editable files" in text
    assert "Edit only the editable files" in stdio_run["instructions"]
    assert "matmul.cpp" in stdio_run["list"] and "waste 3" in stdio_run["source"]
    assert stdio_run["write_spec"].is_error and "read-only" in text_of(stdio_run["write_spec"])
    assert stdio_run["edit_manifest"].is_error
    assert stdio_run["escape"].is_error and "'..' is not allowed" in text_of(stdio_run["escape"])
    assert not stdio_run["edit"].is_error and not stdio_run["check"].is_error


def test_stdio_noop_refused_and_gain_lands_as_one_commit(stdio_run):
    noop = stdio_run["noop"]
    assert noop.is_error and "nothing changed" in text_of(noop) and "without an attempt" in text_of(noop)
    gain = stdio_run["gain"]
    assert gain.structured_content["accepted"] is True, text_of(gain)
    assert gain.structured_content["speedup"] > 1.5
    status = stdio_run["status"].structured_content
    assert status["accepted"] == 1 and status["attempts"] == 2 and status["left"]["attempts"] == 6  # the no-op cost none
    info = RunRecord.open(stdio_run["run_dir"]).info
    assert info.policy == "mcp:pytest-mcp/0.9"
    assert accepted_commits(stdio_run["repo"], info.branch, info.base_commit) == ["Compute the product twice, not four times"]
    assert sorted(git.Repo(stdio_run["repo"]).commit(info.branch).stats.files) == ["kernels/matmul_cpu/matmul.cpp"]
    events = RunRecord.open(stdio_run["run_dir"]).events()
    assert [e.name for e in events if e.kind == "tool_call"].count("submit") == 3
    assert events[-1].kind == "note" and "client disconnected" in events[-1].text  # the session stays open
    assert KEY not in "\n".join(stdio_run["shown"])


def test_a_model_sees_the_whole_verdict(stdio_run):
    """Accepted and rejected, what the client's model is shown (structuredContent, as Claude Code reads
    it) carries the verdict's text: per-shape timings, the check table, what happened to the worktree."""
    gain, broken = stdio_run["gain"], stdio_run["broken"]
    assert not stdio_run["broken_edit"].is_error
    for result in (gain, broken):
        seen = model_sees(result)
        assert result.structured_content["text"] == text_of(result)  # the same words either way
        assert text_of(result) in json.loads(seen)["text"]
    seen_gain = model_sees(gain)
    shapes = gain.structured_content["shapes"]
    assert len(shapes) >= 2 and all(s["time_best"] > s["time_candidate"] > 0 for s in shapes), shapes
    for s in shapes:
        assert s["shape"] in text_of(gain) and s["shape"] in seen_gain
    assert "committed" in gain.structured_content["worktree"] and "new best" in seen_gain
    assert "gate A/B" in gain.structured_content["timing_method"]

    assert broken.structured_content["accepted"] is False and broken.structured_content["stage"] == "check", text_of(broken)
    seen_broken = model_sees(broken)
    assert "reverted" in broken.structured_content["worktree"] and "your edits were reverted" in seen_broken
    failures = broken.structured_content["check_failures"]
    assert failures and all(not f["passed"] for f in failures)
    assert failures[0]["shape"] in text_of(broken) and failures[0]["shape"] in seen_broken


def test_status_is_whole_and_the_record_names_the_client(stdio_run):
    """`status` (like submit, read by Claude Code from its structuredContent only) carries its text; the
    client's `initialize` name and version are a field of run.json that the views show as who drove it."""
    from agent.run_view import load_view

    status = stdio_run["status"]
    assert status.structured_content["text"] == text_of(status) and "accepted" in model_sees(status)
    info = RunRecord.open(stdio_run["run_dir"]).info
    assert [(c.name, c.version, c.via) for c in info.clients] == [("pytest-mcp", "0.9", "mcp")]
    assert load_view(stdio_run["run_dir"]).driven_by == "pytest-mcp 0.9 (over MCP)"


def test_long_tools_send_progress(stdio_run):
    """A submit (seconds of building and timing) sends MCP progress notifications to a client that gave
    a progressToken: a client with a per-request timeout is kept waiting, not timed out."""
    progress = stdio_run["gain_progress"]
    assert progress, "no progress notification during a submit"
    assert [p[0] for p in progress] == sorted(p[0] for p in progress) and all("submit: running" in p[2] for p in progress)


def test_print_config_works_from_any_folder(stdio_run, tmp_path):
    """The stdio snippet names the run by its absolute folder: it works without KLOOP_RUNS, from anywhere."""
    env = {k: v for k, v in {**os.environ, **server_env(stdio_run["tmp"])}.items() if k != "KLOOP_RUNS"}
    run_dir = stdio_run["run_dir"]
    out = subprocess.run([sys.executable, "-m", "agent.cli", "mcp", run_dir.name, "--print-config"],
                         capture_output=True, text=True, env={**env, "KLOOP_RUNS": str(run_dir.parent)}, timeout=120)
    assert out.returncode == 0, out.stderr
    snippet = json.loads(out.stdout[out.stdout.index("{"):out.stdout.index("\n}\n") + 2])
    server = snippet["mcpServers"]["kloop"]
    assert server["args"][-1] == str(run_dir.resolve())
    again = subprocess.run([server["command"], *server["args"], "--print-config"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=120)
    assert again.returncode == 0 and str(run_dir.resolve()) in again.stdout, again.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, headers: dict[str, str]) -> int:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Accept": "application/json, text/event-stream", **headers})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to localhost
    try:
        with opener.open(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except urllib.error.URLError:
        return 0  # not listening yet


def await_unauthorized(url: str) -> str:
    """What the official SDK client without the token is told (it must name the token file, and the
    client must not be sent into OAuth)."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    async def go() -> str:
        http = httpx2.AsyncClient(timeout=httpx2.Timeout(60), trust_env=False)
        try:
            async with http, Client(streamable_http_client(url, http_client=http), client_info=CLIENT,
                                    read_timeout_seconds=60) as client:
                await client.list_tools()
        except Exception as exc:  # the initialize is refused: the error carries the server's message
            return "".join(str(e) for e in getattr(exc, "exceptions", [exc])) + repr(exc)
        return "(no error)"

    return anyio.run(go)


def test_http_resumes_the_run_behind_a_token(stdio_run):
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    tmp, run_dir = stdio_run["tmp"], stdio_run["run_dir"]
    port = _free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    log = (tmp / "http-server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "mcp", str(run_dir), "--http", f"127.0.0.1:{port}"],
                            env={**os.environ, **server_env(tmp)}, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        token_file = run_dir / "mcp-token"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if token_file.is_file() and _post(url, {}) == 403:
                break
            assert proc.poll() is None, (tmp / "http-server.log").read_text()
            time.sleep(0.5)
        token = token_file.read_text().strip()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert _post(url, {}) == 403
        assert _post(url, {"Authorization": "Bearer not-the-token"}) == 403
        assert _post(url.replace("/mcp", "/.well-known/oauth-protected-resource"), {}) == 404  # no OAuth to discover
        unauthorized = await_unauthorized(url)
        assert str(token_file) in unauthorized, unauthorized

        async def drive() -> dict:
            out: dict = {}
            http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(TIMEOUT),
                                      trust_env=False)
            async with http, Client(streamable_http_client(url, http_client=http), client_info=CLIENT,
                                    read_timeout_seconds=TIMEOUT) as client:
                t = Transcript(client)
                out["tools"] = {tool.name for tool in (await client.list_tools()).tools}
                out["edit"] = await t.call("edit_file", {"path": "matmul.cpp", "old": WASTE[0], "new": ""})
                results: list = []

                async def submit(title: str) -> None:
                    results.append(await t.call("submit", {"title": title}))

                async with anyio.create_task_group() as tg:  # two submits at once: one is judged, one is busy
                    tg.start_soon(submit, "Compute the product once")
                    tg.start_soon(submit, "Compute the product once (again)")
                out["submits"] = results
                out["status"] = await t.call("status")
                out["texts"] = t.texts
            return out

        out = anyio.run(drive)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    server_log = (tmp / "http-server.log").read_text()
    assert token in server_log  # printed once, when it was made

    assert out["tools"] == set(expected_tools())
    assert not out["edit"].is_error
    busy = [r for r in out["submits"] if text_of(r).startswith("busy")]
    judged = [r for r in out["submits"] if not text_of(r).startswith("busy")]
    assert len(busy) == 1 and len(judged) == 1, [text_of(r) for r in out["submits"]]
    assert "one at a time" in text_of(busy[0])
    assert judged[0].structured_content["accepted"] is True, text_of(judged[0])
    assert out["status"].structured_content["accepted"] == 2

    info = RunRecord.open(run_dir).info
    assert accepted_commits(stdio_run["repo"], info.branch, info.base_commit) == [
        "Compute the product once", "Compute the product twice, not four times"]
    events = RunRecord.open(run_dir).events()
    refused = [e for e in events if e.kind == "note" and e.data.get("unauthorized")]
    assert len(refused) >= 3 and {e.data["authorization_header"] for e in refused} == {"missing", "wrong"}
    record_text = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.json*"))
    assert token not in record_text and "not-the-token" not in record_text
    assert KEY not in "\n".join(out["texts"]) and KEY not in record_text
    assert any(e.kind == "session_started" and e.resumed for e in events)
