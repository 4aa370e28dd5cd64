"""The judge's handle on a runner process (tools/libhost.py): the untrusted side of an evaluation.

Each library (candidate, best) is loaded by its own runner, started through `spawn_runner` — the one
place a runner's command line is built (the sandbox wraps exactly that argv) — and driven through
`Runner`: requests pickled down a pipe, answers JSON up another, buffers in shared memory
(`SharedArena`; CPU: files in /dev/shm the judge allocated, inputs mapped read-only in the runner;
CUDA: VMM allocations exported by descriptor). A runner adds the seccomp lockdown before the untrusted
library loads; secrets never reach its environment.
"""

from __future__ import annotations

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
import time
import weakref
from pathlib import Path

from tools.proc import exit_status, memory_note, tail
from tools.sandbox import LOCKDOWN_VAR, PIDNS_DEPTH, PROFILER_VAR, RUNNER_PIDNS_VAR, runner_pidns_argv, runner_pidns_requested, scrubbed_env

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ARENA_PREFIX = "kloop-arena-"  # /dev/shm folders of a judge's SharedArena, named after its pid


def _runner_memory_note(output: str = "") -> str:
    """Why a runner that just died probably hit the memory limit ('' when nothing says so): runners
    inherit the judge's RLIMIT_DATA; its output naming a refused allocation (std::bad_alloc from one
    large `new` is refused before anything is resident, then SIGABRT) or the largest peak of the
    children reaped so far (getrusage) near the limit says so (`_memory_note`)."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if limit in (resource.RLIM_INFINITY, -1) or limit <= 0:
        return ""
    return memory_note(limit, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, output)


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
    """A minimal environment: no secrets, nothing of the session's beyond what Python and CUDA need.
    Under a profiler (PROFILER_VAR, set only by trusted code: tools/judge_handle.profiled_judge_command)
    the judge's own environment, which was built minimal and holds only the profiler's additions beyond."""
    if os.environ.get(PROFILER_VAR) == "1":
        env = {k: v for k, v in os.environ.items() if k not in (LOCKDOWN_VAR, PROFILER_VAR, RUNNER_PIDNS_VAR)}
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        return env
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
        said = tail(output, 600, strip=True)
        return RunnerError("crash", f"{self.name} runner {exit_status(code, wrapped=self.wrapped)} {when}{_runner_memory_note(output)}; "
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

    def pin(self, cpus) -> None:
        """Every thread of the runner onto `cpus` (tools/placement.py). Threads it starts later inherit
        the mask; a CPU runner cannot change it itself (seccomp denies it sched_setaffinity; a CUDA runner may
        move its own threads, which the driver needs: there placement is a measurement aid). A thread that
        exits meanwhile is skipped; any other refusal raises OSError."""
        base = f"/proc/{self.pid}/task"
        for tid in os.listdir(base):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:
                pass

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
        """Idempotent: a second close must not close fd numbers the process has since reused."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
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
