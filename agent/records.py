"""Run records: `runs/<run-id>/` written ahead of every action (DESIGN.md, invariant 4).

    runs/<run-id>/run.json          RunInfo: task, policy, config, base commit, branch, versions, GPU
    runs/<run-id>/events.jsonl      one pydantic event per line, append-only, seq 0, 1, 2, ...
    runs/<run-id>/attempts/NNN.patch  the patch of attempt NNN (atomic: tmp, fsync, rename)

`RunRecord.append` writes one line and fsyncs it before returning, so an event that `append`
returned is on disk, and the action it announces may take effect. A session killed at any instant
leaves at most a torn last line: readers ignore it (and report it in `read()`); the next writer
moves it aside (`events.jsonl.torn`) before appending. Readers never modify a record, so
`kloop runs`/`show` may read a record that a live session is writing.

No secret ever reaches a record: every value written (events, run.json, patches) is scrubbed of
the values of every environment variable tools/secrets.py calls secret (ANTHROPIC_API_KEY, names
with KEY, TOKEN, SECRET, PASSWORD, ...), by its one scrubber (`tools.secrets.SecretScrubber`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agent.run_state import RunState
from tools.fmt import json_safe, real
from tools.secrets import SecretScrubber  # the one scrubber (records name what they redacted)

log = logging.getLogger(__name__)

RUN_JSON = "run.json"
EVENTS = "events.jsonl"
TORN = "events.jsonl.torn"
ATTEMPTS = "attempts"
ENCODING = "utf-8"
ERRORS = "surrogateescape"  # patches round-trip bytes that are not UTF-8 (see agent.workspace)


class RecordError(Exception):
    """A run record that cannot be read or written; the message names the file and the line."""


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


# --------------------------------------------------------------------------------------------
# secrets
# --------------------------------------------------------------------------------------------

class SecretLeak(RecordError):
    """A secret survived scrubbing (should not happen); nothing was written."""


def _scrubbed_json(data: Any, where: str) -> tuple[str, list[str]]:
    scrubber = SecretScrubber.from_env()
    clean, hits = scrubber.scrub(data)
    # strict JSON: a figure that is NaN or Inf (a failed measurement) is written as null, never as a bare
    # NaN that other JSON readers (browsers, jq) refuse
    line = json.dumps(json_safe(clean), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # one event, one line, for any reader: the line breaks JSON leaves raw (U+0085, U+2028, U+2029) escaped
    line = line.replace("\u0085", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    left = scrubber.find(line)
    if left:
        raise SecretLeak(f"{where}: the value of {', '.join(left)} would have been written; refused")
    if hits:
        log.warning("%s: redacted the value of %s", where, ", ".join(hits))
    return line, hits


# --------------------------------------------------------------------------------------------
# run.json
# --------------------------------------------------------------------------------------------


class Versions(BaseModel):
    """Where the numbers come from (invariant 5). Unknown entries are kept (extra allowed)."""

    model_config = ConfigDict(extra="allow")

    kloop: str | None = None
    python: str | None = None
    torch: str | None = None
    compiler: str | None = None  # e.g. "nvcc 12.6.85" or "g++ 13.2"
    driver: str | None = None
    cuda: str | None = None
    git: str | None = None


class Client(BaseModel):
    """An agent that drove the run over MCP, as its `initialize` named itself."""

    model_config = ConfigDict(extra="allow")

    name: str
    version: str | None = None
    via: str = "mcp"
    first_seen: datetime = Field(default_factory=lambda: utc_now())


class RunInfo(BaseModel):
    """run.json: everything needed to understand, resume and replay a run."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = 1
    run_id: str
    task: str  # task name (manifest)
    task_rel: str  # task folder relative to the repository root
    task_path: Path  # task folder, absolute (in the user's checkout)
    policy: str
    config: dict[str, Any] = Field(default_factory=dict)  # budget, knobs, flags as launched
    base_commit: str
    branch: str
    repo_root: Path
    worktree: Path
    started_at: datetime = Field(default_factory=utc_now)
    versions: Versions = Field(default_factory=Versions)
    gpu: str | None = None  # e.g. "NVIDIA H200"; None for CPU tasks
    machine: dict[str, Any] = Field(default_factory=dict)  # hostname, clocks, cores, ... as known
    # what isolates untrusted kernel code here (tools/sandbox.py SandboxStatus): mechanism, available, reason
    sandbox: dict[str, Any] = Field(default_factory=dict)
    # why the baseline has not been measured yet (e.g. "no CUDA device here": a session started on a
    # workstation without the GPU); None once it is measured. `kloop resume` on the device measures it.
    baseline_pending: str | None = None
    # who drove it over MCP (client name/version from `initialize`), in the order they came; the
    # policy says what started it ("cli", "claude", "mcp:<client>")
    clients: list[Client] = Field(default_factory=list)


