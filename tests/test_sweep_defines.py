"""The sweep's exploration constants: -D NAME=VALUE beside the knobs, validated, crossed with the
settings, each built for real and labelled in the table; never a way past the knob rules."""

import shutil
from pathlib import Path

import pytest

from tools.sweep import define_grid, format_sweep, sweep
from tools.task import TaskError, load_task

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def task(tmp_path, monkeypatch):
    monkeypatch.setenv("KLOOP_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "matmul_cpu"
    shutil.copytree(ROOT / "kernels" / "matmul_cpu", folder)
    src = folder / "matmul.cpp"
    # a constant the source reads: one value fails to build, so the define demonstrably reaches the compiler
    src.write_text('#if defined(KLOOP_PROBE) && KLOOP_PROBE == 2\n#error "KLOOP_PROBE=2 asked to fail"\n#endif\n'
                   + src.read_text())
    return load_task(folder)


def test_define_grid_crosses_values_and_refuses_bad_names(task):
    assert define_grid(task, None) == [{}]
    assert define_grid(task, {"B": [1, 2], "A": [3]}) == [{"A": 3, "B": 1}, {"A": 3, "B": 2}]
    for bad, words in [({"lanes": [1]}, "upper-case"), ({"X=1 -fplugin": [1]}, "upper-case"),
                       ({"LOOP_ORDER": [1]}, "is a knob"), ({"LANES": []}, "integers"),
                       ({"LANES": ["8; rm -rf"]}, "integers"), ({"LANES": [True]}, "integers")]:
        with pytest.raises(TaskError, match=words):
            define_grid(task, bad)


def test_sweep_builds_every_define_and_labels_it(task):
    rows = sweep(task, [{}], defines={"KLOOP_PROBE": [1, 2]}, shapes=["one"], seconds_per_shape=0.05, jobs=2)
    by_value = {r.defines["KLOOP_PROBE"]: r for r in rows}
    assert set(by_value) == {1, 2}
    assert by_value[1].ok, by_value[1].error
    assert not by_value[2].ok and "asked to fail" in (by_value[2].error or "")
    table = format_sweep(rows, baseline=task.knob_settings())
    assert "-D KLOOP_PROBE=1" in table and "-D KLOOP_PROBE=2" in table
    assert "exploration only" in table
