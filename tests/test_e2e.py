"""The end-to-end check stage (tools/e2e.py, Gate.e2e_stage) and long checks (manifest [check]).

The point of the stage: a kernel that passes every per-call tolerance can still bias training.
`tests/cheats/e2e_round_down.cpp` is matmul_cpu's fast i-k-j loop with every result rounded toward
zero at 17 significant bits (relative error < 7.6e-6, inside the check's fp32 tolerance): today's
check and timing accept it (x2 and more), the e2e stage (least squares trained to its noise floor
through the candidate, kernels/matmul_cpu/e2e.py) rejects it with both loss figures, and the honest
faster change (LOOP_ORDER=1) passes.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from agent.gate import Candidate, Gate, GateConfig, Verdict
from agent.session import accepts_since_e2e, evidence_trailers, Attempt
from agent.trailers import format_commit_message, trailer_dict
from tools.build import build
from tools.e2e import due, judge_losses, summary
from tools.protocol import E2EReport, WorkerResult
from tools.scope import change_refusal
from tools.task import TaskError, load_task

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "kernels" / "matmul_cpu"
BIASED = ROOT / "tests" / "cheats" / "e2e_round_down.cpp"


def task_copy(tmp: Path, when: str = "accept", extra: str = "", small: bool = True) -> Path:
    """matmul_cpu with its e2e run on `when`; small bench shapes so a decision takes about a second."""
    dest = tmp / "matmul_cpu"
    shutil.copytree(TASK, dest)
    text = (dest / "task.toml").read_text().replace('when = "export"', f'when = "{when}"')
    if small:
        for old, new in [("m = 192, n = 192, k = 192", "m = 48, n = 64, k = 48"),
                         ("m = 96, n = 320, k = 128", "m = 32, n = 96, k = 40")]:
            assert old in text
            text = text.replace(old, new)
    (dest / "task.toml").write_text(text + extra)
    return dest


def with_manifest(tmp: Path, edit) -> Path:
    dest = tmp / "t"
    shutil.copytree(TASK, dest)
    (dest / "task.toml").write_text(edit((dest / "task.toml").read_text()))
    return dest


# ---- the verdict on two loss curves (pure) ----------------------------------------------------------

def test_within_the_bound_passes_with_both_figures():
    ref = [4.0, 2.0] + [1.0] * 8
    ok, reason, rm, cm = judge_losses(ref, [4.0, 2.0] + [1.004] * 8, 10, 5, 0.01, 4.0)
    assert ok and rm == pytest.approx(1.0) and cm == pytest.approx(1.004)
    assert "last-5 mean loss 1.004 vs 1 ref (+0.40%, bound 1%), 10 steps" == reason


@pytest.mark.parametrize("cand, words", [
    ([4.0, 2.0] + [1.02] * 8, ["moved off the reference", "1.02 vs 1 ref", "+2.00%"]),
    ([4.0, 2.0] + [0.97] * 8, ["moved off the reference", "-3.00%"]),  # too good is off the reference too
    ([4.0, float("nan")] + [1.0] * 8, ["training broke", "step 2"]),
    ([4.0, 2.0, 17.0] + [1.0] * 7, ["diverged", "step 3", "over 4x"]),
    ([4.0] * 9, ["returned 9 losses for 10 steps"]),
])
def test_off_the_reference_fails(cand, words):
    ok, reason, _, _ = judge_losses([4.0, 2.0] + [1.0] * 8, cand, 10, 5, 0.01, 4.0)
    assert not ok
    for w in words:
        assert w in reason, reason


def test_a_broken_reference_run_fails_closed():
    ok, reason, _, _ = judge_losses([1.0, float("inf")], [1.0, 1.0], 2, 1, 0.01, 4.0)
    assert not ok and "reference run's loss is not finite" in reason


def test_when_every_n():
    assert due("accept", 0) and not due("export", 0) and not due("export", 99)
    assert [due("every:3", n) for n in range(4)] == [False, False, True, True]


def test_accepts_since_e2e_counts_across_a_resume():
    a = [Attempt(1, "x", accepted=True, figures={"e2e": {"passed": True}}), Attempt(2, "y", accepted=False),
         Attempt(3, "z", accepted=True, figures={}), Attempt(4, "w", accepted=True, figures={})]
    assert accepts_since_e2e(a) == 2 and accepts_since_e2e(a[:1]) == 0


def test_trailer_carries_both_losses():
    rep = E2EReport(passed=True, reason="last-10 mean loss 2.314 vs 2.311 ref (+0.13%, bound 1%), 40 steps",
                    seconds=3.21)
    figures = {"speedup": 1.1, "speedup_lo": 1.05, "speedup_hi": 1.15, "e2e": rep.model_dump(mode="json")}
    msg = format_commit_message("t", "r", evidence_trailers(figures, None, "run-1", 3))
    assert trailer_dict(msg)["Kloop-E2E"] == "pass, last-10 mean loss 2.314 vs 2.311 ref (+0.13%, bound 1%), 40 steps, 3.2 s"
    assert "Kloop-E2E" not in trailer_dict(format_commit_message("t", "r", evidence_trailers({}, None, "run-1", 3)))


# ---- the manifest ---------------------------------------------------------------------------------

def test_shipped_manifest_declares_it():
    t = load_task(TASK)
    assert t.manifest.e2e.script == "e2e.py" and t.manifest.e2e.when == "export" and t.e2e_path.is_file()
    assert change_refusal(t, "e2e.py", by_submit=True) and "e2e script is read-only" in change_refusal(t, "e2e.py", by_submit=True)


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.replace("bound = 0.05", "bound = 0.05\nbnd = 1"), ["e2e.bnd", "unknown key"]),
    (lambda s: s.replace('when = "export"', 'when = "sometimes"'), ["e2e.when"]),
    (lambda s: s.replace('when = "export"', 'when = "every:0"'), ["e2e.when"]),
    (lambda s: s.replace("last = 10", "last = 50"), ["last = 50 is more than steps = 40"]),
    (lambda s: s.replace('script = "e2e.py"', 'script = "nope.py"'), ["e2e.script", "nope.py", "does not exist"]),
    (lambda s: s.replace('script = "e2e.py"', 'script = "../spec.py"'), ["e2e.script", "outside the task folder"]),
    (lambda s: s.replace('editable = ["matmul.cpp", "*.h"]', 'editable = ["matmul.cpp", "*.py"]'), ["e2e script"]),
    (lambda s: s + '\n[check]\nquick = ["one", "nosuch"]\n', ["check", "nosuch"]),
    (lambda s: s + '\n[check]\ngate = []\n', ["check.gate is empty"]),
    (lambda s: s + '\n[check]\nlong = ["one"]\n', ["check.long", "unknown key"]),
])
def test_bad_manifests_say_what(tmp_path, edit, words):
    with pytest.raises(TaskError) as e:
        load_task(with_manifest(tmp_path, edit))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_check_plan_quick_and_gate(tmp_path):
    t = load_task(with_manifest(tmp_path, lambda s: s + '\n[check]\nquick = ["one", "odd"]\ngate_rounds = 4\n'))
    quick, qr = t.check_plan("quick")
    gate, gr = t.check_plan("gate")
    assert [s.name for s in quick] == ["one", "odd"] and qr == 4  # quick rounds default to the gate's
    assert [s.name for s in gate] == [s.name for s in t.check_shapes] and gr == 4
    plain = load_task(TASK)
    assert plain.check_plan("quick") == (plain.check_shapes, None) == plain.check_plan("gate")


def test_gate_runs_the_long_check_and_the_tool_the_quick_one(tmp_path, monkeypatch):
    """The gate asks its judge for the [check] gate set and rounds; the agent's check tool for the quick set."""
    extra = '\n[check]\nquick = ["one"]\ngate = ["one", "odd", "sq192"]\nquick_rounds = 1\ngate_rounds = 3\n'
    task = task_copy(tmp_path, extra=extra)
    asked = []

    def fake_worker(req, timeout, standby=None):
        asked.append(req)
        return WorkerResult(ok=False, error="not run in this test")

    import agent.gate as gate_mod
    import tools.evaluate as evaluate

    monkeypatch.setattr(gate_mod, "run_worker", fake_worker)
    monkeypatch.setattr(evaluate, "run_worker", fake_worker)
    g = Gate(task, "matmul_cpu", GateConfig(standby=False))
    built = build(g.task, src_root=task)
    assert built.ok
    g.judge_built(built, None)
    g.judge_built(built, built)
    evaluate.run_check(g.task, built.lib, plan="quick")
    evaluate.run_check(g.task, built.lib)
    assert [(r.kind, r.check_shapes or r.shapes, r.rounds) for r in asked] == [
        ("check", ["one", "odd", "sq192"], 3), ("gate", ["one", "odd", "sq192"], 3),
        ("check", ["one"], 1), ("check", ["one", "odd", "sq192"], 3)]


