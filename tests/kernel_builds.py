"""Building a task's kernel in several variants through the product's own pipeline (tools.build).

The task tests compile their kernels with `build()` (generated build.ninja, content-hash cache,
`ptxas -v` parsed per kernel) rather than calling nvcc themselves, and assert on `BuildResult`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tools.task import Task
from tools.build import BuildResult, build, compiler_version


def one_knob_at_a_time(task: Task) -> list[dict]:
    """The defaults, then every other value of each knob with the rest at their defaults."""
    defaults = task.knob_defaults()
    configs = [dict(defaults)]
    for name, knob in task.manifest.knobs.items():
        configs += [{**defaults, name: value} for value in knob.values if value != knob.default]
    return configs


def every_value_once(task: Task) -> list[dict]:
    """The defaults, then each knob stepped through its values together: config i takes each knob's
    i-th value after its default (wrapping), so every value of every knob is built at least once, in
    combinations (the tuner samples combinations, so they must build too), with as many builds as the
    longest knob has values. `one_knob_at_a_time` builds each value beside the defaults instead (the
    `long` run)."""
    knobs = task.manifest.knobs
    start = {name: knob.values.index(knob.default) for name, knob in knobs.items()}
    width = max((len(k.values) for k in knobs.values()), default=1)
    return [{name: knob.values[(start[name] + i) % len(knob.values)] for name, knob in knobs.items()}
            for i in range(width)]


def label(task: Task, config: dict) -> str:
    """`defaults`, or what differs from the defaults: `THREADS=512`, `KLOOP_TEST_DELAY_NS=10000`."""
    defaults = task.knob_defaults()
    changed = [f"{k}={v}" for k, v in config.items() if k not in defaults or defaults[k] != v]
    return ",".join(changed) or "defaults"


def build_variants(task: Task, configs: list[dict], cache_dir: Path, jobs: int | None = None) -> dict[str, BuildResult]:
    """Build every config of `task` in parallel with `tools.build.build`, keyed by `label()`.

    A config's keys that are knobs of the task are knob settings; any other key is passed as an
    extra `-DKEY=VALUE` flag (as the gate does for its test hooks, e.g. KLOOP_TEST_DELAY_NS).
    Skips the calling test when the task's compiler (nvcc for CUDA tasks) is not installed.
    """
    if compiler_version(task.target) == "missing":
        pytest.skip(f"no compiler for {task.target} tasks ({'nvcc' if task.target == 'cuda' else 'c++'} not found)")
    labels = [label(task, c) for c in configs]
    assert len(set(labels)) == len(labels), f"duplicate configs: {labels}"

    def one(config: dict) -> BuildResult:
        knobs = {k: v for k, v in config.items() if k in task.manifest.knobs}
        extra = [f"-D{k}={int(v) if isinstance(v, bool) else v}" for k, v in config.items() if k not in knobs]
        return build(task, knobs=knobs, cache_dir=cache_dir, extra_flags=extra or None)

    with ThreadPoolExecutor(max_workers=jobs or max(2, os.cpu_count() or 2)) as pool:
        results = list(pool.map(one, configs))
    return dict(zip(labels, results))


def spills(result: BuildResult) -> dict[str, tuple[int, int]]:
    """Kernel name -> (spill store bytes, spill load bytes), for the kernels that spill."""
    return {k.name: (k.spill_store_bytes, k.spill_load_bytes)
            for k in result.kernels if k.spill_store_bytes or k.spill_load_bytes}
