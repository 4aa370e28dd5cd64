"""`kloop export RUN -o DIR`: the accepted kernel as a pip-installable torch.library op.

The session branch is the hand-made one of test_audit_cmd (an honest knob change, accepted-looking
commits with kloop's trailers, a run record naming them): the export's own audit runs scope, rules,
build, audit of what was built and check, which no noise can change."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_audit_cmd import RUN_ID, invoke, session_repo

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long  # CI time (16 min on 2026-12-07): run with `-m long`
def test_export_installs_and_its_own_test_passes(tmp_path):
    s = session_repo(tmp_path)
    out = tmp_path / "pkg"
    res = invoke("export", RUN_ID, "--runs-dir", str(s["runs"]), "-o", str(out))
    assert res.exit_code == 0, res.output
    assert "torch.ops.kloop.matmul_cpu" in res.stdout
    pkg = out / "kloop_matmul_cpu"
    prov = json.loads((pkg / "provenance.json").read_text())
    assert prov["commit"] == s["commits"][-1] and prov["run_id"] == RUN_ID and prov["base_commit"] == s["base"]
    assert prov["evidence"]["Kloop-Speedup"] == "1.5000" and prov["knobs"]["LOOP_ORDER"] == 1
    assert prov["audit"] == {"machine": prov["audit"]["machine"], "layers_run_up_to": "check",
                             "not_run": prov["audit"]["not_run"], "commits": 1, "rejected": 0}
    # the accepted source, the knob setting as a define, and the trusted spec with its helpers vendored
    build_py = (pkg / "_build.py").read_text()
    assert "'-DLOOP_ORDER=1'" in build_py and "'-DTILE=0'" in build_py
    assert (pkg / "kernel" / "matmul.cpp").read_text() == (s["repo"] / "kernels/matmul_cpu/matmul.cpp").read_text()
    assert "from ._kloop_spec import" in (pkg / "spec.py").read_text() and not (pkg / "kernel" / "spec.py").exists()

    # pip installs it (no kloop needed), then the package's own test runs from outside the checkout
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(out)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(PYTHONPATH=str(site), KLOOP_EXPORT_BUILD_DIR=str(tmp_path / "build"))
    test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(out / "tests")],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert test.returncode == 0, test.stdout[-3000:] + test.stderr[-2000:]
    assert "passed" in test.stdout and "failed" not in test.stdout
    # the installed package runs without kloop: calling the op imports none of kloop's modules
    probe = ("import sys, torch, kloop_matmul_cpu as k; c = k.op(torch.ones(2, 3), torch.ones(3, 4), 2, 4, 3);"
             "print(k.__file__, float(c.sum()), sorted(m for m in sys.modules if m.split('.')[0] in ('tools', 'agent')))")
    where = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.split() == [str(site / "kloop_matmul_cpu" / "__init__.py"), "24.0", "[]"]


def test_export_is_refused_when_the_audit_rejects_a_commit(tmp_path):
    s = session_repo(tmp_path, cheats=["cache"])
    out = tmp_path / "pkg"
    res = invoke("export", RUN_ID, "--runs-dir", str(s["runs"]), "-o", str(out))
    assert res.exit_code == 1, res.output
    assert "audit would now reject 1 of 2" in res.output and "Reuse the last product" in res.output
    assert not out.exists()


@pytest.mark.long  # CI time (16 min on 2026-12-07): run with `-m long`
def test_export_is_refused_when_the_tip_biases_training(tmp_path):
    """A kernel inside every per-call tolerance that biases training (tests/cheats/e2e_round_down.cpp):
    the export's audit runs the task's e2e check after the check (it once stopped at the check and
    exported it), and refuses."""
    s = session_repo(tmp_path, cheats=["e2e"])
    out = tmp_path / "pkg"
    res = invoke("export", RUN_ID, "--runs-dir", str(s["runs"]), "-o", str(out))
    assert res.exit_code == 1, res.output
    assert "audit would now reject 1 of 2" in res.output and "Round the sums" in res.output
    assert "e2e: FAIL" in res.output and "mean loss" in res.output and "bound 5%" in res.output
    assert not out.exists()


def test_export_refuses_a_folder_that_is_not_empty(tmp_path):
    s = session_repo(tmp_path)
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    res = invoke("export", RUN_ID, "--runs-dir", str(s["runs"]), "-o", str(out))
    assert res.exit_code == 2 and "not an empty folder" in res.output
    assert (out / "mine.txt").read_text() == "keep" and len(list(out.iterdir())) == 1


def test_op_signature_of_each_shipped_task():
    from agent.export import op_signature
    from agent.locations import shipped_tasks_dir
    from tools.spec import load_spec
    from tools.task import load_task

    want = {"matmul_cpu": (["a", "b"], ["c"], ["m", "n", "k"]), "softmax": (["x"], ["y"], ["rows", "cols"])}
    for name, (ins, outs, dims) in want.items():
        task = load_task(shipped_tasks_dir() / name)
        sig = op_signature(task, load_spec(task.root / task.manifest.spec))
        assert (sig.inputs, sig.outputs, [d for d, _ in sig.dims]) == (ins, outs, dims), name


def test_a_triton_task_exports_its_built_cubins_and_needs_no_triton_to_load(tmp_path):
    """A Triton task's package: the bundle of cubins kloop's sandboxed build makes of the accepted source with
    the accepted knobs, kloop's driver launcher vendored, no Triton or kloop import at run time. Without a GPU
    here the op is registered, its fake traces, and calling it says it needs a CUDA GPU; the package's own test
    (`tests/`) runs the op against the reference on a GPU."""
    pytest.importorskip("triton")
    import git
    import shutil

    from agent.export import export
    from agent.gate import GateConfig
    from agent.reaudit import AuditReport, AuditTarget
    from tests.test_audit_cmd import _commit

    repo = tmp_path / "repo"
    (repo / "kernels").mkdir(parents=True)
    shutil.copytree(ROOT / "kernels" / "rmsnorm_triton", repo / "kernels" / "rmsnorm_triton")
    r = git.Repo.init(repo, initial_branch="main")
    r.git.add(A=True)
    r.index.commit("the shipped task")
    base = r.head.commit.hexsha
    r.git.checkout("-b", "kloop/triton-run")
    (repo / "kernels" / "rmsnorm_triton" / "knobs.toml").write_text("NUM_WARPS = 8\nBLOCK = 2048\n")
    tip = _commit(r, "Eight warps, 2048-wide blocks", 1)
    target = AuditTarget(repo=repo, branch="kloop/triton-run", base=base, task_rel="kernels/rmsnorm_triton",
                         run_id="triton-run", gate_config=GateConfig(), source="branch trailers")

    def no_gpu_audit(t, no_timing=True):
        return AuditReport(run_id=t.run_id, branch=t.branch, repo=str(t.repo), base=t.base, task_rel=t.task_rel,
                           source=t.source, upto="audit", not_run="the check needs a CUDA GPU", machine="this CPU box")

    out = tmp_path / "pkg"
    res = export(target, out, run_audit=no_gpu_audit)
    assert res.op == "torch.ops.kloop.rmsnorm_triton" and res.commit == tip
    pkg = out / "kloop_rmsnorm_triton"
    bundle = json.loads((pkg / "kernel.bundle.json").read_text())
    assert bundle["format"] == "kloop-triton-1" and bundle["knobs"]["NUM_WARPS"] == 8 and bundle["knobs"]["BLOCK"] == 2048
    assert bundle["kernels"] and all(k["cubin"] and k["num_warps"] == 8 for k in bundle["kernels"])
    prov = json.loads((pkg / "provenance.json").read_text())
    assert prov["built"]["compiler"].startswith("triton ") and prov["built"]["arch"] == "sm_90a"
    assert "ninja" not in (out / "pyproject.toml").read_text() and "kernel.bundle.json" in (out / "pyproject.toml").read_text()

    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(out)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-2000:]
    assert (site / "kloop_rmsnorm_triton" / "kernel.bundle.json").is_file()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(PYTHONPATH=str(site), CUDA_VISIBLE_DEVICES="")
    # Triton blocked as if not installed (torch's own dispatch looks for it and copes when it is absent)
    probe = ("import sys; sys.modules['triton'] = None\n"
             "import torch, kloop_rmsnorm_triton as k\n"
             "try:\n"
             "    k.op(torch.ones(4, 1024, dtype=torch.bfloat16), torch.ones(4, 1024, dtype=torch.bfloat16), torch.ones(1024, dtype=torch.bfloat16), 4, 1024)\n"
             "except RuntimeError as e:\n"
             "    print('refused:', e)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tools', 'agent') or m.startswith('triton.')))\n"
             "from torch._subclasses.fake_tensor import FakeTensorMode\n"
             "with FakeTensorMode():\n"
             "    x = torch.empty(4, 1024, dtype=torch.bfloat16, device='cuda'); w = torch.empty(1024, dtype=torch.bfloat16, device='cuda')\n"
             "    h, y = k.op(x, x, w, 4, 1024)\n"
             "print(tuple(h.shape), h.dtype, tuple(y.shape))\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert "refused:" in lines[0] and "needs a CUDA GPU" in lines[0], run.stdout
    assert lines[1] == "[]", run.stdout  # no kloop module loaded, and none needed of Triton
    assert lines[2].startswith("(4, 1024) torch.bfloat16 (4, 1024)"), run.stdout  # the fake traces
    # the package's own test collects and, with no GPU here, skips (on a GPU it checks every check shape)
    test = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(out / "tests")],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert test.returncode in (0, 5), test.stdout[-3000:] + test.stderr[-2000:]
    assert "error" not in test.stdout.lower() and "needs a CUDA GPU" in test.stdout, test.stdout[-2000:]