def test_every_n_runs_on_the_nth_accept(tmp_path, monkeypatch):
    g = Gate(task_copy(tmp_path, when="every:2"), "matmul_cpu", GateConfig(standby=False))
    ran = []

    def fake_e2e(lib):
        ran.append(lib)
        return WorkerResult(ok=True, e2e=E2EReport(passed=len(ran) != 2, reason="r")), {"e2e": 0.1}

    monkeypatch.setattr(g, "run_e2e", fake_e2e)
    accepted = Verdict(accepted=True, stage="accepted", reason="faster: x2")
    out = [g.e2e_stage(accepted, build(g.task, src_root=g.trusted_dir)) for _ in range(5)]
    assert [v.e2e is not None for v in out] == [False, True, False, True, True]
    assert [v.accepted for v in out] == [True, True, True, False, True]
    assert out[3].stage == "e2e" and "every earlier stage passed: faster: x2" in out[3].reason
    # a failed e2e does not reset the count: the next accept runs it again
    assert g.accepts_since_e2e == 0 and len(ran) == 3


# ---- the real thing: runners, the gate -----------------------------------------------------------------

@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """Builds of matmul_cpu: the baseline (i-j-k), the honest faster i-k-j, and the biased kernel."""
    tmp = tmp_path_factory.mktemp("e2e-libs")
    task = load_task(TASK)
    biased_src = tmp / "biased"
    shutil.copytree(TASK, biased_src)
    shutil.copyfile(BIASED, biased_src / "matmul.cpp")
    out = {"ijk": build(task), "ikj": build(task, {"LOOP_ORDER": 1}), "biased": build(task, src_root=biased_src)}
    for name, b in out.items():
        assert b.ok, (name, b.error_text())
    return out


