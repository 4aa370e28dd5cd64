"""One session served to an outside agent, over MCP (`agent.mcp_server`) or the shell
(`agent.session_cli`): the same ToolBox the Claude policy gets, plus `status`, behind the budgets
and the locks, with every call written to the run record.

The session's state lives in the run record and on its branch, so any process can attach to it:
the MCP server once for its lifetime, each shell command once per command. Attaching never throws
the agent's uncommitted edits away (unless the record needed repairing after a kill).

Locks (files in the run folder, so that they hold across threads and processes alike):
  submit.lock  held exclusively by a submit from start to verdict: a second submit is answered 'busy'
  work.lock    submit holds it exclusively; the tools that edit or measure hold it shared. While a
               submit is judged, they are answered 'busy' (an edit then could land unjudged code, a
               timing would disturb the gate's); a submit waits for the tools already running.
Read-only tools (list_files, read_file, history, status) take no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from agent import records as rec
from agent import run_state
from agent.gate import Candidate, GateConfig
from agent.policies.base import Budget
from agent.locations import WORKTREES, default_runs_root
from agent.mcp_config import TOKEN_FILE
from agent.session import Session, SessionError
from agent.workspace import BRANCH_PREFIX, WorkspaceError, checkout_of, find_repo, holds
from tools.agent_tools import session_toolbox
from tools.base import Tool, ToolInput, ToolResult, cap

READ_ONLY = {"list_files", "read_file", "history", "status"}
# the tools that occupy the device: their time counts against Budget.max_gpu_seconds
DEVICE_TOOLS = run_state.DEVICE_TOOLS
LOG_TEXT = 2_000  # characters of a tool's answer kept in the run record
PLACEHOLDER_POLICY = "mcp"  # until a client says who it is


class ServiceError(Exception):
    """The session cannot be served (no such run, not a session worktree, ...); the message says why."""


class SessionEnded(ServiceError):
    """The session has ended; only reopening it (`kloop session resume`, `kloop mcp RUN`) is allowed."""


class Busy(Exception):
    """Another submit is being judged; the caller should try again later."""


DEVICE_WORK = "check/bench/sweep/profile/submit"


def pending_text(reason: str, run_id: str) -> str:
    """What an agent is told when the baseline waits for the task's device."""
    return (f"baseline pending: {reason}; build, sass and the audit work; {DEVICE_WORK} need the device "
            f"— `kloop resume {run_id}` on a GPU machine (copy the run folder and the branch there) measures the baseline")


def no_device_text(tool: str, reason: str, run_id: str) -> str:
    """The answer of a device tool on a machine without the task's device (exit 3 in the shell)."""
    return (f"not run: {tool} needs the task's device and there is {reason}. Here: build (with the audit), sass "
            f"and the file tools. The way on: on a machine with the GPU, `kloop resume {run_id}` (copy the run "
            f"folder and `git bundle` the branch kloop/{run_id} there first), then {tool} again")


# ---- figures from the record (they survive processes and machines) ------------------------------

def budget_stop(session: Session, tool: str) -> str | None:
    """Why `tool` may not run now (a budget is spent), else None: agent/run_state.budget_stop on the record."""
    return run_state.budget_stop(session.budget, session.state(), tool)


# ---- the status tool ----------------------------------------------------------------------------

class StatusInput(ToolInput):
    pass


def status_data(session: Session) -> dict[str, Any]:
    info = session.record.info
    state = session.state()
    attempts = state.attempts
    b = session.budget
    used_gpu, used_h, used_n = state.gpu_seconds, state.hours_used(), state.attempts_used
    try:
        changed = session.ws.changed_paths(against=session.best_commit)
    except WorkspaceError:
        changed = []
    return {
        "run": info.run_id, "task": info.task, "policy": info.policy, "branch": info.branch,
        "worktree": str(session.ws.path), "task_folder": str(session.ws.task_path),
        "base_commit": info.base_commit, "best_commit": session.best_commit,
        "best_speedup": round(state.best_speedup, 4),
        "attempts": len(attempts), "accepted": sum(1 for a in attempts if a.accepted),
        "uncommitted_changes": changed,
        "budget": {"max_attempts": b.max_attempts, "max_hours": b.max_hours, "max_gpu_seconds": b.max_gpu_seconds},
        "used": {"attempts": used_n, "hours": round(used_h, 3), "gpu_seconds": round(used_gpu, 1)},
        "left": {
            "attempts": None if b.max_attempts is None else max(0, b.max_attempts - used_n),
            "hours": None if b.max_hours is None else round(max(0.0, b.max_hours - used_h), 3),
            "gpu_seconds": None if b.max_gpu_seconds is None else round(max(0.0, b.max_gpu_seconds - used_gpu), 1),
        },
        "ended": state.ended,
        "baseline_pending": info.baseline_pending,
    }


