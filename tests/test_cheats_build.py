"""The build-time cheat corpus (tests/cheats/bt_*): every kind is rejected by the gate, with a reason
naming the file and the rule, and the audit of what was built catches it on its own (with the
source rules skipped: they are hints, not the boundary). Honest kernels pass the audit.

Each cheat file says which audit rule must catch it (`// audit: RULE`); `build-fails` means the
sandboxed compiler cannot even read what it includes, and the failure must not show the file.
"""

from __future__ import annotations

import re
import shutil
import sysconfig
from pathlib import Path

import pytest

from agent.gate import Candidate, Gate
from tools import sandbox
from tools.audit import audit_build
from tools.build import build, compiler_version
from tools.task import load_task

ROOT = Path(__file__).resolve().parents[1]
CHEATS = Path(__file__).parent / "cheats"
CPU_CHEATS = sorted(CHEATS.glob("bt_*.cpp"))
CUDA_CHEATS = sorted(CHEATS.glob("bt_*.cu"))
PASSWD_LINE = "root:x:0:0"


def expected_rule(path: Path) -> str:
    m = re.search(r"^// audit: (\S+)", path.read_text(), re.M)
    assert m, f"{path}: no '// audit: RULE' line"
    return m.group(1)


def cheat_text(path: Path) -> str:
    return path.read_text().replace("@PYINCLUDE@", sysconfig.get_paths()["include"])


@pytest.fixture(scope="module")
def gates(tmp_path_factory):
    made = {}
    for task in ("matmul_cpu", "softmax"):
        trusted = tmp_path_factory.mktemp("trusted") / task
        shutil.copytree(ROOT / "kernels" / task, trusted)
        made[task] = Gate(trusted, f"kernels/{task}")
    return made


def candidate(gate: Gate, tmp: Path, text: str) -> tuple[Candidate, str]:
    src = gate.task.manifest.sources[0]
    folder = tmp / "cand"
    shutil.copytree(gate.trusted_dir, folder)
    (folder / src).write_text(text)
    return Candidate(task_dir=folder, changed=[f"{gate.task_rel}/{src}"]), src


def _needs(target: str) -> None:
    if compiler_version(target) == "missing":
        pytest.skip(f"no compiler for {target} tasks")


def _cases():
    return ([pytest.param("matmul_cpu", p, id=p.name) for p in CPU_CHEATS]
            + [pytest.param("softmax", p, id=p.name) for p in CUDA_CHEATS])


def test_corpus_is_complete():
    assert len(CPU_CHEATS) >= 18 and len(CUDA_CHEATS) >= 6
    assert {expected_rule(p) for p in CPU_CHEATS + CUDA_CHEATS} == {
        "syscall", "symbols", "load-time", "headers", "preprocessed", "build-fails"}


@pytest.mark.parametrize("task,path", _cases())
def test_gate_rejects_with_file_and_rule(gates, tmp_path, task, path):
    gate = gates[task]
    _needs(gate.task.target)
    cand, src = candidate(gate, tmp_path, cheat_text(path))
    v = gate.evaluate(cand, best=None)
    assert not v.accepted, v.summary()
    assert v.stage in ("static", "build"), v.summary()
    assert src in v.reason, v.reason
    rule = expected_rule(path)
    if v.stage == "static":
        assert "forbidden patterns" in v.reason and v.static_hits
    elif rule == "build-fails":
        assert v.reason.startswith("build failed")
    else:
        assert v.reason.startswith("audit of what was built") and f"[{rule}]" in v.reason, v.reason
    assert PASSWD_LINE not in v.model_dump_json()


@pytest.mark.parametrize("task,path", _cases())
def test_audit_alone_catches_it(gates, tmp_path, task, path):
    """Without the source rules: the sandboxed build and the audit of its objects still reject it."""
    gate = gates[task]
    _needs(gate.task.target)
    cand, src = candidate(gate, tmp_path, cheat_text(path))
    built = gate.build(cand)
    rule = expected_rule(path)
    if rule == "build-fails":
        assert not built.ok
        assert PASSWD_LINE not in built.model_dump_json()
        return
    assert built.ok, built.error_text()
    report = gate.audit(built)
    assert not report.ok
    assert any(f.rule == rule and f.file == src for f in report.findings), report.reason()


