"""The session's handle on a judge process (tools/worker.py, which drives its runners through
tools/runner.py).

`run_worker` starts the judge in its own process (scrubbed environment, timeout, own process group);
its answer is read back from a file and parsed as data. The judge loads no untrusted code. It runs in
the sandbox of tools/sandbox.py where the host provides it (no network, no other process visible,
read-only files but its scratch) with an allow-listed environment: secrets (API keys, tokens) never
reach it. `JudgeStandby`/`StandbySlot`: one judge tree pre-started before it is needed.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from tools.proc import exit_status, kill_group, memory_note, tail
from tools.protocol import WorkerRequest, WorkerResult
from tools.runner import ARENA_PREFIX
from tools.worker import LOAD_TIMEOUT_S, LOADED_FILE
from tools.sandbox import LOCKDOWN_VAR, PROFILER_VAR, RUNNER_PIDNS_VAR, keep_secrets_in, scrubbed_env, status, wrap

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def runner_command(cmd: list[str], *, scratch: Path, readable: list[Path] = (), writable: list[Path] = (),
                   lockdown: bool = True, extra_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, env) for a runner process running `cmd`: inside the sandbox where the host has one,
    reading only kloop's tools/, the toolchain and `readable`, writing only `scratch` and `writable`
    (e.g. a per-evaluation /dev/shm folder); `lockdown` asks the runner to install the seccomp filter
    (tools.sandbox.lockdown) before it loads untrusted code."""
    extra = {LOCKDOWN_VAR: "1"} if lockdown and status().seccomp else {}
    if status().runner_pidns:  # the judge starts each of its runners in a PID namespace of its own
        extra[RUNNER_PIDNS_VAR] = "1"
    env = scrubbed_env(home=scratch) | extra | (extra_env or {})
    gpu = any(Path("/dev").glob("nvidia*"))
    argv = wrap(cmd, readable=[PROJECT_ROOT / "tools", *readable], writable=[scratch, *writable], gpu=gpu,
                cwd=scratch, env=env, cap_add=status().judge_caps if status().runner_pidns else ())
    return argv, env


def profiled_judge_command(ncu_argv: list[str], *, scratch: Path, readable: list[Path] = ()) -> tuple[list[str], dict[str, str]]:
    """(argv, env) for a profiler (`ncu ... python -m tools.worker ...`) and the judge it starts, inside the
    same sandbox as every judge (namespaces, filesystem view, minimal environment): the candidate's
    library loads in a runner there, as it does for the gate. No syscall filter (the profiler's
    injection talks to its process over sockets), and PROFILER_VAR so the runners inherit the
    profiler's injection variables (tools/runner.runner_env)."""
    return runner_command(ncu_argv, scratch=scratch, readable=readable, lockdown=False, extra_env={PROFILER_VAR: "1"})


SCRATCH_PREFIX = "kloop-worker-"
# a judge's start before its request's timeout counts: its torch import and its runners' start and
# library loads (each load is bounded by LOAD_TIMEOUT_S inside the judge)
STARTUP_TIMEOUT_S = LOAD_TIMEOUT_S + 30.0


def run_worker(req: WorkerRequest, timeout: float, prefix: list[str] | None = None,
               standby: "JudgeStandby | None" = None) -> WorkerResult:
    """Run one request in a fresh worker; `prefix` wraps the command (e.g. an ncu invocation).
    `standby`: a pre-started judge (JudgeStandby) to answer it, consumed whatever happens; where it
    cannot (dead, another task, a profiler prefix) a fresh judge answers and `standby` is closed.

    The scratch folder is named after this process (`kloop-worker-<pid>-...`), so one left behind by
    a killed session is recognised and removed by the next worker start. An exception raised while
    waiting (a second Ctrl-C) kills the worker's whole process group before it propagates."""
    keep_secrets_in()  # before any process that will run candidate code exists
    if standby is not None:
        try:
            if prefix is None:
                result = standby.answer(req, timeout)
                if result is not None:
                    return result
        finally:
            standby.close()
    remove_stale_scratch()
    limit = _memory_limit(req.task_dir)
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as tmp:
        req_path, out_path = Path(tmp, "request.json"), Path(tmp, "result.json")
        _write_private(req_path, req.model_dump_json())  # holds the gate's seed: owner-only, and the worker deletes it first
        cmd = [*(prefix or []), sys.executable, "-m", "tools.worker", str(req_path), str(out_path)]
        readable = [Path(req.task_dir)] + [Path(lib).resolve().parent for lib in req.libs]
        # The judge itself loads no untrusted code and must start its runners (fork/exec): it gets the
        # namespaces and the filesystem view, never the syscall filter; LOCKDOWN_VAR in its environment
        # is passed on to its runners, which install the filter before the library loads. A profiler
        # prefix (ncu) injects into the processes and talks to them: no syscall filter then.
        argv, env = runner_command(cmd, scratch=Path(tmp), readable=readable, lockdown=not prefix)
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=functools.partial(_own_group_dies_with_parent, limit))
        return _collect(proc, _OutputReader(proc), out_path, timeout, limit)