# --------------------------------------------------------------------------------------------
# events
# --------------------------------------------------------------------------------------------


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seq: int = -1  # assigned by RunRecord.append
    t: datetime = Field(default_factory=utc_now)


class SessionStarted(_Event):
    kind: Literal["session_started"] = "session_started"
    resumed: bool = False
    pid: int = Field(default_factory=os.getpid)
    host: str = Field(default_factory=lambda: os.uname().nodename)


class Baseline(_Event):
    kind: Literal["baseline"] = "baseline"
    commit: str | None = None
    figures: dict[str, Any] = Field(default_factory=dict)


class AttemptStarted(_Event):
    kind: Literal["attempt_started"] = "attempt_started"
    attempt: int
    title: str
    rationale: str = ""
    patch: str | None = None  # path relative to the run folder, e.g. attempts/003.patch
    knobs: dict[str, Any] = Field(default_factory=dict)
    gate_seconds: float | None = None  # this decision's timing cap, when the agent asked for one (submit --gate-seconds)
    best_commit: str | None = None  # the best it was judged against


class Verdict(_Event):
    kind: Literal["verdict"] = "verdict"
    attempt: int
    accepted: bool
    reason: str
    figures: dict[str, Any] = Field(default_factory=dict)  # speedup, ci, per-shape times, ...
    worker: str | None = None  # the judge that decided (agent/parallel.py: name@host:pid), when a pool did


class Committed(_Event):
    kind: Literal["committed"] = "committed"
    attempt: int
    commit: str


class Restored(_Event):
    kind: Literal["restored"] = "restored"
    to: str
    attempt: int | None = None


class ToolCall(_Event):
    kind: Literal["tool_call"] = "tool_call"
    name: str
    input: Any = None  # as the policy sent it (the trajectory stays replayable)
    ok: bool = True
    duration_s: float = 0.0
    error: str | None = None
    turn: int | None = None
    id: str | None = None  # the tool_use id
    event: str | None = None  # a state change the tool made (accepted, rejected, reverted)
    data: dict[str, Any] | None = None
    text: str = ""  # the start of what the model was shown


class LlmTurn(_Event):
    kind: Literal["llm_turn"] = "llm_turn"
    turn: int
    usage: dict[str, Any] = Field(default_factory=dict)
    cost_usd: float = 0.0
    total_cost_usd: float | None = None
    stop_reason: str | None = None
    model: str | None = None
    retries: int = 0
    tool_calls: list[str] = Field(default_factory=list)
    text: str = ""  # the start of the model's text


class LlmRetry(_Event):
    kind: Literal["llm_retry"] = "llm_retry"
    turn: int
    attempt: int
    wait_s: float
    error: str


class ContextCleared(_Event):
    kind: Literal["context_cleared"] = "context_cleared"
    turn: int
    context_tokens: int
    cleared: int


class PolicyStop(_Event):
    kind: Literal["policy_stop"] = "policy_stop"
    reason: str
    turns: int = 0
    cost_usd: float = 0.0


class Note(_Event):
    kind: Literal["note"] = "note"
    text: str
    data: dict[str, Any] = Field(default_factory=dict)


class SessionEnded(_Event):
    kind: Literal["session_ended"] = "session_ended"
    reason: str


