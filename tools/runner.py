"""Processes of an evaluation: the judge (tools/worker.py) and the runners it drives (tools/libhost.py).

`run_worker` starts the judge in its own process (scrubbed environment, timeout, own process group);
its answer is read back from a file and parsed as data. The judge loads no untrusted code: each
library (candidate, best) is loaded by its own runner process, started through `spawn_runner` — the
one place a runner's command line is built (the sandbox wraps exactly that argv) — and driven
through `Runner`: requests pickled down a pipe, answers JSON up another, buffers in shared memory
(CPU: files in /dev/shm the judge allocated, inputs mapped read-only in the runner; CUDA: IPC handles).
Secrets (API keys, tokens) never reach either environment.
The judge runs in the sandbox of tools/sandbox.py where the host provides it (no network, no other
process visible, read-only files but its scratch) with an allow-listed environment; its runners
add the seccomp lockdown before the untrusted library loads.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import mmap
import os
import pickle
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from pydantic import ValidationError

from tools.proc import kill_group, tail
from tools.protocol import WorkerRequest, WorkerResult
from tools.sandbox import (LOCKDOWN_VAR, PIDNS_DEPTH, RUNNER_PIDNS_VAR, keep_secrets_in, minimal_env, runner_pidns_argv,
                           runner_pidns_requested, status, wrap)

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def scrubbed_env(base: dict[str, str] | None = None, home: str | os.PathLike | None = None) -> dict[str, str]:
    """A runner's environment: the allow-list of tools/sandbox.py `minimal_env` (so no secret, whatever
    its name) plus kloop's own package on PYTHONPATH, then the session's own PYTHONPATH entries (where
    kloop's dependencies may live, e.g. a --target install): the child must import what the parent did."""
    src = os.environ if base is None else base
    paths = [str(PROJECT_ROOT)] + [d for d in src.get("PYTHONPATH", "").split(os.pathsep) if d]
    return minimal_env({"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1"},
                       home=home, base=base)


def runner_command(cmd: list[str], *, scratch: Path, readable: list[Path] = (), writable: list[Path] = (),
                   lockdown: bool = True) -> tuple[list[str], dict[str, str]]:
    """(argv, env) for a runner process running `cmd`: inside the sandbox where the host has one,
    reading only kloop's tools/, the toolchain and `readable`, writing only `scratch` and `writable`
    (e.g. a per-evaluation /dev/shm folder); `lockdown` asks the runner to install the seccomp filter
    (tools.sandbox.lockdown) before it loads untrusted code."""
    extra = {LOCKDOWN_VAR: "1"} if lockdown and status().seccomp else {}
    if status().runner_pidns:  # the judge starts each of its runners in a PID namespace of its own
        extra[RUNNER_PIDNS_VAR] = "1"
    env = scrubbed_env(home=scratch) | extra
    gpu = any(Path("/dev").glob("nvidia*"))
    argv = wrap(cmd, readable=[PROJECT_ROOT / "tools", *readable], writable=[scratch, *writable], gpu=gpu,
                cwd=scratch, env=env, cap_add=status().judge_caps if status().runner_pidns else ())
    return argv, env


SCRATCH_PREFIX = "kloop-worker-"
_MEMORY_WORDS = ("bad_alloc", "MemoryError", "Cannot allocate memory", "out of memory")


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
        finished, peak_rss = _wait(proc, timeout)
    finally:
        kill_group(proc)  # nothing the kernel forked outlives the evaluation (nor a Ctrl-C)
        _remove_arenas(proc.pid)
        if proc.returncode is None:
            _reap(proc)
    text = reader.text()
    reader.close(proc)
    if not finished:
        return WorkerResult(ok=False, error=f"timed out after {timeout:.0f} s (hang or far too slow); "
                                            f"output tail: {_tail(text)}")
    memory = _memory_note(limit, peak_rss, text)
    if not out_path.is_file():
        return WorkerResult(ok=False, error=f"worker {_status(proc.returncode)} without an answer{memory}; "
                                            f"output tail: {_tail(text)}")
    try:
        result = WorkerResult.model_validate_json(out_path.read_text())
    except (ValidationError, ValueError) as exc:
        return WorkerResult(ok=False, error=f"worker answer unreadable: {str(exc)[:300]}")
    if proc.returncode != 0 and result.ok:
        return WorkerResult(ok=False, error=f"worker {_status(proc.returncode)} after answering{memory}")
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


ARENA_PREFIX = "kloop-arena-"


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


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[bool, int]:
    """Wait for the worker; (finished in time, the peak resident memory of its process tree in bytes).

    The peak is the largest VmHWM seen while polling the tree (the sandbox sits between us and the
    worker, so wait4's figure is the sandbox's own), or wait4's when larger."""
    deadline = time.monotonic() + timeout
    watch = _TreeWatch(proc.pid)
    pause = 0.005
    while True:
        watch.poll()
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return True, max(watch.peak, usage.ru_maxrss * 1024)
        if time.monotonic() >= deadline:
            return False, watch.peak
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


def _memory_note(limit: int | None, peak_rss: int, output: str) -> str:
    """Why a failed worker probably ran out of its memory limit ('' when nothing says so). A worker
    whose allocation is refused dies of the NULL pointer or of std::bad_alloc, or reports MemoryError;
    its peak resident memory then sits near the limit."""
    if not limit:
        return ""
    said = next((w for w in _MEMORY_WORDS if w in output), None)
    if said is None and peak_rss < 0.8 * limit:
        return ""
    return (f"; it hit the worker memory limit of {limit / 2**30:.3g} GiB (memory_limit_gb in task.toml; "
            f"peak resident {peak_rss / 2**30:.2f} GiB{', ' + said if said else ''})")


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


def _status(code: int | None) -> str:
    if code is None:
        return "did not finish"
    if code > 128 and (status().namespaces or runner_pidns_requested()):  # bwrap and the PID namespace's init
        # exit with 128 + the signal that killed their child
        code = 128 - code
    if code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _tail(text, n: int = 1500) -> str:
    return tail(text, n, strip=True)


# ---- runners: the untrusted side of an evaluation --------------------------------------------------

def _runner_memory_note(output: str = "") -> str:
    """Why a runner that just died probably hit the memory limit ('' when nothing says so): runners
    inherit the judge's RLIMIT_DATA; its output naming a refused allocation (std::bad_alloc from one
    large `new` is refused before anything is resident, then SIGABRT) or the largest peak of the
    children reaped so far (getrusage) near the limit says so (`_memory_note`)."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if limit in (resource.RLIM_INFINITY, -1) or limit <= 0:
        return ""
    return _memory_note(limit, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, output)


class RunnerError(Exception):
    """A runner failed: crashed, hung, answered garbage, or its call raised. `kind` says which."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # "crash" | "timeout" | "call" | "protocol"


def spawn_runner(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = (),
                 log_path: Path | None = None, pidns: bool = True) -> subprocess.Popen:
    """Start one runner process. THE ONLY place runners are spawned.

    SANDBOX CALL SITE. A runner lives inside its judge's bubblewrap namespaces (run_worker wraps the
    judge: no network, read-only files but the scratch) and installs the seccomp filter itself
    (`tools.sandbox.lockdown()` in tools/libhost.py, when KLOOP_LOCKDOWN=1) before the untrusted
    library loads. Where the session found it works (tools.sandbox.status().runner_pidns, passed as
    KLOOP_RUNNER_PIDNS=1), `argv` starts under `unshare`: a PID namespace and a /proc of its own, so it
    sees neither its sibling nor the judge (their CPU time in /proc/<pid>/stat would tell it the pair
    order). The Popen is then the wrapper; `Runner.pid` finds the runner itself. `pidns=False`: not
    under `unshare` (a judge that has dropped its capabilities cannot make the namespaces any more)."""
    prefix = runner_pidns_argv() if pidns and runner_pidns_requested() else None
    if prefix:
        argv = [*prefix, *argv]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                pass_fds=pass_fds, preexec_fn=_dies_with_parent, cwd=str(log_path.parent) if log_path else None)
    finally:
        if log_path:
            log.close()


