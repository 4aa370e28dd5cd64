"""tools/sass.py: the parser on a captured listing, then real nvcc + cuobjdump on tiny kernels (no GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tools.fmt import kernel_name
from tools.sass import (
    KernelSass,
    SassError,
    SassSummary,
    dump_sass,
    find_cuobjdump,
    find_nvdisasm,
    format_mix,
    parse_sass,
    sass_excerpt,
    sass_mix,
)

# The shape of `cuobjdump --dump-sass` output for sm_90a: section headers, `Function :` blocks,
# one instruction line plus one encoding line per instruction, and the linker's tail padding.
HEADER = """
Fatbin elf code:
================
arch = {arch}
code version = [1,8]
host = linux
compile_size = 64bit

	code for {arch}
	.target	{arch}
"""
GEMM = """
		Function : _Z4gemmILi128EEvPKfPf
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */
                                                                                 /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                            /* 0x0000000000007919 */
        /*0020*/                   UMOV UR4, 0x400 ;                             /* 0x0000040000047882 */
        /*0030*/                   ULDC.64 UR6, c[0x0][0x208] ;                  /* 0x0000820000067ab9 */
        /*0040*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;             /* 0x000000ff0000720c */
        /*0050*/              @!P0 SYNCS.EXCH.64 URZ, [UR4], UR6 ;               /* 0x00000006ff0085b2 */
        /*0060*/                   ELECT P1, URZ, PT ;                           /* 0x00000000003f782f */
        /*0070*/               @P1 UTMALDG.2D [UR8], [UR10] ;                    /* 0x00000008000015b4 */
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR4], RZ ; /* 0x000000ffff0075a7 */
        /*0090*/              @!P2 BRA 0x80 ;                                    /* 0xfffffffc00e0a947 */
        /*00a0*/                   WARPGROUP.ARRIVE ;                            /* 0x00000000000079c5 */
        /*00b0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT, gsb0 ; /* 0x0 */
        /*00c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;               /* 0x00008000000079c5 */
        /*00d0*/                   MUFU.RCP R3, R2 ;                             /* 0x0000000200037308 */
        /*00e0*/                   FMUL R24, R24, R3 ;                           /* 0x0000000318187220 */
        /*00f0*/                   F2FP.BF16.F32.PACK_AB R4, R25, R24 ;          /* 0x000000181904723e */
        /*0100*/                   STS [R5], R4 ;                                /* 0x0000000405007388 */
        /*0110*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                 /* 0x0000000000007b1d */
        /*0120*/                   LDS.U.128 R8, [R6] ;                          /* 0x0000000006087984 */
        /*0130*/                   STG.E.128 desc[UR6][R10.64], R8 ;             /* 0x000000080a007986 */
        /*0140*/                   EXIT ;                                        /* 0x000000000000794d */
        /*0150*/                   BRA 0x150;                                    /* 0xfffffffc00fc7947 */
        /*0160*/                   NOP;                                          /* 0x0000000000007918 */
        /*0170*/                   NOP;                                          /* 0x0000000000007918 */
		..........
"""
SPILL = """
		Function : spill_hmma
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */
        /*0010*/                   IADD3 R1, R1, -0x10, RZ ;                     /* 0xfffffff001017810 */
        /*0020*/                   LDG.E.U16 R2, desc[UR4][R2.64] ;              /* 0x0000000402027981 */
        /*0030*/                   STL.64 [R1], R12 ;                            /* 0x0000000c01007387 */
        /*0040*/                   HFMA2.MMA R13, -RZ, RZ, 0, 0 ;                /* 0x00000000ff0d7435 */
        /*0050*/                   HMMA.16816.F32.BF16 R12, R4, R10, R12 ;       /* 0x0000000a040c723c */
        /*0060*/                   LDL.64 R12, [R1] ;                            /* 0x00000000010c7983 */
        /*0070*/                   SHFL.BFLY PT, R5, R0, 0x10, 0x1f ;            /* 0x0e001f0000057f89 */
        /*0080*/                   EXIT ;                                        /* 0x000000000000794d */
        /*0090*/                   BRA 0x90;                                     /* 0xfffffffc00fc7947 */
		..........
