"""`kloop`: the command line.

Every command that prints a table also takes --json for scripts. Errors in user input (a broken
manifest, an unknown knob) print one clear message and exit 2; a failed build or check exits 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from agent.task import Task, TaskError, find_tasks, load_task

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kernel-loop: make GPU kernels faster, committing only proven gains.")
console = Console()
err_console = Console(stderr=True)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SHIPPED = PROJECT_ROOT / "kernels"


def fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def resolve_task(spec: str) -> Task:
    """A folder holding task.toml, or the name of a shipped task (kernels/<name>)."""
    path = Path(spec).expanduser()
    if not path.exists() and (SHIPPED / spec).is_dir():
        path = SHIPPED / spec
    try:
        return load_task(path)
    except TaskError as exc:
        fail(str(exc))
    raise AssertionError  # unreachable


def parse_knobs(items: list[str] | None) -> dict[str, str]:
    knobs = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            fail(f"--knob {item!r}: expected NAME=VALUE")
        knobs[name.strip()] = value.strip()
    return knobs


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")


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
            "arch": t.manifest.arch if t.target == "cuda" else None,
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
    if report.check is not None and not report.check.passed:
        raise typer.Exit(1)
    if report.check_error and report.check is None and "no CUDA GPU" not in report.check_error:
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