def _dies_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def runner_env() -> dict[str, str]:
    """A minimal environment: no secrets, nothing of the session's beyond what Python and CUDA need."""
    keep = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "HOME", "TMPDIR", LOCKDOWN_VAR)
    # (RUNNER_PIDNS_VAR stays with the judge: spawn_runner reads it there, a runner starts nothing)
    env = {k: v for k, v in scrubbed_env().items() if k in keep or k in ("PYTHONPATH", "PYTHONUNBUFFERED")}
    if os.environ.get(LOCKDOWN_VAR):  # the judge was asked to have its runners lock down
        env[LOCKDOWN_VAR] = os.environ[LOCKDOWN_VAR]
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


class Runner:
    """The judge's handle on one runner process (one library). Started early (torch imported while the
    judge draws inputs); every answer is parsed as JSON and must echo its request's nonce."""

    def __init__(self, scratch: Path, name: str, pidns: bool = True):
        self.scratch = Path(scratch)
        self.name = name
        cmd_r, self._cmd_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        # descriptors of device buffers (tools/vmm.py) go down this socket, in the order of the descriptions
        self._fds, runner_fds = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.log_path = self.scratch / f"{name}.log"
        self.proc = spawn_runner([sys.executable, "-m", "tools.libhost", str(cmd_r), str(reply_w), str(runner_fds.fileno())],
                                 runner_env(), pass_fds=(cmd_r, reply_w, runner_fds.fileno()), log_path=self.log_path,
                                 pidns=pidns)
        os.close(cmd_r)
        os.close(reply_w)
        runner_fds.close()
        self._buf = b""
        self._nonce = itertools.count(secrets.randbits(40))
        self.busy_s = 0.0  # wall seconds the judge saw this runner working (for the CPU-time audit)
        self.prepared = False  # device, spec and seccomp set up, waiting for its one library
        self.loaded: str | None = None  # the library it loaded (single-use: never a second one)
        # under `unshare` (spawn_runner) the Popen is the wrapper and the runner its grandchild (under an init)
        self.wrapped = pidns and runner_pidns_requested()
        self._pid: int | None = None if self.wrapped else self.proc.pid
        # frozen between requests (SIGSTOP after each answer, SIGCONT before the next request): no thread
        # of the runner can run while the judge flushes, draws, poisons or re-checks (RemoteLib on CPU tasks)
        self.freeze = False
        self.frozen = False

    @property
    def pid(self) -> int:
        """The runner process itself (in the judge's PID namespace): whose CPU clock, threads and stop
        state the judge reads. Under the `unshare` wrapper: its child, found once in /proc."""
        if self._pid is None:
            deadline = time.monotonic() + 10
            while self._pid is None:
                kids = _generation(self.proc.pid, PIDNS_DEPTH)
                if kids:
                    self._pid = kids[0]
                elif self.proc.poll() is not None or time.monotonic() > deadline:
                    return self.proc.pid  # gone (or never forked): reads of it fail like those of a dead runner
                else:
                    time.sleep(0.002)
        return self._pid

    def stop(self) -> None:
        """Freeze every thread of the runner (it answered; nothing of it may run until the next request)."""
        if self.freeze and not self.frozen:
            self._signal(signal.SIGSTOP)
            self.frozen = True

    def resume(self) -> None:
        if self.frozen:
            self._signal(signal.SIGCONT)
            self.frozen = False

    def _signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def prepare(self, spec_path: str | os.PathLike, device: str, timeout: float) -> None:
        """Set up everything but the library (tools/libhost.Host.prepare): a pre-started runner."""
        self.request("prepare", timeout, spec_path=str(spec_path), device=device)
        self.prepared = True

    # -- requests --------------------------------------------------------------------------------
    def request(self, op: str, timeout: float, fds: list[int] = (), keep_running: bool = False, **kw) -> dict:
        """`fds`: descriptors the runner receives before it reads the request (tools/libhost.Host.bind).
        A frozen runner (`freeze`) is resumed for the request and stopped again when it answered, unless
        `keep_running` (a probe's idle window: the caller stops it)."""
        self.resume()
        try:
            return self._request(op, timeout, fds, **kw)
        finally:
            if not keep_running:
                self.stop()

    def _request(self, op: str, timeout: float, fds: list[int], **kw) -> dict:
        if fds:
            self._fds.settimeout(timeout)  # a runner that stops reading its socket cannot hang the judge
            try:
                socket.send_fds(self._fds, [b"f"], list(fds))
            except OSError:
                self.kill()
                raise self._died("before the request")
        nonce = next(self._nonce)
        data = pickle.dumps((nonce, op, kw), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            os.write(self._cmd_w, struct.pack("<I", len(data)))
            view = memoryview(data)
            while view:
                view = view[os.write(self._cmd_w, view):]
        except (BrokenPipeError, OSError):
            raise self._died("before the request")
        t0 = time.perf_counter()
        reply = self._recv(timeout, op)
        self.busy_s += time.perf_counter() - t0
        if not isinstance(reply, dict) or reply.get("nonce") != nonce:
            self.kill()
            raise RunnerError("protocol", f"runner {self.name} answered out of turn to {op!r} (forged or stale answer)")
        if not reply.get("ok"):
            raise RunnerError("call", str(reply.get("error", "call failed"))[:2000])
        return reply

    def _recv(self, timeout: float, op: str):
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise RunnerError("timeout", f"{self.name} runner timed out after {timeout:.0f} s in {op} (hang or far too slow)")
            ready, _, _ = select.select([self._reply_r], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._reply_r, 1 << 16)
            if not chunk:
                raise self._died(f"during {op}")
            self._buf += chunk
            if len(self._buf) > (16 << 20):
                self.kill()
                raise RunnerError("protocol", f"runner {self.name} answer too large")
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)  # data only: never unpickle what a runner sends
        except ValueError:
            self.kill()
            raise RunnerError("protocol", f"runner {self.name} answered unreadable data to {op!r}")

    def _died(self, when: str) -> RunnerError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait()
        output = self.output()
        said = _tail(output, 600)
        return RunnerError("crash", f"{self.name} runner {_status(code)} {when}{_runner_memory_note(output)}; "
                                    + (f"output tail: {said}" if said else "it printed nothing"))

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # -- CPU time of the runner, read from outside (the runner cannot lie about it) ----------------
    def cpu_ns(self) -> int:
        """CPU nanoseconds of the whole runner (every thread, exited ones included), read by the kernel's
        per-process CPU clock: exact at the moment of reading, and nothing the runner can forge."""
        try:
            return time.clock_gettime_ns(((~self.pid) << 3) | 2)  # clock_getcpuclockid(pid): CPUCLOCK_SCHED
        except OSError:
            return self._cpu_ns_proc()

    def _cpu_ns_proc(self) -> int:
        total = 0
        base = f"/proc/{self.pid}/task"
        try:
            tids = os.listdir(base)
        except OSError:
            return 0
        for tid in tids:
            try:
                with open(f"{base}/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return total

    def threads(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid}/task"))
        except OSError:
            return 0

    def stat_cpu_s(self) -> float:
        """utime + stime of the whole process (dead threads included), in seconds (tick resolution)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return float("nan")

    def kill(self) -> None:
        if self.proc.poll() is None:
            if self.wrapped and self._pid is not None:  # the runner first (stopped or not), so its wrapper reaps it
                try:
                    os.kill(self._pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request("exit", timeout=5, keep_running=True)
            except RunnerError:
                pass
        self.kill()
        for fd in (self._cmd_w, self._reply_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.close()


def _granule_ceil(nbytes: int, buf) -> int:
    """`nbytes` rounded up to the allocation granularity the buffer was made with (its size where unknown)."""
    g = int(getattr(buf, "granularity", 0) or 0)
    return -(-max(nbytes, 1) // g) * g if g > 0 else buf.size


def _generation(pid: int, depth: int) -> list[int]:
    """The processes `depth` generations below `pid` (1: its children)."""
    level = [pid]
    for _ in range(depth):
        level = [kid for p in level for kid in _children(p)]
    return level


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc; the kernel's `children` file is not always built in)."""
    found = []
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return found
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)


