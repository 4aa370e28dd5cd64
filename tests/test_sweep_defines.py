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


def test_a_sweep_times_its_settings_in_one_judge_and_a_crash_costs_only_its_row(task, monkeypatch):
    """Several settings are quick-benched by ONE judge (each in its own runner): a judge's start is paid
    once per batch, not per setting (on the H200 it was 3-8 s of each setting's ~6 s). A setting whose
    kernel crashes fails its own row; the others are still timed."""
    src = task.root / "matmul.cpp"
    # KLOOP_PROBE=3 crashes at the first call (a null write), 1 and 4 are honest
    src.write_text("#include <cstdlib>\n#if defined(KLOOP_PROBE) && KLOOP_PROBE == 3\n#define KLOOP_CRASH 1\n#endif\n"
                   + src.read_text().replace("extern \"C\" int kloop_matmul(", "static int kloop_matmul_impl(", 1)
                   + "\nextern \"C\" int kloop_matmul(const float* a, const float* b, float* c, int M, int N, int K) {\n"
                   "#ifdef KLOOP_CRASH\n  *(volatile int*)nullptr = 1;\n#endif\n"
                   "  return kloop_matmul_impl(a, b, c, M, N, K);\n}\n")
    import tools.judge_handle as jh
    import tools.evaluate as ev

    judges = []
    real = jh.run_worker

    def counted(req, *a, **kw):
        judges.append((req.kind, len(req.libs)))
        return real(req, *a, **kw)

    monkeypatch.setattr(ev, "run_worker", counted)
    rows = sweep(task, [{}], defines={"KLOOP_PROBE": [1, 3, 4]}, shapes=["one"], seconds_per_shape=0.05, jobs=2)
    by_value = {r.defines["KLOOP_PROBE"]: r for r in rows}
    assert judges == [("bench", 3)], judges
    assert by_value[1].ok and by_value[4].ok and by_value[1].times["one"] > 0 and by_value[4].times["one"] > 0, rows
    assert not by_value[3].ok and by_value[3].error, by_value[3]
