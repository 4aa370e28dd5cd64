"""One process per run: a lock in the run folder, held while `optimize` or `resume` runs a session.

Two processes on one run would write events with the same numbers and commit over each other, so
the second is refused, naming the holder. The lock itself is an OS file lock (`filelock`, flock on
`<run>/lock`): the kernel drops it when its process dies, however it dies, so a lock can only be
held by a live process. Beside it `<run>/lock.json` says who holds it (pid, host, since, command).
A `lock.json` whose lock is free was left by a process that died holding it: the next holder takes
over and the session records a note saying whose lock it took. Where the file lock is held but the
recorded holder is a dead process on this host (a child that inherited the lock outlived it), the
lock is stale too and is taken over.

Within one process the lock is re-entrant (one process per run, not one object): a `Session`
reopened by the process that already holds its run's lock shares that lock.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_FILE = "lock"
HOLDER_FILE = "lock.json"


class RunLocked(Exception):
    """The run is held by another live process; the message names it."""

    def __init__(self, message: str, holder: "Holder | None"):
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    since: str  # UTC, ISO 8601
    command: str = ""

    @classmethod
    def me(cls) -> "Holder":
        return cls(pid=os.getpid(), host=socket.gethostname(),
                   since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   command=" ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200])

    def alive(self) -> bool | None:
        """Whether the process still exists; None when it runs on another host (unknowable here)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} since {self.since}" + (f" ({self.command})" if self.command else "")


def read_holder(run_dir: Path) -> Holder | None:
    """Who `lock.json` says holds the run (None when there is no readable holder file)."""
    try:
        data = json.loads((Path(run_dir) / HOLDER_FILE).read_text(encoding="utf-8"))
        return Holder(pid=int(data["pid"]), host=str(data["host"]), since=str(data["since"]),
                      command=str(data.get("command", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


_held: dict[Path, "RunLock"] = {}  # the run locks this process holds, by run folder
_held_guard = threading.Lock()


class RunLock:
    """The lock of one run folder. `acquire()` returns a note when it took over a stale lock."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir).resolve()
        self._file = FileLock(str(self.run_dir / LOCK_FILE), timeout=0, thread_local=False)
        self._count = 0

    @classmethod
    def take(cls, run_dir: Path) -> tuple["RunLock", str | None]:
        """The run's lock for this process (shared if this process holds it already) and the
        stale-takeover note, if any. RunLocked when another live process holds it."""
        key = Path(run_dir).resolve()
        with _held_guard:
            lock = _held.get(key)
            if lock is None:
                lock = cls(key)
            note = lock.acquire()
            _held[key] = lock
        return lock, note

    @property
    def held(self) -> bool:
        return self._count > 0

    def acquire(self) -> str | None:
        if self._count:
            self._count += 1
            return None
        note = None
        try:
            self._file.acquire()
        except Timeout:
            holder = read_holder(self.run_dir)
            if holder is not None and holder.alive() is False:
                time.sleep(0.5)  # a new holder may have the lock and not have written its name yet
                if read_holder(self.run_dir) != holder:
                    holder = read_holder(self.run_dir)
            if holder is None or holder.alive() is not False:
                raise RunLocked(self._refusal(holder), holder) from None
            # the file lock outlived its recorded holder: stale; start over on a fresh lock file
            (self.run_dir / LOCK_FILE).unlink(missing_ok=True)
            try:
                self._file.acquire()
            except Timeout:
                raise RunLocked(self._refusal(read_holder(self.run_dir)), holder) from None
            note = self._takeover_note(holder)
        else:
            previous = read_holder(self.run_dir)
            if previous is not None and previous.pid != os.getpid():
                note = self._takeover_note(previous)
        me = Holder.me()
        tmp = self.run_dir / (HOLDER_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(me)) + "\n", encoding="utf-8")
        os.replace(tmp, self.run_dir / HOLDER_FILE)
        self._count = 1
        return note

    def release(self) -> None:
        """Give the lock up (the outermost release of this process does); idempotent."""
        with _held_guard:
            if self._count == 0:
                return
            self._count -= 1
            if self._count:
                return
            holder = read_holder(self.run_dir)
            if holder is not None and holder.pid == os.getpid():
                (self.run_dir / HOLDER_FILE).unlink(missing_ok=True)
            self._file.release()
            _held.pop(self.run_dir, None)

    def _refusal(self, holder: Holder | None) -> str:
        who = holder.describe() if holder else "another process (it has not said who yet)"
        return (f"run {self.run_dir.name} is in use by {who}; one process per run. "
                f"Wait for it to end or stop it, then try again (its lock: {self.run_dir / LOCK_FILE})")

    @staticmethod
    def _takeover_note(previous: Holder) -> str:
        alive = previous.alive()
        state = "is gone" if alive is False else "no longer holds it" if alive else "did not release it"
        return f"took over the run's lock from {previous.describe()}: that process {state}"
