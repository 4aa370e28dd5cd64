"""Run the evaluation worker in its own process: sandboxed, minimal environment, timeout, own group.

The worker's answer is read back from a file and parsed as data; its exit status, a signal or a
timeout become an error result. The worker runs in the sandbox of tools/sandbox.py where the host
provides it (no network, no other process visible, read-only files but its scratch, seccomp
lockdown before the candidate's library loads) with an allow-listed environment: secrets (API keys,
tokens) never reach it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
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


def run_worker(req: WorkerRequest, timeout: float, prefix: list[str] | None = None) -> WorkerResult:
    """Run one request in a fresh worker; `prefix` wraps the command (e.g. an ncu invocation)."""
    with tempfile.TemporaryDirectory(prefix="kloop-worker-") as tmp:
        req_path, out_path = Path(tmp, "request.json"), Path(tmp, "result.json")
        req_path.write_text(req.model_dump_json())
        cmd = [*(prefix or []), sys.executable, "-m", "tools.worker", str(req_path), str(out_path)]
        readable = [Path(req.task_dir)] + [Path(lib).resolve().parent for lib in req.libs]
        # a profiler prefix (ncu) injects into the worker and talks to it: no syscall filter then
        argv, env = runner_command(cmd, scratch=Path(tmp), readable=readable, lockdown=not prefix)
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_own_group_dies_with_parent)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            output = proc.communicate()[0]
            return WorkerResult(ok=False, error=f"timed out after {timeout:.0f} s (hang or far too slow); "
                                                f"output tail: {_tail(output)}")
        finally:
            kill_group(proc)  # nothing the kernel forked outlives the evaluation
        text = output.decode(errors="replace") if isinstance(output, bytes) else (output or "")
        if not out_path.is_file():
            return WorkerResult(ok=False, error=f"worker {_status(proc.returncode)} without an answer; "
                                                f"output tail: {_tail(text)}")
        try:
            result = WorkerResult.model_validate_json(out_path.read_text())
        except (ValidationError, ValueError) as exc:
            return WorkerResult(ok=False, error=f"worker answer unreadable: {str(exc)[:300]}")
        if proc.returncode != 0 and result.ok:
            return WorkerResult(ok=False, error=f"worker {_status(proc.returncode)} after answering")
        return result


def _own_group_dies_with_parent() -> None:
    """In the child: its own process group (so a timeout kills all it forked), and killed when the
    session that started it dies (kill -9 included), so no orphan keeps spinning on a core or GPU."""
    os.setsid()
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
