"""`kloop`: the command line.

Every command that prints a table also takes --json for scripts. Errors in user input (a broken
manifest, an unknown knob) print one clear message and exit 2; a failed build or check exits 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agent.locations import shipped_tasks_dir
from tools.task import Task, TaskError, find_tasks, load_task

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kernel-loop: make GPU kernels faster, committing only proven gains.")
console = Console()
err_console = Console(stderr=True)
for _c in (console, err_console):  # into a pipe or a log: no hard wrap at 80 columns (it splits paths)
    _c.soft_wrap = not _c.is_terminal

SHIPPED = shipped_tasks_dir()  # kloop's tasks: the checkout's kernels/, or the installed package data


EXIT_FAILURE = 1  # a build, check, gate or session failed
EXIT_USAGE = 2  # bad input: a flag, a task path, a run id, a manifest or spec
EXIT_NOT_RUN = 3  # not run: another process holds the run, a budget is spent, ... (as the session commands)
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (128 + SIGINT), as shells expect


def _clip(text: str, limit: int = 600) -> str:
    """A live line's reason, whole words only (an "undecided" reason ends with the advice that matters:
    it is kept when it fits); `kloop show` has every reason in full."""
    text = str(text)
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ... (kloop show RUN N has it whole)"


def fail(message: str, code: int = EXIT_USAGE) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        from agent import __version__

        console.print(f"kloop {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """kernel-loop: make GPU kernels faster, committing only proven gains."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit():  # the width this command runs at (the consoles were made at import)
        console.width = err_console.width = int(columns)


def _at_least(minimum: float, strict: bool):
    """A typer callback refusing a budget flag below `minimum` (or equal to it when `strict`)."""
    def check(value):
        if value is not None and (value < minimum or (strict and value == minimum)):
            raise typer.BadParameter(f"{value} is not allowed: must be {'greater than' if strict else 'at least'} {minimum:g}")
        return value
    return check


def resolve_task(spec: str) -> Task:
    """A folder holding task.toml, or the name of a shipped task (kernels/<name>)."""
    path = Path(spec).expanduser()
    if not path.exists() and (SHIPPED / spec).is_dir():
        path = SHIPPED / spec
    if not path.exists():
        fail(f"no task {spec!r}: neither a folder nor a shipped task (see `kloop tasks`)")
    try:
        task = load_task(path)
    except TaskError as exc:
        fail(str(exc))
    _check_spec(task)
    return task


def _check_spec(task: Task) -> None:
    """Import the task's spec in this (trusted) process: a syntax error or an exception at import is
    one clear message naming the file and line, before anything is built or a run is recorded."""
    from tools.spec import SpecError, load_spec

    try:
        load_spec(task.spec_path)
    except SpecError as exc:
        fail(str(exc))


def parse_knobs(items: list[str] | None) -> dict[str, str]:
    knobs = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            fail(f"--knob {item!r}: expected NAME=VALUE")
        knobs[name.strip()] = value.strip()
    return knobs


def emit_json(data) -> None:
    """Strict JSON on stdout (NaN/Inf as null)."""
    from tools.fmt import json_safe

    sys.stdout.write(json.dumps(json_safe(json.loads(json.dumps(data, default=str))), indent=1, allow_nan=False) + "\n")


# ---- tasks, new ---------------------------------------------------------------------------------

