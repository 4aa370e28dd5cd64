"""Triton tasks on a machine without a GPU: the shipped ones build ahead of time (ptxas registers and
spills, the SASS mix, the audit of what was built), the static rules and the audit reject the Triton
cheat corpus, the runner's launch packs exactly the task's parameters (a fake driver records it).
The check and the tuner on the H200: tests/gpu/test_triton_tasks.py."""

from __future__ import annotations

import ctypes
import inspect
import shutil
from pathlib import Path

import pytest

from tests.triton_cheats import ROOT, TR_CHEATS, candidates, kind_of
from tools.build import build
from tools.task import TaskError, load_task
from tools.triton_build import triton_version

pytestmark = pytest.mark.skipif(triton_version() is None, reason="triton is not installed (pip install -e '.[triton]')")
FA, FA_CUDA, RMS = ROOT / "kernels" / "flash_attn_fwd_triton", ROOT / "kernels" / "flash_attn_fwd", ROOT / "kernels" / "rmsnorm_triton"


@pytest.fixture(scope="module")
def shipped(kernel_build_cache):  # the cache tests/test_kernels.py builds the starters in: each compiles once
    return {p.name: (load_task(p), build(load_task(p), cache_dir=kernel_build_cache)) for p in (FA, RMS)}


def test_shipped_tasks_build_audit_and_show_ptxas_and_sass(shipped):
    from tools.audit import audit_task_build
    from tools.evaluate import sass_summary

    want = {"flash_attn_fwd_triton": {f"attn_fwd[HEAD_DIM={d},IS_CAUSAL={c}]" for d in (64, 128) for c in (False, True)},
            "rmsnorm_triton": {"add_rmsnorm"}}
    for name, (task, res) in shipped.items():
        assert res.ok, res.error_text()
        assert res.compiler == f"triton {triton_version()}"
        assert {k.name for k in res.kernels} == want[name]
        for k in res.kernels:
            assert k.registers and 8 <= k.registers <= 255 and k.arch == "sm_90a", k
            assert k.spill_store_bytes == 0 and k.spill_load_bytes == 0, k  # the baselines do not spill
        report = audit_task_build(task, Path(res.build_dir))
        assert report.ok and report.cubins == len(want[name]), report.reason()
        mix, err = sass_summary(task, res.lib)
        if err and "not found" in err:
            pytest.skip(err)
        assert err is None and set(mix) == want[name], (err, list(mix))
        assert all(m["total"] > 50 and m["families"].get("global") for m in mix.values())
    # attention runs on the tensor cores; its dynamic shared memory is Triton's (> 48 KiB at d=128)
    fa = {k.name: k for k in shipped["flash_attn_fwd_triton"][1].kernels}
    assert fa["attn_fwd[HEAD_DIM=128,IS_CAUSAL=False]"].smem_bytes > 48 * 1024


def test_knobs_change_the_build_and_the_key(shipped, tmp_path):
    task, base = shipped["rmsnorm_triton"]
    other = build(task, {"BLOCK": 4096, "NUM_WARPS": 8}, cache_dir=Path(base.build_dir).parent)
    assert other.ok and other.key != base.key
    from tools.triton_build import load_bundle

    rec = load_bundle(other.lib)["kernels"][0]
    assert rec["constexprs"] == {"BLOCK": 4096, "ROW_IN_REGISTERS": 0} and rec["num_warps"] == 8 and rec["num_stages"] == 1
    assert rec["types"][0] == "*bf16:16" and rec["extra_params"] in (0, 1, 2)
    from tools.build import code_digest

    assert code_digest(other.lib) != code_digest(base.lib)
    # a comment moves every line below it: a new build, the same code (the session refuses it as a re-draw)
    moved = tmp_path / "moved"
    shutil.copytree(RMS, moved)
    (moved / "rmsnorm.py").write_text((moved / "rmsnorm.py").read_text().replace("@triton.jit", "# moved\n\n@triton.jit"))
    same = build(task, src_root=moved, cache_dir=Path(base.build_dir).parent)
    assert same.ok and same.key != base.key and code_digest(same.lib) == code_digest(base.lib)
    # the cache key follows the Triton version (the compiler)
    from tools import build as build_mod

    assert "triton" in build_mod.compiler_version("triton")