"""
LISTING = HEADER.format(arch="sm_90a") + GEMM + SPILL
GEMM_DEMANGLED = "void gemm<128>(float const*, float*)"


@pytest.fixture(scope="module")
def listing() -> dict[str, KernelSass]:
    return parse_sass(LISTING)


# --- parser on the captured listing --------------------------------------------------------------


def test_kernels_names_and_arch(listing):
    assert list(listing) == ["_Z4gemmILi128EEvPKfPf", "spill_hmma"]
    gemm = listing["_Z4gemmILi128EEvPKfPf"]
    assert gemm.mangled == "_Z4gemmILi128EEvPKfPf" and gemm.arch == "sm_90a"
    if shutil.which("c++filt"):
        assert gemm.name == GEMM_DEMANGLED
    assert listing["spill_hmma"].name == "spill_hmma"  # extern "C": nothing to demangle


def test_instruction_fields(listing):
    ins = listing["_Z4gemmILi128EEvPKfPf"].instructions
    assert len(ins) == 24  # padding stays in the listing, only the summary drops it
    tma = ins[7]
    assert (tma.address, tma.predicate, tma.opcode, tma.operands) == (0x70, "P1", "UTMALDG.2D", ["[UR8]", "[UR10]"])
    assert ins[5].predicate == "!P0" and ins[5].base == "SYNCS"
    assert ins[11].operands == ["R24", "gdesc[UR12]", "RZ", "!UPT", "gsb0"]
    assert ins[10].operands == [] and ins[10].opcode == "WARPGROUP.ARRIVE"
    assert listing["spill_hmma"].instructions[3].modifiers == ["64"]


def test_summary_counts_families_widths(listing):
    s = listing["_Z4gemmILi128EEvPKfPf"].summary
    assert s.total == 21  # the self-branch and NOPs after EXIT are alignment, not code
    assert s.families == {"move": 4, "tensor": 3, "sync": 3, "control": 2, "shared": 2, "int": 1,
                          "shuffle": 1, "tma": 1, "sfu": 1, "fp32": 1, "convert": 1, "global": 1}
    assert s.opcodes["WARPGROUP"] == 2 and s.opcodes["SYNCS"] == 2 and s.opcodes["BRA"] == 1
    assert s.memory == {"STS.32": 1, "LDS.128": 1, "STG.128": 1}
    assert s.mufu == {"RCP": 1}
    assert s.warnings == []
    assert SassSummary.model_validate_json(s.model_dump_json()) == s


def test_spill_and_mma_warnings(listing):
    s = listing["spill_hmma"].summary
    assert s.memory == {"LDG.16": 1, "STL.64": 1, "LDL.64": 1}
    assert s.families["local"] == 2 and s.families["half"] == 1 and s.families["tensor"] == 1
    assert len(s.warnings) == 2
    assert "local memory: 1 LDL, 1 STL" in s.warnings[0]
    assert "HMMA 1" in s.warnings[1] and "HGMMA" in s.warnings[1]


def test_format_mix_shows_each_kernels_ptxas_resources_beside_its_sass(listing):
    """`sass` (the agent tool) names each kernel as the trailers do and shows what ptxas reported for
    it: registers (with setmaxnreg), spill stores/loads, stack (local memory) bytes, and the LDL/STL
    the SASS holds; a kernel without ptxas figures gets no such line."""
    from tools.build import KernelResources

    res = [KernelResources(name="spill_hmma", mangled="spill_hmma", registers=255, spill_store_bytes=8,
                           spill_load_bytes=12, stack_bytes=16, setmaxnreg=[40, 232])]
    text = format_mix({k: v.summary for k, v in listing.items()}, resources=res)
    gemm, spill = text.split("\n\n")
    assert "ptxas:" not in gemm
    assert spill.startswith("spill_hmma [sm_90a]")
    assert ("  ptxas: 255 regs at entry; setmaxnreg 40 / 232, spills 8/12 B st/ld, 16 B stack; "
            "local memory in SASS: 1 LDL, 1 STL") in spill.splitlines()


def test_other_arch_keeps_both_and_skips_hopper_advice():
    kernels = parse_sass(LISTING + HEADER.format(arch="sm_80") + SPILL)
    old = kernels["spill_hmma [sm_80]"]
    assert old.arch == "sm_80" and kernels["spill_hmma"].arch == "sm_90a"
    assert len(old.summary.warnings) == 1 and "local memory" in old.summary.warnings[0]


def test_format_mix(listing):
    text = format_mix({k: v.summary for k, v in listing.items()})
    blocks = text.split("\n\n")
    assert len(blocks) == 2
    if shutil.which("c++filt"):
        assert blocks[0].startswith(f"{kernel_name(GEMM_DEMANGLED)} [sm_90a]: 21 instructions")  # short, as trailers name it
    assert "families: move 4, sync 3, tensor 3" in blocks[0]
    assert "ld/st widths: STS.32 1, LDS.128 1, STG.128 1" in blocks[0] and "mufu: RCP 1" in blocks[0]
    assert "WARNING" not in blocks[0]
    assert blocks[1].count("WARNING") == 2
    assert format_mix({}).startswith("no kernels")


def test_excerpt_context_and_gaps():
    text = sass_excerpt(LISTING, "gemm", r"MUFU|UTMALDG", context=1)
    lines = text.splitlines()
    assert lines[0].endswith("2 matches of /MUFU|UTMALDG/, 2 shown")
    assert lines[1:] == [
        "  /*0060*/ ELECT P1, URZ, PT ;",
        "> /*0070*/ @P1 UTMALDG.2D [UR8], [UR10] ;",
        "  /*0080*/ SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR4], RZ ;",
        "--",
        "  /*00c0*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "> /*00d0*/ MUFU.RCP R3, R2 ;",
        "  /*00e0*/ FMUL R24, R24, R3 ;",
    ]


def test_excerpt_caps_and_counts():
    text = sass_excerpt(LISTING, "_Z4gemm", r".", context=0, max_lines=10)
    lines = text.splitlines()
    assert "24 matches" in lines[0] and "10 shown" in lines[0] and "capped at 10 lines" in lines[0]
    assert len(lines) == 11
    merged = sass_excerpt(LISTING, "spill", "hmma|ldl", context=3).splitlines()  # case-insensitive
    assert merged[0].endswith("2 matches of /hmma|ldl/, 2 shown") and "--" not in merged
    assert "no line matches" in sass_excerpt(LISTING, "spill", "HGMMA")


def test_excerpt_kernel_selection_errors():
    with pytest.raises(SassError, match="no kernel matches 'nope'"):
        sass_excerpt(LISTING, "nope", "LDC")
    with pytest.raises(SassError, match="matches 2 kernels"):
        sass_excerpt(LISTING, "", "LDC")
    with pytest.raises(SassError, match="bad pattern"):
        sass_excerpt(LISTING, "spill", "(")


# --- finding and running the tools ---------------------------------------------------------------


def _fake_tool(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / name
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    return tool


def test_find_tools_off_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    expected = _fake_tool(tmp_path / "cuda" / "bin", "nvdisasm")
    assert find_nvdisasm() == expected
    on_path = _fake_tool(tmp_path / "onpath", "nvdisasm")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_nvdisasm() == on_path  # PATH wins


def test_dump_sass_errors(monkeypatch, tmp_path):
    with pytest.raises(SassError, match="no such file"):
        dump_sass(tmp_path / "missing.so")
    junk = tmp_path / "junk.so"
    junk.write_text("not an ELF")
    monkeypatch.setattr("tools.sass.find_cuobjdump", lambda: None)
    with pytest.raises(SassError, match="pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"):
        dump_sass(junk)


def test_dump_sass_reports_tool_stderr(tmp_path):
    if find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    junk = tmp_path / "junk.so"
    junk.write_text("not an ELF")
    with pytest.raises(SassError, match=r"failed \(exit \d+\): cuobjdump"):
        dump_sass(junk)


# --- real kernels: nvcc for sm_90a, cuobjdump, no GPU --------------------------------------------

KERNELS_CU = r"""
#include <cstdint>
extern "C" __global__ void vec4(const float4* __restrict__ a, float4* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float4 v = a[i]; v.x *= 2.f; b[i] = v; }
}
template <typename T> __global__ void fast_exp(const T* a, T* b) { b[threadIdx.x] = __expf(a[threadIdx.x]); }
template __global__ void fast_exp<float>(const float*, float*);
extern "C" __global__ void warp_sum(float* a) {
  float v = a[threadIdx.x];
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  a[threadIdx.x] = v;
}
extern "C" __global__ void indexed_array(const int* idx, float* out) {
  float arr[32];
  int t = threadIdx.x;
  for (int i = 0; i < 32; ++i) arr[i] = out[i * 32 + t];
  arr[idx[t] & 31] += 1.0f;  // a runtime-indexed write keeps the array in local memory
  out[t] = arr[idx[t + 32] & 31];
}
extern "C" __global__ void mma_sync(const unsigned* a, const unsigned* b, float* c) {
  float d[4] = {0, 0, 0, 0};
  int t = threadIdx.x;
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[4 * t]), "r"(a[4 * t + 1]), "r"(a[4 * t + 2]), "r"(a[4 * t + 3]),
                 "r"(b[2 * t]), "r"(b[2 * t + 1]));
  for (int i = 0; i < 4; ++i) c[4 * t + i] = d[i];
}
extern "C" __global__ void wgmma(const uint64_t* desc, float* c) {
  float d[4] = {0, 0, 0, 0};
  asm volatile("wgmma.fence.sync.aligned;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, 1, 1, 1, 0, 0;\n"
               "wgmma.commit_group.sync.aligned;\n"
               "wgmma.wait_group.sync.aligned 0;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(desc[0]), "l"(desc[1]));
  for (int i = 0; i < 4; ++i) c[4 * threadIdx.x + i] = d[i];
}
"""


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return next((str(Path(h) / "bin" / "nvcc") for h in homes if h and (Path(h) / "bin" / "nvcc").is_file()), None)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict[str, KernelSass]]:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    if find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    folder = tmp_path_factory.mktemp("sass")
    (folder / "kernels.cu").write_text(KERNELS_CU)
    lib = folder / "libkernels.so"
    cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90a,code=sm_90a",
           "-o", str(lib), str(folder / "kernels.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return lib, parse_sass(dump_sass(lib))


def _kernel(kernels: dict[str, KernelSass], part: str) -> SassSummary:
    (match,) = [k for k in kernels.values() if part in k.mangled]
    return match.summary


def test_real_kernels_present(built):
    _, kernels = built
    assert {"vec4", "warp_sum", "indexed_array", "mma_sync", "wgmma"} <= set(kernels)
    fast_exp = next(k for k in kernels.values() if "fast_exp" in k.mangled)
    assert fast_exp.mangled.startswith("_Z") and fast_exp.arch == "sm_90a"
    if shutil.which("c++filt"):
        assert fast_exp.name == "void fast_exp<float>(float const*, float*)"


def test_real_vectorised_loads(built):
    s = _kernel(built[1], "vec4")
    assert s.memory.get("LDG.128", 0) >= 1 and s.memory.get("STG.128", 0) >= 1
    assert "LDG.32" not in s.memory and s.warnings == []


def test_real_mufu_and_shuffle(built):
    assert _kernel(built[1], "fast_exp").mufu.get("EX2", 0) >= 1
    s = _kernel(built[1], "warp_sum")
    assert s.opcodes["SHFL"] == 5 and s.families["shuffle"] == 5


def test_real_local_memory_warning(built):
    s = _kernel(built[1], "indexed_array")
    assert s.families["local"] >= 2 and s.opcodes["LDL"] >= 1 and s.opcodes["STL"] >= 1
    assert any(w.startswith("local memory") for w in s.warnings)


def test_real_tensor_cores(built):
    hmma = _kernel(built[1], "mma_sync")
    assert hmma.opcodes.get("HMMA", 0) >= 1 and hmma.families["tensor"] >= 1
    assert any("HMMA" in w and "HGMMA" in w for w in hmma.warnings)
    wg = _kernel(built[1], "wgmma")
    assert wg.opcodes.get("HGMMA", 0) >= 1 and wg.opcodes.get("WARPGROUP", 0) >= 1
    assert wg.families["tensor"] >= 2 and wg.warnings == []


def test_real_mix_format_and_excerpt(built):
    lib, kernels = built
    mix = sass_mix(lib)
    assert mix == {key: k.summary for key, k in kernels.items()}
    text = format_mix(mix)
    assert text.count("\n\n") == len(mix) - 1
    assert "WARNING local memory" in text and "LDG.128" in text
    excerpt = sass_excerpt(lib, "vec4", r"LDG", context=2)
    assert "1 matches of /LDG/, 1 shown" in excerpt.splitlines()[0]
    assert "> /*" in excerpt and "LDG.E.128" in excerpt


def test_cp_async_is_not_counted_as_tma():
    """A Triton kernel pipelined with cp.async (LDGSTS) once read "tma 48" in the mix: the families
    keep Hopper's tensor memory accelerator and the per-thread async copy apart."""
    from tools.sass import family_of

    assert family_of("LDGSTS") == "cp.async" and family_of("LDGDEPBAR") == "sync"
    assert family_of("UTMALDG") == "tma" and family_of("UBLKCP") == "tma"