class SharedArena:
    """Tensors the judge allocates for runners, reachable by no name. CPU: each tensor in its own file,
    created in a private /dev/shm folder and unlinked at once, mapped here read-write; a runner gets a
    descriptor of it beside the request (read-only for an input, whose file is also made read-only,
    so no reopening makes it writable) and maps it as told. CUDA: every tensor in device memory of its
    own (tools/vmm.py), sent as a descriptor: inputs mapped read-only by the runner, outputs read-write,
    never a CUDA IPC handle (which maps a whole segment of the judge's allocator)."""

    def __init__(self, device, root: Path | None = None):
        import torch

        self.device = device
        self.cuda = device.type == "cuda"
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        # named after the judge's pid: run_worker removes what a killed judge left behind
        self.dir = Path(tempfile.mkdtemp(prefix=f"{ARENA_PREFIX}{os.getpid()}-", dir=root or base))
        self._torch = torch
        self.fds: dict[int, int] = {}  # address of a CPU tensor's storage -> the judge's descriptor of its file
        self.exported: dict = {}  # device address -> weakref to its tools.vmm.ExportedBuffer
        _more_descriptors()

    def share(self, t, read_only: bool = False):
        """A copy of `t` in shared memory (CPU) or `t` itself (CUDA); non-tensors pass through.
        `read_only` (CPU): the file's mode becomes 0400 (this process keeps its writable mapping)."""
        torch = self._torch
        if not isinstance(t, torch.Tensor):
            return t
        if self.cuda:
            return t.contiguous()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return t
        while True:  # an unguessable name, created exclusively: nothing can be waiting at it
            path = self.dir / f"t{secrets.token_hex(8)}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                continue
        os.unlink(path)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if read_only:
                os.fchmod(fd, 0o400)
        except OSError:
            os.close(fd)
            raise
        shared = torch.frombuffer(mm, dtype=t.dtype).view(t.shape)  # the tensor keeps the mapping
        shared.copy_(t)
        self.fds[shared.untyped_storage().data_ptr()] = fd
        return shared

    def share_dict(self, d: dict, inputs: bool = False) -> dict:
        """`inputs`: the inputs of a call. On CUDA every tensor, input or output, goes in its own exported
        device buffer (an input's the runner can only map read-only): a runner's mapping of it holds that
        tensor and nothing else of the judge's. On the CPU each is a file of its own, inputs read-only."""
        if self.cuda:
            return {k: self._share_device(v) for k, v in d.items()}
        return {k: self.share(v, read_only=inputs) for k, v in d.items()}

    def _share_device(self, t):
        from tools import vmm

        torch = self._torch
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return self.share(t)
        t = t.contiguous()
        buf = vmm.ExportedBuffer(t.numel() * t.element_size(), t.device.index or 0)
        shared = vmm.as_tensor(buf, t.dtype, t.shape)
        shared.copy_(t)
        self.exported[shared.untyped_storage().data_ptr()] = weakref.ref(buf)
        return shared

    def describe(self, t, writable: bool = False) -> tuple:
        """What a runner needs to map `t` (pickled down the pipe). A buffer's description holds a new
        descriptor (read-only unless `writable`), which the caller sends beside the request and then
        closes (RemoteLib.bind)."""
        torch = self._torch
        if not isinstance(t, torch.Tensor):
            return ("value", t)
        if self.cuda:
            if t.numel() == 0:
                return ("empty", str(t.dtype), tuple(t.shape))
            ref = self.exported.get(t.untyped_storage().data_ptr())
            buf = ref() if ref is not None else None
            if buf is not None and buf.ptr == t.untyped_storage().data_ptr():
                nbytes = t.numel() * t.element_size()
                if t.storage_offset() or nbytes > buf.size or buf.size > _granule_ceil(nbytes, buf):
                    raise ValueError(f"a {nbytes}-byte tensor in a {buf.size}-byte device buffer: a runner's "
                                     "mapping must hold the tensor and nothing else")
                return ("vmm", buf.export(), buf.size, str(t.dtype), tuple(t.shape))
            # a CUDA IPC handle of torch's allocator maps its whole segment, other tensors of the judge's
            # (references, inputs' copies) with it: never sent
            raise ValueError("CUDA tensor not shared through this arena (tools/vmm.py): an IPC handle of the "
                             "caching allocator would map the judge's whole allocator segment")
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return ("empty", str(t.dtype), tuple(t.shape))
        fd = self.fds.get(t.untyped_storage().data_ptr())
        if fd is None:
            raise ValueError("tensor not allocated by this arena (share it first)")
        if writable:
            return ("fd", os.dup(fd), str(t.dtype), tuple(t.shape), nbytes)
        return ("fd", os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC), str(t.dtype), tuple(t.shape), nbytes)

    def release(self, d: dict) -> None:
        """Close this process's descriptors of these tensors (the mappings stay valid)."""
        for t in d.values():
            if isinstance(t, self._torch.Tensor) and not self.cuda and t.numel():
                fd = self.fds.pop(t.untyped_storage().data_ptr(), None)
                if fd is not None:
                    os.close(fd)

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _more_descriptors() -> None:
    """A judge holds a descriptor per shared tensor (up to 256 rotated sets per shape): its soft limit
    goes up to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