def tool_list(toolbox: Any) -> str:
    """The tools the server serves, as the briefing names them: from the toolbox, never by hand."""
    return ", ".join(f"`{name}`" for name in toolbox.tools)


def format_status(d: dict[str, Any]) -> str:
    def left(key: str, unit: str) -> str:
        cap_ = d["budget"][f"max_{key}"]
        return f"{d['used'][key]}{unit} used" + ("" if cap_ is None else f", {d['left'][key]}{unit} left of {cap_:g}")

    lines = [
        f"run {d['run']} (task {d['task']}, driven by {d['policy']})" + (f" — ENDED: {d['ended']}" if d["ended"] else ""),
        f"best: {d['best_commit'][:10]} on {d['branch']}, x{d['best_speedup']:.4f} over the base ({d['accepted']} accepted)",
        f"attempts: {left('attempts', '')}",
        f"hours: {left('hours', ' h')}",
        f"device seconds: {left('gpu_seconds', ' s')}",
        *([pending_text(d["baseline_pending"], d["run"])] if d.get("baseline_pending") else []),
        "uncommitted changes: " + (", ".join(d["uncommitted_changes"]) if d["uncommitted_changes"] else "none"),
        f"worktree: {d['worktree']}",
    ]
    return "\n".join(lines)


def status_tool(ctx: Session, args: StatusInput) -> ToolResult:
    d = status_data(ctx)
    return ToolResult(text=format_status(d), data=d)


STATUS_TOOL = Tool("status", "Where the session stands: the best version so far and its speedup over the base, attempts "
                   "made and accepted, the budget left (attempts, hours, device seconds), uncommitted changes.",
                   StatusInput, status_tool)


# ---- locks --------------------------------------------------------------------------------------

@contextlib.contextmanager
def _flock(path: Path, mode: int, blocking: bool) -> Iterator[bool]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, mode | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def submit_in_flight(run_dir: Path) -> bool:
    with _flock(run_dir / "submit.lock", fcntl.LOCK_SH, blocking=False) as got:
        return not got


@contextlib.contextmanager
def hold(run_dir: Path, tool: str) -> Iterator[None]:
    """The locks `tool` needs (module docstring); Busy when a submit is being judged."""
    if tool in READ_ONLY:
        yield
        return
    busy = "busy: a submit is being judged now; try again when it has its verdict"
    if tool == "submit":
        with _flock(run_dir / "submit.lock", fcntl.LOCK_EX, blocking=False) as got:
            if not got:
                raise Busy("busy: another submit is being judged now (one at a time per session); "
                           "wait for its verdict, then submit again")
            with _flock(run_dir / "work.lock", fcntl.LOCK_EX, blocking=True):
                yield
        return
    with _flock(run_dir / "submit.lock", fcntl.LOCK_SH, blocking=False) as free:
        if not free:
            raise Busy(busy)
        work = _flock(run_dir / "work.lock", fcntl.LOCK_SH, blocking=True)
        work.__enter__()
    try:
        yield
    finally:
        work.__exit__(None, None, None)


# ---- a record several processes append to ------------------------------------------------------

class SharedRecord(rec.RunRecord):
    """The run record of a session that several processes serve at once (an MCP server and shell
    commands): each append takes an exclusive lock and learns the next seq from the file itself,
    so that seqs stay 0, 1, 2, ... whoever writes."""

    def append(self, event):
        with _flock(self.dir / "events.lock", fcntl.LOCK_EX, blocking=True):
            self._next_seq = None  # another process may have appended since our last event
            return super().append(event)


def _share(session: Session) -> Session:
    session.record = SharedRecord(session.record.dir, session.record.info)
    return session


# ---- locating a run -----------------------------------------------------------------------------

