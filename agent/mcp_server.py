"""`kloop mcp`: one session's tools over the Model Context Protocol (the official `mcp` SDK).

The tools, their descriptions and their input schemas are the ToolBox's (`tools/`, the same pydantic
models the Claude policy's tool schemas come from), plus `status`; a call goes through
`SessionService.call` (budgets, locks, the run record). The briefing (rules + task briefing) is a
resource (`kloop://briefing`) and a prompt (`briefing`), and the server's instructions.

Transports: stdio (a local agent starts `kloop mcp TASK|RUN` itself), or streamable HTTP
(`--http HOST:PORT`, 127.0.0.1 unless told otherwise) behind a bearer token that is generated once
per run, printed once and kept 0600 in the run folder; a request without it gets 403 naming the
token file (not 401, which sends MCP clients into OAuth discovery), and is noted in the run record
(without what it sent). A tool call with a progressToken gets a progress notification every 2 s.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server

from agent import __version__
from agent.mcp_config import TOKEN_FILE
from agent.session_service import SessionService
from tools.fmt import json_safe

BRIEFING_URI = "kloop://briefing"
STATUS_URI = "kloop://status"
MAX_LOGGED_REJECTIONS = 200  # refused requests noted in the run record; past this only a count is kept


def client_of(ctx: Any) -> tuple[str | None, str | None]:
    params = getattr(ctx.session, "client_params", None)
    info = getattr(params, "client_info", None)
    return (getattr(info, "name", None), getattr(info, "version", None)) if info else (None, None)


def build_server(service: SessionService) -> Server:
    """A low-level MCP server whose tools are the service's ToolBox."""

    def who(ctx: Any) -> None:
        name, version = client_of(ctx)
        if name:
            service.set_client(name, version)

    async def list_tools(ctx, params) -> types.ListToolsResult:
        who(ctx)
        return types.ListToolsResult(tools=[
            types.Tool(name=s["name"], description=s["description"], input_schema=s["input_schema"])
            for s in service.schemas()
        ])

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        who(ctx)
        # tools block (builds, the gate): run them off the event loop so other requests are answered,
        # and tell a client that asked for progress (its progressToken) that the call is alive
        result = await with_progress(ctx, params.name, lambda: anyio.to_thread.run_sync(service.call, params.name,
                                                                                       params.arguments or {}))
        return tool_result(result)

    async def list_resources(ctx, params) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[
            types.Resource(name="briefing", uri=BRIEFING_URI, mime_type="text/markdown",
                           description="The rules of the session and the task briefing (roofline, baseline, knobs, files)."),
            types.Resource(name="status", uri=STATUS_URI, mime_type="text/plain",
                           description="Best so far, attempts, budget left."),
        ])

    async def read_resource(ctx, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        uri = str(params.uri)
        if uri == BRIEFING_URI:
            text = await anyio.to_thread.run_sync(briefing_text, service)
            mime = "text/markdown"
        elif uri == STATUS_URI:
            text = (await anyio.to_thread.run_sync(service.call, "status", {})).text
            mime = "text/plain"
        else:
            raise ValueError(f"no resource {uri!r}; resources: {BRIEFING_URI}, {STATUS_URI}")
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, mime_type=mime, text=text)])

    async def list_prompts(ctx, params) -> types.ListPromptsResult:
        return types.ListPromptsResult(prompts=[
            types.Prompt(name="briefing", description="Start the session: the rules and the task briefing."),
        ])

    async def get_prompt(ctx, params: types.GetPromptRequestParams) -> types.GetPromptResult:
        if params.name != "briefing":
            raise ValueError(f"no prompt {params.name!r}; prompts: briefing")
        text = await anyio.to_thread.run_sync(briefing_text, service)
        return types.GetPromptResult(description="The kloop session briefing", messages=[
            types.PromptMessage(role="user", content=types.TextContent(type="text", text=text))])

    info = service.session.record.info
    return Server(
        "kloop", version=__version__, title=f"kloop session {info.run_id}",
        instructions=service.rules(),
        on_list_tools=list_tools, on_call_tool=call_tool,
        on_list_resources=list_resources, on_read_resource=read_resource,
        on_list_prompts=list_prompts, on_get_prompt=get_prompt,
    )


PROGRESS_EVERY_S = 2.0  # a heartbeat: a client with a per-request timeout resets it on each notification


