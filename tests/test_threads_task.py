"""Threads on CPU tasks (issue 20, item 8): a manifest may allow `threads = N`; then the build may
start threads (the audit's thread symbols and source rule lifted) and the gate times the judge's wall
clock around each request, with every CPU-ns of the runner charged to a sample (frozen between
requests: no thread works off the clock). A real parallel kernel is judged on wall time; on this
2-core box under load no gain is asserted, only the structure."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tools.task import TaskError, load_task

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "kernels" / "matmul_cpu"
CHEATS = Path(__file__).resolve().parent / "cheats"


def _task(tmp: Path, source: str, threads: int | None) -> Path:
    dest = tmp / f"{source}-{threads}"
    shutil.copytree(TASK, dest)
    shutil.copyfile(CHEATS / f"{source}.cpp", dest / "matmul.cpp")
    shutil.copyfile(CHEATS / "rt_common.h", dest / "rt_common.h")
    if threads is not None:
        _set_threads(dest, threads)
    return dest


def _set_threads(folder: Path, threads: int) -> None:
    """`threads = N` among the manifest's top-level keys (before its first table)."""
    toml = (folder / "task.toml").read_text()
    (folder / "task.toml").write_text(re.sub(r"(?m)^name = .*$", lambda m: f"{m.group(0)}\nthreads = {threads}", toml, count=1))


def test_threads_is_validated(tmp_path):
    assert load_task(TASK).manifest.threads == 1  # the default
    for bad in (0, -1, 1000):
        with pytest.raises(TaskError, match="threads"):
            load_task(_task(tmp_path / str(bad), "rt_honest", bad))
    cuda = ROOT / "kernels" / "softmax"
    dest = tmp_path / "softmax"
    shutil.copytree(cuda, dest)
    _set_threads(dest, 2)
    with pytest.raises(TaskError, match="only CPU tasks"):
        load_task(dest)


def test_the_audit_allows_threads_only_where_the_manifest_does(tmp_path):
    from tools.audit import audit_task_build
    from tools.build import build

    for threads, ok in ((None, False), (2, True)):
        task = load_task(_task(tmp_path, "rt_honest_threads", threads))
        built = build(task, cache_dir=tmp_path / "cache")
        assert built.ok, built.error_text()
        report = audit_task_build(task, Path(built.build_dir))
        assert report.ok == ok, report.reason()
        if not ok:
            assert "pthread_create" in report.reason() or "std::thread" in report.reason(), report.reason()


@pytest.mark.slow
def test_a_two_thread_kernel_is_judged_on_wall_time_with_all_cpu_in_samples(tmp_path):
    from agent.gate import Gate, GateConfig
    from tools.build import build

    folder = _task(tmp_path, "rt_honest_threads", 2)
    gate = Gate(folder, "kernels/matmul_cpu", GateConfig(max_seconds=2.0, min_pairs=8))
    best = build(gate.task, src_root=_task(tmp_path / "best", "rt_honest", 2), cache_dir=tmp_path / "cache")
    cand = build(gate.task, src_root=folder, cache_dir=tmp_path / "cache")
    assert best.ok and cand.ok, (best.error_text(), cand.error_text())
    v = gate.judge_built(cand, best)
    assert v.check is not None and v.check.passed, v.summary()
    ab = v.ab
    assert ab is not None and ab.measure == "wall", v.summary()
    assert ab.cpu_in_samples_b > 0 and abs(ab.cpu_unattributed_b) < 1e-3 * ab.cpu_in_samples_b, ab
    assert ab.max_parallelism_b is not None and ab.max_parallelism_b <= 2.2, ab  # never more than 2 threads at work
    # where the timing loop's seconds went: every part booked, and together about the loop's own time
    parts = ab.pass_seconds
    assert set(parts) == {"fresh inputs", "paired samples", "timed calls", "re-checks", "probes"}, parts
    assert min(parts.values()) >= 0 and parts["timed calls"] > 0, parts
    assert 0.8 * ab.timing_seconds <= sum(parts.values()) <= ab.timing_seconds + 0.01, (parts, ab.timing_seconds)
