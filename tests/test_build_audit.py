"""The build tells the whole truth: the `build` tool (and `kloop build`, `kloop eval`) runs the gate's
own audit of what was built and says ok or the findings, not ok (exit 1) when the gate would refuse
the build at submit; ptxas advisories are shown per kernel, one short line each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.session_repo import KEY, ROOT, make_repo
from tools.build import BuildResult, KernelResources, format_build, kernel_advisories, shorten_advisory

GETENV = '#include <cstdlib>\n'
CALL = '  if (std::getenv("KLOOP_PEEK")) return 2;\n'


def test_one_audit_function_for_gate_eval_and_build_tool():
    import agent.gate
    import tools.audit
    import tools.evaluate

    assert agent.gate.audit_task_build is tools.audit.audit_task_build
    assert tools.evaluate.audit_task_build is tools.audit.audit_task_build


def test_ptxas_advisories_one_line_per_kernel():
    kernels = [KernelResources(name="void attn<128>(...)", mangled="_Z4attnILi128EEvPf", registers=168),
               KernelResources(name="other(float*)", mangled="_Z5otherPf", registers=32)]
    warnings = [
        "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "insufficient register resources for the wgmma pipeline in the function '_Z4attnILi128EEvPf'",
        "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "program dependence on compiler-inserted WG.AR in divergent path in the function '_Z4attnILi128EEvPf'",
        "ptxas warning : Stack size for entry function '_Z5otherPf' cannot be statically determined",
        "ptxas warning : a warning about no kernel in particular",
    ]
    ks = kernel_advisories(warnings, kernels)
    assert ks[0].advisories == [
        "C7511 wgmma serialized: insufficient register resources for the wgmma pipeline",
        "C7520 wgmma serialized: program dependence on compiler-inserted WG.AR in divergent path"]
    assert ks[1].advisories == ["Stack size cannot be statically determined"]
    text = format_build(BuildResult(ok=True, key="k", build_dir="/nowhere", compiler="nvcc 13.0", warnings=warnings,
                                    kernels=ks))
    lines = text.splitlines()
    attn = lines.index(next(line for line in lines if line.startswith("  attn<128>: ")))  # the short name
    assert lines[attn + 1] == ("    ptxas: C7511 wgmma serialized: insufficient register resources for the wgmma "
                               "pipeline; C7520 wgmma serialized: program dependence on compiler-inserted WG.AR in "
                               "divergent path")
    assert "_Z4attn" not in text.replace("_Z4attnILi128EEvPf", "") and text.count("warning:") == 1
    assert len(shorten_advisory("ptxas warning : " + "x" * 300, "_Z1f")) <= 110


def test_real_ptxas_warning_lands_on_its_kernel(tmp_path):
    if subprocess.run(["which", "nvcc"], capture_output=True).returncode:
        pytest.skip("needs nvcc")
    from tools.task import load_task

    task_dir = tmp_path / "t"
    subprocess.run([sys.executable, "-m", "agent.cli", "new", str(task_dir), "--target", "cuda"], check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    task = load_task(task_dir)
    src = task_dir / task.manifest.sources[0]
    src.write_text("__global__ void __launch_bounds__(1024, 4) bounded(int* out) { out[threadIdx.x] = 1; }\n"
                   + src.read_text())
    from tools.build import build

    r = build(task, cache_dir=tmp_path / "cache")
    assert r.ok, r.error_text()
    (k,) = [k for k in r.kernels if "bounded" in k.name]
    assert k.advisories == ["Value of threads per SM is out of range. .minnctapersm will be ignored"], (r.warnings, k)
    assert "    ptxas: Value of threads per SM is out of range" in format_build(r)
    assert all(not other.advisories for other in r.kernels if other is not k)


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KLOOP_")}
    env.update(PYTHONPATH=str(ROOT), ANTHROPIC_API_KEY=KEY,
               KLOOP_CACHE=os.environ.get("KLOOP_CACHE", str(tmp / "cache")), KLOOP_RUNS=str(tmp / "runs"))
    return env


@pytest.mark.slow
def test_build_runs_the_gates_audit(tmp_path, monkeypatch):
    from agent.policies.base import Budget
    from agent.session_service import SessionService

    task = make_repo(tmp_path)
    monkeypatch.setenv("KLOOP_CACHE", _env(tmp_path)["KLOOP_CACHE"])
    service = SessionService.start(task, "cli", Budget(), runs_root=tmp_path / "runs")
    try:
        ok = service.call("build", {})
        assert ok.ok and "audit: ok" in ok.text and ok.data["audit"]["ok"], ok.text
        src = service.session.ws.task_path / "matmul.cpp"
        text = src.read_text()
        marker = "  if (M < 0 || N < 0 || K < 0) return 1;\n"
        src.write_text(GETENV + text.replace(marker, marker + CALL))
        bad = service.call("build", {})
        assert not bad.ok and "build ok" in bad.text, bad.text
        assert "audit: REJECTED" in bad.text and "getenv" in bad.text and "[symbols]" in bad.text
        run_dir, wt = service.run_dir, service.session.ws.path
    finally:
        service.close()
    env = _env(tmp_path)
    res = subprocess.run([sys.executable, "-m", "agent.cli", "build"], cwd=wt, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 1 and "audit: REJECTED" in res.stdout, res.stdout + res.stderr
    # kloop eval on the same sources: the same audit, exit 1
    ev = subprocess.run([sys.executable, "-m", "agent.cli", "eval", str(wt / "kernels" / "matmul_cpu"), "--no-bench"],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ev.returncode == 1 and "audit: REJECTED" in " ".join(ev.stdout.split()), ev.stdout + ev.stderr
    assert run_dir.is_dir()
