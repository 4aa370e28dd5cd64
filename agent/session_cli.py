"""The session as shell commands, for agents that only have a shell, and `kloop mcp`.

    kloop session start TASK        -> run id and worktree (baseline built, checked and timed)
    kloop build|check|bench|sass|profile|status|revert   (in the worktree, or --run RUN)
    kloop submit -m TITLE [--rationale R] [--knob N=V] [--gate-seconds N]   exit 0 accepted, 1 rejected
    kloop session resume RUN [--repo PATH]               reopen (here, or on another machine)
    kloop session end

Each command is its own process: it attaches to the session (run record + branch), runs one tool
through `SessionService.call` (the same tools, budgets, locks and record as MCP), and leaves.
Exit status: 0 done (accepted), 1 the tool said no (rejected, wrong results, build failed),
2 bad usage (no session here, unknown run), 3 not run (busy with a submit, budget spent, ended).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import List, Optional

import typer

session_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Sessions driven from the shell: start, resume, end (the tools are top-level commands).")

RUN_OPT = typer.Option(None, "--run", help="Run id, run folder or 'last' (default: the session of the worktree you are in).")
RUNS_DIR_OPT = typer.Option(None, "--runs-dir", help="Runs folder (default: $KLOOP_RUNS, else the one holding the session worktree you are in, else .kloop/runs of the task's git repository (of the current folder's, for a shipped task or no task), else ~/.kloop/runs).")
REPO_OPT = typer.Option(None, "--repo", help="The repository holding the session branch, when the run moved machines.")
JSON_OPT = typer.Option(False, "--json", help="Print the result as JSON.")
KNOB_OPT = typer.Option(None, "--knob", "-k", help="NAME=VALUE, repeatable.")


def _cli():
    from agent import cli  # late: agent.cli registers this module's commands

    return cli


def _budget(max_attempts, max_hours, max_gpu_seconds):
    from agent.policies.base import Budget

    return Budget(max_attempts=max_attempts, max_hours=max_hours, max_gpu_seconds=max_gpu_seconds)


def attach(run: Optional[str], runs_dir: Optional[Path], repo: Optional[Path] = None, announce: bool = False,
           lock: bool = True):
    """The service of the session named by --run, or of the worktree holding the current folder."""
    from agent.records import RecordError
    from agent.runlock import RunLocked
    from agent.session_service import ServiceError, SessionEnded, SessionService, run_of_worktree
    from agent.workspace import WorkspaceError

    cli = _cli()
    try:
        run_dir = cli.resolve_run(run, runs_dir) if run else run_of_worktree(Path.cwd(), runs_dir)
        service = SessionService.attach(run_dir, repo=repo, announce=announce, lock=lock)
    except (SessionEnded, RunLocked) as exc:
        cli.fail(str(exc), code=3)
    except (ServiceError, WorkspaceError, RecordError) as exc:
        cli.fail(str(exc))
    return service


def _emit(name: str, result, as_json: bool) -> None:
    if as_json:
        payload = {"tool": name, "ok": result.ok, "event": result.event, "text": result.text, "data": result.data}
        _cli().emit_json(payload)  # strict JSON: a figure that is NaN/Inf is null
    else:
        sys.stdout.write(result.text.rstrip() + "\n")


def run_tool(name: str, args: dict, run: Optional[str], runs_dir: Optional[Path], as_json: bool) -> None:
    """Attach, run one tool, print its answer, exit with its status."""
    from agent.session_service import READ_ONLY

    # reading needs no lock: `kloop status` works while an MCP server holds the run
    service = attach(run, runs_dir, lock=name not in READ_ONLY)
    try:
        result = service.call(name, {k: v for k, v in args.items() if v is not None})
    finally:
        service.close()
    _emit(name, result, as_json)
    if result.bad_input:  # a knob value, a field, a tool name: the caller's error, as elsewhere
        raise typer.Exit(2)
    if result.event in ("busy", "budget") or result.text.startswith("not run:"):
        raise typer.Exit(3)
    if name == "submit":
        raise typer.Exit(0 if result.event == "accepted" else 1)
    raise typer.Exit(0 if result.ok else 1)


def is_external(policy: str) -> bool:
    """A run driven by an outside agent (through MCP or these commands), not by a kloop policy."""
    return policy == "cli" or policy == "mcp" or policy.startswith("mcp:")


def _knobs(items: Optional[List[str]]) -> dict | None:
    knobs = _cli().parse_knobs(items)
    return knobs or None


# ---- session start / resume / end ---------------------------------------------------------------

@session_app.command("start")
def session_start(
    task: str = typer.Argument(..., help="Task folder (holding task.toml) or shipped task name."),
    max_attempts: Optional[int] = typer.Option(None, help="Most submissions to the gate."),
    max_hours: Optional[float] = typer.Option(None, help="Wall-clock hours from now."),
    max_gpu_seconds: Optional[float] = typer.Option(None, help="Most seconds spent in check/bench/sweep/profile and the gate."),
    gate_seconds: float = typer.Option(4.0, help="Gate: timing seconds per decision."),
    allow_dirty: bool = typer.Option(False, help="Snapshot uncommitted changes of the task folder into the base."),
    runs_dir: Optional[Path] = RUNS_DIR_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Start a session driven from the shell: prints the run id and the worktree to work in."""
    service = start_service(task, "cli", _budget(max_attempts, max_hours, max_gpu_seconds), gate_seconds, allow_dirty, runs_dir)
    cli = _cli()
    cli._print_sandbox(service.session.record.info.sandbox)
    try:
        pending = service.ensure_best()  # a reason when the task's device is not here: the baseline waits
    except Exception as exc:
        service.close()
        cli.fail(f"baseline: {exc}", code=1)
    service.write_agent_files()
    service.close()
    info = service.session.record.info
    if as_json:
        cli.emit_json({"run": info.run_id, "worktree": str(info.worktree), "run_dir": str(service.run_dir),
                       "branch": info.branch, "task_folder": str(service.session.ws.task_path),
                       "baseline_pending": pending})
        return
    sys.stdout.write(f"run {info.run_id}\nworktree {info.worktree}\n")
    if pending:
        _say_pending(pending, info.run_id)
        cli.err_console.print(f"cd {info.worktree}; read AGENTS.md; then kloop build / sass. Record: {service.run_dir}",
                              highlight=False)
        return
    cli.err_console.print(f"cd {info.worktree}; read AGENTS.md; then kloop check / bench / submit -m TITLE. "
                          f"Record: {service.run_dir}", highlight=False)


