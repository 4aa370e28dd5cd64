"""The judge: `python -m tools.worker REQUEST.json RESULT.json` — the trusted side of an evaluation.

It loads the trusted manifest and spec from the request's task folder, draws the inputs from the
secret seed, computes the references, compares, times and does the statistics, and writes a
`WorkerResult` as JSON. It loads NO untrusted code: every library (the candidate, the best) is loaded
by its own runner process (tools/libhost.py via tools/runner.py), which only calls `spec.launch` on
buffers this process allocated and answers with plain data. The judge itself still runs in its own
process (tools/judge_handle.run_worker), so a runaway evaluation costs one evaluation, never the session.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tools.task import load_task
from tools.protocol import WorkerRequest, WorkerResult
from tools.spec import load_spec

LOAD_TIMEOUT_S = 120.0  # a runner's start: python, torch (and CUDA) import, the library's load
# Written beside RESULT.json once the runners hold their libraries: the request's own timeout (the
# manifest's timeout_s) counts from here, so a start-up slowed by load never eats the work's seconds
# (tools/judge_handle._wait). A runner cannot write it (it sees only its own scratch).
LOADED_FILE = "loaded"


def call_timeout(task) -> float:
    """Seconds one request to a runner may take before it counts as a hang."""
    return max(5.0, 0.4 * task.manifest.timeout_s)


class Judge:
    """The judge's processes and buffers for one request: a runner per library, the arena, the timer.
    Constructing it starts the runners (their torch import overlaps the judge's own set-up);
    `prepare()` has them set up their device, the trusted spec and their seccomp filter before any
    library is named: all a pre-started standby does before it waits for its request."""

    def __init__(self, task, names: list[str], scratch: Path):
        from tools.runner import Runner

        self.task = task
        self.scratch = scratch
        # the runners first: their torch import overlaps ours (torch is imported here, not at the top)
        self.runners = {n: Runner(scratch, n) for n in names}
        import torch

        from tools.device import describe
        from tools.remote import SharedArena
        from tools.timing import Timer

        self.device = torch.device("cuda" if task.on_gpu else "cpu")
        self.arena = SharedArena(self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(0)
            torch.zeros(1, device=self.device)  # the CUDA context, now rather than at the first input
        else:  # no idle OpenMP threads of ours competing with the timed calls
            torch.set_num_threads(1)
        # out of the runners' reach (/proc/<judge>/mem, fd/): the seed, references and verdict live here. On CUDA
        # too: buffers reach a runner as VMM descriptors over a socket (tools/vmm.py), which need no ptrace access
        # to the exporter (torch's CUDA IPC handles, which might, are never sent)
        from tools.sandbox import harden_process

        harden_process()
        self.info = describe(self.device)
        self.spec = load_spec(task.spec_path)
        self.timer = Timer(self.device)

    def prepare(self) -> None:
        for r in self.runners.values():
            r.prepare(self.task.spec_path, self.device.type, LOAD_TIMEOUT_S)

    def close(self) -> None:
        for r in self.runners.values():
            r.close()
        self.arena.close()


def runner_names(kind: str, libs: list[str]) -> list[str]:
    if kind == "bench" and len(libs) > 1:  # a sweep: one runner per library, each library in its own process
        return [f"cand{i}" for i in range(len(libs))]
    return {"check": ["cand"], "bench": ["cand"] if libs else [], "ab": ["best", "cand"],
            "gate": ["best", "cand"], "e2e": ["cand"]}.get(kind, [])


def serve(req: WorkerRequest, judge: Judge | None = None, loaded_marker: Path | None = None) -> WorkerResult:
    """Answer one request; `judge`: a pre-started one (standby) whose runners hold no library yet;
    `loaded_marker`: a file written once every library is loaded (the work's timeout starts there)."""
    task = load_task(req.task_dir) if judge is None else judge.task
    if task.on_gpu:
        import torch

        if not torch.cuda.is_available():
            return WorkerResult(ok=False, error="this task needs a CUDA GPU and none is visible here")
    names = runner_names(req.kind, req.libs)
    stages: dict[str, float] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kloop-judge-") as scratch:
        if judge is None:
            judge = Judge(task, names, Path(scratch))  # starts the runners, then imports torch
        else:
            if set(names) - set(judge.runners):  # a standby holds "best" and "cand" only
                raise ValueError(f"a pre-started judge cannot serve runners {sorted(set(names) - set(judge.runners))}")
            for n in [n for n in judge.runners if n not in names]:  # pre-started, never given a library
                judge.runners.pop(n).close()
        from tools.remote import RemoteLib, RunnerError, start_runners

        device = judge.device
        runners, arena, timer, spec, info = judge.runners, judge.arena, judge.timer, judge.spec, judge.info
        try:
            stages["start"] = round(time.monotonic() - t0, 3)
            t1 = time.monotonic()
            libs = [RemoteLib(runners[n], arena, device, timer, call_timeout(task), task.manifest.threads) for n in names]
            many = req.kind == "bench" and len(req.libs) > 1
            load_errors: list[str | None] = [None] * len(libs)
            for i, (lib, path) in enumerate(zip(libs, req.libs)):
                try:
                    lib.load(task.spec_path, path, LOAD_TIMEOUT_S)
                except RunnerError as exc:
                    if not many:
                        return WorkerResult(ok=False, device=info, error=f"the library did not load: {exc}", stage_seconds=stages)
                    load_errors[i] = f"the library did not load: {exc}"  # that library's row only
            stages["load"] = round(time.monotonic() - t1, 3)
            if loaded_marker is not None:
                loaded_marker.write_text(f"{time.monotonic() - t0:.3f}\n")

            def result(**kw) -> WorkerResult:
                return WorkerResult(device=info, stage_seconds=stages, **kw)

            check = None
            if req.kind in ("check", "gate"):
                from tools.check import check_in_process

                def relaunch():  # a fresh runner with the same library (fault diagnosis)
                    # Not in a PID namespace of its own (the diagnosis is CPU-only): a CPU judge has dropped the capabilities `unshare`
                    # needs (harden_process), and a diagnosis only names what already failed (the
                    # verdict is a rejection, nothing is timed after it). bwrap, seccomp and
                    # harden_process still hold for this runner as for the others.
                    r = start_runners([f"diagnose{len(runners)}"], judge.scratch, pidns=False)
                    runners.update(r)
                    lib = RemoteLib(next(iter(r.values())), arena, device, timer, call_timeout(task), task.manifest.threads)
                    lib.load(task.spec_path, cand_lib, LOAD_TIMEOUT_S)
                    return lib

                cand_lib = req.libs[-1]
                t2 = time.monotonic()
                report = check_in_process(task, spec, libs[-1], req.check_shapes or req.shapes, req.seed, req.rounds,
                                          device, arena, relaunch)
                stages["check"] = round(time.monotonic() - t2, 3)
                if req.kind == "check" or not report.passed:
                    return result(ok=True, check=report)
                check = report
            if req.kind == "e2e":
                from tools.e2e import e2e_in_process

                t2 = time.monotonic()
                report = e2e_in_process(task, spec, libs[0], req.seed, device, arena)
                stages["e2e"] = round(time.monotonic() - t2, 3)
                return result(ok=True, e2e=report)
            if many:  # a sweep's libraries timed one after another in this one judge, each in its runner
                from tools.bench import bench_in_process

                t2 = time.monotonic()
                benches, errors = [], []
                for lib, load_error in zip(libs, load_errors):
                    report, error = None, load_error
                    if error is None:
                        try:
                            report = bench_in_process(task, spec, lib, req.shapes, req.seed, device, req.max_seconds,
                                                      req.comparators, arena, timer)
                        except RunnerError as exc:  # it crashed or hung: its row says so, the others are timed
                            error = f"timing stopped: {exc}"
                        finally:
                            lib.runner.close()  # done with: its process (and memory) gone before the next is timed
                    benches.append(report)
                    errors.append(error)
                stages["timing"] = round(time.monotonic() - t2, 3)
                return result(ok=True, benches=benches, bench_errors=errors)
            if req.kind == "bench":
                from tools.bench import bench_in_process

                t2 = time.monotonic()
                report = bench_in_process(task, spec, libs[0] if libs else None, req.shapes, req.seed, device,
                                          req.max_seconds, req.comparators, arena, timer)
                stages["timing"] = round(time.monotonic() - t2, 3)
                return result(ok=True, bench=report)
            if req.kind in ("ab", "gate"):
                from tools.ab import ab_in_process, decision_rules

                seed = req.timing_seed if req.kind == "gate" else req.seed
                trials = max(1, req.trials) if req.kind == "ab" else 1
                seeds = random.Random(seed).sample(range(1 << 62), trials) if trials > 1 else [seed]
                reports, trial_seconds = [], []
                t2 = time.monotonic()
                try:
                    for s in seeds:
                        t3 = time.monotonic()
                        if req.trials_seconds and reports and t3 - t2 > req.trials_seconds:
                            break  # the benchmark's time budget: the trials done so far are the answer
                        reports.append(ab_in_process(task, spec, libs[0], libs[1], req.shapes, s, device,
                                                     req.max_seconds, decision_rules(req), req.weights, arena,
                                                     look=req.look, placement=req.cpu_placement,
                                                     cuda_placement=req.cuda_placement,
                                                     cuda_request_s=req.cuda_request_s))
                        trial_seconds.append(round(time.monotonic() - t3, 3))
                except RunnerError as exc:
                    stages["timing"] = round(time.monotonic() - t2, 3)
                    return result(ok=False, check=check, error=f"timing stopped: {exc}")
                stages["timing"] = round(time.monotonic() - t2, 3)
                _timing_structure(reports, libs[1])
                audit = cpu_audit(runners, task.manifest.threads) if device.type == "cpu" else []
                e2e = None
                if req.kind == "gate" and req.e2e and task.manifest.e2e and reports[0].speedup_lo > 1 + req.min_gain:
                    from tools.e2e import e2e_in_process

                    t2 = time.monotonic()
                    e2e = e2e_in_process(task, spec, libs[1], req.e2e_seed, device, arena)
                    stages["e2e"] = round(time.monotonic() - t2, 3)
                return result(ok=True, check=check, ab=reports[0], warnings=audit, e2e=e2e,
                              trials=reports if trials > 1 else [], trial_seconds=trial_seconds if trials > 1 else [])
            return result(ok=True)  # probe
        finally:
            judge.close()


def _timing_structure(reports: list, cand) -> None:
    """How the time was read, and where the candidate runner's CPU went (tools/remote.RemoteLib)."""
    for r in reports:
        r.measure = cand.measure
    if cand.cuda or not reports:
        return
    reports[0].cpu_in_samples_b = sum(c for _, c in cand.sample_cpu)
    reports[0].cpu_between_requests_b = cand.after_return_ns * 1e-9
    reports[0].max_parallelism_b = max((c / w for w, c in cand.sample_cpu if w > 0), default=None)
    reports[0].cpu_unattributed_b = cand.unattributed_ns() * 1e-9


def cpu_audit(runners: dict, allowed: int = 1) -> list[str]:
    """Threads the runners hold beyond what the manifest allows (`threads`, the main thread included)."""
    out = []
    for name, r in runners.items():
        n = r.threads()
        if n > allowed and r.proc.poll() is None:
            out.append(f"{name} runner holds {n} threads")
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[1] == "--standby":
        return standby(Path(argv[2]), Path(argv[3]), Path(argv[4]))
    if len(argv) != 3:
        print("usage: python -m tools.worker REQUEST.json RESULT.json\n"
              "       python -m tools.worker --standby TASK_DIR SCRATCH RESULT.json  (request on stdin)", file=sys.stderr)
        return 2
    req_path, out_path = Path(argv[1]), Path(argv[2])
    try:
        req = WorkerRequest.model_validate_json(req_path.read_text())
        req_path.unlink()  # the request holds the gate's seed: gone before any untrusted code loads
        result = serve(req, loaded_marker=out_path.parent / LOADED_FILE)
    except Exception as exc:
        result = _failure(exc)
    _answer(result, out_path)
    return 0


READY_FILE = "ready"


def standby(task_dir: Path, scratch: Path, out_path: Path) -> int:
    """A pre-started judge (tools/judge_handle.JudgeStandby): torch imported (and the CUDA context made),
    both runners started, prepared and locked down, no library loaded; then `ready` is written in
    `scratch` and the request (with its seeds) is read from stdin, sent only at decision time.
    Stdin closed without a request: exit without answering (the standby was not needed)."""
    t0 = time.monotonic()
    try:
        task = load_task(task_dir)
        judge = Judge(task, ["best", "cand"], scratch)
    except Exception as exc:
        _answer(_failure(exc), out_path)
        return 0
    try:
        judge.prepare()
        warmed = time.monotonic() - t0
        (scratch / READY_FILE).write_text(f"{warmed:.3f}\n")
        data = sys.stdin.buffer.read()
        if not data:
            judge.close()
            return 0
        req = WorkerRequest.model_validate_json(data)
        del data
        if Path(req.task_dir).resolve() != task_dir.resolve():
            raise ValueError(f"request for {req.task_dir}, standby for {task_dir}")
        result = serve(req, judge, loaded_marker=out_path.parent / LOADED_FILE)
    except Exception as exc:
        judge.close()
        result = _failure(exc)
    _answer(result, out_path)
    return 0


def _failure(exc: Exception) -> WorkerResult:
    tb = traceback.format_exc(limit=4)
    return WorkerResult(ok=False, error=f"{type(exc).__name__}: {exc}\n{tb[-1500:]}")


def _answer(result: WorkerResult, out_path: Path) -> None:
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(result.model_dump_json())
    tmp.replace(out_path)


if __name__ == "__main__":
    code = main(sys.argv)
    # the answer is written and every runner closed: skip the interpreter's teardown (torch's takes
    # about 0.3 s, on every decision's critical path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