def run_of_worktree(cwd: Path, runs_root: Path | None = None) -> Path:
    """The run folder of the session worktree holding `cwd` (its branch is kloop/<run-id>)."""
    try:
        top, branch, common = checkout_of(cwd)
    except WorkspaceError:
        raise ServiceError(f"{cwd} is not inside a kloop session worktree (no git branch); "
                           "pass --run RUN, or cd into the worktree `kloop session start` printed") from None
    if not branch.startswith(BRANCH_PREFIX):
        raise ServiceError(f"{top} is on branch {branch!r}, not a kloop session branch (kloop/<run-id>); pass --run RUN")
    run_id = branch[len(BRANCH_PREFIX):]
    candidates = [Path(runs_root) / run_id] if runs_root else []
    # <runs>/_worktrees/<run-id>; the repository's .kloop/runs; the default
    candidates += [top.parent.parent / run_id, common / ".kloop" / "runs" / run_id, default_runs_root(cwd=common) / run_id]
    for c in candidates:
        if (c / rec.RUN_JSON).is_file():
            return c
    raise ServiceError(f"the run record of {run_id} is in none of: {', '.join(map(str, candidates))}; pass --run or --runs-dir")


def relocate(run_dir: Path, repo: Path | None = None) -> None:
    """Point run.json at this machine's repository and worktree when they moved (a run folder copied
    to another machine, the branch fetched into a clone there): the record plus the branch are enough."""
    record = rec.RunRecord.open(run_dir)
    info = record.info

    def has_branch(root: Path) -> bool:
        return holds(root, info.branch, info.base_commit)

    if repo is None and Path(info.repo_root).is_dir() and has_branch(Path(info.repo_root)):
        return
    where = Path(repo or Path.cwd()).resolve()
    if not where.is_dir() or not has_branch(where):
        raise ServiceError(
            f"run {info.run_id}: the repository {info.repo_root} is not here (or lacks {info.branch}), and {where} "
            f"does not hold branch {info.branch} with base {info.base_commit[:12]}. Fetch the branch first, e.g. "
            f"`git fetch SESSION.bundle {info.branch}:{info.branch}`, then pass --repo")
    root = find_repo(where)
    if root is None:
        raise ServiceError(f"run {info.run_id}: {where} has no working tree (a bare repository?); pass --repo a checkout")
    worktree = Path(info.worktree)
    if not worktree.parent.is_dir() or root != Path(info.repo_root):
        worktree = Path(run_dir).resolve().parent / WORKTREES / info.run_id
    info.repo_root, info.worktree = root, worktree
    info.task_path = root / info.task_rel
    record.write_info(info)


# ---- the service --------------------------------------------------------------------------------