def _say_pending(reason: str, run_id: str) -> None:
    from agent.session_service import pending_text

    _cli().err_console.print(pending_text(reason, run_id), highlight=False, markup=False)


def start_service(task: str, policy: str, budget, gate_seconds: float, allow_dirty: bool, runs_dir: Optional[Path]):
    from agent.gate import GateConfig
    from agent.session_service import SessionService
    from agent.workspace import WorkspaceError
    from tools.task import TaskError

    cli = _cli()
    t = cli.resolve_task(task)
    try:
        return SessionService.start(t.root, policy, budget, runs_root=cli._runs_root(runs_dir, t.root), allow_dirty=allow_dirty,
                                    gate_config=GateConfig(max_seconds=gate_seconds))
    except (WorkspaceError, TaskError) as exc:
        cli.fail(str(exc))


@session_app.command("resume")
def session_resume(run: str = typer.Argument(..., help="Run id, run folder, or 'last'."),
                   repo: Optional[Path] = REPO_OPT, runs_dir: Optional[Path] = RUNS_DIR_OPT,
                   as_json: bool = JSON_OPT) -> None:
    """Reopen a session (after `session end`, or on another machine: copy the run folder, fetch the
    branch into a clone, pass --repo)."""
    service = attach(run, runs_dir, repo=repo, announce=True)
    _cli()._print_sandbox(service.session.sandbox.as_dict())
    pending = None
    if service.session.record.info.baseline_pending:  # started without the device: measure the baseline now
        try:
            pending = service.ensure_best()
        except Exception as exc:
            service.close()
            _cli().fail(f"baseline: {exc}", code=1)
    service.write_agent_files()
    service.close()
    info = service.session.record.info
    if as_json:
        _cli().emit_json({"run": info.run_id, "worktree": str(service.session.ws.path), "run_dir": str(service.run_dir),
                          "baseline_pending": pending})
        return
    sys.stdout.write(f"run {info.run_id}\nworktree {service.session.ws.path}\n")
    if pending:
        _say_pending(pending, info.run_id)


