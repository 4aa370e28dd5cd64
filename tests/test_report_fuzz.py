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


# ---- the whole report path: verdict -> record -> show/log/report/trailers -----------------------------

from types import SimpleNamespace

from typer.testing import CliRunner

from agent.cli import Progress, _numbers, app
from agent.records import RunInfo, RunRecord, make_event
from agent.report_html import render_body, render_compare_body
from agent.run_view import load_view
from agent.session import evidence_trailers
from agent.trailers import format_commit_message, parse_trailers

# names with markup, escapes, unicode, control characters: all data, never formatting
names = st.one_of(st.sampled_from(["sq192", "wide", "[/]", "[bold]x", "{0}", "%s", "näme ✓", "a\nb", "", "`x`", "<b>"]),
                  st.text(max_size=12))
anything = st.one_of(nasty, st.integers(-10**30, 10**30), st.text(max_size=8), st.booleans())
any_shapes = st.builds(
    ShapeAB, shape=names, weight=nasty_req, pairs=st.integers(-5, 10**9),
    log_ratio_mean=nasty_req, log_ratio_se=nasty_req, speedup=nasty_req, speedup_lo=nasty_req, speedup_hi=nasty_req,
    time_a=nasty_req, time_b=nasty_req, wall_a=nasty, wall_b=nasty, extra_a=nasty, extra_b=nasty, idle_cpu_a=nasty,
    idle_cpu_b=nasty, probes=st.integers(-3, 50), after_return_a=nasty, after_return_b=nasty, floor_s=nasty,
    baseline_a=nasty, timed_outputs_ok=st.booleans(), timed_outputs_problem=text)
ab_reports = st.builds(ABReport, shapes=st.lists(st.one_of(shape_abs, any_shapes), max_size=3), speedup=nasty_req,
                       speedup_lo=nasty_req, speedup_hi=nasty_req, pairs=st.integers(-1, 10**6), timing_seconds=nasty_req,
                       stopped_because=text.map(lambda t: t or ""))
stage_seconds = st.dictionaries(names, nasty_req, max_size=4)


def strict_json(line: str):
    """json.loads that refuses NaN/Infinity (what every other JSON reader does)."""
    def refuse(const):
        raise ValueError(f"non-standard JSON constant {const}")
    return json.loads(line, parse_constant=refuse)


def _record(tmp: Path, verdicts: list, baseline: dict, titles: list[str]) -> RunRecord:
    run_id = f"20261201-000000-fuzz-{len(list(tmp.iterdir())):04d}"
    info = RunInfo(run_id=run_id, task="matmul_cpu", task_rel="kernels/matmul_cpu", task_path=tmp / "t", policy="tuner",
                   base_commit="0" * 40, branch=f"kloop/{run_id}", repo_root=tmp, worktree=tmp / "w",
                   machine={"name": "a CPU", "kind": "cpu"})
    record = RunRecord.create(tmp, info)
    record.log("session_started")
    record.log("baseline", figures=baseline)
    for n, (v, title) in enumerate(zip(verdicts, titles), start=1):
        record.log("attempt_started", attempt=n, title=title or "t", rationale=title)
        record.log("verdict", attempt=n, accepted=v.accepted, reason=v.reason, figures=v.figures())
        if v.accepted:
            record.log("committed", attempt=n, commit=f"{n:040x}")
    return record


@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(ab_reports, st.lists(shape_checks, max_size=2), stage_seconds, nasty_req, names), min_size=1, max_size=3),
       st.dictionaries(st.sampled_from(["bench", "device", "build", "sass", "check_failures"]), anything, max_size=3))
def test_every_report_gets_a_verdict_strict_json_and_readable_text(tmp_path_factory, attempts, baseline):
    tmp = tmp_path_factory.mktemp("runs")
    verdicts, titles = [], []
    for ab, checks, stages, seconds, title in attempts:
        v = GATE.judge(ab)
        assert isinstance(v, Verdict) and v.reason
        if checks:  # a check report beside it (a verdict never carries both in the gate, but nothing may crash)
            v = v.model_copy(update={"check": CheckReport(passed=False, shapes=checks)})
        v = v.model_copy(update={"stage_seconds": stages, "seconds": seconds, "judge": "ready"})
        for line in (v.summary(), v.stages_line()):
            assert isinstance(line, str)
        verdicts.append(v)
        titles.append(title)
        # trailers: the commit message of an accept, parsed back
        # (a title of whitespace only never gets here: SubmitInput refuses it before the gate runs)
        message = format_commit_message(title if title.strip() else "t", "why", evidence_trailers(v.figures(), None, "run", 1))
        assert isinstance(parse_trailers(message), list)
        row = {"commit": "0" * 40, "title": title, "attempt": "1", "speedup": _trailer(message, "Kloop-Speedup"),
               "interval": _trailer(message, "Kloop-Speedup-Interval"), "times": {}, "registers": {}}
        json.dumps(_numbers(row), allow_nan=False)
        # the live progress line of a session
        Progress()(make_event("verdict", attempt=1, accepted=v.accepted, reason=v.reason, figures=v.figures()))
    record = _record(tmp, verdicts, baseline, titles)
    for line in (record.dir / "events.jsonl").read_text().splitlines():
        strict_json(line)
    strict_json((record.dir / "run.json").read_text())
    view = load_view(record.dir)
    assert len(view.attempts) == len(verdicts)
    assert isinstance(render_body(view), str) and isinstance(render_compare_body([view, view]), str)
    for args in ([], ["1"], ["--json"]):
        res = CliRunner().invoke(app, ["show", str(record.dir), *args], env={"COLUMNS": "100"})
        assert res.exit_code == 0, (res.output, res.exception)
    res = CliRunner().invoke(app, ["runs", "--runs-dir", str(tmp)], env={"COLUMNS": "100"})
    assert res.exit_code == 0, (res.output, res.exception)