@app.command()
def tasks(root: Path = typer.Option(SHIPPED, help="Folder to list tasks from."),
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List tasks: target, knobs, check and bench shapes."""
    rows = []
    for folder in find_tasks(root):
        try:
            t = load_task(folder)
        except TaskError as exc:
            rows.append({"path": str(folder), "error": str(exc)})
            continue
        rows.append({
            "name": t.name, "path": str(folder), "target": t.target,
            "arch": t.manifest.arch if t.target != "cpu" else None,
            "check_shapes": [s.name for s in t.check_shapes], "bench_shapes": [s.name for s in t.bench_shapes],
            "knobs": {k: v.values for k, v in t.manifest.knobs.items()}, "description": t.manifest.description,
        })
    if as_json:
        emit_json(rows)
        return
    table = Table(title=f"tasks in {root}")
    for col in ("name", "target", "check shapes", "bench shapes", "knobs"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["path"], "[red]invalid[/]", r["error"].splitlines()[0], "", "")
            continue
        target = r["target"] + (f" ({r['arch']})" if r["arch"] else "")
        table.add_row(r["name"], target, ", ".join(r["check_shapes"]), ", ".join(r["bench_shapes"]),
                      " ".join(f"{k}={v}" for k, v in r["knobs"].items()))
    console.print(table)


@app.command()
def new(task_dir: Path = typer.Argument(..., help="Folder to create (must not exist or be empty)."),
        target: str = typer.Option("cpu", help="cuda or cpu"),
        name: Optional[str] = typer.Option(None, help="Task name (default: the folder's name).")) -> None:
    """Scaffold a task (manifest, spec, a correct starter kernel) to fill in."""
    from agent.scaffold import scaffold

    if target not in ("cuda", "cpu"):
        fail(f"--target {target!r}: expected cuda or cpu")
    try:
        written = scaffold(task_dir, target, name)
    except (FileExistsError, ValueError) as exc:
        fail(str(exc))
    console.print(f"created task [bold]{task_dir}[/] ({target}): " + ", ".join(p.name for p in written))
    console.print(f"next: edit the files, then [bold]kloop eval {task_dir}[/]")


# ---- eval ---------------------------------------------------------------------------------------

@app.command("eval")
def eval_cmd(
    task: str = typer.Argument(..., help="Task folder (holding task.toml) or shipped task name."),
    knob: Optional[List[str]] = typer.Option(None, "--knob", "-k", help="NAME=VALUE, repeatable."),
    shape: Optional[List[str]] = typer.Option(None, "--shape", "-s", help="Only these shapes (repeatable)."),
    no_bench: bool = typer.Option(False, "--no-bench", help="Build, analyse and check only."),
    no_comparators: bool = typer.Option(False, "--no-comparators", help="Do not time the comparators."),
    seconds: float = typer.Option(1.0, help="Timing seconds per shape and callable."),
    seed: Optional[int] = typer.Option(None, help="Seed for the check inputs (default: fresh)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
) -> None:
    """Build, analyse (ptxas, SASS), check and time a task."""
    from agent.report import print_eval
    from tools.evaluate import evaluate

    t = resolve_task(task)
    try:
        for s in shape or []:
            t.shape(s)
        knobs = t.resolve_knobs(parse_knobs(knob))
    except TaskError as exc:
        fail(str(exc))
    report = evaluate(t, knobs, seed=seed, bench=not no_bench, comparators=not no_comparators,
                      shapes=list(shape) if shape else None, bench_seconds=seconds)
    if as_json:
        emit_json(report.model_dump(mode="json"))
    else:
        print_eval(console, t, report)
    if not report.build.ok:
        raise typer.Exit(1)
    if report.audit is None or not report.audit.ok:  # the gate would refuse this build at submit
        raise typer.Exit(1)
    if report.check is not None and not report.check.passed:
        raise typer.Exit(1)
    if report.check_error and report.check is None and "no CUDA GPU" not in report.check_error:
        raise typer.Exit(1)


# ---- sessions -----------------------------------------------------------------------------------

RUNS_DIR_DEFAULT = "(default: $KLOOP_RUNS, else the one holding the session worktree you are in, else .kloop/runs of the git repository around the current folder, else ~/.kloop/runs)"
RUNS_DIR_HELP = "Runs folder " + RUNS_DIR_DEFAULT + "."


def _runs_root(runs_dir: Optional[Path], task: Optional[Path] = None) -> Path:
    """--runs-dir, else $KLOOP_RUNS, else <repo>/.kloop/runs (see agent/locations.py)."""
    from agent.locations import default_runs_root

    return Path(runs_dir).expanduser().resolve() if runs_dir else default_runs_root(task)


def resolve_run(run: str, runs_dir: Optional[Path]) -> Path:
    """A run id under the runs folder, a unique prefix of one, a path to a run folder, or 'last'."""
    from agent.records import list_runs

    root = _runs_root(runs_dir)
    if run in ("last", "latest"):
        runs = list_runs(root)
        if not runs:
            fail(f"no runs in {root}")
        return root / runs[-1].run_id
    path = Path(run).expanduser()
    if (path / "run.json").is_file():
        return path
    if (root / run / "run.json").is_file():
        return root / run
    ids = sorted(p.name for p in root.iterdir() if (p / "run.json").is_file()) if root.is_dir() else []
    matches = [i for i in ids if i.startswith(run)] or [i for i in ids if run in i]
    if len(matches) == 1:
        return root / matches[0]
    if matches:
        fail(f"run {run!r} is ambiguous in {root}; it matches:\n  " + "\n  ".join(matches) + "\ngive more of the id")
    fail(f"no run {run!r} in {root}" + (f" (runs there: {len(ids)}; list them with `kloop runs`)" if ids else " (no runs there)"))
    raise AssertionError


def make_policy(agent: str, model: Optional[str], seed: Optional[int], claude: Optional[dict] = None, workers: int = 1):
    """A policy that can drive a session, from the registry (agent/policies/__init__.py). `claude`: the
    Claude policy's settings (max_tokens, effort, thinking, context_limit, retry_hours), as
    `ClaudePolicy.settings()` records them in run.json (so `resume` continues with the same ones)."""
    from agent.policies import REGISTRY, PolicyError, policy_spec
    from agent.policies import make_policy as from_registry

    usable = [n for n, s in REGISTRY.items() if s.interactive]
    try:
        spec = policy_spec(agent)
    except PolicyError:
        fail(f"--agent {agent!r}: expected {' or '.join(usable)}")
    if not spec.interactive:
        fail(f"--agent {agent!r}: {spec.summary}; use `kloop {agent}` (sessions take {' or '.join(usable)})")
    if spec.needs_api_key and not _has_api_key():
        fail(f"--agent {agent} needs ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN) in the environment; "
             "without one, use --agent tuner")
    try:
        return from_registry(agent, model=model, seed=seed, console=err_console, claude=claude, workers=workers)
    except PolicyError as exc:
        fail(f"--agent {agent}: {exc}" if agent != "claude" else str(exc))


def _thinking_option(thinking: Optional[str], budget: Optional[int]):
    """--thinking adaptive|off and --thinking-budget N as ClaudePolicy's `thinking`."""
    if budget is not None:
        if thinking not in (None, "enabled"):
            fail(f"--thinking-budget goes with extended thinking, not --thinking {thinking}")
        return budget
    if thinking not in (None, "adaptive", "off"):
        fail(f"--thinking {thinking!r}: expected adaptive or off (or --thinking-budget N)")
    return thinking


def run_command(verb: str, run_dir: Path) -> str:
    """`kloop VERB RUN` as one can paste it here: with --runs-dir when the run is not where that
    command looks by default (from this directory), paths quoted for the shell."""
    import shlex

    run_dir = Path(run_dir).resolve()
    try:
        default = _runs_root(None).resolve()
    except Exception:  # noqa: BLE001 - no default to rely on: name the folder
        default = None
    where = "" if default == run_dir.parent else f" --runs-dir {shlex.quote(str(run_dir.parent))}"
    return f"kloop {verb} {shlex.quote(run_dir.name)}{where}"


# stop reasons after which `kloop resume` is the way on (a fresh conversation from the notes and the ledger)
RESUMABLE = ("interrupted", "context_full", "no_progress")


def _api_gave_up(reason: str, run_dir: Path) -> None:
    """The API gave up (retries spent, or an error that retrying cannot fix): exit 1, say what next."""
    if reason.startswith("api_error"):
        err_console.print(f"[bold red]the API gave up[/]: {escape(reason)}\nnext: [bold]{escape(run_command('resume', run_dir))}[/] "
                          "(the record keeps everything; spent cost and turns count against the budgets)",
                          highlight=False, soft_wrap=True)  # never wrapped: the command works as printed
        raise typer.Exit(1)


def _has_api_key() -> bool:
    import os

    return bool(os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN"))


def _default_agent() -> str:
    return "claude" if _has_api_key() else "tuner"


class Progress:
    """Live progress while a session runs: one line per turn, tool call, attempt and verdict, and a
    status line with elapsed time while a build, check or timing runs."""

    def __init__(self):
        from agent.report import StageStatus

        self.status = StageStatus(err_console)

    def __call__(self, event) -> None:
        from tools.fmt import fmt_num

        kind = event.kind
        if kind == "stage":
            self._stage(event)
            return
        if kind in ("verdict", "baseline", "session_ended", "attempt_started", "llm_turn"):
            self.status.stop()
        if kind == "llm_turn":
            line = f"[dim]turn {event.turn}[/] {escape(str(event.stop_reason))} ${fmt_num(event.cost_usd)}" + (
                f" (total ${fmt_num(event.total_cost_usd, '.2f')})" if event.total_cost_usd is not None else "")
        elif kind == "tool_call":
            line = f"  {'[green]' if event.ok else '[red]'}{escape(event.name)}[/] {fmt_num(event.duration_s, '.1f')} s"
        elif kind == "attempt_started":
            line = f"[bold]attempt {event.attempt}[/]: {escape(event.title)}"
        elif kind == "verdict":
            line = f"  {'[green]accepted[/]' if event.accepted else '[red]rejected[/]'}: {escape(_clip(event.reason))}"
            stages = (getattr(event, "figures", None) or {}).get("stage_seconds") or {}
            if stages and isinstance(stages, dict):  # where the decision's seconds went
                line += "\n  [dim]" + escape(", ".join(f"{k} {fmt_num(v, '.1f')}" for k, v in stages.items())) + " s[/]"
        elif kind == "baseline":
            line = "baseline built, checked and timed"
        elif kind == "llm_retry":
            line = f"  [yellow]API retry {event.attempt} in {event.wait_s:.1f} s[/]: {escape(event.error[:120])}"
        elif kind == "note" and isinstance(event.data, dict) and (event.data.get("fault") or event.data.get("wait_stopped")):
            line = f"  [yellow]{'API fault' if event.data.get('fault') else 'wait ended'}[/]: {escape(event.text[:300])}"
        else:
            return
        err_console.print(line, highlight=False)

    def _stage(self, event) -> None:
        who = "baseline" if event.attempt is None else f"attempt {event.attempt}"
        if event.state == "started":
            self.status.start(f"{who}: {event.stage.replace('-', ' ')}")
            return
        elapsed = self.status.stop()
        if event.stage == "build" and event.ok is False:
            err_console.print(f"  [red]build failed[/] after {event.seconds or elapsed or 0:.1f} s", highlight=False)
        elif event.stage == "build":
            err_console.print(f"  [dim]built in {event.seconds or elapsed or 0:.1f} s[/]", highlight=False)

    def interrupted(self, message: str) -> None:
        err_console.print(f"[bold yellow]{message}[/]", highlight=False)

    def close(self) -> None:
        self.status.stop()


def _run_session(session, policy) -> str:
    """Run with live progress; Ctrl-C is acknowledged at once; a second one exits 130 (the record
    says interrupted); a failing session exits 1."""
    from agent.session import SessionError

    progress = Progress()
    session.on_event = progress
    session.on_interrupt = progress.interrupted
    try:
        return session.run(policy)
    except SessionError as exc:
        progress.close()
        fail(str(exc), code=EXIT_FAILURE)
    except KeyboardInterrupt:
        progress.close()
        # say what was actually running: a gate evaluation (killed, its attempt recorded as interrupted),
        # or the policy's own step (an API request, a wait, a tool call), or nothing
        killed = getattr(session, "killed", None)
        doing = getattr(policy, "doing", None)
        what = (f"{killed} was killed and recorded as interrupted" if killed else
                f"{doing} was cut off (no evaluation was running)" if doing else "no evaluation was running")
        err_console.print(f"[yellow]stopped now[/]: {escape(what)}. Continue with: "
                          f"{escape(run_command('resume', session.record.dir))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    finally:
        progress.close()
    raise AssertionError


def _finish(session, reason: str) -> None:
    run_dir = session.record.dir
    _print_log(run_dir, as_json=False)
    err_console.print(escape(f"session ended: {reason}. Review: {run_command('log', run_dir)}; {run_command('show', run_dir)}"
                             + (f"; continue: {run_command('resume', run_dir)}" if reason in RESUMABLE else "")),
                      highlight=False, soft_wrap=True)
    if reason == "interrupted":
        raise typer.Exit(EXIT_INTERRUPTED)


@app.command()
def optimize(
    task: str = typer.Argument(..., help="Task folder (holding task.toml) or shipped task name."),
    agent: Optional[str] = typer.Option(None, help="claude or tuner (default: claude when ANTHROPIC_API_KEY is set, else tuner)."),
    model: Optional[str] = typer.Option(None, help="Claude model id (default: claude-opus-5-5)."),
    effort: Optional[str] = typer.Option(None, help="Claude: effort (low, medium, high, xhigh, max; default: the model's)."),
    max_tokens: int = typer.Option(32_000, help="Claude: most output tokens per turn (thinking included)."),
    thinking: Optional[str] = typer.Option(None, help="Claude: adaptive (default where the model has it) or off."),
    thinking_budget: Optional[int] = typer.Option(None, help="Claude: extended thinking with this budget in tokens."),
    context_limit: Optional[int] = typer.Option(None, help="Claude: prompt tokens past which the API clears old tool results (default 60% of the window)."),
    context_window: Optional[int] = typer.Option(None, help="Claude: the model's context window in tokens (default: the model's known one); a request that cannot fit is not sent."),
    retry_hours: Optional[float] = typer.Option(None, help="Claude: hours to ride out API overload and rate limits before giving up (default 10 minutes)."),
    retry_max_wait: Optional[float] = typer.Option(None, help="Claude: longest single wait between API retries, seconds (backoff is exponential with jitter; default 300)."),
    max_turns: Optional[int] = typer.Option(None, help="Claude: most model turns.", callback=_at_least(1, False)),
    max_cost: Optional[float] = typer.Option(None, help="Claude: most USD spent on the API.", callback=_at_least(0, True)),
    max_hours: Optional[float] = typer.Option(None, help="Wall-clock hours.", callback=_at_least(0, True)),
    max_attempts: Optional[int] = typer.Option(None, help="Most submissions to the gate.", callback=_at_least(1, False)),
    allow_dirty: bool = typer.Option(False, help="Snapshot uncommitted changes of the task folder into the base."),
    runs_dir: Optional[Path] = typer.Option(None, help="Where run records go (default: $KLOOP_RUNS, else .kloop/runs of the task's repository)."),
    gate_seconds: float = typer.Option(4.0, help="Gate: timing seconds per decision."),
    seed: Optional[int] = typer.Option(None, help="Tuner: sampler seed."),
    require_sandbox: bool = typer.Option(False, "--require-sandbox", help="Refuse to run where untrusted kernel code cannot be sandboxed (bubblewrap + seccomp)."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Judge candidates in parallel on Ray: 'local' starts one here, or a cluster ADDRESS (ray://host:10001 or host:6379)."),
    workers: int = typer.Option(1, "--workers", help="With --ray: judges (one per GPU, or per CPU for a CPU task); the tuner judges its top settings this many at a time.", callback=_at_least(1, False)),
) -> None:
    """Run an optimisation session: accepted changes land as commits on branch kloop/<run-id>."""
    from agent.gate import GateConfig
    from agent.policies.base import Budget
    from agent.session import Session, SessionError
    from agent.workspace import WorkspaceError

    t = resolve_task(task)
    from tools.device import missing_device

    absent = missing_device(t.manifest.target)
    if absent:  # before any worktree or record: nothing to clean up
        fail(f"{t.name} is a {t.manifest.target.upper()} task and there is {absent}: a session's baseline needs it.\n"
             f"Here, `kloop session start {task}` starts one with the baseline pending (build, sass and the audit "
             f"work), and `kloop resume RUN` on a machine with the device continues it; `kloop eval {task} --no-bench` "
             f"builds and audits.", EXIT_FAILURE)
    agent = agent or _default_agent()
    claude = {"max_tokens": max_tokens, "effort": effort, "thinking": _thinking_option(thinking, thinking_budget),
              "context_limit": context_limit, "context_window": context_window, "retry_hours": retry_hours,
              "max_retry_wait_s": retry_max_wait}
    if workers > 1 and ray is None:
        fail("--workers N needs --ray local (or --ray ADDRESS): one judge per device, never two on one")
    policy = make_policy(agent, model, seed, claude, workers=workers)
    if agent == "claude" and max_turns is None and max_cost is None and max_hours is None and max_attempts is None:
        max_turns, max_cost = 100, 20.0  # never spend without a bound
    budget = Budget(max_turns=max_turns, max_cost_usd=max_cost, max_hours=max_hours, max_attempts=max_attempts)
    try:
        session = Session.start(t.root, policy.name, budget, runs_root=_runs_root(runs_dir, t.root), allow_dirty=allow_dirty,
                                                config={"model": getattr(policy, "model", None), "seed": seed, "ray": ray,
                                        "workers": workers if ray else None,
                                        **({"claude": policy.settings()} if hasattr(policy, "settings") else {})},
                                gate_config=GateConfig(max_seconds=gate_seconds, require_sandbox=require_sandbox))
    except (WorkspaceError, TaskError, SessionError) as exc:
        fail(str(exc))
    info = session.record.info
    err_console.print(f"run [bold]{info.run_id}[/]: task {t.name}, policy {policy.name}, branch {info.branch}\n"
                      f"  worktree {info.worktree}\n  record   {session.record.dir}", highlight=False)
    _print_sandbox(info.sandbox)
    _attach_pool(session, ray, workers)
    reason = _run_session(session, policy)
    _finish(session, reason)
    _api_gave_up(reason, session.record.dir)


def _attach_pool(session, ray: Optional[str], workers: int) -> None:
    """--ray: the session's judges (agent/parallel.py); a pool that cannot start ends the session cleanly."""
    if ray is None:
        return
    from agent.parallel import PoolError, RayPool

    err_console.print(f"  judges   starting {workers} on Ray ({ray}) ...", highlight=False)
    try:
        session.pool = RayPool(ray, workers, session.gate)
    except PoolError as exc:
        session.close()
        fail(str(exc), code=EXIT_FAILURE)
    for name in session.pool.names:
        err_console.print(f"  judge    {name}", highlight=False)


def _print_sandbox(sandbox: dict) -> None:
    """One line on what isolates untrusted kernel code; loud where nothing does."""
    if sandbox.get("available"):
        err_console.print(f"  sandbox  {sandbox.get('mechanism')}", highlight=False)
        if "runner_pidns" in sandbox and not sandbox["runner_pidns"]:
            err_console.print(f"[yellow]  runner PID namespaces unavailable ({sandbox.get('runner_pidns_reason')}): "
                              "a runner can read the other runner's /proc (its CPU time)[/]", highlight=False)
    else:
        err_console.print(f"[bold red]WARNING: no sandbox ({sandbox.get('reason') or 'unknown'}): untrusted kernel code "
                          "runs with your user's rights. Use --require-sandbox to refuse this.[/]", highlight=False)


@app.command()
def resume(run: str = typer.Argument(..., help="Run id (or a unique prefix), run folder, or 'last'."),
           runs_dir: Optional[Path] = typer.Option(None, help=RUNS_DIR_HELP),
           model: Optional[str] = typer.Option(None, help="Claude model id (claude runs)."),
           max_turns: Optional[int] = typer.Option(None, help="Claude: most model turns, for the whole run.", callback=_at_least(1, False)),
           max_cost: Optional[float] = typer.Option(None, help="Claude: most USD for the whole run.", callback=_at_least(0, True)),
           max_hours: Optional[float] = typer.Option(None, help="Wall-clock hours for the whole run.", callback=_at_least(0, True)),
           max_attempts: Optional[int] = typer.Option(None, help="Most submissions for the whole run.", callback=_at_least(1, False)),
           require_sandbox: bool = typer.Option(False, "--require-sandbox", help="Refuse to run without the sandbox."),
           ) -> None:
    """Continue a session that was stopped or killed, from its record (budgets count what was spent)."""
    import dataclasses

    from agent.policies.base import Budget
    from agent.records import RunRecord
    from agent.runlock import RunLocked
    from agent.session import Session, SessionError
    from agent.workspace import WorkspaceError
    from agent.session_cli import is_external, session_resume
    from tools.sandbox import status as sandbox_status

    run_dir = resolve_run(run, runs_dir)
    recorded_info = RunRecord.open(run_dir).info
    if is_external(recorded_info.policy):  # driven by an outside agent: reopen it for them
        return session_resume(str(run_dir), repo=None, runs_dir=runs_dir, as_json=False)
    recorded = Budget(**((recorded_info.config or {}).get("budget") or {}))
    flags = {"max_turns": max_turns, "max_cost_usd": max_cost, "max_hours": max_hours, "max_attempts": max_attempts}
    budget = None if all(v is None for v in flags.values()) else dataclasses.replace(
        recorded, **{k: v for k, v in flags.items() if v is not None})
    try:
        session = Session.resume(run_dir, budget=budget, require_sandbox=require_sandbox)
    except RunLocked as exc:  # held by a live process: "not run", as `kloop session resume` says it
        fail(str(exc), code=EXIT_NOT_RUN)
    except (WorkspaceError, SessionError) as exc:
        fail(str(exc))
    _print_sandbox(sandbox_status().as_dict())
    info = session.record.info
    config = info.config or {}
    try:  # after the lock: a run held by a live process is refused first, whatever its policy
        policy = make_policy(info.policy, model or config.get("model"), None, config.get("claude"),
                             workers=int(config.get("workers") or 1))
    except typer.Exit:
        session.close()
        raise
    spent = session.spent_before
    err_console.print(f"resuming run [bold]{info.run_id}[/]: task {info.task}, policy {policy.name}, branch {info.branch}; "
                      f"{session.attempts_made()} attempt(s) so far, {spent.hours_before * 60:.1f} min"
                      + (f", {spent.turns} turns, ${spent.cost_usd:.2f}" if spent.turns else ""), highlight=False)
    for line in session.repairs or ["nothing to repair: the record and the branch agree"]:
        err_console.print(f"  repaired: {line}" if session.repairs else f"  {line}", highlight=False)
    if session.recorded_baseline() is not None:
        err_console.print("  baseline: the recorded figures are reused; the best is rebuilt, not re-timed", highlight=False)
    offered = session.interrupted_attempt()
    if offered:
        err_console.print(f"  attempt {offered.number} ({offered.title}) was interrupted: offered to the policy again", highlight=False)
    _attach_pool(session, config.get("ray"), int(config.get("workers") or 1))
    reason = _run_session(session, policy)
    _finish(session, reason)
    _api_gave_up(reason, session.record.dir)


@app.command()
def runs(runs_dir: Optional[Path] = typer.Option(None, help=RUNS_DIR_HELP),
         as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List runs: task, who drove it, started, attempts, accepted, best speedup, its state (live, idle, ended)."""
    from agent.records import list_runs
    from agent.run_view import run_rows
    from tools.fmt import fmt_num

    if as_json:
        emit_json([r.model_dump(mode="json") for r in list_runs(_runs_root(runs_dir))])
        return
    rows = sorted(run_rows(_runs_root(runs_dir)), key=lambda r: r.name)  # the same rows `kloop serve` lists
    table = Table(title=f"runs in {_runs_root(runs_dir)}")
    # the run id is the handle every other command takes: never cut or wrapped
    table.add_column("run", no_wrap=True, min_width=max((len(r.summary.run_id) for r in rows), default=3))
    for col in ("task", "driven by", "started", "attempts", "accepted", "best speedup", "state"):
        table.add_column(col)
    for row in rows:
        r = row.summary
        state = r.error or row.state
        table.add_row(escape(r.run_id), escape(r.task or ""), escape(row.driven_by or r.policy or ""),
                      f"{r.started_at:%Y-%m-%d %H:%M}" if r.started_at else "", str(r.attempts), str(r.accepted),
                      f"x{fmt_num(r.best_speedup, '.3f')}" if r.best_speedup else "-", escape(state))
    console.print(table)


def _commit_rows(repo_root: Path, branch: str, base: Optional[str]) -> list[dict]:
    from agent.trailers import parse_trailers
    from agent.workspace import commit_log

    rev = f"{base}..{branch}" if base else branch
    rows = []
    for c in commit_log(repo_root, rev):
        trailers = parse_trailers(c.message)
        if not any(k == "Kloop-Attempt" for k, _ in trailers):
            continue
        t = dict(trailers)
        rows.append({
            "commit": c.sha, "title": c.summary, "attempt": t.get("Kloop-Attempt"), "speedup": t.get("Kloop-Speedup"),
            "interval": t.get("Kloop-Speedup-Interval", t.get("Kloop-Speedup-CI95")),
            "times": {k.removeprefix("Kloop-Time-"): v for k, v in trailers if k.startswith("Kloop-Time-")},
            "registers": {k.removeprefix("Kloop-Regs-"): v for k, v in trailers if k.startswith("Kloop-Regs-")},
            "device": t.get("Kloop-Device"), "knobs": t.get("Kloop-Knobs"), "run": t.get("Kloop-Run"),
        })
    return rows


_NUM = r"(-?[0-9.]+(?:e-?[0-9]+)?)"


def _numbers(row: dict) -> dict:
    """A commit row for --json: the trailers' figures as numbers (the table shows the text)."""
    import re

    def num(text):
        from tools.fmt import real

        try:
            return real(float(text)) if text is not None else None
        except (TypeError, ValueError):
            return None

    out = dict(row)
    out["attempt"] = int(row["attempt"]) if row.get("attempt") and str(row["attempt"]).isdigit() else row.get("attempt")
    out["speedup"] = num(row.get("speedup"))
    lo, _, hi = (row.get("interval") or "").partition("..")
    out["interval"] = [num(lo), num(hi)] if hi else None
    times = {}
    for shape, text in row.get("times", {}).items():
        m = re.match(rf"{_NUM}ms -> {_NUM}ms \(x{_NUM}, {_NUM}\.\.{_NUM}, (\d+) pairs\)", text)
        times[shape] = {"best_ms": num(m[1]), "candidate_ms": num(m[2]), "speedup": num(m[3]),
                        "interval": [num(m[4]), num(m[5])], "pairs": int(m[6])} if m else {"text": text}
    out["times"] = times
    regs = {}
    for kernel, text in row.get("registers", {}).items():
        m = re.match(r"(?:(\d+) -> )?(\d+) regs, spills (?:(\d+)/(\d+) -> )?(\d+)/(\d+) B", text)
        regs[kernel] = {"registers": int(m[2]), "registers_before": int(m[1] or m[2]),
                        "spill_store_bytes": int(m[5]), "spill_load_bytes": int(m[6])} if m else {"text": text}
        if m and (st := re.search(r"stack (?:(\d+) -> )?(\d+) B", text)):
            regs[kernel]["stack_bytes"] = int(st[2])
        if m and (ws := re.search(r"setmaxnreg (\d+(?: / \d+)*)", text)):
            regs[kernel]["setmaxnreg"] = [int(v) for v in ws[1].split(" / ")]
    out["registers"] = regs
    return out


def _print_log(run_dir: Path, as_json: bool) -> None:
    from agent.records import RunRecord

    info = RunRecord.open(run_dir).info
    rows = _commit_rows(Path(info.repo_root), info.branch, info.base_commit)
    if as_json:
        emit_json({"run": info.run_id, "branch": info.branch, "base": info.base_commit, "commits": [_numbers(r) for r in rows]})
        return
    if not rows:
        console.print(f"no accepted changes on {info.branch} (base {info.base_commit[:10]})", highlight=False)
        return
    table = Table(title=f"accepted changes on {info.branch} (base {info.base_commit[:10]})", title_justify="left")
    for col in ("commit", "title", "speedup [gate interval]", "time per bench shape", "registers / spills"):
        table.add_column(col)
    total = 1.0
    for r in rows:
        sp = _numbers(r)["speedup"]
        total *= sp if sp and sp > 0 else 1.0
        table.add_row(r["commit"][:10], escape(r["title"]), escape(f"x{r['speedup']} [{r['interval']}]"),
                      escape("\n".join(f"{k}: {v.split(' (')[0]}" for k, v in r["times"].items())),
                      escape("\n".join(f"{k}: {v}" for k, v in r["registers"].items())))
    console.print(table)
    console.print(f"{len(rows)} accepted; compounded speedup x{total:.3f} over the base" if rows else "no accepted changes")


@app.command()
def log(run: str = typer.Argument("last", help="Run id, run folder, 'last', or a branch name (kloop/...)."),
        runs_dir: Optional[Path] = typer.Option(None, help=RUNS_DIR_HELP),
        repo: Path = typer.Option(Path("."), help="Repository holding the branch (for a branch name)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """One row per accepted commit: title, speedup with interval, time per bench shape, registers/spills."""
    if run.startswith("kloop/"):
        rows = _commit_rows(repo, run, None)
        if as_json:
            emit_json([_numbers(r) for r in rows])
        else:
            for r in rows:
                console.print(escape(f"{r['commit'][:10]} x{r['speedup']} [{r['interval']}] {r['title']}"), highlight=False)
        return
    _print_log(resolve_run(run, runs_dir), as_json)


@app.command()
def show(run: str = typer.Argument("last", help="Run id (or a unique prefix), run folder, or 'last'."),
         attempt: Optional[int] = typer.Argument(None, help="One attempt: its full reason, or its patch with --diff."),
         diff: bool = typer.Option(False, "--diff", help="Print the attempt's patch (needs N)."),
         runs_dir: Optional[Path] = typer.Option(None, help=RUNS_DIR_HELP),
         as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Every attempt of a run, accepted or not, and why; `show RUN N --diff` prints attempt N's patch."""
    from agent.records import RunRecord
    from agent.run_state import RunState
    from tools.fmt import fmt_speedup

    record = RunRecord.open(resolve_run(run, runs_dir))
    events = record.events()
    state = RunState.fold(events)
    attempts = state.attempts
    info = record.info
    if diff and attempt is None:
        fail("--diff needs an attempt number: kloop show RUN N --diff")
    if attempt is not None:
        _show_attempt(record, attempts, attempt, diff, as_json)
        return
    if as_json:
        emit_json({"run": info.model_dump(mode="json"), "attempts": [{**a.__dict__, "verdict": a.verdict} for a in attempts]})
        return
    from agent.run_view import driven_by, session_state

    console.print(escape(f"run {info.run_id}: task {info.task}, driven by {driven_by(info)}, branch {info.branch}, "
                         f"base {info.base_commit[:10]}; measured on {info.machine.get('name', '?')}"), highlight=False)
    table = Table()
    for col in ("#", "title", "verdict", "speedup [gate interval]", "reason"):
        table.add_column(col)
    for a in attempts:
        verdict = {"pending": "[yellow]pending[/]", "interrupted": "[yellow]interrupted[/]", "accepted": "[green]accepted[/]",
                   "rejected": "[red]rejected[/]"}[a.verdict]
        spt = fmt_speedup(a.figures.get("speedup"), a.figures.get("speedup_lo"), a.figures.get("speedup_hi"))
        table.add_row(str(a.number), escape(a.title), verdict, escape(spt), escape(a.reason[:400]))
    console.print(table)
    pending = state.pending.number if state.pending is not None and state.ended is None else None
    console.print(escape(session_state(record.dir, state.ended, state.last_event_at, pending)), highlight=False)


def _show_attempt(record, attempts, number: int, diff: bool, as_json: bool) -> None:
    found = [a for a in attempts if a.number == number]
    if not found:
        fail(f"run {record.info.run_id} has no attempt {number} (attempts: "
             f"{', '.join(str(a.number) for a in attempts) or 'none'})")
    a = found[0]
    path = record.patch_path(number)
    patch = record.read_patch(number) if path.is_file() else None
    if as_json:
        emit_json(a.__dict__ | ({"patch": patch} if diff else {}))
        return
    if diff:
        if patch is None:
            fail(f"attempt {number} has no patch in the record ({path} is missing)", code=EXIT_FAILURE)
        sys.stdout.write(patch if patch.endswith("\n") or not patch else patch + "\n")
        if not patch.strip():
            err_console.print(f"(attempt {number}'s patch is empty: nothing changed against the best)")
        return
    verdict = "interrupted" if a.accepted is None else ("accepted" if a.accepted else "rejected")
    console.print(f"[bold]attempt {a.number}[/]: {escape(a.title)}\n{verdict}: {escape(a.reason)}", highlight=False)
    if a.rationale:
        console.print(escape(f"rationale: {a.rationale}"), highlight=False)
    if a.knobs:
        console.print(escape("knobs: " + " ".join(f"{k}={v}" for k, v in a.knobs.items())), highlight=False)
    if a.commit:
        console.print(f"commit: {a.commit}", highlight=False)
    console.print(f"patch: kloop show {record.info.run_id} {a.number} --diff", highlight=False)


@app.command()
def replay(run: str = typer.Argument("last", help="Run id, run folder, or 'last'."),
           runs_dir: Optional[Path] = typer.Option(None, help=RUNS_DIR_HELP),
           repo: Optional[Path] = typer.Option(None, help="Repository holding the run's base commit (default: as recorded)."),
           gate_seconds: Optional[float] = typer.Option(None, "--gate-seconds", min=1, max=30,
                                                        help="Timing cap per decision, 1 to 30, for every attempt (default: each attempt's recorded one); longer decides on a noisier machine."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Re-apply each recorded attempt from the recorded base, re-run the gate here, compare verdicts."""
    from agent.replay import replay as do_replay
    from tools.fmt import fmt_num, fmt_speedup

    run_dir = resolve_run(run, runs_dir)
    report = do_replay(run_dir, repo=repo, gate_seconds=gate_seconds, on_row=None if as_json else
                       (lambda r: err_console.print(f"  replayed #{r.attempt}: " + ("accepted" if r.replayed_accepted else
                                                    "undecided here" if r.replayed_undecided else "rejected"), highlight=False)))
    if as_json:
        emit_json(report.model_dump(mode="json") | {"ok": report.ok, "contradicted": report.contradicted, "counts": report.counts()})
    else:
        table = Table(title=f"replay of {report.run_id}", title_justify="left")
        for col in ("#", "title", "recorded", "replayed", "agree", "replayed reason"):
            table.add_column(col)
        for r in report.rows:
            rec_txt = ("accepted" if r.recorded_accepted else "rejected") + (f" x{fmt_num(r.recorded_speedup)}" if r.recorded_speedup else "")
            rep_txt = ("accepted" if r.replayed_accepted else f"rejected ({r.replayed_stage})") + (
                " " + fmt_speedup(r.replayed_speedup, r.replayed_lo, r.replayed_hi) if r.replayed_speedup else "")
            agree = ("n/a (interrupted)" if r.interrupted else "yes" if r.agrees else
                     "n/a (recorded undecided)" if r.undecided else
                     "[yellow]undecided here[/]" if r.replayed_undecided else "[red]FLIPPED[/]")
            table.add_row(str(r.attempt), escape(r.title), escape(rec_txt), escape(rep_txt), agree,
                          ("[red]NO LONGER CORRECT[/] " if r.broken else "") + escape(r.replayed_reason[:300]))
        console.print(table)
        console.print(f"recorded on: {report.recorded_machine}\nreplayed on: {report.replay_machine or 'n/a'}", highlight=False)
        summary = Table(title="summary", title_justify="left", show_header=False)
        summary.add_column("what")
        summary.add_column("count", justify="right")
        for what, n in report.counts().items():
            bad = n and what in ("accepted -> rejected", "rejected -> accepted", "no longer correct")
            summary.add_row(what, f"[red]{n}[/]" if bad else f"[yellow]{n}[/]" if n and what == "accepted, undecided here" else str(n))
        console.print(summary)
        if report.ok:
            console.print("[green]every verdict reproduced[/]")
        elif report.contradicted:
            console.print("[red]verdicts flipped: the run does not replay here[/]")
        else:
            console.print("[yellow]not confirmed: an accepted change could not be decided here (the interval was wider "
                          "than the noise limit); replay on a quieter machine, or with a longer --gate-seconds[/]")
    if not report.ok:
        raise typer.Exit(EXIT_FAILURE)


@app.command("audit")
def audit_cmd(run: str = typer.Argument("last", help="Run id (or a unique prefix), run folder, 'last', or a branch kloop/<run-id>."),
              runs_dir: Optional[Path] = typer.Option(None, help=RUNS_DIR_HELP),
              repo: Optional[Path] = typer.Option(None, help="Repository holding the branch (default: the current directory's; for a run: as recorded)."),
              no_timing: bool = typer.Option(False, "--no-timing", help="Scope, static rules, build, audit and check only (no paired timing)."),
              seconds: Optional[float] = typer.Option(None, help="Timing seconds per commit (default: the run's gate setting).", callback=_at_least(0, True)),
              no_e2e: bool = typer.Option(False, "--no-e2e", help="Skip the task's end-to-end training check (run by default where the task declares one, with --no-timing too)."),
              as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Today's gate over every accepted commit of a run: which would now be rejected, and why, and whose gain
    does not hold with today's estimate (exit 1 if any)."""
    from agent.reaudit import LAYERS, AuditInputError, audit, target_from_branch, target_from_run
    from agent.workspace import WorkspaceError, find_repo

    try:
        if run.startswith("kloop/"):
            where = Path(repo or Path.cwd()).expanduser()
            top = find_repo(where) if where.exists() else None
            if top is None:
                fail(f"{where} is not inside a git repository: pass --repo for branch {run}")
            roots = [_runs_root(runs_dir, top) if runs_dir else _runs_root(None, top / ".")]
            if top.parent.name == "_tasks":  # a shipped task's own repository: <runs>/_tasks/<name>
                roots.append(top.parent.parent)
            target = target_from_branch(top, run, roots)
        else:
            target = target_from_run(resolve_run(run, runs_dir), repo)
        from tools.sandbox import status as sandbox_status

        _print_sandbox(sandbox_status().as_dict())  # the commits' kernels run here (check, timing)
        report = audit(target, no_timing=no_timing, seconds=seconds, e2e=not no_e2e, on_row=None if as_json else (
            lambda r: err_console.print(f"  audited {r.commit[:10]} {r.title[:50]}: "
                                        + ("[red]would now be rejected[/]" if r.rejected else "[green]passes[/]"), highlight=False)))
    except AuditInputError as exc:
        fail(str(exc))
    except WorkspaceError as exc:
        fail(str(exc), code=EXIT_FAILURE)
    if as_json:
        emit_json(report.model_dump(mode="json") | {"rejected": len(report.rejected), "total": len(report.rows),
                                                    "gain_not_held": len(report.gain_not_held), "summary": report.summary()})
    else:
        table = Table(title=escape(f"audit of {report.branch} (base {report.base[:10]}, {report.task_rel}; from the {report.source})"),
                      title_justify="left")
        # one column for the layers (green: passed, red: failed, dim: not run) keeps the table readable at 80 columns
        table.add_column("commit", no_wrap=True)
        table.add_column("title", no_wrap=True, overflow="ellipsis", max_width=18)
        table.add_column("layers", min_width=14)
        table.add_column("gain here", min_width=9)
        table.add_column("reason", ratio=1, min_width=12)
        for r in report.rows:
            layers = " ".join({"ok": f"[green]{k}[/]", "FAIL": f"[bold red]{k.upper()} FAIL[/]"}.get(
                r.stages.get(k, ""), f"[dim]({k})[/]") for k in LAYERS)
            why = escape(r.reason[:300]) if r.rejected else ""
            if r.e2e and not r.rejected:
                why = f"[dim]e2e: {escape(r.e2e)}[/]"
            if r.note:
                why = (why + "\n" if why else "") + f"[dim]{escape(r.note)}[/]"
            table.add_row(r.commit[:10], escape(r.title), layers, escape(r.gain), why)
        console.print(table)
        console.print("[dim]layers: green passed, red failed, (in brackets) not run[/]", highlight=False)
        if report.not_run:
            console.print(f"[yellow]{report.not_run}[/]", highlight=False)
        console.print(f"audited on: {report.machine or 'n/a'}", highlight=False)
        console.print(("[red]" if report.rejected or report.gain_not_held else "[green]") + report.summary() + "[/]",
                      highlight=False)
    if report.rejected or report.gain_not_held:
        raise typer.Exit(EXIT_FAILURE)


@app.command("export")
def export_cmd(run: str = typer.Argument("last", help="Run id (or a unique prefix), run folder, 'last', or a branch kloop/<run-id>."),
               out: Path = typer.Option(..., "-o", "--out", help="Folder to write the package into (new or empty)."),
               runs_dir: Optional[Path] = typer.Option(None, help=RUNS_DIR_HELP),
               repo: Optional[Path] = typer.Option(None, help="Repository holding the branch (default: the current directory's; for a run: as recorded)."),
               namespace: str = typer.Option("kloop", help="The op's namespace: torch.ops.<namespace>.<task>.")) -> None:
    """A run's accepted kernel as a pip-installable torch.library op (refused if `kloop audit` rejects a commit)."""
    from agent.export import ExportError, export
    from agent.reaudit import AuditInputError, target_from_branch, target_from_run
    from agent.workspace import WorkspaceError, find_repo

    run_dir = None
    try:
        if run.startswith("kloop/"):
            where = Path(repo or Path.cwd()).expanduser()
            top = find_repo(where) if where.exists() else None
            if top is None:
                fail(f"{where} is not inside a git repository: pass --repo for branch {run}")
            roots = [_runs_root(runs_dir, top) if runs_dir else _runs_root(None, top / ".")]
            if top.parent.name == "_tasks":
                roots.append(top.parent.parent)
            target = target_from_branch(top, run, roots)
            run_dir = next((Path(r) / target.run_id for r in roots if (Path(r) / target.run_id / "run.json").is_file()), None)
        else:
            run_dir = resolve_run(run, runs_dir)
            target = target_from_run(run_dir, repo)
        err_console.print(f"auditing the accepted commits of {target.branch} (scope, rules, build, audit, check, and the e2e check where the task has one) ...")
        result = export(target, out, namespace=namespace, run_dir=run_dir)
    except AuditInputError as exc:
        fail(str(exc))
    except ExportError as exc:
        fail(str(exc), code=EXIT_FAILURE if "audit would now reject" in str(exc) else EXIT_USAGE)
    except WorkspaceError as exc:
        fail(str(exc), code=EXIT_FAILURE)
    a = result.audit
    console.print(f"wrote {result.out}: package {result.package}, op {result.op}, commit {result.commit[:12]}", highlight=False)
    console.print(f"audit: {len(a.rows)} accepted commit(s), none rejected" + (f" ({a.not_run})" if a.not_run else ""),
                  highlight=False)
    console.print(f"next: pip install {result.out} && python -m pytest {result.out / 'tests'}", highlight=False)


def _error_exit(exc: BaseException) -> int:
    """One paragraph for an error that escaped a command (no internal traceback; KLOOP_DEBUG=1 shows it)."""
    import os

    from agent.locations import RunsFolderError
    from agent.records import RecordError
    from agent.session import SessionError
    from agent.workspace import WorkspaceError
    from tools.spec import SpecError

    if os.environ.get("KLOOP_DEBUG"):
        import traceback

        traceback.print_exception(exc)
    if isinstance(exc, KeyboardInterrupt):
        err_console.print("[yellow]interrupted[/]")
        return EXIT_INTERRUPTED
    usage = isinstance(exc, (TaskError, SpecError, RecordError, RunsFolderError))
    known = usage or isinstance(exc, (SessionError, WorkspaceError))
    message = str(exc) if known else f"internal error: {type(exc).__name__}: {exc} (KLOOP_DEBUG=1 shows the traceback)"
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return EXIT_USAGE if usage else EXIT_FAILURE


# ---- see a session: report, serve, compare (agent/run_view.py, agent/report_html.py, agent/web.py) ----

@app.command()
def report(run: str = typer.Argument("last", help="Run id, run folder, or 'last'."),
           output: Optional[Path] = typer.Option(None, "-o", "--output", help="HTML file to write (default: report.html in the run's folder, so no checkout gets a stray file)."),
           runs_dir: Optional[Path] = typer.Option(None, help=RUNS_DIR_HELP)) -> None:
    """One self-contained HTML report of a run: plots, attempts with diffs, notes, transcript."""
    from agent.records import RecordError
    from agent.report_html import render_report
    from agent.run_view import load_view

    try:
        view = load_view(resolve_run(run, runs_dir))
    except RecordError as exc:
        fail(str(exc))
    out = output or view.dir / "report.html"
    try:
        out.write_text(render_report(view), encoding="utf-8")
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror or exc}; pass -o FILE to write the report elsewhere")
    console.print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB; {len(view.attempts)} attempt{'s' * (len(view.attempts) != 1)}); open it in a browser", highlight=False)


@app.command()
def serve(runs_dir: Optional[Path] = typer.Option(None, "--runs", "--runs-dir", help="Runs folder to serve " + RUNS_DIR_DEFAULT + "."),
          host: str = typer.Option("127.0.0.1", help="Address to bind; anything but loopback requires a token."),
          port: int = typer.Option(8765, help="Port."),
          token: Optional[str] = typer.Option(None, envvar="KLOOP_SERVE_TOKEN", help="Token for non-loopback hosts (default: a fresh one).")) -> None:
    """A read-only web app: the runs, each run's report live while its session runs, comparisons."""
    from agent.web import serve as run_server

    root = _runs_root(runs_dir)

    def ready(h: str, p: int, tok: Optional[str]) -> None:
        shown = f"[{h}]" if ":" in h else h
        err_console.print(f"serving {root} at http://{shown}:{p}/" + (f"?token={tok}" if tok else "") + "  (Ctrl-C stops)", highlight=False)

    run_server(root, host=host, port=port, token=token, on_ready=ready)


@app.command()
def compare(run_a: str = typer.Argument(..., help="Run id or folder."), run_b: str = typer.Argument(..., help="Run id or folder."),
            output: Optional[Path] = typer.Option(None, "-o", "--output", help="Also write a self-contained HTML comparison."),
            runs_dir: Optional[Path] = typer.Option(None, help=RUNS_DIR_HELP)) -> None:
    """Two runs side by side: where each was measured, each attempt's verdict and speedup, best times."""
    from agent.records import RecordError
    from agent.report_html import compare_rows, render_compare
    from agent.run_view import load_view

    try:
        views = [load_view(resolve_run(r, runs_dir)) for r in (run_a, run_b)]
    except RecordError as exc:
        fail(str(exc))
    head = Table(title="runs", title_justify="left")
    head.add_column("")
    for v in views:
        head.add_column(v.run_id)
    for label, get in (("task", lambda v: v.task), ("device", lambda v: v.device + (f", driver {v.driver}" if v.driver else "")),
                       ("compiler", lambda v: v.compiler or "-"), ("driven by", lambda v: v.driven_by), ("state", lambda v: v.state),
                       ("result", lambda v: f"x{v.best_speedup:.3f} ({len(v.accepted)}/{len(v.attempts)} accepted)")):
        head.add_row(label, *[get(v) for v in views])
    console.print(head)
    table = Table(title="attempts (matched by identical patch)", title_justify="left")
    table.add_column("title")
    for v in views:  # run ids whole: they are the handle every other command takes
        table.add_column(v.run_id, min_width=len(v.run_id))
    for r in compare_rows(views):
        table.add_row(r["title"], *[(f"#{a.number} {a.verdict}" + (f" x{a.speedup:.4f} [{a.lo:.4f}, {a.hi:.4f}]" if a.speedup else "")
                                     + (f" ({a.stage})" if a.verdict != "accepted" and a.stage else "")) if a else "-" for a in r["cells"]])
    console.print(table)
    if output:
        output.write_text(render_compare(views), encoding="utf-8")
        console.print(f"wrote {output}", highlight=False)


# the session as shell commands (session start/resume/end, build, check, bench, ..., submit) and `kloop mcp`
from agent.session_cli import register as _register_session_commands  # noqa: E402

_register_session_commands(app)


def main() -> None:  # pragma: no cover
    try:
        app()
    except (Exception, KeyboardInterrupt) as exc:
        sys.exit(_error_exit(exc))


if __name__ == "__main__":  # pragma: no cover
    main()
