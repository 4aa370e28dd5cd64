"""What an MCP client needs to start or reach `kloop mcp`: the `.mcp.json` snippets (stdio and streamable
HTTP) that `kloop mcp --print-config` prints and `kloop session start` writes into the worktree. No MCP SDK
import here: writing a client's config must not need the server's dependencies loaded."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

TOKEN_FILE = "mcp-token"  # in the run folder: the bearer token of `kloop mcp --http`


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8765")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


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
    # the stdio snippet runs from whatever folder the client starts in: name the run by its absolute
    # folder (a bare run id would need a matching KLOOP_RUNS there), a task by its absolute path
    if run_dir is not None:
        target = str(Path(run_dir).resolve())
    elif target and Path(target).exists():
        target = str(Path(target).resolve())
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