async def with_progress(ctx: Any, tool: str, work: Callable[[], Any]) -> Any:
    """Run `work` (awaitable factory); meanwhile send the MCP progress notification of this request
    every PROGRESS_EVERY_S (elapsed seconds as progress, total unknown) when the client gave a
    progressToken, for any tool: a build, check, bench, sweep, profile or submit can take minutes."""
    import time

    started = time.monotonic()
    out: dict[str, Any] = {}

    async def run_it(scope: anyio.CancelScope) -> None:
        try:
            out["r"] = await work()
        except Exception as exc:  # raised as itself below, not wrapped in an exception group
            out["e"] = exc
        finally:
            scope.cancel()

    async def beat() -> None:
        n = 0
        while True:
            await anyio.sleep(PROGRESS_EVERY_S)
            n += 1
            try:
                await ctx.session.report_progress(float(n), None, f"{tool}: running for {time.monotonic() - started:.0f} s")
            except Exception:  # a client gone or a transport without a back channel: the call goes on
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(beat)
        await run_it(tg.cancel_scope)
    if "e" in out:
        raise out["e"]
    return out["r"]


def tool_result(result: Any) -> types.CallToolResult:
    """A tool's answer for every client: the text as text content, and for tools with data (submit,
    status, sweep, ...) a structuredContent holding the data *and* the same text, because some clients
    (Claude Code) show their model only the structured part when there is one."""
    text = result.text or "(no output)"
    structured = None
    if isinstance(result.data, dict):
        structured = json_safe(json.loads(json.dumps(result.data, default=str)))  # NaN/Inf as null
        structured = {**structured, "text": text}
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=not result.ok,
                                structured_content=structured)


def briefing_text(service: SessionService) -> str:
    service.ensure_best()  # the baseline's figures fill the briefing
    return service.agent_text()


# ---- stdio --------------------------------------------------------------------------------------

def serve_stdio(service: SessionService) -> None:
    from mcp.server.stdio import stdio_server

    server = build_server(service)

    async def main() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)


# ---- streamable HTTP ----------------------------------------------------------------------------

def ensure_token(run_dir: Path) -> tuple[str, bool]:
    """The run's bearer token and whether it was made now (0600, created exclusively)."""
    path = Path(run_dir) / TOKEN_FILE
    if path.is_file():
        return path.read_text().strip(), False
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


class BearerGate:
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer <token>`.

    Without it the answer is 403 with a JSON-RPC error naming the token file, not 401: an MCP
    client answers any 401 by starting OAuth discovery (Claude Code then fails with "Interactive OAuth
    requires a TTY" and never shows why), and this server has no OAuth to discover. No
    WWW-Authenticate header for the same reason; /.well-known/ (OAuth metadata) is a plain 404."""

    def __init__(self, app: Any, token: str, on_reject: Callable[[dict[str, Any]], None], token_file: Path | None = None):
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.on_reject = on_reject
        self.token_file = token_file

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                client = scope.get("client")
                path = str(scope.get("path") or "")
                self.on_reject({"path": path, "method": scope.get("method"),
                                "client": f"{client[0]}:{client[1]}" if client else None,
                                "authorization_header": "wrong" if got else "missing"})
                if path.startswith("/.well-known/"):
                    status, body = 404, b'{"error": "not found: this kloop server has no OAuth; it takes a bearer token"}'
                else:
                    where = str(self.token_file) if self.token_file else f"<run folder>/{TOKEN_FILE}"
                    message = (f"kloop: this MCP session needs its bearer token ({'a wrong one was sent' if got else 'none was sent'}): "
                               f"send the header 'Authorization: Bearer <token>' with the token kept in {where} "
                               "(mode 0600, on the machine that serves the session). No OAuth here.")
                    status = 403
                    body = json.dumps({"jsonrpc": "2.0", "id": None,
                                       "error": {"code": -32001, "message": message, "data": {"token_file": where}}}).encode()
                await send({"type": "http.response.start", "status": status, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def http_app(service: SessionService, token: str, host: str) -> Any:
    server = build_server(service)
    app = server.streamable_http_app(host=host)
    rejected = {"n": 0}

    def on_reject(data: dict[str, Any]) -> None:
        rejected["n"] += 1
        n = rejected["n"]
        if n <= MAX_LOGGED_REJECTIONS or n % 1000 == 0:
            service.session.log("note", text=f"mcp http: unauthorized request #{n} refused (403)",
                                data={"source": "mcp-http", "unauthorized": n, **data})

    return BearerGate(app, token, on_reject, Path(service.run_dir) / TOKEN_FILE)


def serve_http(service: SessionService, host: str, port: int, say: Callable[[str], None]) -> None:
    import uvicorn

    token, new = ensure_token(service.run_dir)
    app = http_app(service, token, host)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/mcp"
    say(f"serving run {service.session.record.info.run_id} at {url}")
    if new:
        say(f"bearer token (shown once; kept in {service.run_dir / TOKEN_FILE}, mode 0600):\n  {token}")
    else:
        say(f"bearer token: in {service.run_dir / TOKEN_FILE}")
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")).run()
