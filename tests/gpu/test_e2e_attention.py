"""On the GPU: the attention tasks' end-to-end stage (tools/e2e.py over tools/e2e_attention.py).

flash_attn_fwd: the honest baseline passes the e2e check; a kernel that passes every per-call tolerance
but lets each causal query see the next key with a small fixed weight (LEAK: a mask bug, O += LEAK *
v[i + 1]; the largest leak whose per-call error stays inside the check's bf16 tolerance on every check
shape, measured on the CPU with the spec's reference) is accepted by check and timing and rejected at
e2e.

flash_attn_bwd: the same bug in a backward. The causal mask lets key i + 1 into query i's P with the
fixed weight BWD_LEAK (P, and from it dS, dV, dK and dQ, as if the forward had that leak; the forward
is the reference's, so only the gradients are off). Emulated on the CPU (seeds 1-9, P and dS rounded to
bf16 as the kernel does): the per-call check passes at a weight of 3e-4 (worst norm-relative 0.42% of
the 1% bound) and fails at 7e-4 and the last-40 mean loss moves by -0.0065% or more at 3e-4,
the honest path by at most 0.0009%; the task's bound is 0.004% (bench/e2e_bwd_emulation.py).

Seconds per decision are printed (run with -s) for the README.

Run on the device machine: `python -m pytest -m gpu tests/gpu/test_e2e_attention.py -s` (skipped
without CUDA).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from agent.gate import Candidate, Gate, GateConfig
from tools.build import build
from tools.task import load_task

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
pytestmark = pytest.mark.gpu

LEAK = "1e-3f"
EPILOGUE = "*reinterpret_cast<__nv_bfloat162*>(o_row + c) = __floats2bfloat162_rn(acc.x * inv_l, acc.y * inv_l);"
LEAKY = """float lx = 0.f, ly = 0.f;  // the bias under test: the next key leaks into a causal row
            if (causal && qi + 1 < seqlen) {
                lx = LEAK * __bfloat162float(v[base + (size_t)(qi + 1) * D + c]);
                ly = LEAK * __bfloat162float(v[base + (size_t)(qi + 1) * D + c + 1]);
            }
            *reinterpret_cast<__nv_bfloat162*>(o_row + c) = __floats2bfloat162_rn(acc.x * inv_l + lx, acc.y * inv_l + ly);"""


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


BWD_LEAK = "3e-4f"
BWD_P = "const float p = masked ? 0.f : exp2f(sS[r * L::LDS + c] * scale_log2 - s_lse2[r]);"
BWD_LEAKY = ("const float p = (causal && kj == qi + 1 && kj < seqlen) ? LEAK  // the bias under test\n"
             "                          : masked ? 0.f : exp2f(sS[r * L::LDS + c] * scale_log2 - s_lse2[r]);")


def task_copy(tmp: Path, name: str = "flash_attn_fwd") -> Path:
    dest = tmp / name
    shutil.copytree(KERNELS / name, dest)
    return dest


def leaky_source(task: Path) -> None:
    src = task / "flash_attn_fwd.cu"
    text = src.read_text()
    assert EPILOGUE in text, "the baseline's epilogue changed: update the leak patch"
    src.write_text(text.replace(EPILOGUE, LEAKY.replace("LEAK", LEAK)))


def leaky_backward(task: Path) -> None:
    src = task / "flash_attn_bwd.cu"
    text = src.read_text()
    assert text.count(BWD_P) == 1, "the baseline's P changed: update the leak patch"
    src.write_text(text.replace(BWD_P, BWD_LEAKY.replace("LEAK", BWD_LEAK)))


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["flash_attn_fwd", "flash_attn_bwd"])
def test_e2e_passes_the_baseline_and_rejects_a_leaky_mask(name, tmp_path):
    task = task_copy(tmp_path, name)
    assert load_task(task).manifest.e2e is not None
    gate = Gate(task, name, GateConfig(max_seconds=4.0))
    try:
        t0 = time.monotonic()
        base = gate.evaluate(Candidate(task, []), None)
        assert base.accepted, base.summary()
        res, stages = gate.run_e2e(base.build.lib)  # the honest baseline, in a judge of its own
        print(f"\nbaseline e2e: {res.e2e and res.e2e.reason} ({stages}, {time.monotonic() - t0:.1f} s with the baseline)")
        assert res.e2e is not None and res.e2e.passed, res.e2e or res.error

        cand = tmp_path / "cand"
        shutil.copytree(task, cand)
        (leaky_source if name == "flash_attn_fwd" else leaky_backward)(cand)
        leaky = build(gate.task, src_root=cand)
        assert leaky.ok, leaky.error_text()
        v = gate.judge_built(leaky, None)  # the per-call check alone: today's gate before timing
        assert v.accepted, f"the leak must pass the per-call check: {v.summary()}"
        t1 = time.monotonic()
        res, stages = gate.run_e2e(leaky.lib)
        print(f"leaky mask e2e: {res.e2e and res.e2e.reason} ({stages}, {time.monotonic() - t1:.1f} s per decision)")
        assert res.e2e is not None and not res.e2e.passed, res.e2e
        assert "mean loss" in res.e2e.reason or "diverged" in res.e2e.reason
    finally:
        gate.close()