def test_flash_attn_triton_shares_the_cuda_tasks_spec_and_shapes():
    """The two languages compare on one table: same shapes, tolerances, inputs, reference, figures."""
    from tools.spec import load_spec

    a, b = load_task(FA).manifest, load_task(FA_CUDA).manifest
    assert a.shapes == b.shapes and a.tolerance == b.tolerance and a.tolerance_for == b.tolerance_for
    assert a.compute_unit == b.compute_unit and a.min_gain == b.min_gain
    sa, sb = load_spec(FA / "spec.py").module, load_spec(FA_CUDA / "spec.py").module
    for fn in ("make_inputs", "make_outputs", "reference", "attention_reference", "flops", "bytes_moved", "input_kind",
               "scale_of", "_dims", "_sdpa"):
        assert inspect.getsource(getattr(sa, fn)) == inspect.getsource(getattr(sb, fn)), fn
    assert set(sa.COMPARATORS) == set(sb.COMPARATORS)


def test_manifest_errors_name_the_field(tmp_path):
    t = tmp_path / "t"
    shutil.copytree(RMS, t)
    text = (t / "task.toml").read_text()
    (t / "task.toml").write_text(text.replace('hidden = "i32"', 'hidden = "int"'))
    with pytest.raises(TaskError, match=r'triton.kernels\[0\] "add_rmsnorm".signature.*.int. is not one of'):
        load_task(t)
    (t / "task.toml").write_text(text.replace('num_warps = "NUM_WARPS"', 'num_warps = "WARPS"'))
    with pytest.raises(TaskError, match="neither an int nor a knob name"):
        load_task(t)
    (t / "task.toml").write_text(text.replace("[triton]\n", "[notriton]\n").replace("[[triton.kernels]]", "[[notriton.kernels]]"))
    with pytest.raises(TaskError):
        load_task(t)


# ---- the corpus -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from agent.gate import Gate

    trusted = tmp_path_factory.mktemp("trusted") / "rmsnorm_triton"
    shutil.copytree(RMS, trusted)
    gate = Gate(trusted, "kernels/rmsnorm_triton")
    gate.config.standby = False
    return gate, candidates(gate, tmp_path_factory.mktemp("cands"), TR_CHEATS)


def test_corpus_covers_each_layer():
    kinds = [kind_of(p)[0] for p in TR_CHEATS]
    assert kinds.count("static") >= 8 and kinds.count("audit") >= 1 and kinds.count("check") >= 3


@pytest.mark.parametrize("cheat", [p.stem for p in TR_CHEATS if kind_of(p)[0] == "static"])
def test_static_kinds_rejected_by_the_rules_and_by_the_build(corpus, cheat):
    gate, cands = corpus
    expect = kind_of(next(p for p in TR_CHEATS if p.stem == cheat))[1]
    hits = gate.static_hits(cands[cheat])
    assert hits and any(expect in h for h in hits), hits
    assert all(h.startswith("rmsnorm.py:") for h in hits)
    # the build refuses it too (nothing of it is imported: the compile never starts)
    res = gate.build(cands[cheat])
    assert not res.ok and "static rule" in res.error_text() and expect in res.error_text(), res.error_text()
    assert not (Path(res.build_dir) / "out").exists()


@pytest.mark.parametrize("cheat", [p.stem for p in TR_CHEATS if kind_of(p)[0] in ("audit", "check")])
def test_audit_and_check_kinds(corpus, cheat):
    """audit kinds: rules pass, the build succeeds, the audit rejects naming the rule; check kinds get
    past both (only the check can stop them: tests/gpu/test_triton_tasks.py)."""
    gate, cands = corpus
    kind, expect = kind_of(next(p for p in TR_CHEATS if p.stem == cheat))
    assert gate.static_hits(cands[cheat]) == []
    res = gate.build(cands[cheat])
    assert res.ok, res.error_text()
    report = gate.audit(res)
    if kind == "audit":
        assert not report.ok and expect in report.reason(), report.reason()
    else:
        assert report.ok, report.reason()


