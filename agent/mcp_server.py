"""`kloop mcp`: one session's tools over the Model Context Protocol (the official `mcp` SDK).

The tools, their descriptions and their input schemas are the ToolBox's (`tools/`, the same pydantic
models the Claude policy's tool schemas come from), plus `status`; a call goes through
`SessionService.call` (budgets, locks, the run record). The briefing (rules + task briefing) is a
resource (`kloop://briefing`) and a prompt (`briefing`), and the server's instructions.

Transports: stdio (a local agent starts `kloop mcp TASK|RUN` itself), or streamable HTTP
(`--http HOST:PORT`, 127.0.0.1 unless told otherwise) behind a bearer token that is generated once
per run, printed once and kept 0600 in the run folder; a request without it gets 401, and is noted
in the run record (without what it sent).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server

from agent import __version__
from agent.session_service import TOKEN_FILE, SessionService
from tools.fmt import json_safe

BRIEFING_URI = "kloop://briefing"
STATUS_URI = "kloop://status"
MAX_LOGGED_REJECTIONS = 200  # 401s noted in the run record; past this only a count is kept


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
        # tools block (builds, the gate): run them off the event loop so other requests are answered
        result = await anyio.to_thread.run_sync(service.call, params.name, params.arguments or {})
        structured = None
        if params.name in ("submit", "status") and result.data is not None:
            structured = json_safe(json.loads(json.dumps(result.data, default=str)))  # NaN/Inf as null
        return types.CallToolResult(content=[types.TextContent(type="text", text=result.text or "(no output)")],
                                    is_error=not result.ok, structured_content=structured)

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
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer <token>`, else 401."""

    def __init__(self, app: Any, token: str, on_reject: Callable[[dict[str, Any]], None]):
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                client = scope.get("client")
                self.on_reject({"path": scope.get("path"), "method": scope.get("method"),
                                "client": f"{client[0]}:{client[1]}" if client else None,
                                "authorization_header": "wrong" if got else "missing"})
                body = b'{"error": "unauthorized: this kloop session needs its bearer token"}'
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="kloop"')]})
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
            service.session.log("note", text=f"mcp http: unauthorized request #{n} refused (401)",
                                data={"source": "mcp-http", "unauthorized": n, **data})

    return BearerGate(app, token, on_reject)


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8765")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


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


# ---- client configuration -----------------------------------------------------------------------

def kloop_command() -> list[str]:
    exe = shutil.which("kloop")
    return [exe] if exe else [sys.executable, "-m", "agent.cli"]


def stdio_config(target: str) -> dict[str, Any]:
    cmd = kloop_command()
    return {"mcpServers": {"kloop": {"type": "stdio", "command": cmd[0], "args": [*cmd[1:], "mcp", target]}}}


def http_config(url: str) -> dict[str, Any]:
    return {"mcpServers": {"kloop": {"type": "http", "url": url,
                                     "headers": {"Authorization": "Bearer ${KLOOP_MCP_TOKEN}"}}}}


def print_config(target: str | None, run_dir: Path | None, host: str, port: int) -> str:
    target = target or "TASK_OR_RUN"
    url = f"http://{host}:{port}/mcp"
    token_at = f"{run_dir / TOKEN_FILE}" if run_dir else "<run folder>/" + TOKEN_FILE
    return "\n".join([
        "# Claude Code: .mcp.json in the folder you open (stdio: Claude Code starts the server itself)",
        json.dumps(stdio_config(target), indent=2),
        "",
        "# Any client over streamable HTTP (e.g. an agent on a laptop driving the GPU box):",
        f"#   on the GPU box:  kloop mcp {target} --http 127.0.0.1:{port}   (prints the bearer token once)",
        f"#   on the laptop:   ssh -N -L {port}:127.0.0.1:{port} GPU_BOX",
        f"#                    export KLOOP_MCP_TOKEN=...   (the token printed; also in {token_at})",
        json.dumps(http_config(url), indent=2),
        "# (or: claude mcp add --transport http kloop " + url + ' --header "Authorization: Bearer $KLOOP_MCP_TOKEN")',
    ])
