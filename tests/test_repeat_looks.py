"""Repeated looks at one best spend from one error budget: the look count comes from the run record,
and an agent that re-submits an A/A change until it is accepted stays within the budget
(bench/repeat_looks_sim.py, a small deterministic run of it)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from agent import records as rec
from agent.session import recorded_best_times, timed_looks
from tools.stats import look_alpha

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import repeat_looks_sim  # noqa: E402


def test_the_looks_levels_sum_to_the_budget():
    assert sum(look_alpha(0.01, i) for i in range(1, 200_000)) == pytest.approx(0.01, rel=1e-4)
    assert look_alpha(0.01, 1) > look_alpha(0.01, 2) > look_alpha(0.01, 10)
    with pytest.raises(ValueError, match="look"):
        look_alpha(0.01, 0)


def _attempt(n, best, verdict_figures, accepted=False, commit=None):
    evs = [rec.AttemptStarted(attempt=n, title=f"a{n}", best_commit=best),
           rec.Verdict(attempt=n, accepted=accepted, reason="r", figures=verdict_figures)]
    if commit:
        evs.append(rec.Committed(attempt=n, commit=commit))
    return evs


AB = {"shapes": [{"shape": "sq192", "time_b": 1.5e-3}, {"shape": "wide", "time_b": 0.7e-3}]}


def test_timed_looks_count_every_timed_decision_against_the_same_best():
    events = [rec.Baseline(commit="base", figures={"bench": {"shapes": [
        {"shape": "sq192", "kernel": {"median": 3e-3}}, {"shape": "wide", "kernel": {"median": 1e-3}}]}})]
    events += _attempt(1, "base", {"stage": "undecided", "timing_seed": 11})
    events += _attempt(2, "base", {"stage": "check"})  # rejected before timing: no look
    events += _attempt(3, "base", {"stage": "timing", "timing_seed": 12})
    events += [rec.AttemptStarted(attempt=4, title="older record, no best_commit")]
    events += [rec.Verdict(attempt=4, accepted=False, reason="r", figures={"stage": "undecided", "timing_seed": 13})]
    assert timed_looks(events, "base", "base") == 3
    events += _attempt(5, "base", {"stage": "accepted", "timing_seed": 14, "ab": AB}, accepted=True, commit="c5")
    assert timed_looks(events, "base", "base") == 4
    assert timed_looks(events, "c5", "base") == 0  # a new best: a new budget
    events += _attempt(6, None, {"stage": "undecided", "timing_seed": 15})  # judged against c5 (the last accepted)
    assert timed_looks(events, "c5", "base") == 1


def test_the_best_times_come_from_the_record_by_the_gates_own_method():
    events = [rec.Baseline(commit="base", figures={"bench": {"shapes": [
        {"shape": "sq192", "kernel": {"median": 3e-3}}, {"shape": "wide", "kernel": {"median": 1e-3}}]}})]
    # the quick bench's medians are another method: no reference from them
    assert recorded_best_times(events, "base", "base") == {}
    events += _attempt(1, "base", {"stage": "check"})  # not timed: no times
    first = {"shapes": [{"shape": "sq192", "time_a": 3.1e-3, "time_b": 3.0e-3}, {"shape": "wide", "time_a": 1.1e-3}]}
    events += _attempt(2, "base", {"stage": "undecided", "timing_seed": 7, "ab": first})
    later = {"shapes": [{"shape": "sq192", "time_a": 9.0, "time_b": 9.0}]}
    events += _attempt(3, "base", {"stage": "timing", "timing_seed": 8, "ab": later})
    # the first timed decision against the base: the best's own paired times (a later one cannot raise the bar)
    assert recorded_best_times(events, "base", "base") == {"sq192": 3.1e-3, "wide": 1.1e-3}
    events += _attempt(4, "base", {"stage": "accepted", "timing_seed": 1, "ab": AB}, accepted=True, commit="c1")
    assert recorded_best_times(events, "c1", "base") == {"sq192": 1.5e-3, "wide": 0.7e-3}  # the accepted verdict's
    assert recorded_best_times(events, "unknown", "base") == {}


def test_resubmitting_an_aa_change_until_accepted_stays_within_the_budget():
    """The worst case for the budget: an A/A change judged at min_gain 0 (every look's level binds).
    Deterministic (seeded synthetic pass data, the real criterion): the naive gate's false accepts grow
    with the tries, the spent gate's stay within the 1% budget."""
    r = repeat_looks_sim.simulate(agents=150, tries=5, seed=3, min_gain=0.0, cap_max=32)
    naive, spent = r["cumulative"]["naive"], r["cumulative"]["spent"]
    print(repeat_looks_sim.table(r))
    assert all(s <= n for s, n in zip(spent, naive))
    assert spent[-1] <= 0.015
    assert naive[-1] > spent[-1] and naive[-1] > naive[0]  # what counting the looks prevents
    assert all(math.isfinite(x) for x in naive + spent)


def test_a_new_process_judges_with_the_records_best_times_and_look_count(tmp_path):
    """`kloop submit` and MCP open the run afresh for each decision (Session.open): the best's recorded
    times (the sabotage check) and the count of timed looks at this best (the error budget) come from
    the run record, not from the memory of the process that made them."""
    from agent.gate import GateConfig, Verdict
    from agent.policies.base import Budget
    from agent.session import Session
    from tests.fakes import make_repo
    from tools.build import BuildResult

    repo = make_repo(tmp_path)
    first = Session.start(repo / "kernels" / "matmul_cpu", "test", Budget(), runs_root=tmp_path / "runs",
                          gate_config=GateConfig(standby=False))
    best = first.best_commit
    first.log("baseline", commit=best, figures={"bench": {"shapes": [{"shape": "sq192", "kernel": {"median": 2e-3}},
                                                                       {"shape": "wide", "kernel": {"median": 1e-3}}]}})
    for n in (1, 2):  # two timed decisions against this best, made by an earlier process
        first.log("attempt_started", attempt=n, title=f"try {n}", best_commit=best)
        ab = {"shapes": [{"shape": "sq192", "time_a": 2e-3 * n, "time_b": 2e-3}, {"shape": "wide", "time_a": 1e-3 * n}]}
        first.log("verdict", attempt=n, accepted=False, reason="undecided",
                  figures={"stage": "undecided", "timing_seed": n, "ab": ab})
    first.close()

    other = Session.open(first.record.dir, lock=False)
    other.best_build = BuildResult(ok=True, key="best", lib="/nonexistent/best.so", build_dir="/nonexistent")
    assert other.gate._recorded_times == {}
    seen = {}

    def evaluate(cand, best_build, max_seconds=None, upto="timing", look=1):
        seen["times"], seen["look"] = dict(other.gate._recorded_times.get(best_build.lib, {})), look
        return Verdict(accepted=False, stage="timing", reason="not run here")

    other.gate.evaluate = evaluate
    try:
        other._evaluate_or_record_interrupt(3, [], None)
    finally:
        other.close()
    # the best's times in the first timed decision against it (the gate's method, not the bench's medians)
    assert seen == {"times": {"sq192": 2e-3, "wide": 1e-3}, "look": 3}