def test_biased_kernel_passes_the_check_but_not_training(libs):
    """Through real runners, several seeds: both honest loops stay within the bound (well inside),
    the biased one is far outside it every time (measured: honest < 0.7%, biased >= +78%, 38 seeds emulated in torch)."""
    from tools.e2e import e2e_in_process
    from tools.remote import LibSession
    from tools.spec import load_spec

    task = load_task(TASK)
    spec = load_spec(task.spec_path)
    names = list(libs)
    torch.set_num_threads(1)
    with LibSession(task, [libs[n].lib for n in names], names=names) as s:
        for seed in (1, 2, 3):
            got = {n: e2e_in_process(task, spec, lib, seed, s.device, s.arena) for n, lib in zip(names, s.libs)}
            for n in ("ijk", "ikj"):
                r = got[n]
                assert r.passed, (n, seed, r.reason)
                assert abs(r.cand_mean / r.ref_mean - 1) < task.manifest.e2e.bound / 3, (n, seed, r.reason)
                assert r.calls == 2 * task.manifest.e2e.steps and len(r.cand_losses) == task.manifest.e2e.steps
            b = got["biased"]
            assert not b.passed and "moved off the reference" in b.reason, b.reason
            assert b.cand_mean / b.ref_mean - 1 > 6 * task.manifest.e2e.bound, b.reason
            assert all(math.isfinite(x) for x in b.cand_losses)


def _evaluate_until_decided(g, cand: Candidate, best, looks: int = 3):
    """Gate.evaluate, then again with the seconds an 'undecided' verdict names (a loaded machine; each
    look is counted), up to `looks` in all, as a user following the gate's advice would. (Once was not
    enough beside the other long tests under -n 2: 1 failure in 2 runs of them, 2026-12-04.)"""
    v = g.evaluate(cand, best)
    for look in range(2, looks + 1):
        if not (v.stage == "undecided" and v.decide_seconds):
            break
        v = g.evaluate(cand, best, max_seconds=v.decide_seconds, look=look)
    return v


@pytest.mark.long
@pytest.mark.slow
def test_gate_accepts_honest_and_rejects_biased_at_e2e(tmp_path, libs):
    """The whole gate with `when = "accept"`: the honest faster change is accepted with its e2e figures
    (and the trailer line); the biased one passes scope, build, audit, check and timing (faster) and is
    rejected at stage e2e, both loss figures in the reason."""
    task = task_copy(tmp_path)
    g = Gate(task, "matmul_cpu", GateConfig(max_seconds=1.0, min_pairs=8, standby=False))
    try:
        best = libs["ijk"]
        cand = tmp_path / "cand"
        shutil.copytree(task, cand)
        (cand / "knobs.toml").write_text("LOOP_ORDER = 1\n")
        honest = _evaluate_until_decided(g, Candidate(cand, ["matmul_cpu/knobs.toml"]), best)
        assert honest.accepted and honest.e2e is not None and honest.e2e.passed, honest.summary()
        assert "e2e" in honest.stage_seconds and "e2e: pass, last-10 mean loss" in honest.summary()
        trailers = trailer_dict(format_commit_message("t", "r", evidence_trailers(honest.figures(), best, "r", 1)))
        assert trailers["Kloop-E2E"].startswith("pass, last-10 mean loss ")
        (cand / "knobs.toml").unlink()
        shutil.copyfile(BIASED, cand / "matmul.cpp")
        biased = _evaluate_until_decided(g, Candidate(cand, ["matmul_cpu/matmul.cpp"]), best)
        assert not biased.accepted and biased.stage == "e2e", biased.summary()
        assert biased.check is not None and biased.check.passed and biased.speedup_lo > 1 + g.task.manifest.min_gain
        assert "training moved off the reference: last-10 mean loss" in biased.reason and " ref (+" in biased.reason
        assert "every earlier stage passed: faster" in biased.reason
        assert summary(biased.e2e).startswith("FAIL, last-10 mean loss")
    finally:
        g.close()