def _collect(proc: subprocess.Popen, reader: "_OutputReader", out_path: Path, timeout: float,
             limit: int | None) -> WorkerResult:
    """Wait for a judge (killing its whole tree at the end, whatever happens) and read its answer."""
    try:
        overran, peak_rss = _wait(proc, timeout, out_path.parent / LOADED_FILE)
    finally:
        kill_group(proc)  # nothing the kernel forked outlives the evaluation (nor a Ctrl-C)
        _remove_arenas(proc.pid)
        if proc.returncode is None:
            _reap(proc)
    text = reader.text()
    reader.close(proc)
    if overran == "start":
        return WorkerResult(ok=False, error=f"the judge and its runners did not start and load within "
                                            f"{STARTUP_TIMEOUT_S + timeout:.0f} s (host overloaded, or a hang at load); "
                                            f"output tail: {tail(text, 1500, strip=True)}")
    if overran:
        return WorkerResult(ok=False, error=f"timed out after {timeout:.0f} s (hang or far too slow); "
                                            f"output tail: {tail(text, 1500, strip=True)}")
    memory = memory_note(limit, peak_rss, text)
    if not out_path.is_file():
        return WorkerResult(ok=False, error=f"worker {_judge_status(proc.returncode)} without an answer{memory}; "
                                            f"output tail: {tail(text, 1500, strip=True)}")
    try:
        result = WorkerResult.model_validate_json(out_path.read_text())
    except (ValidationError, ValueError) as exc:
        return WorkerResult(ok=False, error=f"worker answer unreadable: {str(exc)[:300]}")
    if proc.returncode != 0 and result.ok:
        return WorkerResult(ok=False, error=f"worker {_judge_status(proc.returncode)} after answering{memory}")
    if not result.ok and memory and result.error:
        result.error += memory
    return result


# ---- the warm standby: one judge process tree started before it is needed ----------------------

STANDBY_VAR = "KLOOP_STANDBY"  # "off": every request starts its judge and runners from scratch


def standby_enabled() -> bool:
    return os.environ.get(STANDBY_VAR, "").lower() not in ("off", "0", "no", "false")