@session_app.command("end")
def session_end(run: Optional[str] = RUN_OPT, runs_dir: Optional[Path] = RUNS_DIR_OPT,
                keep_worktree: bool = typer.Option(False, help="Keep the worktree folder (at the best version).")) -> None:
    """End the session: the worktree goes back to the best version (uncommitted edits are dropped) and
    is removed; the branch kloop/<run-id> holds every accepted change."""
    from agent.session_service import Busy

    service = attach(run, runs_dir)
    worktree = Path(service.session.ws.path).resolve()
    try:
        service.end("ended from the shell", remove_worktree=not keep_worktree)
    except Busy as exc:
        _cli().fail(str(exc), code=3)
    info = service.session.record.info
    accepted = len(service.session.state().accepted)
    if accepted:
        # a shipped task's branch lives in kloop's copy of the task (<runs>/_tasks/<name>), not in the checkout
        sys.stdout.write(f"session {info.run_id} ended; {accepted} accepted change{'s' * (accepted != 1)} on "
                         f"{info.branch} in {info.repo_root} (git -C {info.repo_root} log {info.branch})\n")
    else:
        sys.stdout.write(f"session {info.run_id} ended; no change was accepted (the attempts: kloop log {info.run_id})\n")
    try:
        inside = not keep_worktree and Path.cwd().resolve().is_relative_to(worktree)
    except OSError:  # the current folder is gone: it was the worktree
        inside = not keep_worktree
    if inside:
        sys.stdout.write(f"the worktree {worktree} was removed: cd out of it (e.g. cd {info.repo_root})\n")


# ---- the tools ----------------------------------------------------------------------------------

def build_cmd(knob: Optional[List[str]] = KNOB_OPT, run: Optional[str] = RUN_OPT,
              runs_dir: Optional[Path] = RUNS_DIR_OPT, as_json: bool = JSON_OPT) -> None:
    """Compile the worktree's sources: errors, registers, spills, shared memory per kernel."""
    run_tool("build", {"knobs": _knobs(knob)}, run, runs_dir, as_json)


def check_cmd(knob: Optional[List[str]] = KNOB_OPT, shape: Optional[List[str]] = typer.Option(None, "--shape", "-s", help="Only these check shapes."),
              run: Optional[str] = RUN_OPT, runs_dir: Optional[Path] = RUNS_DIR_OPT, as_json: bool = JSON_OPT) -> None:
    """Correctness on every check shape (fresh random inputs); exit 1 when wrong."""
    run_tool("check", {"knobs": _knobs(knob), "shapes": shape or None}, run, runs_dir, as_json)


def bench_cmd(knob: Optional[List[str]] = KNOB_OPT, shape: Optional[List[str]] = typer.Option(None, "--shape", "-s", help="Only these bench shapes."),
              seconds: Optional[float] = typer.Option(None, help="Timing seconds per shape."),
              comparators: bool = typer.Option(False, help="Also time the library ops the kernel replaces."),
              run: Optional[str] = RUN_OPT, runs_dir: Optional[Path] = RUNS_DIR_OPT, as_json: bool = JSON_OPT) -> None:
    """Quick timings per bench shape (not a gate decision)."""
    run_tool("bench", {"knobs": _knobs(knob), "shapes": shape or None, "seconds": seconds, "comparators": comparators or None},
             run, runs_dir, as_json)


