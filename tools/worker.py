"""The evaluation worker: `python -m tools.worker REQUEST.json RESULT.json`.

It loads the trusted manifest and spec from the request's task folder, loads the built libraries
with ctypes, runs the check, bench or A/B request, and writes a `WorkerResult` as JSON. It runs
untrusted native code, so it is always a separate process (see tools/runner.py): a crash, a hang or
an illegal memory access here costs one evaluation, never the session.
"""

from __future__ import annotations

import ctypes
import sys
import traceback
from pathlib import Path

import torch

from tools.task import load_task
from tools.protocol import WorkerRequest, WorkerResult
from tools.spec import load_spec


def load_library(path: str, spec) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(path).resolve()), mode=ctypes.RTLD_LOCAL)
    spec.setup(lib)
    return lib


def serve(req: WorkerRequest) -> WorkerResult:
    from tools.device import describe

    task = load_task(req.task_dir)
    device = torch.device("cuda" if task.target == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        return WorkerResult(ok=False, error="this task needs a CUDA GPU and none is visible here")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    else:  # no idle OpenMP threads spinning during the timed calls (they would read as the kernel's CPU time)
        torch.set_num_threads(1)
    info = describe(device)
    spec = load_spec(task.spec_path)
    libs = [load_library(p, spec) for p in req.libs]
    if req.kind == "check":
        from tools.check import check_in_process

        report = check_in_process(task, spec, libs[0], req.shapes, req.seed, req.rounds, device)
        return WorkerResult(ok=True, device=info, check=report)
    if req.kind == "bench":
        from tools.bench import bench_in_process

        report = bench_in_process(task, spec, libs[0] if libs else None, req.shapes, req.seed, device,
                                  req.max_seconds, req.comparators)
        return WorkerResult(ok=True, device=info, bench=report)
    if req.kind == "ab":
        from tools.ab import ab_in_process

        report = ab_in_process(task, spec, libs[0], libs[1], req.shapes, req.seed, device, req.max_seconds,
                               req.min_pairs, req.target_halfwidth, req.min_gain, req.allowances, req.weights)
        return WorkerResult(ok=True, device=info, ab=report)
    return WorkerResult(ok=True, device=info)  # probe


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