class JudgeStandby:
    """A judge started before its request (tools/worker.py `--standby`): torch imported (CUDA
    context made), its two runners started, prepared and locked down with no library loaded. The
    request (seeds included) goes down its stdin only when it is consumed; the libraries are copied
    into a folder the judge and runners see read-only. Single-use like every judge: it answers one
    request, then it and its runners are gone. Killed with this process however it ends (atexit,
    its own process group with PR_SET_PDEATHSIG, bwrap --die-with-parent) and on `close()`."""

    def __init__(self, task_dir: str | os.PathLike):
        keep_secrets_in()
        remove_stale_scratch()
        self.task_dir = Path(task_dir).resolve()
        self.root = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-standby-"))
        self.scratch, self.libs = self.root / "run", self.root / "libs"
        self.scratch.mkdir()
        self.libs.mkdir()
        self.out_path = self.scratch / "result.json"
        self.limit = _memory_limit(str(self.task_dir))
        cmd = [sys.executable, "-m", "tools.worker", "--standby", str(self.task_dir), str(self.scratch), str(self.out_path)]
        argv, env = runner_command(cmd, scratch=self.scratch, readable=[self.task_dir, self.libs], lockdown=True)
        self.argv = argv
        self.started = time.monotonic()
        self.proc = _keeper_call(lambda: subprocess.Popen(
            argv, cwd=self.scratch, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(_own_group_dies_with_parent, self.limit)))
        self.reader = _OutputReader(self.proc)
        self.closed = False
        with _LIVE_LOCK:
            _LIVE_STANDBYS.append(self)
            surplus = _LIVE_STANDBYS[:-MAX_STANDBYS]
        for old in surplus:  # gates nobody closed (tests, replays): never more than a few trees warm
            old.close()

    def alive(self) -> bool:
        return not self.closed and self.proc.poll() is None

    def ready(self) -> bool:
        """Warmed up: runners prepared and locked down, waiting for the request."""
        return (self.scratch / "ready").is_file()

    def answer(self, req: WorkerRequest, timeout: float) -> WorkerResult | None:
        """The judge's answer to `req`; None when this standby cannot take it (dead, another task)."""
        if not self.alive() or Path(req.task_dir).resolve() != self.task_dir or self.out_path.exists():
            return None  # dead, another task, or it failed while warming up (its answer says why): a cold judge
        _forget(self)  # in use: no longer a spare that a newer standby may close
        was_ready = self.ready()
        libs = []
        for i, lib in enumerate(req.libs):
            dest = self.libs / f"{i}-{Path(lib).name}"
            shutil.copyfile(lib, dest)  # read-only in the sandbox: no runner can patch another's code
            libs.append(str(dest))
        try:
            self.proc.stdin.write(req.model_copy(update={"libs": libs}).model_dump_json().encode())
            self.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            return None
        result = _collect(self.proc, self.reader, self.out_path, timeout, self.limit)
        result.standby = "ready" if was_ready else "warming"
        return result

    def close(self) -> None:
        """Kill the tree (if still there) and remove its folder."""
        if self.closed:
            return
        self.closed = True
        _forget(self)
        try:
            if self.proc.returncode is None:
                kill_group(self.proc)
                _remove_arenas(self.proc.pid)
                _reap(self.proc)
            self.reader.close(self.proc)
            if self.proc.stdin:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class StandbySlot:
    """The one standby a gate keeps for its trusted task folder. `take()` hands it over (None when
    there is none or it died); `refill()` starts the next one, to warm up while the agent works."""

    def __init__(self, task_dir: str | os.PathLike, enabled: bool = True):
        self.task_dir = Path(task_dir).resolve()
        self.enabled = enabled and standby_enabled()
        self._current: JudgeStandby | None = None
        self._lock = threading.Lock()
        self._no_gpu: bool | None = None  # a CUDA task on a machine without a GPU (known at the first refill)

    def refill(self) -> None:
        if not self.enabled:
            return
        if self._no_gpu is None:
            self._no_gpu = self._needs_missing_gpu()
        if self._no_gpu:  # its judge could only say "no GPU here": a cold one says it as well
            return
        with self._lock:
            if self._current is not None and self._current.alive():
                return
            if self._current is not None:
                self._current.close()
            try:
                self._current = JudgeStandby(self.task_dir)
            except OSError:  # cannot start processes now: the next request starts its own
                self._current = None

    def _needs_missing_gpu(self) -> bool:
        from tools.task import TaskError, load_task

        try:
            cuda = load_task(self.task_dir).on_gpu
        except (TaskError, OSError):
            return False
        return cuda and not any(Path("/dev").glob("nvidia*"))

    def take(self) -> JudgeStandby | None:
        with self._lock:
            cur, self._current = self._current, None
        if cur is not None and not cur.alive():
            cur.close()
            return None
        return cur

    def close(self) -> None:
        with self._lock:
            cur, self._current = self._current, None
        if cur is not None:
            cur.close()


MAX_STANDBYS = 2  # live pre-started trees per process; starting another closes the oldest
_LIVE_STANDBYS: list[JudgeStandby] = []
_LIVE_LOCK = threading.Lock()


def _forget(standby: JudgeStandby) -> None:
    with _LIVE_LOCK:
        if standby in _LIVE_STANDBYS:
            _LIVE_STANDBYS.remove(standby)


@atexit.register
def _close_standbys() -> None:
    for s in list(_LIVE_STANDBYS):
        s.close()


class _Keeper:
    """One long-lived thread that starts standbys. PR_SET_PDEATHSIG fires when the THREAD that forked
    a child exits, so a standby started from a short-lived worker thread (MCP tool calls run in a
    pool) would die with it; started from here it lives as long as this process."""

    def __init__(self):
        import queue

        self.jobs: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._run, name="kloop-standby-keeper", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, box, done = self.jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed back to the caller
                box.append((False, exc))
            done.set()


_KEEPER: _Keeper | None = None
_KEEPER_LOCK = threading.Lock()


def _keeper_call(fn):
    global _KEEPER
    with _KEEPER_LOCK:
        if _KEEPER is None:
            _KEEPER = _Keeper()
    box, done = [], threading.Event()
    _KEEPER.jobs.put((fn, box, done))
    done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return value




