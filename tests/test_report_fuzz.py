"""Every wrong kernel gets a verdict, never a crash: the report-formatting path fed random failure
shapes (None, NaN, Inf in every numeric field, before and after the JSON round trip the worker's
answer takes)."""

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.gate import Gate, Verdict, _describe_failure
from tools.check import compare, describe_error, format_check
from tools.protocol import ABReport, CheckReport, OutputError, ShapeAB, ShapeCheck, WorkerResult

TASK = Path(__file__).resolve().parents[1] / "kernels" / "matmul_cpu"
GATE = Gate(TASK, "kernels/matmul_cpu")

nasty = st.one_of(st.none(), st.just(math.nan), st.just(math.inf), st.just(-math.inf),
                  st.floats(allow_nan=True, allow_infinity=True))
nasty_req = st.one_of(st.just(math.nan), st.just(math.inf), st.floats(allow_nan=True, allow_infinity=True))
text = st.one_of(st.none(), st.text(max_size=30))

outputs = st.builds(
    OutputError, name=st.text(min_size=1, max_size=8), passed=st.booleans(), max_abs=nasty, max_rel=nasty,
    norm_rel=nasty, nonfinite=st.integers(0, 10**9), mismatches=st.integers(0, 10**9), numel=st.integers(0, 10**9),
    worst_index=st.lists(st.integers(0, 1000), max_size=4), worst_got=nasty, worst_want=nasty, problem=text)
shape_checks = st.builds(
    ShapeCheck, shape=st.text(max_size=10), dims=st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    round=st.integers(0, 5), passed=st.booleans(), outputs=st.lists(outputs, max_size=3),
    inputs_changed=st.lists(st.text(max_size=4), max_size=2), error=text)
shape_abs = st.builds(
    ShapeAB, shape=st.sampled_from(["sq192", "wide"]), weight=st.just(1.0), pairs=st.integers(0, 500),
    log_ratio_mean=nasty_req, log_ratio_se=nasty_req, speedup=nasty_req, speedup_lo=nasty_req, speedup_hi=nasty_req,
    time_a=nasty_req, time_b=nasty_req, wall_a=nasty, wall_b=nasty, extra_a=nasty, extra_b=nasty, idle_cpu_a=nasty,
    idle_cpu_b=nasty, probes=st.integers(0, 50), timed_outputs_ok=st.booleans(), timed_outputs_problem=text)


def roundtrip(model):
    """What the parent reads back: NaN/Inf become null in JSON."""
    return WorkerResult.model_validate_json(WorkerResult(ok=True, **model).model_dump_json())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(shape_checks, min_size=1, max_size=4))
def test_check_failures_always_format(shapes):
    report = CheckReport(passed=False, shapes=shapes)
    for rep in (report, roundtrip({"check": report}).check):
        assert isinstance(format_check(rep), str)
        for s in rep.shapes:
            assert isinstance(_describe_failure(s), str)
            for o in s.outputs:
                assert isinstance(describe_error(o), str)
        v = Verdict(accepted=False, stage="check", reason="wrong results: " + _describe_failure(rep.shapes[0]), check=rep)
        assert isinstance(v.summary(), str)
        json.dumps(v.figures())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(shape_abs, min_size=0, max_size=3), nasty_req, nasty_req, nasty_req,
       st.sampled_from(["", "time cap", "interval tight", "clearly faster"]))
def test_timing_reports_always_get_a_verdict(shapes, sp, lo, hi, stopped):
    report = ABReport(shapes=shapes, speedup=sp, speedup_lo=lo, speedup_hi=hi, pairs=10, timing_seconds=1.0,
                      stopped_because=stopped)
    for rep in (report, roundtrip({"ab": report}).ab if _json_safe(report) else report):
        v = GATE.judge(rep)
        assert isinstance(v, Verdict) and v.reason
        assert isinstance(v.summary(), str)
        if v.accepted:  # an accept needs finite, measured, clean evidence
            assert rep.shapes and all(s.timed_outputs_ok and s.probes > 0 for s in rep.shapes)
            assert math.isfinite(rep.speedup_lo) and rep.speedup_lo > 1.01
            assert all(math.isfinite(s.speedup_lo) and math.isfinite(s.speedup_hi) for s in rep.shapes)


def _json_safe(report: ABReport) -> bool:
    """Required float fields cannot come back as null: such a report fails validation (an error
    result, not a crash), so the round trip applies only where they are finite."""
    try:
        roundtrip({"ab": report})
        return True
    except Exception:
        return False


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_compare_with_non_finite_output_gives_a_formattable_failure(bad):
    import torch

    want = torch.ones(4, 4, dtype=torch.float64)
    got = torch.ones(4, 4)
    got[1, 2] = bad
    err = compare("c", got, want, 1e-4, 1e-4, 1e-5)
    assert not err.passed and err.nonfinite == 1
    s = ShapeCheck(shape="sq", dims={"m": 4}, round=0, passed=False, outputs=[err])
    back = roundtrip({"check": CheckReport(passed=False, shapes=[s])}).check.shapes[0]
    reason = _describe_failure(back)
    assert "1 NaN/Inf" in reason and "sq" in reason
