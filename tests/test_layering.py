"""The house's one direction: tools/ (the ground floor) never imports agent/, and the agent tools reach
a session only through tools.port.SessionPort (no `.gate`, `.ws`, `.record` on their context)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted((ROOT / "tools").glob("*.py"))


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_tools_never_import_agent():
    assert TOOLS
    bad = {p.name: sorted(m for m in imported(p) if m == "agent" or m.startswith("agent.")) for p in TOOLS}
    assert not {k: v for k, v in bad.items() if v}


def test_agent_tools_use_only_the_port():
    for name in ("agent_tools.py", "files.py"):
        tree = ast.parse((ROOT / "tools" / name).read_text())
        reached = {n.attr for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "ctx"}
        assert reached, name
        assert not reached & {"gate", "ws", "record", "session", "best_commit", "baseline"}, (name, reached)
        assert reached <= {"task", "trusted_dir", "files_root", "notes_path", "device", "submit", "submit_batch", "revert", "ledger"}, (name, reached)


def test_git_runs_only_through_the_workspace():
    """agent/workspace.py is kloop's one runner of git (its allow-listed environment, `-C`, no hooks):
    nothing else imports GitPython, whose git children inherit the whole environment."""
    modules = sorted((ROOT / "agent").rglob("*.py")) + TOOLS
    bad = {p.relative_to(ROOT).as_posix(): sorted(m for m in imported(p) if m == "git" or m.startswith("git."))
           for p in modules}
    assert not {k: v for k, v in bad.items() if v}


def test_policies_never_import_the_session():
    """A policy reads the record through agent/run_state.py and acts through its facade, never the session."""
    policies = sorted((ROOT / "agent" / "policies").glob("*.py"))
    assert policies
    bad = {p.name: sorted(m for m in imported(p) if m == "agent.session" or m.startswith("agent.session_"))
           for p in policies}
    assert not {k: v for k, v in bad.items() if v}


def test_one_number_formatter_and_one_secret_scrubber():
    """Numbers for people are written by tools/fmt.py, secrets scrubbed by tools/secrets.py: no module
    defines its own (a second copy drifts: one said 'n/a', the other '-', for the same missing figure)."""
    wrappers = {"agent/report_html.py: fmt_time"}  # the pages' Jinja filter: tools.fmt.fmt_time with 'µs'
    bad = []
    for path in sorted((ROOT / "agent").rglob("*.py")) + TOOLS:
        if path.parent.name == "tools" and path.name in ("fmt.py", "secrets.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.col_offset == 0:
                name = node.name.lstrip("_")
                if name.startswith("fmt_") or name in ("us", "num") or "Scrubber" in name or name in ("scrub", "scrub_text", "redact"):
                    bad.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not set(bad) - wrappers


def test_sessions_and_client_configs_need_no_mcp_sdk():
    """`kloop session start` writes .mcp.json and `kloop mcp --print-config` prints it: neither loads the MCP
    SDK (a machine without it, like the H100 of stop 36, still runs shell sessions); only serving does."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['mcp'] = sys.modules['mcp_types'] = None\n"
            "import agent.cli, agent.session_cli, agent.session_service, agent.mcp_config\n"
            "assert 'kloop' in agent.mcp_config.stdio_config('/run')['mcpServers']\n"
            "assert 'mcp_server' not in ' '.join(sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    served = {m for m in imported(ROOT / "agent" / "mcp_config.py") if m.split(".")[0] in ("mcp", "mcp_types")}
    assert not served


def test_kloop_mcp_without_the_sdk_fails_before_any_session_exists(tmp_path):
    """Serving needs the SDK: without it `kloop mcp TASK` says so and starts nothing (no run, no worktree)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['mcp'] = sys.modules['mcp_types'] = None\n"
            "from agent.cli import main\n"
            f"sys.argv = ['kloop', 'mcp', 'matmul_cpu', '--runs-dir', {str(tmp_path / 'runs')!r}]\n"
            "main()\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "needs the MCP SDK" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "runs").exists()