def sass_cmd(kernel: Optional[str] = typer.Option(None, help="With --pattern: the kernel to excerpt from."),
             pattern: Optional[str] = typer.Option(None, help="A regex over SASS lines; shows the lines around each match."),
             knob: Optional[List[str]] = KNOB_OPT, run: Optional[str] = RUN_OPT,
             runs_dir: Optional[Path] = RUNS_DIR_OPT, as_json: bool = JSON_OPT) -> None:
    """The SASS instruction mix per kernel, or an excerpt around a regex."""
    run_tool("sass", {"kernel": kernel, "pattern": pattern, "knobs": _knobs(knob)}, run, runs_dir, as_json)


def profile_cmd(shape: Optional[str] = typer.Option(None, help="Bench shape to profile (default: the first)."),
                knob: Optional[List[str]] = KNOB_OPT, run: Optional[str] = RUN_OPT,
                runs_dir: Optional[Path] = RUNS_DIR_OPT, as_json: bool = JSON_OPT) -> None:
    """Nsight Compute figures for one bench shape."""
    run_tool("profile", {"shape": shape, "knobs": _knobs(knob)}, run, runs_dir, as_json)


def submit_cmd(title: str = typer.Option(..., "--message", "-m", help="One line: what changed (the commit title)."),
               rationale: str = typer.Option("", help="Why it should be faster, what you measured (the commit body)."),
               knob: Optional[List[str]] = KNOB_OPT,
               gate_seconds: Optional[float] = typer.Option(
                   None, "--gate-seconds", min=1, max=30,
                   help="Timing seconds for this decision, 1 to 30 (default: the session's); an 'undecided' verdict says how many would decide."),
               run: Optional[str] = RUN_OPT,
               runs_dir: Optional[Path] = RUNS_DIR_OPT, as_json: bool = JSON_OPT) -> None:
    """Submit the worktree to the gate: exit 0 accepted (committed), 1 rejected (tree back at best), 3 not run
    (busy, budget spent, no device here, or the identical change already judged not faster against this best)."""
    run_tool("submit", {"title": title, "rationale": rationale, "knobs": _knobs(knob), "gate_seconds": gate_seconds},
             run, runs_dir, as_json)


def revert_cmd(run: Optional[str] = RUN_OPT, runs_dir: Optional[Path] = RUNS_DIR_OPT, as_json: bool = JSON_OPT) -> None:
    """Throw away uncommitted edits: the worktree goes back to the best version."""
    run_tool("revert", {}, run, runs_dir, as_json)


def status_cmd(run: Optional[str] = RUN_OPT, runs_dir: Optional[Path] = RUNS_DIR_OPT, as_json: bool = JSON_OPT) -> None:
    """Where the session stands: best so far, attempts, budget left."""
    run_tool("status", {}, run, runs_dir, as_json)


def tool_cmd(name: str = typer.Argument(..., help="Tool name (e.g. sweep, history, notes, read_file)."),
             args: str = typer.Argument("{}", help="Its input as a JSON object."),
             run: Optional[str] = RUN_OPT, runs_dir: Optional[Path] = RUNS_DIR_OPT, as_json: bool = JSON_OPT) -> None:
    """Call any session tool by name with a JSON input (the same tools as over MCP)."""
    try:
        data = json.loads(args)
    except json.JSONDecodeError as exc:
        _cli().fail(f"tool input {args[:80]!r} is not JSON: {exc}")
    run_tool(name, data, run, runs_dir, as_json)


# ---- kloop mcp ----------------------------------------------------------------------------------

