"""The sandbox for untrusted code: runners (which load a candidate's library) and builds.

Two maintained mechanisms, one per layer:

- **bubblewrap** (`bwrap`) for namespaces and the filesystem: no network (own, empty net namespace),
  own PID namespace with a fresh /proc (no other process visible, so no /proc/<ppid>/environ), a
  read-only view of the toolchain, Python and the folders the caller names, writable scratch only,
  /tmp a private tmpfs, all capabilities dropped, killed with its parent (`--die-with-parent`),
  own session (no TIOCSTI into the terminal), and an explicit environment (`--clearenv`).
- **seccomp** (libseccomp through `pyseccomp`) for the syscalls: `lockdown()`, called in the runner
  after torch is imported and before the candidate's library loads, denies exec, fork (clone
  without CLONE_THREAD), ptrace and cross-process memory access, sockets, mounts and namespaces,
  kernel keyrings and modules, bpf, io_uring and userfaultfd. Threads stay allowed (torch and the
  CUDA driver start them); work a candidate leaves running on a thread after its call returns is
  caught by the harness (CPU time and device-idle checks), not here.

`status()` says what this host provides (probed once). Where a mechanism is missing kloop says so
at session start and in run.json; `--require-sandbox` refuses to run. `KLOOP_SANDBOX=off` forces
"unavailable" (for hosts where bwrap cannot run, and for tests).

`minimal_env()` is the environment of every child kloop starts (compilers, git, runners): an
allow-list, so no secret (API keys, tokens) reaches one whatever its name.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Iterable, Mapping

DISABLE_VAR = "KLOOP_SANDBOX"  # "off": run without the sandbox (and say so)
LOCKDOWN_VAR = "KLOOP_LOCKDOWN"  # "1" in a runner's environment: call lockdown() before untrusted code
# "1" in the judge's environment: start every runner in a PID namespace of its own (runner_pidns_argv);
# "off" in the session's: do not (status() says why)
RUNNER_PIDNS_VAR = "KLOOP_RUNNER_PIDNS"
# "1" in the judge's environment: it runs under a profiler (ncu) that injects itself through environment
# variables; its runners then inherit the judge's whole environment (already minimal: the profiler's
# variables are the only additions), or the kernels they launch are never seen (`kloop profile`)
PROFILER_VAR = "KLOOP_UNDER_PROFILER"
# variables a child may inherit (values from this process); everything else is dropped
INHERITED = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_HOME", "CUDA_PATH", "CUDA_MODULE_LOADING",
    "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TZ",
)
SYSTEM_PATH = "/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class SandboxStatus:
    mechanism: str  # e.g. "bubblewrap 0.8.0 + seccomp (libseccomp 2.5.4)", or what is missing
    available: bool  # namespaces/filesystem AND syscall filter both work here
    reason: str  # why not, or "" when available
    namespaces: bool = False  # bwrap works (runners and builds are wrapped)
    seccomp: bool = False  # lockdown() can install its filter
    # each runner in a PID namespace of its own with its own /proc (no sibling, no judge visible)
    runner_pidns: bool = False
    runner_pidns_reason: str = ""  # why not, or "" when it holds
    judge_caps: tuple[str, ...] = ()  # capabilities the judge's bwrap keeps (in its own user namespace) for that

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        pidns = "" if self.runner_pidns else (f"; runner PID namespaces UNAVAILABLE ({self.runner_pidns_reason}): "
                                               "runners can read each other's /proc")
        if self.available:
            return f"sandbox: {self.mechanism}{pidns}"
        return f"sandbox UNAVAILABLE ({self.reason}): untrusted kernel code runs with this user's rights{pidns}"


class SandboxUnavailable(RuntimeError):
    pass


# ---- what this host provides ------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def status() -> SandboxStatus:
    """Probe bwrap (namespaces, a fresh /proc, no network) and libseccomp, once per process."""
    if os.environ.get(DISABLE_VAR, "").lower() in ("off", "0", "no", "false"):
        return SandboxStatus("none", False, f"disabled by {DISABLE_VAR}={os.environ[DISABLE_VAR]}")
    ns_ok, ns_what = _probe_bwrap()
    sc_ok, sc_what = _probe_seccomp()
    pid_ok, pid_what, caps = _probe_runner_pidns(ns_ok)
    mechanism = " + ".join(w for ok, w in ((ns_ok, ns_what), (sc_ok, sc_what), (pid_ok, pid_what)) if ok) or "none"
    missing = [w for ok, w in ((ns_ok, ns_what), (sc_ok, sc_what)) if not ok]
    return SandboxStatus(mechanism, ns_ok and sc_ok, "; ".join(missing), namespaces=ns_ok, seccomp=sc_ok,
                         runner_pidns=pid_ok, runner_pidns_reason="" if pid_ok else pid_what, judge_caps=caps)


def require() -> SandboxStatus:
    s = status()
    if not s.available:
        raise SandboxUnavailable(f"--require-sandbox: the sandbox is not available on this host: {s.reason}")
    return s


def _bwrap() -> str | None:
    return shutil.which("bwrap")


def _probe_bwrap() -> tuple[bool, str]:
    exe = _bwrap()
    if exe is None:
        return False, "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        probe = subprocess.run(sandboxed_argv(["/bin/true"], readable=[], writable=[], _exe=exe),
                               capture_output=True, text=True, timeout=30, env=minimal_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bwrap does not run here: {exc}"
    if probe.returncode != 0:
        return False, f"bwrap cannot create namespaces here: {probe.stderr.strip()[:200] or probe.returncode}"
    return True, version or "bubblewrap"


def _probe_seccomp() -> tuple[bool, str]:
    try:
        import pyseccomp

        pyseccomp.SyscallFilter(pyseccomp.ALLOW)  # loads libseccomp and makes a filter (not installed)
    except (ImportError, OSError, AttributeError) as exc:
        return False, f"seccomp unavailable (pip install pyseccomp; apt-get install libseccomp2): {exc}"
    return True, "seccomp (libseccomp)"


# ---- a PID namespace per runner ------------------------------------------------------------------
# The judge's bwrap gives judge and runners one PID namespace; inside it a runner could still list its
# sibling and the judge in /proc and read their stat/schedstat (CPU time to the nanosecond: the pair
# order). So each runner starts under util-linux `unshare`: a PID namespace and a mount namespace of
# its own with a fresh /proc, where it is PID 1 and the only process. Where the judge holds
# CAP_SYS_ADMIN (root without bwrap, or bwrap --cap-add CAP_SYS_ADMIN in its own user namespace) no
# user namespace is needed; otherwise a nested user namespace maps the user to root in it (the runner
# drops every capability before its library loads: harden_process).

PIDNS_PROBE = "set -- /proc/[0-9]*; echo $#"  # processes visible in /proc: 2 (the init and the shell) when it holds
# PID 1 of the namespace is a shell that only waits for the runner, never the runner itself: the kernel
# drops the signals PID 1 sends itself without a handler, so a runner as PID 1 that calls abort() dies
# of SIGSEGV (glibc's fallback), and its raise() does nothing. The shell exits 128 + the signal that
# killed the runner (tools.runner._status reads it as that signal, as it does bwrap's).
PIDNS_INIT = ["/bin/sh", "-c", '"$@"; exit $?', "kloop-init"]
PIDNS_DEPTH = 2  # the runner is the wrapper's grandchild: unshare -> the init -> the runner


def _cap_sys_admin() -> bool:
    """CAP_SYS_ADMIN (bit 21) in this process's effective set (in its own user namespace)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 21 & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def runner_pidns_argv() -> list[str] | None:
    """The prefix that starts a runner in its own PID namespace (None: no `unshare` here). The real
    runner is the wrapper's only grandchild (PIDNS_DEPTH; tools/runner.Runner finds it)."""
    exe = shutil.which("unshare") or next((p for p in ("/usr/bin/unshare", "/bin/unshare") if os.access(p, os.X_OK)), None)
    if exe is None:
        return None
    user = [] if _cap_sys_admin() else ["--user", "--map-root-user"]
    return [exe, *user, "--pid", "--fork", "--mount-proc", "--kill-child", *PIDNS_INIT]


