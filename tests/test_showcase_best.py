"""bench/showcase_best.py: each showcase folder's best.json is what its run record says (the gate's times for
the best and the baseline, the quick bench's for the comparators, each labelled), and is kept in step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
RUNS = sorted(p.parent for p in (ROOT / "runs" / "showcase").glob("*/*/run.json"))


def _module():
    return load_script("bench/showcase_best.py")


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_best_json_is_the_run_records_and_up_to_date(run):
    from agent.run_view import METHOD_BENCH, METHOD_GATE, load_view

    mod = _module()
    view = load_view(run)
    best = mod.best_record(view)
    accepted = [a for a in view.attempts if a.verdict == "accepted"]
    assert best["best_commit"] == accepted[-1].commit and best["run_id"] == run.name
    last = {st.shape: st for st in accepted[-1].shapes}
    for shape, s in best["shapes"].items():
        assert s["best"]["time_s"] == last[shape].time_cand and s["best"]["method"] == METHOD_GATE
        assert all(c["method"] == METHOD_BENCH for c in s["comparators"].values())
        if "tflops" in s["best"]:  # the rate is the shape's FLOPs over the gate's time
            flops = next(x.flops for x in view.series if x.shape == shape)
            assert s["best"]["tflops"] == pytest.approx(flops / s["best"]["time_s"] / 1e12, abs=0.01)
    table = mod.markdown(best)
    assert all(f"`{shape}`" in table for shape in best["shapes"]) and METHOD_GATE in table
    kept = run.parent / "best.json"
    if run != max(p.parent for p in run.parent.glob("*/run.json")):
        return  # an earlier run of the folder: its best was superseded; best.json is the latest run's
    assert json.loads(kept.read_text()) == json.loads(json.dumps(best)), (
        f"{kept} is stale: python bench/showcase_best.py {run.relative_to(ROOT)} -o {kept.relative_to(ROOT)}")


def test_a_run_without_an_accepted_commit_is_refused(tmp_path):
    from agent.run_view import load_view

    mod = _module()
    run = RUNS[0]
    view = load_view(run)
    for a in view.attempts:
        a.verdict = "rejected"
    with pytest.raises(ValueError, match="no accepted commit"):
        mod.best_record(view)
