"""The briefing an agent starts from: shapes with their roofline, baseline and comparator figures, knobs."""

from pathlib import Path
from types import SimpleNamespace

from agent.briefing import briefing, briefing_fields, ledger, peak_rates
from agent.policies.base import Budget
from tools.task import load_task

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def fake_session(task_name: str, bench: list[dict]) -> SimpleNamespace:
    task = load_task(KERNELS / task_name)
    return SimpleNamespace(
        gate=SimpleNamespace(task=task), ws=SimpleNamespace(task_path=task.root),
        baseline={"device": {"name": "NVIDIA H200", "driver": "580.159.04", "sm_count": 132},
                  "build": {"compiler": "nvcc 13.0, V13.0.88"}, "bench": {"shapes": bench}},
        budget=Budget(max_turns=50, max_cost_usd=10), attempts=lambda: [], notes_path=Path("/nonexistent"),
        best_commit="0" * 40,
    )


def test_flash_briefing_has_roofline_baseline_and_comparators():
    flops = 4 * 16 * 16 * 1024 * 1024 * 128  # d128_s1k: b=16, h=16, s=1k, d=128
    bench = [{"shape": "d128_s1k", "flops": flops, "bytes": 6.7e7, "kernel": {"median": 1.823e-3},
              "comparators": {"sdpa_flash": {"median": 444.9e-6}, "sdpa_cudnn": {"median": 263.0e-6}}}]
    session = fake_session("flash_attn_fwd", bench)
    flops_peak, bytes_peak = peak_rates(session.gate.task, session.baseline["device"])
    assert flops_peak == 690e12 and bytes_peak == 4.24e12  # bf16 tensor cores on an H200, measured
    fields = briefing_fields(session)
    row = next(l for l in fields["bench_table"].splitlines() if l.startswith("| d128_s1k |"))
    floor_us = flops / 690e12 * 1e6
    assert f"{floor_us:.1f} us" in row and "compute" in row and "1.823 ms" in row
    assert f"{100 * floor_us * 1e-6 / 1.823e-3:.1f}%" in row
    assert "sdpa_flash 444.9 us" in row and "sdpa_cudnn 263.0 us" in row
    assert "BLOCK_M" in fields["knobs_table"] and "NVIDIA H200" in fields["gpu_name"]
    text = briefing(session)
    assert "d128_s1k" in text and ("Hopper" in text or "wgmma" in text)  # the Hopper playbook is appended


def test_memory_bound_task_and_ledger():
    bench = [{"shape": "65536x4096", "flops": 5 * 65536 * 4096, "bytes": 4 * 65536 * 4096, "kernel": {"median": 454.3e-6},
              "comparators": {"torch.softmax": {"median": 829.5e-6}}}]
    session = fake_session("softmax", bench)
    row = next(l for l in briefing_fields(session)["bench_table"].splitlines() if l.startswith("| 65536x4096 |"))
    assert "memory" in row and f"{4 * 65536 * 4096 / 4.24e12 * 1e6:.1f} us" in row
    from agent.session import Attempt

    session.attempts = lambda: [Attempt(1, "Vectorise", knobs={"VEC": 8}, accepted=True, reason="faster",
                                        figures={"speedup": 1.12, "speedup_lo": 1.11, "speedup_hi": 1.13})]
    assert "#1 ACCEPTED x1.1200 [1.1100, 1.1300]: Vectorise knobs {'VEC': 8}" in ledger(session)


def test_a_cpu_briefing_lists_only_the_rules_that_can_apply_to_it():
    bench = [{"shape": "256x256x256", "flops": 2 * 256 ** 3, "bytes": 3 * 4 * 256 ** 2, "kernel": {"median": 5e-3}}]
    cpu = briefing_fields(fake_session("matmul_cpu", bench))["forbidden"]
    cuda = briefing_fields(fake_session("softmax", bench))["forbidden"]
    assert "cudaStream" not in cpu and "cuLaunch" not in cpu and "other streams" not in cpu
    assert "cudaStream" in cuda and "cuLaunch" in cuda
    assert "pthread_create" in cpu and "fopen" in cpu  # the rules that do apply stay