def _trailer(message: str, key: str):
    return dict(parse_trailers(message)).get(key)


def test_a_verdict_with_non_finite_figures_is_recorded_as_null(tmp_path):
    ab = ABReport(shapes=[], speedup=math.nan, speedup_lo=-math.inf, speedup_hi=math.inf)
    v = GATE.judge(ab).model_copy(update={"stage_seconds": {"timing": math.nan}, "seconds": math.inf})
    record = _record(tmp_path, [v], {"device": {"name": "x", "sm_clock_mhz": math.nan}}, ["t"])
    lines = [strict_json(line) for line in (record.dir / "events.jsonl").read_text().splitlines()]
    verdict = next(e for e in lines if e["kind"] == "verdict")
    assert verdict["figures"]["speedup"] is None and verdict["figures"]["seconds"] is None
    assert verdict["figures"]["stage_seconds"] == {"timing": None}
    assert next(e for e in lines if e["kind"] == "baseline")["figures"]["device"]["sm_clock_mhz"] is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.fixed_dictionaries({}, optional={
    "speedup": anything, "speedup_lo": anything, "speedup_hi": anything, "stage": anything, "seconds": anything,
    "ab": st.one_of(anything, st.fixed_dictionaries({}, optional={"shapes": st.one_of(anything, st.lists(
        st.one_of(anything, st.dictionaries(st.sampled_from(["shape", "time_a", "time_b", "speedup", "speedup_lo",
                                                              "speedup_hi", "pairs"]), anything)), max_size=3))})),
    "build": st.one_of(anything, st.fixed_dictionaries({}, optional={"kernels": st.one_of(anything, st.lists(
        st.dictionaries(st.sampled_from(["name", "registers", "spill_store_bytes", "spill_load_bytes", "smem_bytes"]),
                        anything), max_size=2)), "knobs": anything, "compiler": anything})),
    "device": anything, "stage_seconds": st.one_of(anything, st.dictionaries(names, anything, max_size=3)),
}), min_size=1, max_size=3), st.lists(st.booleans(), min_size=3, max_size=3))
def test_records_of_any_shape_are_read_and_shown(tmp_path_factory, figures, accepted):
    """A record written by another version (or edited by hand): missing keys, wrong types, NaN; every reader
    shows it, none crashes."""
    tmp = tmp_path_factory.mktemp("runs")
    verdicts = [SimpleNamespace(accepted=a, reason="r", figures=lambda f=f: f) for f, a in zip(figures, accepted)]
    record = _record(tmp, verdicts, {}, ["[/]"] * len(verdicts))
    view = load_view(record.dir)
    assert isinstance(render_body(view), str)
    for args in ([], ["1"]):
        res = CliRunner().invoke(app, ["show", str(record.dir), *args], env={"COLUMNS": "100"})
        assert res.exit_code == 0, (res.output, res.exception)
    for f in figures:
        Progress()(make_event("verdict", attempt=1, accepted=True, reason="r", figures=f))
        evidence_trailers(f, None, "run", 1)


# ---- `kloop eval`'s tables ------------------------------------------------------------------------------

from rich.console import Console

from agent.report import print_eval
from tools.build import BuildResult
from tools.evaluate import EvalReport
from tools.protocol import BenchReport, ShapeBench, Timing
from tools.task import load_task

TASK_MODEL = load_task(TASK)
timings = st.builds(Timing, median=nasty_req, p10=nasty_req, p90=nasty_req, mean=nasty_req, samples=st.integers(0, 10),
                    tflops=nasty, gbps=nasty)
benches = st.builds(ShapeBench, shape=names, dims=st.just({}), kernel=st.one_of(st.none(), timings),
                    comparators=st.dictionaries(names, timings, max_size=2),
                    comparator_errors=st.dictionaries(names, st.text(max_size=20), max_size=1), error=text)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(shape_checks, max_size=3), st.lists(benches, max_size=3), text, text, st.booleans())
