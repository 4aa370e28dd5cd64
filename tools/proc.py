"""Programs and processes: finding a tool, demangling names, killing a process group, tails of output.

One place for what build, sass, profile, device and the runner each used to write for themselves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Iterable, Mapping

from tools.sandbox import minimal_env

CUDA_BIN_DIRS = ("/usr/local/cuda/bin",)  # looked in after PATH and $CUDA_HOME/$CUDA_PATH


def find_program(name: str, env: Mapping[str, str] | None = None, extra_dirs: Iterable[Path | str] = (),
                 cuda_dirs: Iterable[Path | str] = CUDA_BIN_DIRS) -> str | None:
    """Path of executable `name`: on PATH, else in $CUDA_HOME/bin, $CUDA_PATH/bin, `cuda_dirs`
    (/usr/local/cuda/bin), else in `extra_dirs`; None when nowhere. `env` (default os.environ)
    supplies PATH and the CUDA homes."""
    e = os.environ if env is None else env
    found = shutil.which(name, path=e.get("PATH", os.defpath))
    if found:
        return found
    homes = [Path(h) / "bin" for h in (e.get("CUDA_HOME"), e.get("CUDA_PATH")) if h]
    for folder in [*homes, *map(Path, cuda_dirs), *map(Path, extra_dirs)]:
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def demangle(names: list[str]) -> dict[str, str]:
    """Demangled C++ names (mangled -> readable), in one c++filt call; {} when c++filt is absent or
    fails (callers keep the mangled names)."""
    mangled = [n for n in names if n.startswith("_Z")]
    cxxfilt = find_program("c++filt")
    if not mangled or cxxfilt is None:
        return {}
    try:
        proc = subprocess.run([cxxfilt], input="\n".join(mangled) + "\n", capture_output=True,
                              text=True, timeout=60, check=True, env=minimal_env())  # no secret reaches a child
    except (OSError, subprocess.SubprocessError):
        return {}
    out = proc.stdout.splitlines()
    return dict(zip(mangled, out)) if len(out) == len(mangled) else {}


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (started with start_new_session/setsid), else `proc` itself."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def tail(text: str | bytes | None, limit: int, strip: bool = False) -> str:
    """The last `limit` characters of `text` (bytes decoded leniently), '...' in front when cut."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = text or ""
    if strip:
        text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


MEMORY_WORDS = ("bad_alloc", "MemoryError", "Cannot allocate memory", "out of memory")


def exit_status(code: int | None, wrapped: bool = False) -> str:
    """A child's end in words. `wrapped`: the child ran under a wrapper that exits 128 + the signal
    that killed what it wraps (bwrap; a PID namespace's init shell), so such a code is that signal."""
    if code is None:
        return "did not finish"
    if code > 128 and wrapped:
        code = 128 - code
    if code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def memory_note(limit: int | None, peak_rss: int, output: str) -> str:
    """Why a failed process probably ran out of its memory limit ('' when nothing says so). One whose
    allocation is refused dies of the NULL pointer or of std::bad_alloc, or reports MemoryError; its
    peak resident memory then sits near the limit."""
    if not limit:
        return ""
    said = next((w for w in MEMORY_WORDS if w in output), None)
    if said is None and peak_rss < 0.8 * limit:
        return ""
    return (f"; it hit the worker memory limit of {limit / 2**30:.3g} GiB (memory_limit_gb in task.toml; "
            f"peak resident {peak_rss / 2**30:.2f} GiB{', ' + said if said else ''})")