def test_rules_accept_the_shipped_sources_and_name_line_and_reason():
    from tools.triton_rules import check_source

    for p in (FA / "flash_attn_fwd.py", RMS / "rmsnorm.py"):
        found, kernels = check_source(p.name, p.read_text())
        assert found == [] and kernels
    src = "import triton\nimport triton.language as tl\n\n@triton.jit\ndef k(X):\n    x = tl.extra.pkgutil\n"
    (v,) = check_source("k.py", src)[0]
    assert v.line == 6 and "pkgutil" in v.reason and str(v).startswith("k.py:6: `tl.extra.pkgutil`")
    # every public name of the installed triton.language is usable, but device output and bare modules
    import types

    import triton.language as tl

    from tools.triton_rules import NO_OUTPUT, resolve_triton_path

    refused = {n for n in tl.__all__ if resolve_triton_path("triton.language", [n])}
    assert refused == {n for n in tl.__all__ if n in NO_OUTPUT or isinstance(getattr(tl, n), types.ModuleType)}, refused
    # a module held in a local, or a module name rebound, would hide the paths from the resolution above
    for body in ("    m = tl.core\n    f = m.builtins.open\n", "    m = tl\n", "    tl = tl.core\n"):
        found = check_source("k.py", src.replace("    x = tl.extra.pkgutil\n", body))[0]
        assert found and all("module" in v.reason for v in found), (body, found)


# ---- the runner's launch, against a fake driver ---------------------------------------------------

class FakeDriver:
    """The few libcuda entry points tools/triton_launch.py calls, recording the launches."""

    def __init__(self, param_sizes):
        self.sizes, self.launches, self.attrs = param_sizes, [], []

    def cuModuleLoadData(self, mod, image):
        return 0

    def cuModuleGetFunction(self, fn, mod, name):
        return 0

    def cuFuncSetAttribute(self, fn, attr, value):
        self.attrs.append((attr, value))
        return 0

    def cuFuncGetParamInfo(self, fn, i, off, size):
        if i >= len(self.sizes):
            return 1
        ctypes.cast(size, ctypes.POINTER(ctypes.c_size_t))[0] = self.sizes[i]
        return 0

    def cuGetErrorString(self, status, msg):
        return 0

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.launches.append({"grid": (gx, gy, gz), "block": bx, "shared": shared, "params": params})
        return 0


def _record(**over):
    import base64

    rec = {"kernel": "k", "label": "k", "variant": {}, "constexprs": {"BLOCK": 128}, "num_warps": 4, "num_stages": 2,
           "params": ["X", "n", "eps"], "types": ["*bf16:16", "i32:16", "fp32"], "extra_params": 2, "shared": 64 * 1024,
           "global_scratch_size": 16, "global_scratch_align": 16, "profile_scratch_size": 0, "profile_scratch_align": 1,
           "cubin": base64.b64encode(b"\x7fELF").decode()}
    rec.update(over)
    return rec


def test_launch_packs_the_signature_checks_divisibility_and_zeroes_scratch(monkeypatch):
    import torch

    from tools import triton_launch as tlh

    fake = FakeDriver([8, 4, 4, 8, 8])
    monkeypatch.setattr(tlh, "driver", lambda: fake)
    k = tlh.TritonKernel(_record(), torch.device("cpu"))
    assert fake.attrs == [(tlh.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 64 * 1024)]  # > 48 KiB asked for
    x = torch.zeros(64, dtype=torch.bfloat16)
    if x.data_ptr() % 16:
        pytest.skip("unaligned CPU allocation")
    seen = []

    def launch_and_dirty(*a):
        fake.launches.append(a)
        buf = next(iter(k._scratch.values()))
        seen.append(int(buf.sum()))
        buf.fill_(7)  # what a kernel might leave in its scratch for the next call
        return 0

    monkeypatch.setattr(fake, "cuLaunchKernel", launch_and_dirty)
    k.launch((3, 2), [x, 32, 0.5], 0)
    k.launch((3, 2), [x, 48, 0.5], 0)
    assert seen == [0, 0], "the global scratch is zeroed before every launch"
    f, gx, gy, gz, bx, by, bz, shared, stream, params, extra = fake.launches[-1]
    assert (gx, gy, gz, bx, shared) == (3, 2, 1, 128, 64 * 1024)
    vals = [ctypes.cast(params[i], ctypes.POINTER(t))[0] for i, t in
            enumerate((ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint64))]
    assert vals[0] == x.data_ptr() and vals[1] == 48 and vals[2] == 0.5 and vals[3] % 16 == 0 and vals[4] == 0
    with pytest.raises(tlh.TritonLaunchError, match="not divisible by 16"):
        k.launch((1,), [x, 33, 0.5], 0)
    with pytest.raises(tlh.TritonLaunchError, match="not divisible by 16"):
        k.launch((1,), [x[1:], 32, 0.5], 0)
    with pytest.raises(tlh.TritonLaunchError, match="3 parameters"):
        k.launch((1,), [x, 32], 0)
    with pytest.raises(tlh.TritonLaunchError, match="does not fit i32"):
        k.launch((1,), [x, 1 << 40, 0.5], 0)
    # a cubin whose kernel takes other parameters than the task's signature never launches
    fake.sizes = [8, 4, 4, 8]
    with pytest.raises(tlh.TritonLaunchError, match="the task's signature makes"):
        tlh.TritonKernel(_record(), torch.device("cpu"))