@pytest.mark.parametrize("name", ["bt_include_passwd.cpp", "bt_include_split.cpp"])
def test_outside_file_never_echoed_without_sandbox(tmp_path, monkeypatch, name):
    """Even where the compiler can read /etc/passwd (no sandbox), its text is withheld from the
    build errors and the log."""
    if not Path("/etc/passwd").is_file() or PASSWD_LINE not in Path("/etc/passwd").read_text():
        pytest.skip("no /etc/passwd with a root line here")
    _needs("cpu")
    monkeypatch.setenv("KLOOP_SANDBOX", "off")
    sandbox.status.cache_clear()
    try:
        folder = tmp_path / "task"
        shutil.copytree(ROOT / "kernels" / "matmul_cpu", folder)
        (folder / "matmul.cpp").write_text((CHEATS / name).read_text())
        task = load_task(folder)
        res = build(task, src_root=folder, cache_dir=tmp_path / "cache")
    finally:
        sandbox.status.cache_clear()
    assert not res.ok
    dumped = res.model_dump_json()
    assert PASSWD_LINE not in dumped and "/bin/bash" not in dumped
    assert "withheld" in dumped or "No such file" in dumped


HONEST = [
    ("matmul_cpu", {}), ("matmul_cpu", {"LOOP_ORDER": 1}), ("matmul_cpu", {"LOOP_ORDER": 1, "TILE": 64}),
    ("softmax", {}), ("softmax", {"VEC": 8}), ("softmax", {"VEC": 8, "ONLINE": 1}),
    ("paged_decode", {}), ("flash_attn_fwd", {}),
]


@pytest.mark.parametrize("task_name,knobs", HONEST, ids=[f"{t}-{k or 'baseline'}" for t, k in HONEST])
def test_honest_kernels_pass_the_audit(task_name, knobs):
    task = load_task(ROOT / "kernels" / task_name)
    _needs(task.target)
    res = build(task, knobs=knobs)
    assert res.ok, res.error_text()
    m = task.manifest
    report = audit_build(Path(res.build_dir), m.target, sources=m.sources, allowed_symbols=m.allowed_symbols,
                         extra_rules=[(f.pattern, f.reason) for f in m.forbidden])
    assert report.ok, report.reason()
    assert report.objects == len(m.sources) and report.headers > 1


TMA_HOST = r'''
#include <cuda.h>
// A TMA descriptor for a row-major bf16 matrix, 64x64 boxes, 128-byte swizzle (what a wgmma pipeline
// loads with cp.async.bulk.tensor): the driver's encoder is on the CUDA allow-list.
__global__ void tma_touch(const __grid_constant__ CUtensorMap map, int* out) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(&map) : "memory");
    if (threadIdx.x == 0) out[0] = 1;
}
extern "C" int kloop_make_map(void* base, int rows, int cols, CUtensorMap* map) {
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)cols * 2};
    cuuint32_t box[2] = {64, 64}, elem[2] = {1, 1};
    return (int)cuTensorMapEncodeTiled(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, elem,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}
'''


def test_tma_descriptor_from_the_host_passes_the_audit(gates, tmp_path):
    """TMA needs a tensor map encoded on the host by the driver: cuTensorMapEncodeTiled is allowed (the
    runner puts the driver in the global scope), while cudaGetDriverEntryPoint (bt_cuda_driver_entry)
    is not. The shipped softmax with a TMA helper added builds and passes the gate's audit."""
    gate = gates["softmax"]
    _needs(gate.task.target)
    shipped = (gate.trusted_dir / "softmax.cu").read_text()
    cand, _ = candidate(gate, tmp_path, shipped + TMA_HOST)
    built = gate.build(cand)
    assert built.ok, built.error_text()
    report = gate.audit(built)
    assert report.ok, report.reason()
    import ctypes.util
    from tools.libhost import _driver_in_global_scope
    if ctypes.util.find_library("cuda") is None:  # no driver here (CI): says so, never raises
        assert _driver_in_global_scope() is False


def test_the_flag_override_rule_refuses_overrides_and_lets_diagnostics_be():
    """`#pragma nv_diag_suppress` only silences a front-end warning (the v4 flash kernel had one for its
    unused wrappers, and the rule refused it on the H200 in stop 36); every pragma that changes code
    generation stays refused."""
    import re

    from tools.audit import source_rules

    rules = source_rules(1, "cuda")

    def hits(text):
        return [r for p, r in rules if re.search(p, text)]

    for ok in ("#pragma nv_diag_suppress 177", "#pragma nv_diag_default 177", "#pragma nv_diagnostic push",
               "#pragma unroll 4", "#pragma once"):
        assert hits(ok) == [], ok
    for bad in ("#pragma nv_abi preserve_n_data(16)", "#pragma nv_exec_check_disable", "#pragma nvcc something",
                '#pragma GCC optimize("O3")', "#pragma clang loop unroll(full)", '_Pragma("GCC optimize(3)")'):
        assert any("flag overrides" in r for r in hits(bad)), bad