Event = Annotated[
    Union[
        SessionStarted, Baseline, AttemptStarted, Verdict, Committed, Restored, ToolCall, LlmTurn, LlmRetry,
        ContextCleared, PolicyStop, Note, SessionEnded,
    ],
    Field(discriminator="kind"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_KINDS = {
    cls.model_fields["kind"].default: cls
    for cls in (SessionStarted, Baseline, AttemptStarted, Verdict, Committed, Restored, ToolCall, LlmTurn, LlmRetry,
                ContextCleared, PolicyStop, Note, SessionEnded)
}


def make_event(kind: str, **data: Any) -> _Event:
    """An event from its kind and fields (what `PolicyContext.log(kind, **data)` needs)."""
    try:
        return EVENT_ADAPTER.validate_python({"kind": kind, **data})
    except ValidationError as exc:
        raise RecordError(f"invalid {kind!r} event: {exc}") from None


class Torn(BaseModel):
    """The incomplete last line of events.jsonl (a write interrupted by a kill)."""

    offset: int  # byte offset where it starts
    length: int
    preview: str


# --------------------------------------------------------------------------------------------
# the record
# --------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


class RunRecord:
    """One run's folder. Create it once (`create`), reopen it to read or resume (`open`)."""

    def __init__(self, run_dir: Path, info: RunInfo):
        self.dir = Path(run_dir)
        self.info = info
        self._lock = threading.Lock()
        self._next_seq: int | None = None  # known after the first append
        self.repaired: Torn | None = None  # a torn tail moved aside by this writer

    @property
    def events_path(self) -> Path:
        return self.dir / EVENTS

    @property
    def attempts_dir(self) -> Path:
        return self.dir / ATTEMPTS

    # -- creation ------------------------------------------------------------------------------
    @classmethod
    def create(cls, runs_root: Path, run_info: RunInfo) -> "RunRecord":
        run_dir = Path(runs_root) / run_info.run_id
        try:
            run_dir.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise RecordError(f"{run_dir} already exists (run id reused?)") from None
        (run_dir / ATTEMPTS).mkdir()
        rec = cls(run_dir, run_info)
        rec.write_info(run_info)
        (run_dir / EVENTS).touch()
        _fsync_dir(run_dir)
        _fsync_dir(run_dir.parent)
        rec._next_seq = 0
        return rec

    @classmethod
    def open(cls, run_dir: Path) -> "RunRecord":
        run_dir = Path(run_dir)
        path = run_dir / RUN_JSON
        if not path.is_file():
            raise RecordError(f"{run_dir}: not a run record (no {RUN_JSON})")
        try:
            info = RunInfo.model_validate_json(path.read_bytes())
        except ValidationError as exc:
            raise RecordError(f"{path}: invalid run info: {exc}") from None
        return cls(run_dir, info)

    def write_info(self, info: RunInfo) -> None:
        """Replace run.json atomically (scrubbed of secrets)."""
        text, _ = _scrubbed_json(info.model_dump(mode="json"), f"{self.dir / RUN_JSON}")
        data = json.dumps(json.loads(text), indent=2, ensure_ascii=False) + "\n"
        _atomic_write(self.dir / RUN_JSON, data.encode(ENCODING))
        self.info = RunInfo.model_validate_json(data)

    # -- events --------------------------------------------------------------------------------
    def read(self) -> tuple[list[Event], Torn | None]:
        """All complete events, and the torn last line if the file ends in one.

        A line that is complete (newline-terminated) but not a valid event is corruption, not an
        interrupted write: RecordError naming the line.
        """
        try:
            data = self.events_path.read_bytes()
        except FileNotFoundError:
            return [], None
        end = data.rfind(b"\n") + 1
        torn = None
        if end < len(data):
            tail = data[end:]
            torn = Torn(offset=end, length=len(tail), preview=tail[:120].decode(ENCODING, "replace"))
        events: list[Event] = []
        for no, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
            if not line.strip():
                continue
            try:
                events.append(EVENT_ADAPTER.validate_json(line))
            except ValidationError as exc:
                raise RecordError(f"{self.events_path}:{no}: not a valid event: {exc}") from None
        return events, torn

    def events(self) -> list[Event]:
        """All complete events; a torn last line is ignored and reported in the log."""
        events, torn = self.read()
        if torn is not None:
            log.warning(
                "%s: ignoring an incomplete last line (%d bytes at offset %d; an interrupted write): %r",
                self.events_path, torn.length, torn.offset, torn.preview,
            )
        return events

    def _prepare_append(self) -> None:
        """Before this writer's first append: move a torn tail aside, learn the next seq."""
        events, torn = self.read()
        if torn is not None:
            with open(self.events_path, "rb+") as f:
                f.seek(torn.offset)
                tail = f.read()
                with open(self.dir / TORN, "ab") as aside:
                    aside.write(tail + b"\n")
                    aside.flush()
                    os.fsync(aside.fileno())
                f.truncate(torn.offset)
                f.flush()
                os.fsync(f.fileno())
            self.repaired = torn
            log.warning("%s: moved an incomplete last line (%d bytes) to %s", self.events_path, torn.length, TORN)
        self._next_seq = (events[-1].seq + 1) if events else 0

    def append(self, event: _Event) -> _Event:
        """Write `event` (seq assigned, secrets redacted) as one line, flushed and fsynced before
        returning; returns the event as written."""
        if not isinstance(event, _Event):
            raise TypeError(f"append takes an event model, got {type(event).__name__}")
        with self._lock:
            if self._next_seq is None:
                self._prepare_append()
            assert self._next_seq is not None
            data = event.model_dump(mode="json")
            data["seq"] = self._next_seq
            if "t" not in event.model_fields_set:
                data["t"] = utc_now().isoformat().replace("+00:00", "Z")
            line, hits = _scrubbed_json(data, str(self.events_path))
            written = EVENT_ADAPTER.validate_json(line)
            payload = (line + "\n").encode(ENCODING)
            fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                view = memoryview(payload)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
            self._next_seq += 1
            return written

    def log(self, kind: str, **data: Any) -> _Event:
        """`append(make_event(kind, **data))`."""
        return self.append(make_event(kind, **data))

    # -- patches -------------------------------------------------------------------------------
    def patch_path(self, n: int) -> Path:
        return self.attempts_dir / f"{n:03d}.patch"

    def write_patch(self, n: int, text: str) -> Path:
        """Write attempt n's patch atomically (tmp file, fsync, rename); secrets are redacted
        (a patch that carried one must never be replayed anyway)."""
        clean, hits = SecretScrubber.from_env().scrub_text(text)
        if hits:
            log.warning("attempt %d patch: redacted the value of %s", n, ", ".join(hits))
        self.attempts_dir.mkdir(exist_ok=True)
        path = self.patch_path(n)
        _atomic_write(path, clean.encode(ENCODING, ERRORS))
        return path

    def read_patch(self, n: int) -> str:
        return self.patch_path(n).read_bytes().decode(ENCODING, ERRORS)


# --------------------------------------------------------------------------------------------
# listing and naming runs
# --------------------------------------------------------------------------------------------


class RunSummary(BaseModel):
    run_id: str
    task: str | None = None
    policy: str | None = None
    started_at: datetime | None = None
    attempts: int = 0
    accepted: int = 0
    best_speedup: float | None = None  # largest figures["speedup"] among accepted verdicts
    last_event_at: datetime | None = None
    ended: bool = False
    end_reason: str | None = None
    torn: bool = False  # the events file ends in an incomplete line
    error: str | None = None  # why the record could not be read


def summarize(record: RunRecord) -> RunSummary:
    info = record.info
    s = RunSummary(run_id=info.run_id, task=info.task, policy=info.policy, started_at=info.started_at)
    try:
        events, torn = record.read()
    except RecordError as exc:
        s.error = str(exc)
        return s
    s.torn = torn is not None
    state = RunState.fold(events)
    s.attempts, s.accepted = len(state.attempts), len(state.accepted)
    s.ended, s.end_reason = state.ended is not None, state.ended
    s.last_event_at = state.last_event_at
    speedups = [sp for a in state.accepted if (sp := real(a.figures.get("speedup"))) is not None and sp > 0]
    s.best_speedup = max(speedups) if speedups else None
    return s


def list_runs(runs_root: Path) -> list[RunSummary]:
    """Summaries of the runs under `runs_root`, oldest first (run ids sort by time)."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and (p / RUN_JSON).exists()):
        try:
            out.append(summarize(RunRecord.open(d)))
        except RecordError as exc:
            out.append(RunSummary(run_id=d.name, error=str(exc)))
    return out


def _slug(name: str, limit: int = 32) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return s[:limit].strip("-") or "task"


def new_run_id(task_name: str, now: datetime | None = None) -> str:
    """`20261129-091500-softmax-3fa2`: UTC second, task slug, 4 random hex digits (sortable by
    time; unique in practice; `RunRecord.create` refuses a folder that exists)."""
    when = (now or utc_now()).astimezone(timezone.utc)
    return f"{when:%Y%m%d-%H%M%S}-{_slug(task_name)}-{secrets.token_hex(2)}"