def test_eval_tables_print_any_report(checks, bench, check_error, bench_error, passed):
    report = EvalReport(task="matmul_cpu", target="cpu",
                        build=BuildResult(ok=True, key="k", lib="/x.so", build_dir="/b", compiler="g++ [/]"),
                        check=CheckReport(passed=passed, shapes=checks, seconds=math.nan), check_error=check_error,
                        bench=BenchReport(shapes=bench), bench_error=bench_error)
    console = Console(record=True, width=100, file=open("/dev/null", "w"))
    print_eval(console, TASK_MODEL, report)
    assert console.export_text()


# ---- the gate fails closed on figures it needs ----------------------------------------------------------

def _shape(name="sq192", **kw):
    base = dict(shape=name, weight=1.0, pairs=100, speedup=2.0, speedup_lo=1.9, speedup_hi=2.1, time_a=1e-3,
                time_b=0.5e-3, pass_a=[1e-3, 1.01e-3, 0.99e-3, 1e-3, 1.02e-3, 0.98e-3],
                pass_b=[0.5e-3, 0.49e-3, 0.51e-3, 0.5e-3, 0.5e-3, 0.505e-3], wall_a=1.02e-3, wall_b=0.52e-3,
                extra_a=0.0, extra_b=0.0, extra_a_se=0.2e-6, idle_cpu_a=0.0, idle_cpu_b=0.0, probes=10)
    return ShapeAB(**(base | kw))


def test_a_clean_report_is_accepted():  # the reference point for the cases below
    assert GATE.judge(ABReport(shapes=[_shape()], speedup=2.0, speedup_lo=1.9, speedup_hi=2.1, pairs=100)).accepted


@pytest.mark.parametrize("shape, top, words", [
    (_shape("[/] näme"), {}, "does not time"),  # a shape the task does not have: no allowance applies
    (_shape(pass_b=[0.5e-3] * 5 + [0.0]), {}, "integrity probes missing"),  # a pass time not positive: no time at all
    (_shape(pass_b=[-1e-3] * 6, pass_a=[-2e-3] * 6), {}, "integrity probes missing"),
    (_shape(pass_b=[0.5e-3] * 5 + [math.nan]), {}, "integrity probes missing"),
    (_shape(probes=-1), {}, "integrity probes missing"),
    (_shape(extra_a_se=math.nan), {}, "integrity probes missing"),
    (_shape(pass_a=[], pass_b=[]), {}, "fewer than"),  # no passes: no estimate, whatever the report says
])
def test_missing_or_impossible_figures_are_rejected_never_a_crash(shape, top, words):
    ab = ABReport(shapes=[shape], **({"speedup": 2.0, "speedup_lo": 1.9, "speedup_hi": 2.1, "pairs": 100} | top))
    v = GATE.judge(ab)
    assert not v.accepted and words in v.reason, v.reason
    assert isinstance(v.summary(), str)


def test_log_of_commits_with_garbage_trailers(tmp_path):
    """`kloop log` reads trailers from commits anyone can write: any value is shown, --json stays strict."""
    import git

    from agent.records import RunRecord as _RR
    from agent.run_view import run_rows
    from agent.report_html import render_index
    from tests.fakes import make_repo

    repo = make_repo(tmp_path)
    r = git.Repo(repo)
    base = r.head.commit.hexsha
    r.git.checkout("-b", "kloop/fuzz")
    (repo / "kernels" / "matmul_cpu" / "knobs.toml").write_text("LOOP_ORDER = 1\n")
    r.git.add(A=True)
    r.index.commit(format_commit_message("[/] [bold]title", "", [
        ("Kloop-Speedup", "1.2.3"), ("Kloop-Speedup-CI95", "nan..inf"), ("Kloop-Time-[/]", "...ms -> 1e999ms (x..., .....1, 3 pairs)"),
        ("Kloop-Regs-k", "9 -> 8 regs, spills [/] B"), ("Kloop-Run", "fuzz"), ("Kloop-Attempt", "1")]))
    runs = tmp_path / "runs"
    info = RunInfo(run_id="fuzz", task="matmul_cpu", task_rel="kernels/matmul_cpu", task_path=repo, policy="tuner",
                   base_commit=base, branch="kloop/fuzz", repo_root=repo, worktree=tmp_path / "w")
    _RR.create(runs, info).log("session_started")
    for args in (["log", "fuzz", "--runs-dir", str(runs)], ["log", "kloop/fuzz", "--repo", str(repo)]):
        for extra in ([], ["--json"]):
            res = CliRunner().invoke(app, args + extra, env={"COLUMNS": "100"})
            assert res.exit_code == 0, (res.output, res.exception)
            if extra:
                strict_json(res.stdout)
    assert "fuzz" in render_index(run_rows(runs))