def runner_pidns_requested(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(RUNNER_PIDNS_VAR) == "1"


def _probe_runner_pidns(bwrap_ok: bool) -> tuple[bool, str, tuple[str, ...]]:
    """Whether a judge here can start its runners in PID namespaces of their own: (ok, what, the
    capabilities the judge's bwrap must keep). Run where the judge runs: inside bwrap when it works.
    KLOOP_RUNNER_PIDNS=off in the session's environment turns it off (and says so)."""
    if os.environ.get(RUNNER_PIDNS_VAR, "").lower() in ("off", "0", "no", "false"):
        return False, f"disabled by {RUNNER_PIDNS_VAR}={os.environ[RUNNER_PIDNS_VAR]}", ()
    prefix = runner_pidns_argv()
    if prefix is None:
        return False, "util-linux `unshare` is not installed", ()
    cmd = [sys.executable, "-c", _PIDNS_INNER]
    # unprivileged bwrap: a nested user namespace; bwrap as root: the judge keeps CAP_SYS_ADMIN in it
    tries = [((), cmd), (("CAP_SYS_ADMIN",), cmd)] if bwrap_ok else [((), cmd)]
    last = ""
    root = Path(__file__).resolve().parents[1]
    env = minimal_env({"PYTHONPATH": str(root)})
    for caps, cmd in tries:
        argv = sandboxed_argv(cmd, readable=[root / "tools"], cap_add=caps, env=env) if bwrap_ok else cmd
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            last = f"unshare does not run here: {exc}"
            continue
        if p.returncode == 0 and p.stdout.strip().splitlines()[-1:] == ["2"]:
            return True, "runner PID namespaces (unshare)", tuple(caps)
        last = (p.stderr.strip() or p.stdout.strip())[-200:] or f"exit {p.returncode}"
    return False, f"unshare cannot make a PID namespace here: {last}", ()


# what the probe runs where the judge would: the judge's own unshare prefix, around a count of /proc
_PIDNS_INNER = ("import subprocess, sys\n"
                "from tools.sandbox import runner_pidns_argv, PIDNS_PROBE\n"
                "p = subprocess.run([*runner_pidns_argv(), '/bin/sh', '-c', PIDNS_PROBE], capture_output=True, text=True)\n"
                "sys.stderr.write(p.stderr); print(p.stdout.strip()); sys.exit(p.returncode)\n")


# ---- the environment of every child -----------------------------------------------------------

def minimal_env(extra: Mapping[str, str] | None = None, *, home: str | os.PathLike | None = None,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An explicit environment: PATH, HOME (= scratch), LANG, TMPDIR and the CUDA/threading variables
    of INHERITED taken from `base` (default: this process's environment), then `extra`."""
    src = os.environ if base is None else base
    home = str(home) if home else "/tmp"
    path_dirs = [str(Path(sys.executable).parent)] + [d for d in SYSTEM_PATH.split(":")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if src.get(var):
            path_dirs.insert(0, str(Path(src[var]) / "bin"))
    env = {
        "PATH": ":".join(dict.fromkeys(path_dirs)),
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # who the process is, without a passwd lookup: in the sandbox no /etc/passwd names this uid, and
        # getpass.getuser() (torch's and Triton's cache folders) raises KeyError without these
        "USER": "kloop",
        "LOGNAME": "kloop",
    }
    env.update({k: src[k] for k in INHERITED if src.get(k)})
    env.update(extra or {})
    return env


# ---- the namespaces and the filesystem ---------------------------------------------------------

def toolchain_dirs() -> list[Path]:
    """What every sandboxed child may read: the system (/usr: compilers, CUDA, libraries), the Python
    that runs kloop with its site-packages, and a CUDA_HOME outside /usr."""
    dirs = [Path(sys.base_prefix), Path(sys.prefix)]
    for key in ("purelib", "platlib", "stdlib", "platstdlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.append(Path(p))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]))
    if os.environ.get("CXX"):
        dirs.append(Path(shutil.which(os.environ["CXX"]) or os.environ["CXX"]).resolve().parent)
    # where kloop's dependencies may live outside site-packages (a PYTHONPATH --target install)
    dirs += [Path(d) for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d and Path(d).is_dir()]
    return _outermost(d for d in dirs if not str(d.resolve()).startswith("/usr/"))


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """Existing resolved paths with those inside another one dropped."""
    out: list[Path] = []
    for p in sorted({Path(p).resolve() for p in paths if Path(p).exists()}, key=lambda p: len(p.parts)):
        if not any(p.is_relative_to(o) for o in out):
            out.append(p)
    return out


def sandboxed_argv(argv: list[str], *, readable: Iterable[Path] = (), writable: Iterable[Path] = (),
                   gpu: bool = False, cwd: Path | None = None, env: Mapping[str, str] | None = None,
                   cap_add: Iterable[str] = (), _exe: str | None = None) -> list[str]:
    """`argv` wrapped in bwrap: no network, own PID/IPC/UTS namespaces and a fresh /proc, the
    toolchain and `readable` read-only, only `writable` writable (a /dev/shm subfolder is fine),
    /tmp private, `env` (default minimal_env()) as the whole environment; `gpu` binds /dev/nvidia*
    and /sys; `cap_add`: capabilities kept inside (in the sandbox's own user namespace; the judge's
    CAP_SYS_ADMIN where runner PID namespaces need it). Raises SandboxUnavailable where bwrap is missing."""
    exe = _exe or _bwrap()
    if exe is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
    args = [exe, "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--unshare-net", "--unshare-pid", "--unshare-uts",
            "--unshare-cgroup-try"]
    for cap in cap_add:
        args += ["--cap-add", cap]
    if not gpu:  # CUDA IPC between the runner and the judge may need the host's IPC namespace
        args.append("--unshare-ipc")
    for top in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/", top)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            args += ["--ro-bind", str(p), str(p)]
    # the dynamic linker's cache (multiarch libraries) and `alternatives` (c++ -> g++); not /etc itself
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives"):
        args += ["--ro-bind-try", f, f]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    if gpu:
        args += ["--ro-bind-try", "/sys", "/sys"]
        for dev in sorted(Path("/dev").glob("nvidia*")):
            args += ["--dev-bind", str(dev), str(dev)]
        for f in ("/dev/dri",):
            args += ["--dev-bind-try", f, f]
    ro = _outermost([*toolchain_dirs(), *map(Path, readable)])
    rw = _outermost(map(Path, writable))
    for p in ro:
        if not any(p.is_relative_to(w) for w in rw):
            args += ["--ro-bind", str(p), str(p)]
    for p in rw:
        args += ["--bind", str(p), str(p)]
    args += ["--remount-ro", "/", "--clearenv"]  # the sandbox's own root (mount points) read-only too
    for k, v in (env if env is not None else minimal_env()).items():
        args += ["--setenv", k, v]
    if cwd is not None:
        args += ["--chdir", str(Path(cwd).resolve())]
    return [*args, "--", *argv]


def wrap(argv: list[str], *, readable: Iterable[Path] = (), writable: Iterable[Path] = (), gpu: bool = False,
         cwd: Path | None = None, env: Mapping[str, str] | None = None, cap_add: Iterable[str] = ()) -> list[str]:
    """`sandboxed_argv` where the host provides bwrap, else `argv` itself (status() says so loudly)."""
    if not status().namespaces:
        return list(argv)
    return sandboxed_argv(argv, readable=readable, writable=writable, gpu=gpu, cwd=cwd, env=env, cap_add=cap_add)


# ---- the syscall filter ------------------------------------------------------------------------

# denied with EPERM (a clear error in the candidate, not a crash of the runner)
DENIED_SYSCALLS = (
    "execve", "execveat", "fork", "vfork",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open", "pidfd_getfd",
    "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "adjtimex", "iopl", "ioperm",
    "perf_event_open", "quotactl", "name_to_handle_at", "open_by_handle_at",
    "pidfd_send_signal", "process_madvise", "process_mrelease", "tkill",
    # a runner's input arrives as a read-only descriptor of a 0400 file: its owner could chmod it back
    "chmod", "fchmod", "fchmodat", "fchmodat2",
)
# syscalls that name another process: allowed on this process only, so a runner can neither signal,
# stop, renice, re-pin nor re-limit the judge or the other runner. Signals: arg 0 must be this pid
# (glibc's raise() passes it); the others: arg 0 must be 0 ("this thread/process")
SIGNALS_TO_SELF_ONLY = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
PID_ZERO_ONLY = ("sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr", "prlimit64",
                 "migrate_pages", "move_pages")
# ... and by (which, who) in args 0 and 1: setpriority(PRIO_PROCESS, 0), ioprio_set(IOPRIO_WHO_PROCESS, 0) only
SELF_ONLY_BY_WHO = {"setpriority": 0, "ioprio_set": 1}
CLONE_THREAD = 0x00010000
AF_UNIX = 1
PR_SET_DUMPABLE = 4


def lockdown(*, allow_unix_sockets: bool = False, own_placement: bool = True) -> None:
    """Install the seccomp filter on every thread of this process (irreversible).

    Called in a runner after torch is imported and before the candidate's library is loaded. Denies
    exec, fork and clone without CLONE_THREAD (threads stay allowed), ptrace and process_vm_*,
    sockets (AF_UNIX too unless `allow_unix_sockets`), mounts and namespaces, keyrings, modules,
    bpf, io_uring, userfaultfd, perf events. clone3 answers ENOSYS so glibc falls back to clone,
    whose flags the filter can see. `own_placement=False`: sched_setaffinity denied even on this
    process (a CPU runner: the judge pins it per timed pair, tools/placement.py, and a runner that
    moved itself to the faster CPU would undo that). Raises SandboxUnavailable when libseccomp is missing."""
    try:
        import pyseccomp as sc
    except ImportError as exc:
        raise SandboxUnavailable(f"seccomp unavailable: {exc}") from None
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.CTL_TSYNC, 1)  # every thread torch already started, not only this one
    f.set_attr(sc.Attr.CTL_NNP, 1)
    eperm = sc.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        try:
            f.add_rule(eperm, name)
        except (OSError, ValueError, RuntimeError):  # a syscall this kernel/libseccomp does not know
            pass
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
    for name in SIGNALS_TO_SELF_ONLY:
        _add(f, eperm, name, sc.Arg(0, sc.NE, os.getpid()))
    for name in PID_ZERO_ONLY:
        if name == "sched_setaffinity" and not own_placement:
            _add(f, eperm, name)
        else:
            _add(f, eperm, name, sc.Arg(0, sc.NE, 0))
    for name, which in SELF_ONLY_BY_WHO.items():
        _add(f, eperm, name, sc.Arg(0, sc.NE, which))
        _add(f, eperm, name, sc.Arg(1, sc.NE, 0))
    f.add_rule(eperm, "prctl", sc.Arg(0, sc.EQ, PR_SET_DUMPABLE))  # harden_process() cannot be undone
    if allow_unix_sockets:
        f.add_rule(eperm, "socket", sc.Arg(0, sc.NE, AF_UNIX))
    else:
        f.add_rule(eperm, "socket")
    f.load()


def _add(f, action, name: str, *args) -> None:
    try:
        f.add_rule(action, name, *args)
    except (OSError, ValueError, RuntimeError):  # a syscall this kernel/libseccomp does not know
        pass


def keep_secrets_in() -> None:
    """This process (the session, which may hold an API key in its environment) not dumpable: its
    `/proc/<pid>/environ` and memory are closed to processes of the same user without
    CAP_SYS_PTRACE, hardened runners included, sandbox or not. What ssh-agent does for its keys.
    Capabilities are kept: the session is the user's own process."""
    import ctypes

    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def harden_process() -> None:
    """Make this process unreachable for its neighbours of the same user: not dumpable (its
    `/proc/<pid>/mem`, `fd/`, `environ` and `maps` need CAP_SYS_PTRACE, and nobody may ptrace it) and
    without capabilities (a runner started as root keeps none: no CAP_SYS_PTRACE to reach the
    others, no CAP_DAC_OVERRIDE to open a read-only input for writing, no CAP_SYS_ADMIN for
    `/proc/self/map_files`). Called by runners before the library loads and by the judge (CPU and
    CUDA tasks); lockdown() then forbids making the process dumpable again.

    Capabilities belong to threads: this drops the calling thread's. A runner drops them before it
    imports anything that starts threads (`drop_capabilities` at the top of tools/libhost.py), and
    `threads_with_capabilities` says whether any thread still has some."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    drop_capabilities()


def drop_capabilities() -> None:
    """Every capability of the calling thread (effective, permitted, inheritable) dropped; threads it
    starts afterwards inherit none. Called first thing in a runner, while it has a single thread."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3, all zero
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset (dropping every capability) failed")


def threads_with_capabilities(pid: int | str = "self") -> list[str]:
    """Threads of `pid` whose effective or permitted capability set is not empty, as 'tid (name): CapEff/CapPrm'."""
    found = []
    base = Path(f"/proc/{pid}/task")
    for tid in sorted(os.listdir(base)):
        try:
            fields = dict(line.split(":\t", 1) for line in (base / tid / "status").read_text().splitlines() if ":\t" in line)
        except OSError:  # the thread exited
            continue
        eff, prm = fields.get("CapEff", "0").strip(), fields.get("CapPrm", "0").strip()
        if int(eff, 16) or int(prm, 16):
            found.append(f"{tid} ({fields.get('Name', '?').strip()}): CapEff {eff}, CapPrm {prm}")
    return found


def lockdown_requested(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(LOCKDOWN_VAR) == "1"


def scrubbed_env(base: dict[str, str] | None = None, home: str | os.PathLike | None = None) -> dict[str, str]:
    """A runner's environment: the allow-list of tools/sandbox.py `minimal_env` (so no secret, whatever
    its name) plus kloop's own package on PYTHONPATH, then the session's own PYTHONPATH entries (where
    kloop's dependencies may live, e.g. a --target install): the child must import what the parent did."""
    src = os.environ if base is None else base
    paths = [str(Path(__file__).resolve().parents[1])] + [d for d in src.get("PYTHONPATH", "").split(os.pathsep) if d]
    return minimal_env({"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1"},
                       home=home, base=base)