def test_spec_launch_picks_the_variant_and_computes_the_grid(shipped, monkeypatch):
    """flash_attn_fwd_triton's trusted launch on a loaded bundle (fake driver): the variant by head dim
    and causality, grid (cdiv(seqlen, BLOCK_M), batch * heads), the arguments in the signature's order."""
    import torch

    from tools import triton_launch as tlh
    from tools.spec import load_spec

    task, res = shipped["flash_attn_fwd_triton"]
    fake = FakeDriver([8] * 5 + [4, 4] + [8, 8])
    monkeypatch.setattr(tlh, "driver", lambda: fake)
    lib = tlh.TritonModule(res.lib, torch.device("cpu"))
    assert len(lib.kernels) == 4 and lib.knobs == task.knob_defaults()
    with pytest.raises(tlh.TritonLaunchError, match="no compiled variant"):
        lib.kernel("attn_fwd", HEAD_DIM=128, IS_CAUSAL=1)  # 1 is not True: variants match exactly
    spec = load_spec(task.spec_path)
    dims = task.shape("d128_s100_causal").dims
    inputs = spec.make_inputs(dims, torch.Generator().manual_seed(0), torch.device("cpu"))
    outputs = spec.make_outputs(dims, inputs)
    if any(t.data_ptr() % 16 for t in [*inputs.values(), *outputs.values()]):
        pytest.skip("unaligned CPU allocation")
    spec.launch(lib, dims, inputs, outputs, 0)
    (call,) = fake.launches
    assert call["grid"] == (2, 2, 1) and call["block"] == 32 * 4 and call["shared"] > 48 * 1024
    p = call["params"]
    assert ctypes.cast(p[0], ctypes.POINTER(ctypes.c_uint64))[0] == inputs["q"].data_ptr()
    assert ctypes.cast(p[5], ctypes.POINTER(ctypes.c_int32))[0] == 100
    assert abs(ctypes.cast(p[6], ctypes.POINTER(ctypes.c_float))[0] - 128 ** -0.5) < 1e-7


