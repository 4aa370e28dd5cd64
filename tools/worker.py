"""The judge: `python -m tools.worker REQUEST.json RESULT.json` — the trusted side of an evaluation.

It loads the trusted manifest and spec from the request's task folder, draws the inputs from the
secret seed, computes the references, compares, times and does the statistics, and writes a
`WorkerResult` as JSON. It loads NO untrusted code: every library (the candidate, the best) is loaded
by its own runner process (tools/libhost.py via tools/runner.py), which only calls `spec.launch` on
buffers this process allocated and answers with plain data. The judge itself still runs in its own
process (tools/runner.run_worker), so a runaway evaluation costs one evaluation, never the session.
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from tools.task import load_task
from tools.protocol import WorkerRequest, WorkerResult
from tools.spec import load_spec

LOAD_TIMEOUT_S = 120.0  # a runner's start: python, torch (and CUDA) import, the library's load


def call_timeout(task) -> float:
    """Seconds one request to a runner may take before it counts as a hang."""
    return max(5.0, 0.4 * task.manifest.timeout_s)


def serve(req: WorkerRequest) -> WorkerResult:
    from tools.device import describe
    from tools.remote import RemoteLib, RunnerError, SharedArena, start_runners
    from tools.timing import Timer

    task = load_task(req.task_dir)
    device = torch.device("cuda" if task.target == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        return WorkerResult(ok=False, error="this task needs a CUDA GPU and none is visible here")
    names = {"check": ["cand"], "bench": ["cand"] if req.libs else [], "ab": ["best", "cand"],
             "gate": ["best", "cand"]}.get(req.kind, [])
    with tempfile.TemporaryDirectory(prefix="kloop-judge-") as scratch:
        runners = start_runners(names, Path(scratch))  # their torch import overlaps ours below
        arena = SharedArena(device)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(0)
            else:  # no idle OpenMP threads of ours competing with the timed calls
                torch.set_num_threads(1)
            info = describe(device)
            spec = load_spec(task.spec_path)
            timer = Timer(device)
            libs = [RemoteLib(runners[n], arena, device, timer, call_timeout(task)) for n in names]
            try:
                for lib, path in zip(libs, req.libs):
                    lib.load(task.spec_path, path, LOAD_TIMEOUT_S)
            except RunnerError as exc:
                return WorkerResult(ok=False, device=info, error=f"the library did not load: {exc}")
            if req.kind in ("check", "gate"):
                from tools.check import check_in_process

                def relaunch():  # a fresh runner with the same library (fault diagnosis)
                    r = start_runners([f"diagnose{len(runners)}"], Path(scratch))
                    runners.update(r)
                    lib = RemoteLib(next(iter(r.values())), arena, device, timer, call_timeout(task))
                    lib.load(task.spec_path, cand_lib, LOAD_TIMEOUT_S)
                    return lib

                cand_lib = req.libs[-1]
                report = check_in_process(task, spec, libs[-1], req.check_shapes or req.shapes, req.seed, req.rounds,
                                          device, arena, relaunch)
                if req.kind == "check" or not report.passed:
                    return WorkerResult(ok=True, device=info, check=report)
                check = report
            if req.kind == "bench":
                from tools.bench import bench_in_process

                report = bench_in_process(task, spec, libs[0] if libs else None, req.shapes, req.seed, device,
                                          req.max_seconds, req.comparators, arena, timer)
                return WorkerResult(ok=True, device=info, bench=report)
            if req.kind in ("ab", "gate"):
                from tools.ab import ab_in_process

                seed = req.timing_seed if req.kind == "gate" else req.seed
                check = check if req.kind == "gate" else None
                try:
                    report = ab_in_process(task, spec, libs[0], libs[1], req.shapes, seed, device, req.max_seconds,
                                           req.min_pairs, req.target_halfwidth, req.min_gain, req.allowances,
                                           req.weights, arena)
                except RunnerError as exc:
                    return WorkerResult(ok=False, device=info, check=check, error=f"timing stopped: {exc}")
                audit = cpu_audit(runners) if device.type == "cpu" else []
                return WorkerResult(ok=True, device=info, check=check, ab=report, warnings=audit)
            return WorkerResult(ok=True, device=info)  # probe
        finally:
            for r in runners.values():
                r.close()
            arena.close()


def cpu_audit(runners: dict) -> list[str]:
    """Threads the runners hold: a kernel library has no business starting any (CUDA's own excepted)."""
    out = []
    for name, r in runners.items():
        n = r.threads()
        if n > 1 and r.proc.poll() is None:
            out.append(f"{name} runner holds {n} threads")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m tools.worker REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    req_path, out_path = Path(argv[1]), Path(argv[2])
    try:
        req = WorkerRequest.model_validate_json(req_path.read_text())
        req_path.unlink()  # the request holds the gate's seed: gone before any untrusted code loads
        result = serve(req)
    except Exception as exc:
        tb = traceback.format_exc(limit=4)
        result = WorkerResult(ok=False, error=f"{type(exc).__name__}: {exc}\n{tb[-1500:]}")
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(result.model_dump_json())
    tmp.replace(out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
