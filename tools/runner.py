"""Run the evaluation worker in its own process: sandboxed, minimal environment, timeout, own group.

The worker's answer is read back from a file and parsed as data; its exit status, a signal or a
timeout become an error result. The worker runs in the sandbox of tools/sandbox.py where the host
provides it (no network, no other process visible, read-only files but its scratch, seccomp
lockdown before the candidate's library loads) with an allow-listed environment: secrets (API keys,
tokens) never reach it.
"""

from __future__ import annotations

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

from tools.proc import kill_group, tail
from tools.protocol import WorkerRequest, WorkerResult
from tools.sandbox import LOCKDOWN_VAR, minimal_env, status, wrap

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def scrubbed_env(base: dict[str, str] | None = None, home: str | os.PathLike | None = None) -> dict[str, str]:
    """A runner's environment: the allow-list of tools/sandbox.py `minimal_env` (so no secret, whatever
    its name) plus kloop's own package on PYTHONPATH."""
    return minimal_env({"PYTHONPATH": str(PROJECT_ROOT), "PYTHONUNBUFFERED": "1"}, home=home, base=base)


def runner_command(cmd: list[str], *, scratch: Path, readable: list[Path] = (), writable: list[Path] = (),
                   lockdown: bool = True) -> tuple[list[str], dict[str, str]]:
    """(argv, env) for a runner process running `cmd`: inside the sandbox where the host has one,
    reading only kloop's tools/, the toolchain and `readable`, writing only `scratch` and `writable`
    (e.g. a per-evaluation /dev/shm folder); `lockdown` asks the runner to install the seccomp filter
    (tools.sandbox.lockdown) before it loads untrusted code."""
    extra = {LOCKDOWN_VAR: "1"} if lockdown and status().seccomp else {}
    env = scrubbed_env(home=scratch) | extra
    gpu = any(Path("/dev").glob("nvidia*"))
    argv = wrap(cmd, readable=[PROJECT_ROOT / "tools", *readable], writable=[scratch, *writable], gpu=gpu,
                cwd=scratch, env=env)
    return argv, env


SCRATCH_PREFIX = "kloop-worker-"
PROGRESS_FILE = "progress"  # the worker writes what it is running (phase, shape, call) here
_MEMORY_WORDS = ("bad_alloc", "MemoryError", "Cannot allocate memory", "out of memory")


def run_worker(req: WorkerRequest, timeout: float, prefix: list[str] | None = None) -> WorkerResult:
    """Run one request in a fresh worker; `prefix` wraps the command (e.g. an ncu invocation).

    The scratch folder is named after this process (`kloop-worker-<pid>-...`), so one left behind by
    a killed session is recognised and removed by the next worker start. An exception raised while
    waiting (a second Ctrl-C) kills the worker's whole process group before it propagates."""
    remove_stale_scratch()
    limit = _memory_limit(req)
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as tmp:
        req_path, out_path = Path(tmp, "request.json"), Path(tmp, "result.json")
        _write_private(req_path, req.model_dump_json())  # holds the gate's seed: owner-only, and the worker deletes it first
        cmd = [*(prefix or []), sys.executable, "-m", "tools.worker", str(req_path), str(out_path)]
        readable = [Path(req.task_dir)] + [Path(lib).resolve().parent for lib in req.libs]
        # a profiler prefix (ncu) injects into the worker and talks to it: no syscall filter then
        argv, env = runner_command(cmd, scratch=Path(tmp), readable=readable, lockdown=not prefix)
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=functools.partial(_own_group_dies_with_parent, limit))
        reader = _OutputReader(proc)
        try:
            finished, peak_rss = _wait(proc, timeout)
        finally:
            kill_group(proc)  # nothing the kernel forked outlives the evaluation (nor a Ctrl-C)
            if proc.returncode is None:
                _reap(proc)
        text = reader.text()
        reader.close(proc)
        where = _progress(Path(tmp, PROGRESS_FILE))
        if not finished:
            return WorkerResult(ok=False, error=f"timed out after {timeout:.0f} s{where} (hang or far too slow); "
                                                f"output tail: {_tail(text)}")
        memory = _memory_note(limit, peak_rss, text)
        if not out_path.is_file():
            return WorkerResult(ok=False, error=f"worker {_status(proc.returncode)}{where} without an answer{memory}; "
                                                f"output tail: {_tail(text)}")
        try:
            result = WorkerResult.model_validate_json(out_path.read_text())
        except (ValidationError, ValueError) as exc:
            return WorkerResult(ok=False, error=f"worker answer unreadable: {str(exc)[:300]}")
        if proc.returncode != 0 and result.ok:
            return WorkerResult(ok=False, error=f"worker {_status(proc.returncode)}{where} after answering{memory}")
        if not result.ok and memory and result.error:
            result.error += memory
        return result


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


def _progress(path: Path) -> str:
    """' during check of shape X, call N' from the worker's progress marker ('' when there is none)."""
    try:
        fields = dict(f.split("=", 1) for f in path.read_text().split("\x00")[0].split() if "=" in f)
    except (OSError, ValueError):
        return ""
    if not fields.get("shape"):
        return ""
    lib = f" ({fields['lib']})" if fields.get("lib") else ""
    phase = fields.get("phase", "evaluation")
    call = fields.get("call", "?") + (" or later" if phase == "timing" else "")
    return f" during {phase} of shape {fields['shape']}{lib}, call {call}"


def _memory_limit(req: WorkerRequest) -> int | None:
    from tools.task import TaskError, load_task

    try:
        return load_task(Path(req.task_dir)).memory_limit_bytes
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
    if code > 128 and status().namespaces:  # bwrap exits with 128 + the signal that killed its child
        code = 128 - code
    if code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _tail(text, n: int = 1500) -> str:
    return tail(text, n, strip=True)