def _remove_arenas(pid: int) -> None:
    """Shared-memory buffers of a judge that was killed before it could remove them."""
    import shutil

    for root in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        for d in root.glob(f"{ARENA_PREFIX}{pid}-*") if root.is_dir() else []:
            shutil.rmtree(d, ignore_errors=True)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


class _OutputReader:
    """Drains the worker's stdout+stderr in a thread (so the wait loop can watch the process)."""

    def __init__(self, proc: subprocess.Popen):
        self._chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        try:
            for chunk in iter(lambda: pipe.read1(65536), b""):
                self._chunks.append(chunk)
        except (OSError, ValueError):
            pass

    def text(self) -> str:
        self._thread.join(timeout=5)
        return b"".join(self._chunks).decode(errors="replace")

    def close(self, proc: subprocess.Popen) -> None:
        if not self._thread.is_alive() and proc.stdout is not None:
            proc.stdout.close()


def _wait(proc: subprocess.Popen, timeout: float, loaded: Path) -> tuple[str | None, int]:
    """Wait for the worker; (None if it finished in time, else the phase it overran: "start" or
    "work"; the peak resident memory of its process tree in bytes).

    Two deadlines: the judge and its runners get STARTUP_TIMEOUT_S to start and load their libraries
    (the judge then writes `loaded`), and `timeout` counts from then: a start-up slowed by a loaded
    host never eats the request's own seconds, and a hang at start-up is still bounded.
    The peak is the largest VmHWM seen while polling the tree (the sandbox sits between us and the
    worker, so wait4's figure is the sandbox's own), or wait4's when larger."""
    deadline, phase = time.monotonic() + STARTUP_TIMEOUT_S + timeout, "start"
    watch = _TreeWatch(proc.pid)
    pause = 0.005
    while True:
        watch.poll()
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return None, max(watch.peak, usage.ru_maxrss * 1024)
        now = time.monotonic()
        if phase == "start" and loaded.exists():
            deadline, phase = min(deadline, now + timeout), "work"
        if now >= deadline:
            return phase, watch.peak
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class _TreeWatch:
    """The peak resident memory (VmHWM) of a process tree: members found by a /proc scan now and
    then (every RESCAN_S), their high-water marks read at every poll (a few small reads)."""

    RESCAN_S = 0.5

    def __init__(self, root: int):
        self.root = root
        self.members = [root]
        self.peak = 0
        self._scanned = -1e9

    def poll(self) -> None:
        now = time.monotonic()
        if now - self._scanned >= self.RESCAN_S:
            self.members, self._scanned = _descendants(self.root), now
        for pid in self.members:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
                        break
            except (OSError, ValueError):
                continue


def _descendants(root: int) -> list[int]:
    """`root` and every process below it (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return [root]
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _reap(proc: subprocess.Popen) -> None:
    try:
        _, status, _ = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        proc.returncode = proc.returncode if proc.returncode is not None else -signal.SIGKILL


def _memory_limit(task_dir: str) -> int | None:
    from tools.task import TaskError, load_task

    try:
        return load_task(Path(task_dir)).memory_limit_bytes
    except (TaskError, OSError):
        return None


def remove_stale_scratch(root: Path | None = None) -> list[Path]:
    """Delete `kloop-worker-<pid>-*` folders whose owner process is gone (a session killed with
    kill -9 leaves one holding the gate's seed). Folders of the old unnamed kind go after a day."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for path in entries:
        if not path.name.startswith(SCRATCH_PREFIX) or not path.is_dir() or path.is_symlink():
            continue
        owner = path.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        try:
            stale = not _alive(int(owner)) if owner.isdigit() else time.time() - path.stat().st_mtime > 86400
            if stale and path.stat().st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _own_group_dies_with_parent(memory_limit: int | None = None) -> None:
    """In the child: its own process group (so a timeout kills all it forked), and killed when the
    session that started it dies (kill -9 included), so no orphan keeps spinning on a core or GPU.
    `memory_limit` caps its private writable memory (RLIMIT_DATA: heap and anonymous mappings, not
    the address space, so CUDA's large reservations are not refused)."""
    os.setsid()
    if memory_limit:
        import resource

        try:
            resource.setrlimit(resource.RLIMIT_DATA, (memory_limit, memory_limit))
        except (ValueError, OSError):
            pass
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _judge_status(code: int | None) -> str:
    return exit_status(code, wrapped=status().namespaces)  # bwrap exits 128 + the signal that killed the judge