class SessionService:
    """A session and its tools for an outside agent. Thread-safe: the MCP server calls tools from
    worker threads; the locks above serialise what must be."""

    def __init__(self, session: Session):
        self.session = _share(session)
        self.run_dir = session.record.dir
        self.toolbox = session_toolbox(session.port)  # the agent tools see only the session port
        # status reads the session itself (budget, best, record): this service is trusted code; the
        # outside agent sees only the tool's answer
        self.toolbox.add(Tool(STATUS_TOOL.name, STATUS_TOOL.description, STATUS_TOOL.input_model,
                              lambda _port, args: status_tool(session, args)))
        session.toolbox = self.toolbox
        self._best_lock = threading.Lock()
        self._clients: set[str] = set()
        self._load_baseline()

    # -- opening ---------------------------------------------------------------------------------
    @classmethod
    def start(cls, task_dir: Path, policy: str, budget: Budget, runs_root: Path | None = None,
              allow_dirty: bool = False, gate_config: GateConfig | None = None) -> "SessionService":
        session = Session.start(task_dir, policy, budget, runs_root=runs_root, allow_dirty=allow_dirty,
                                gate_config=gate_config)
        return cls(session)

    @classmethod
    def attach(cls, run_dir: Path, repo: Path | None = None, announce: bool = False,
               lock: bool = True) -> "SessionService":
        """Open a recorded session, keeping the worktree's edits. `announce` (a new owner: the MCP
        server, `kloop session resume`) logs session_started; a shell command attaches silently.
        With `lock`, the run's lock is held until `close()` (RunLocked while another live process
        holds it: one process per run) and a record left inconsistent by a kill is repaired; without,
        the service is for reading (status, history) beside the process that holds the run."""
        run_dir = Path(run_dir)
        if not announce:
            ended = run_state.RunState.fold(rec.RunRecord.open(run_dir).events()).ended
            if ended is not None:
                raise SessionEnded(f"session {run_dir.name} has ended ({ended}); reopen it with "
                                   f"`kloop session resume {run_dir.name}` (or `kloop mcp {run_dir.name}`)")
        if not lock:
            return cls(Session.open(run_dir, lock=False))
        relocate(run_dir, repo)
        session = _share(Session.open(run_dir))
        try:
            if not submit_in_flight(run_dir):
                session.repair(keep_edits=True)
            if announce:
                session.log("session_started", resumed=True)
                session._say_sandbox(session.sandbox)
        except BaseException:
            session.close()
            raise
        return cls(session)

    def close(self) -> None:
        """Give the run's lock back (the end of a shell command, of an MCP server)."""
        self.session.close()

    def _load_baseline(self) -> None:
        """The baseline figures (for the briefing) from the record, in a process that did not measure them."""
        if not self.session.baseline:
            self.session.baseline = self.session.recorded_baseline() or {}

    @property
    def ended(self) -> str | None:
        return self.session.state().ended

    # -- the best build (what a submit is timed against) -------------------------------------------
    def device_missing(self) -> str | None:
        """Why the task's device is not here (None: it is): a CUDA task on a machine without a GPU."""
        from tools.device import missing_device

        return missing_device(self.session.trusted_task.target)

    def ensure_best(self) -> str | None:
        """Build the best version from its commit (never from the worktree, which may hold edits).
        The first time in a run this is the baseline evaluation (built, checked, timed, recorded).
        Where the task's device is absent, the baseline waits: it is marked pending in run.json and
        the reason is returned (None: the best is built and the baseline measured)."""
        with self._best_lock:
            s = self.session
            if s.best_build is not None:
                return None
            measured = any(ev.kind == "baseline" for ev in s.events())
            if not measured and (why := self.device_missing()):
                self._mark_pending(why)
                return why
            with tempfile.TemporaryDirectory(prefix="kloop-best-") as tmp:
                best = s.ws.export_tree(s.best_commit, Path(tmp) / "task",
                                        subdir=None if s.ws.task_rel in ("", ".") else s.ws.task_rel)
                if not measured:
                    s.establish_baseline(best)  # clears run.json's baseline_pending
                    return None
                built = s.gate.build(Candidate(best, []))
            if not built.ok:
                raise SessionError(f"the best version ({s.best_commit[:10]}) no longer builds: {built.error_text()[:800]}")
            s.best_build = built
            return None

    def _mark_pending(self, why: str) -> None:
        info = self.session.record.info
        if info.baseline_pending == why:
            return
        info.baseline_pending = why
        self.session.record.write_info(info)
        self.session.log("note", text=pending_text(why, info.run_id), data={"baseline_pending": why})

    # -- who drives it ---------------------------------------------------------------------------
    def set_client(self, name: str | None, version: str | None) -> None:
        """Name the client in the record: run.json's policy becomes mcp:<name>/<version> for a run
        started over MCP; a later or different client is noted."""
        who = f"{(name or 'unknown')[:80]}/{(version or '?')[:40]}"
        if who in self._clients:
            return
        self._clients.add(who)
        info = self.session.record.info
        changed = info.policy == PLACEHOLDER_POLICY
        if changed:
            info.policy = f"mcp:{who}"
        client = rec.Client(name=(name or "unknown")[:80], version=(version or "")[:40] or None)
        if not any((c.name, c.version) == (client.name, client.version) for c in info.clients):
            info.clients.append(client)  # a proper field of run.json: the views show who drove the run
            changed = True
        if changed:
            self.session.record.write_info(info)
        self.session.log("note", text=f"mcp client: {who}", data={"source": "mcp", "client": who})

    # -- texts -----------------------------------------------------------------------------------
    def rules(self) -> str:
        from agent.prompts import render_template

        s = self.session
        return render_template("external", run_id=s.record.info.run_id, worktree=s.ws.path,
                               task_folder=s.ws.task_rel or ".", editable=", ".join(s.gate.task.manifest.editable),
                               tools=tool_list(self.toolbox))

    def briefing(self) -> str:
        return self.session.briefing()

    def agent_text(self) -> str:
        text = self.rules().rstrip() + "\n\n---\n\n" + self.briefing().rstrip() + "\n"
        return rec.SecretScrubber.from_env().scrub_text(text)[0]

    def write_agent_files(self) -> list[Path]:
        """AGENTS.md and CLAUDE.md (rules + briefing) and .mcp.json (Claude Code starts `kloop mcp RUN`
        from it) at the worktree's root: kloop's own files, never part of a change."""
        import json

        from agent.mcp_config import stdio_config

        text = self.agent_text()
        written = []
        for name in self.session.ws.agent_files:
            path = self.session.ws.path / name
            if name.endswith(".md"):
                path.write_text(text, encoding="utf-8")
            else:
                path.write_text(json.dumps(stdio_config(str(self.run_dir)), indent=2) + "\n", encoding="utf-8")
            written.append(path)
        return written

    # -- tools -----------------------------------------------------------------------------------
    def schemas(self) -> list[dict[str, Any]]:
        return self.toolbox.schemas()

    def call(self, name: str, raw: Any) -> ToolResult:
        """Run one tool as the agent asked: budgets, locks, the record, no secret in the answer."""
        started = time.monotonic()
        if name not in self.toolbox.tools:
            result = self.toolbox.call(name, raw)  # the ToolBox's own 'no such tool' answer
        else:
            try:
                with hold(self.run_dir, name):
                    result = self._run(name, raw)
            except Busy as exc:
                result = ToolResult(ok=False, text=str(exc), event="busy")
        result = _scrubbed(result)
        if self.session.lock is None:  # a reader beside the run's owner leaves the record alone
            return result
        self.session.log("tool_call", name=name[:100], input=raw, ok=result.ok, event=result.event, data=result.data,
                         duration_s=round(time.monotonic() - started, 3), text=result.text[:LOG_TEXT])
        return result

    def follow_branch(self) -> None:
        """Another process (a shell command, a second MCP server) may have landed a change: the
        branch's tip is the best, always (only an accepted submit moves it)."""
        s = self.session
        head = s.ws.head()
        if head != s.best_commit:
            with self._best_lock:
                s.best_commit, s.best_build = head, None

    def _run(self, name: str, raw: Any) -> ToolResult:
        self.follow_branch()
        if name not in READ_ONLY:
            if self.session.lock is None:
                return ToolResult(ok=False, text=f"not run: {name} needs the run's lock (this view is read-only)")
            if ended := self.ended:
                return ToolResult(ok=False, text=f"not run: the session has ended ({ended}); reopen it with "
                                  f"`kloop session resume {self.session.record.info.run_id}` or `kloop mcp ...`")
            if why := budget_stop(self.session, name):
                return ToolResult(ok=False, text=f"not run: budget spent ({why}). `status` shows the session; it is over.",
                                  event="budget")
            if name in DEVICE_TOOLS and (missing := self.device_missing()):
                return ToolResult(ok=False, text=no_device_text(name, missing, self.session.record.info.run_id),
                                  event="no_device")
        if name == "submit":
            try:
                self.ensure_best()
            except SessionError as exc:
                return ToolResult(ok=False, text=f"submit not run: {exc}")
        return self.toolbox.call(name, raw)

    # -- ending ----------------------------------------------------------------------------------
    def end(self, reason: str, remove_worktree: bool = True) -> None:
        """Restore the tree to best (uncommitted edits are dropped), log the end, and by default
        remove the worktree (the branch holds the result; resuming recreates it)."""
        s = self.session
        with hold(self.run_dir, "revert"):
            try:
                s.ws.restore(s.best_commit)
                if remove_worktree:
                    s.ws.remove()
            finally:
                s.log("session_ended", reason=reason)
                self.close()
        token = self.run_dir / TOKEN_FILE
        token.unlink(missing_ok=True)


def _scrubbed(result: ToolResult) -> ToolResult:
    scrubber = rec.SecretScrubber.from_env()
    text, _ = scrubber.scrub_text(result.text)
    data = scrubber.scrub(result.data)[0] if result.data is not None else None
    return result.model_copy(update={"text": cap(text), "data": data})