# ---- the attention model (tools/e2e_attention.py): its plumbing on the CPU, a few steps --------------

def _backward_kernel(calls):
    """The flash_attn_bwd contract (q, k, v, o, do, lse -> dq, dk, dv, with workspaces) in torch."""
    from tools.e2e_attention import _reference_attention

    def kernel(dims, inputs):
        calls.append((dims, sorted(inputs)))
        assert dims["kv_heads"] == dims["heads"] and dims["causal"] is True
        with torch.enable_grad():  # called from inside autograd's backward, where grad mode is off
            q, k, v = (inputs[n].float().requires_grad_(True) for n in ("q", "k", "v"))
            grads = torch.autograd.grad(_reference_attention(q, k, v), (q, k, v), inputs["do"].float())
        return {n: g.to(torch.bfloat16) for n, g in zip(("dq", "dk", "dv"), grads)} | {"ws_dq": torch.zeros(1)}

    return kernel


def test_attention_model_forward_and_backward_patterns_match_the_reference():
    """The forward task's script with the spec's reference as the kernel, and the backward pattern with
    a torch backward, train as the all-reference model does (bf16 rounding apart), in a few steps."""
    from tools.e2e import ReferenceKernel, load_script
    from tools.e2e_attention import attention_op, train, train_backward
    from tools.spec import load_spec

    torch.set_num_threads(1)
    steps, cpu = 3, torch.device("cpu")
    ref = train(attention_op(), 5, steps, cpu)
    fwd_task = load_task(ROOT / "kernels" / "flash_attn_fwd")
    assert fwd_task.manifest.e2e is not None and fwd_task.manifest.e2e.when == "accept"
    script = load_script(fwd_task.e2e_path)
    fwd = script.train(ReferenceKernel(load_spec(fwd_task.spec_path)), 5, steps, cpu)
    calls = []
    bwd = train_backward(_backward_kernel(calls), 5, steps, cpu)
    assert len(calls) == 2 * steps and calls[0][1] == ["do", "k", "lse", "o", "q", "v"]
    bwd_task = load_task(ROOT / "kernels" / "flash_attn_bwd")  # the real backward spec: names, shapes, dtypes
    assert bwd_task.manifest.e2e is not None
    spec_bwd = load_script(bwd_task.e2e_path).train(ReferenceKernel(load_spec(bwd_task.spec_path)), 5, steps, cpu)
    for curve in (fwd, bwd, spec_bwd):
        assert len(curve) == steps and all(math.isfinite(x) for x in curve)
        assert curve[0] == pytest.approx(ref[0], rel=1e-3) and curve[-1] == pytest.approx(ref[-1], rel=2e-2)


def test_report_line_per_attempt():
    from agent.run_view import _e2e_line

    rep = E2EReport(passed=False, reason="training moved off the reference: last-10 mean loss 7.3e-12 vs 3.9e-12 ref "
                    "(+87.00%, bound 5%), 40 steps", seconds=0.2)
    assert _e2e_line(rep.model_dump(mode="json")) == "FAIL, last-10 mean loss 7.3e-12 vs 3.9e-12 ref (+87.00%, bound 5%), 40 steps, 0.2 s"
    assert _e2e_line(None) == "" and _e2e_line({"passed": "?"}) == "(unreadable e2e figures)"


def test_briefing_names_the_long_check_and_the_e2e_stage(tmp_path):
    from agent.briefing import _check_text

    t = load_task(task_copy(tmp_path, when="every:3", extra='\n[check]\nquick = ["one"]\ngate_rounds = 3\n', small=False))
    text = _check_text(t)
    assert "(3 calls each)" in text and "your check tool runs the quick set only: one" in text
    assert "on every 3th accept, an end-to-end training check" in text and "within 5%" in text
    assert "end-to-end" not in _check_text(load_task(TASK))  # when = "export": not the agent's concern
