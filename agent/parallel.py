"""Judging several candidates at once: a pool of judges, each deciding one candidate at a time.

A session (agent/session.py `submit_batch`) hands a pool a list of jobs (a candidate's task files as
data, the paths it changed) and the best's files; every job is judged against that same best. The
session keeps the record, the branch and every verdict: a pool only returns verdicts as data, each
naming the worker that made it, or `None` for a job whose worker died or never answered (the session
records it as interrupted, never as a verdict).

- `LocalPool`: the session's own gate, one job after the other (the embedded default; no Ray).
- `RayPool`: one `JudgeActor` per exclusive slot, pinned by Ray resources: a GPU each for a CUDA task,
  one CPU (and, where the host has the cores, its own CPU affinity) for a CPU task, so timings never
  share a device. Each actor builds (so builds fan out over the workers), audits, checks and times
  in its own `Gate` over the trusted task files it was given as data, so the same code works on a
  local Ray (`--ray local`) and on a cluster (`--ray ADDRESS`). Ray is started with no secret in its
  environment: its workers (and everything they start) never see one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agent.gate import Candidate, Gate, GateConfig, Verdict
from tools.secrets import secrets_by_name


class PoolError(Exception):
    """A pool that cannot start (Ray missing or unreachable, no slot for a judge)."""


@dataclass
class JudgeJob:
    number: int  # the attempt number
    files: dict[str, bytes]  # the candidate's task folder (relative path -> bytes)
    changed: list[str]  # paths changed against the best (repository-relative, as the gate's scope reads them)
    look: int = 1  # which timed look at this best this decision is (the session counts them in the record)
    best_times: dict[str, float] = field(default_factory=dict)  # the best's recorded times (the sabotage check)


@dataclass
class JudgeResult:
    number: int
    verdict: Verdict | None  # None: interrupted (the worker died or never answered)
    worker: str
    problem: str = ""  # why there is no verdict


def task_files(folder: Path) -> dict[str, bytes]:
    """Every regular file of a task folder (no symlinks: the gate's scope refuses them anyway)."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not p.is_symlink() and "__pycache__" not in rel.parts and rel.parts[0] != ".git":
            out[rel.as_posix()] = p.read_bytes()
    return out


def write_files(folder: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = folder / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise ValueError(f"refusing to write {rel!r} outside {folder}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return folder


class JudgePool(Protocol):
    workers: int

    def judge(self, jobs: list[JudgeJob], best_files: dict[str, bytes], gate_seconds: float | None) -> list[JudgeResult]:
        """Every job against the same best; results in job order."""

    def close(self) -> None: ...


class LocalPool:
    """The session's gate, one job at a time (what a session without a pool does for one candidate)."""

    workers = 1

    def __init__(self, gate: Gate, best_build_of):
        self.gate, self._best = gate, best_build_of
        self.name = f"local@{socket.gethostname()}:{os.getpid()}"

    def judge(self, jobs, best_files, gate_seconds):
        best = self._best()
        out = []
        for job in jobs:
            if best is not None and best.lib:
                self.gate.remember_times(best.lib, job.best_times)
            with tempfile.TemporaryDirectory(prefix="kloop-cand-") as tmp:
                v = self.gate.evaluate(Candidate(write_files(Path(tmp), job.files), job.changed), best, max_seconds=gate_seconds,
                                       look=job.look)
            out.append(JudgeResult(job.number, v, self.name))
        return out

    def close(self) -> None:
        pass


# ---- Ray -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def _no_secrets_in_environ():
    """Ray's processes (raylet, workers) inherit this process's environment when it starts them."""
    saved = secrets_by_name()
    for k in saved:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        os.environ.update(saved)


class _JudgeActorImpl:
    """What runs in a Ray worker: a Gate over the trusted files, one decision at a time."""

    def __init__(self, name: str, trusted_files: dict[str, bytes], task_rel: str, config: dict, core: int | None):
        if core is not None and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {core})  # an exclusive CPU slot: the judge and its runners inherit it
        self.scratch = Path(tempfile.mkdtemp(prefix=f"kloop-{name}-"))
        trusted = write_files(self.scratch / "trusted", trusted_files)
        self.gate = Gate(trusted, task_rel, GateConfig.model_validate(config))
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.name = f"{name}@{socket.gethostname()}:{os.getpid()}" + (f" gpu {gpus}" if gpus else "") + (
            f" cpu {core}" if core is not None else "")
        self._best_key = None
        self._best = None

    def identity(self) -> str:
        return self.name

    def judge(self, number: int, files: dict[str, bytes], changed: list[str], best_files: dict[str, bytes],
              gate_seconds: float | None, look: int = 1, best_times: dict[str, float] | None = None) -> dict:
        key = hash(tuple(sorted((k, hash(v)) for k, v in best_files.items())))
        if key != self._best_key:  # the best, built here (the build cache makes a rebuild cheap)
            folder = write_files(Path(tempfile.mkdtemp(dir=self.scratch, prefix="best-")), best_files)
            self._best = self.gate.build(Candidate(folder, []))
            self._best_key = key
        if not self._best.ok:
            raise RuntimeError(f"the best does not build on {self.name}: {self._best.error_text()[:500]}")
        cand = write_files(Path(tempfile.mkdtemp(dir=self.scratch, prefix=f"cand-{number}-")), files)
        self.gate.remember_times(self._best.lib, best_times or {})
        v = self.gate.evaluate(Candidate(cand, changed), self._best, max_seconds=gate_seconds, look=look)
        return {"verdict": v.model_dump(mode="json"), "worker": self.name}


class RayPool:
    """`workers` judge actors on a local Ray (`address="local"`) or a running cluster (`address`)."""

    def __init__(self, address: str, workers: int, gate: Gate, timeout_s: float | None = None):
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - ray is a dependency
            raise PoolError(f"--ray needs the ray package ({exc})") from None
        if workers < 1:
            raise PoolError(f"--workers {workers}: at least 1")
        self.ray, self.workers, self.gate = ray, workers, gate
        task = gate.task
        self.cuda = task.on_gpu
        if not ray.is_initialized():
            with _no_secrets_in_environ():
                kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
                if address == "local":
                    cores = os.cpu_count() or 1
                    kwargs["num_cpus"] = max(cores, workers + 1)
                else:
                    kwargs["address"] = address
                try:
                    ray.init(**kwargs)
                except Exception as exc:
                    raise PoolError(f"--ray {address}: Ray did not start ({type(exc).__name__}: {exc})") from None
        m = task.manifest
        gate_s = gate.config.max_seconds
        # a decision's ceiling: the build, then the judge (check and timing), as the gate's own timeouts
        self.timeout_s = timeout_s or (m.timeout_s + 2 * m.timeout_s + 4 * gate_s + 120)
        self._trusted = task_files(gate.trusted_dir)
        self._actors: list = [None] * workers
        self._names: list[str] = [""] * workers
        cores = os.cpu_count() or 1
        self._cores = [i % cores for i in range(workers)] if not self.cuda and cores >= workers else [None] * workers
        for i in range(workers):
            self._start(i)

    def _start(self, i: int) -> None:
        ray = self.ray
        actor_cls = ray.remote(_JudgeActorImpl)
        res = dict(num_gpus=1, num_cpus=1) if self.cuda else dict(num_cpus=1)
        actor = actor_cls.options(**res, max_restarts=0).remote(
            f"judge-{i}", self._trusted, self.gate.task_rel, self.gate.config.model_dump(mode="json"), self._cores[i])
        try:
            self._names[i] = ray.get(actor.identity.remote(), timeout=max(60.0, self.timeout_s))
        except Exception as exc:
            raise PoolError(f"judge {i} did not start on Ray ({type(exc).__name__}: {str(exc)[:300]}); "
                            f"{'a CUDA task needs one GPU per worker' if self.cuda else 'each worker needs one CPU'}") from None
        self._actors[i] = actor

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def judge(self, jobs, best_files, gate_seconds):
        ray = self.ray
        results: dict[int, JudgeResult] = {}
        pending = list(jobs)
        running: dict[Any, tuple[int, JudgeJob, float]] = {}  # ref -> (slot, job, started)
        free = list(range(self.workers))
        while pending or running:
            while pending and free:
                slot, job = free.pop(0), pending.pop(0)
                ref = self._actors[slot].judge.remote(job.number, job.files, job.changed, best_files, gate_seconds,
                                                      job.look, job.best_times)
                running[ref] = (slot, job, time.monotonic())
            done, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            for ref in done:
                slot, job, _ = running.pop(ref)
                try:
                    data = ray.get(ref)
                    results[job.number] = JudgeResult(job.number, Verdict.model_validate(data["verdict"]), data["worker"])
                    free.append(slot)
                except Exception as exc:  # the actor died (kill -9, OOM, node lost) or raised
                    results[job.number] = JudgeResult(job.number, None, self._names[slot],
                                                      f"worker {self._names[slot]} died mid-decision "
                                                      f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]})")
                    self._replace(slot)
                    free.append(slot)
            now = time.monotonic()
            for ref, (slot, job, started) in list(running.items()):
                if now - started > self.timeout_s:
                    running.pop(ref)
                    results[job.number] = JudgeResult(job.number, None, self._names[slot],
                                                      f"worker {self._names[slot]} did not answer within "
                                                      f"{self.timeout_s:.0f} s (killed)")
                    self._replace(slot)
                    free.append(slot)
        return [results[j.number] for j in jobs]

    def _replace(self, slot: int) -> None:
        with contextlib.suppress(Exception):
            self.ray.kill(self._actors[slot], no_restart=True)
        self._start(slot)

    def close(self) -> None:
        for a in self._actors:
            with contextlib.suppress(Exception):
                self.ray.kill(a, no_restart=True)
        self._actors = []