def test_kloop_eval_of_a_triton_task_without_a_gpu(shipped, monkeypatch):
    """`kloop eval TASK --json` here: built, audited, SASS per kernel; check and timing say why not."""
    import json

    import torch
    from typer.testing import CliRunner

    if torch.cuda.is_available():
        pytest.skip("a GPU here: the check runs (tests/gpu/test_triton_tasks.py)")

    from agent.cli import app

    task, res = shipped["rmsnorm_triton"]
    monkeypatch.setenv("KLOOP_CACHE", str(Path(res.build_dir).parent))  # the fixture's build: cached
    out = CliRunner().invoke(app, ["eval", str(RMS), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["target"] == "triton" and data["build"]["ok"] and data["build"]["cached"]
    assert data["audit"]["ok"] and data["audit"]["cubins"] == 1
    assert data["build"]["kernels"][0]["registers"] > 0
    assert "add_rmsnorm" in data["sass"] or "not found" in (data["sass_error"] or "")
    assert "no CUDA GPU" in data["check_error"]


def test_in_kernel_tensor_descriptors_build_to_tma_loads(tmp_path):
    """The Triton showcase's v2 (K and V through `tl.make_tensor_descriptor`, Triton's way to Hopper's TMA
    from inside a kernel) passes the static rules and the audit, loads through the TMA in SASS (no cp.async
    left), and asks for the global scratch its descriptors are made in, which the bundle carries to the
    runner's launcher (tools/triton_launch.py sizes and zeroes it per launch)."""
    from tools.audit import audit_task_build
    from tools.evaluate import sass_summary
    from tools.triton_build import load_bundle

    src = tmp_path / "task"
    shutil.copytree(FA, src)
    shutil.copy(ROOT / "runs" / "showcase" / "flash_attn_fwd_triton" / "exploration" / "attn_v2.py", src / "flash_attn_fwd.py")
    task = load_task(FA)
    res = build(task, {"BLOCK_M": 128, "BLOCK_N": 64, "NUM_WARPS": 8, "NUM_STAGES": 3}, src_root=src,
                cache_dir=tmp_path / "cache")
    assert res.ok, res.error_text()
    assert audit_task_build(task, Path(res.build_dir)).ok
    assert all(r["global_scratch_size"] > 0 for r in load_bundle(res.lib)["kernels"])
    mix, err = sass_summary(task, res.lib)
    if err and "not found" in err:
        pytest.skip(err)
    assert err is None
    for name, m in mix.items():
        assert m["families"].get("tma") and not m["families"].get("cp.async"), (name, m["families"])


def test_a_failed_pass_names_itself_not_just_passmanager_failed(tmp_path):
    """Triton's MLIR pipeline fails with `RuntimeError: PassManager::run failed`, which says nothing; the
    diagnostics it wrote to fd 2 ("Pipeline failed while executing [`NVGPUWarpSpecialization` ...]") are kept per
    job and shown with the kernel's file and line (v3 of the showcase with warp specialisation at 4 warps: every
    such setting failed on the H100 sweep with the bare message)."""
    pytest.importorskip("triton")
    from tools.build import build

    src = tmp_path / "task"
    shutil.copytree(FA, src)
    shutil.copy(ROOT / "runs" / "showcase" / "flash_attn_fwd_triton" / "exploration" / "attn_v3.py", src / "flash_attn_fwd.py")
    res = build(load_task(FA), {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_WARPS": 4, "NUM_STAGES": 2}, src_root=src,
                cache_dir=tmp_path / "cache")
    if res.ok or "PassManager::run failed" not in res.error_text():
        pytest.skip(f"this Triton ({res.compiler}) does not fail that setting in a pass")
    for err in res.errors:
        assert err.file == "flash_attn_fwd.py" and err.line, err
        assert "Pipeline failed while executing" in err.message and "reproducer" not in err.message, err.message


def test_compiler_diagnostics_keep_the_task_s_lines_only(tmp_path):
    from tools.triton_build import compiler_diagnostics

    src = tmp_path / "src"
    src.mkdir()
    (src / "k.py").write_text("x = 1\n")
    log = tmp_path / "0.stderr"
    log.write_text("\n".join([
        "module {",
        "  tt.func public @k() { tt.return }",
        "}",
        f"{src}/k.py:12:1: error: Failures have been detected while processing an MLIR pass pipeline",
        f"{src}/k.py:12:1: note: Pipeline failed while executing [`TritonGPUPipeline` on 'builtin.module' operation]: "
        "reproducer generated at `std::errs, please share the reproducer above with Triton project.`",
        "/etc/passwd:1:1: error: root:x:0:0:root",
        f"{tmp_path}/k.py:2:1: error: a file of the same name outside the task's source",
        f"{src}/k.py:14:5: error: operand #0 does not dominate this use",
    ]))
    line, diags = compiler_diagnostics(log, src, "k.py")
    assert line == 12
    assert diags == ["note: Pipeline failed while executing [`TritonGPUPipeline` on 'builtin.module' operation]",
                     "error: operand #0 does not dominate this use"]
    assert compiler_diagnostics(tmp_path / "missing.stderr", src, "k.py") == (None, [])