def mcp_cmd(
    target: Optional[str] = typer.Argument(None, help="A task (starts a new session) or a run id/folder/'last' (resumes it)."),
    http: Optional[str] = typer.Option(None, "--http", help="Serve streamable HTTP on HOST:PORT (default: stdio)."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the client configuration (.mcp.json, HTTP) and exit."),
    max_attempts: Optional[int] = typer.Option(None, help="New session: most submissions to the gate."),
    max_hours: Optional[float] = typer.Option(None, help="New session: wall-clock hours."),
    max_gpu_seconds: Optional[float] = typer.Option(None, help="New session: most device seconds (check/bench/sweep/profile/gate)."),
    gate_seconds: float = typer.Option(4.0, help="New session: gate timing seconds per decision."),
    allow_dirty: bool = typer.Option(False, help="New session: snapshot uncommitted changes of the task folder."),
    repo: Optional[Path] = REPO_OPT,
    runs_dir: Optional[Path] = RUNS_DIR_OPT,
) -> None:
    """Serve one session's tools over the Model Context Protocol (stdio, or --http HOST:PORT)."""
    from agent.mcp_config import parse_hostport, print_config as config_text
    from agent.session_service import pending_text

    cli = _cli()
    host, port = "127.0.0.1", 8766  # (kloop serve's default is 8765)
    if http:
        try:
            host, port = parse_hostport(http)
        except ValueError as exc:
            cli.fail(str(exc))
    run_dir = _existing_run(target, runs_dir)
    if print_config:
        sys.stdout.write(config_text(target, run_dir, host, port) + "\n")
        return
    if target is None:
        cli.fail("name a task (new session) or a run (resume it); see --print-config")
    try:  # the MCP SDK, loaded only to serve, and before any session is started or attached
        from agent import mcp_server
    except ImportError as exc:
        cli.fail(f"kloop mcp needs the MCP SDK, which does not import here ({exc}): pip install mcp "
                 "(kloop's own dependency), or drive the session from the shell: kloop session start --help")
    if run_dir is not None:
        service = attach(str(run_dir), runs_dir, repo=repo, announce=True)
        service.write_agent_files()
    else:
        service = start_service(target, "mcp", _budget(max_attempts, max_hours, max_gpu_seconds), gate_seconds,
                                allow_dirty, runs_dir)
        service.write_agent_files()

    def baseline() -> None:  # in the background: a client must not wait for it to connect
        try:
            if pending := service.ensure_best():
                cli.err_console.print(f"kloop mcp: {pending_text(pending, service.session.record.info.run_id)}",
                                      highlight=False, markup=False)
            service.write_agent_files()
        except Exception as exc:
            service.session.log("note", text=f"mcp: the best version could not be built: {exc}", data={"source": "mcp"})

    threading.Thread(target=baseline, daemon=True).start()
    info = service.session.record.info
    cli._print_sandbox((service.session.sandbox.as_dict() if service.session.sandbox else None) or info.sandbox)
    cli.err_console.print(f"kloop mcp: run {info.run_id}, worktree {service.session.ws.path}", highlight=False)
    reason = "mcp server stopped"
    try:
        if http:
            mcp_server.serve_http(service, host, port, lambda s: cli.err_console.print(s, highlight=False))
        else:
            mcp_server.serve_stdio(service)
            reason = "mcp client disconnected"
    except KeyboardInterrupt:
        reason = "mcp server interrupted"
    finally:
        # A client going away does not end the session: the worktree stays as it is (the agent may be
        # in it, the shell commands still work), `kloop mcp RUN` serves it again; `kloop session end` ends it.
        service.session.log("note", text=f"{reason}; the session stays open", data={"source": "mcp"})
        service.close()


def _existing_run(target: Optional[str], runs_dir: Optional[Path]) -> Optional[Path]:
    """`target` as a run folder when it names one (a run id, a run folder, 'last'), else None (a task)."""
    if target is None:
        return None
    cli = _cli()
    root = cli._runs_root(runs_dir)
    path = Path(target).expanduser()
    if (path / "run.json").is_file():
        return path
    if (root / target / "run.json").is_file():
        return root / target
    if target in ("last", "latest"):
        return cli.resolve_run(target, runs_dir)
    return None


def register(app: typer.Typer) -> None:
    """Add the session commands to the `kloop` app."""
    app.add_typer(session_app, name="session")
    for name, fn in [("build", build_cmd), ("check", check_cmd), ("bench", bench_cmd), ("sass", sass_cmd),
                     ("profile", profile_cmd), ("submit", submit_cmd), ("revert", revert_cmd), ("status", status_cmd),
                     ("tool", tool_cmd), ("mcp", mcp_cmd)]:
        app.command(name)(fn)
