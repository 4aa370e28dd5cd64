"""Run the evaluation worker in its own process: scrubbed environment, timeout, own process group.

The worker's answer is read back from a file and parsed as data; its exit status, a signal or a
timeout become an error result. Secrets (API keys, tokens) never reach its environment.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from pydantic import ValidationError

from tools.proc import kill_group, tail
from tools.protocol import WorkerRequest, WorkerResult

PROJECT_ROOT = Path(__file__).resolve().parents[1]
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|SESSION)", re.I)


def scrubbed_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment minus anything that looks like a secret (and every ANTHROPIC_* variable)."""
    env = {k: v for k, v in (base if base is not None else os.environ).items()
           if not _SECRET_NAME.search(k) and not k.startswith("ANTHROPIC")}
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(PROJECT_ROOT) + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_worker(req: WorkerRequest, timeout: float, prefix: list[str] | None = None) -> WorkerResult:
    """Run one request in a fresh worker; `prefix` wraps the command (e.g. an ncu invocation)."""
    with tempfile.TemporaryDirectory(prefix="kloop-worker-") as tmp:
        req_path, out_path = Path(tmp, "request.json"), Path(tmp, "result.json")
        req_path.write_text(req.model_dump_json())
        cmd = [*(prefix or []), sys.executable, "-m", "tools.worker", str(req_path), str(out_path)]
        proc = subprocess.Popen(cmd, cwd=tmp, env=scrubbed_env(), stdin=subprocess.DEVNULL,
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
    if code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _tail(text, n: int = 1500) -> str:
    return tail(text, n, strip=True)
