"""tools/profile.py: parsing Nsight Compute's raw CSV, the summary, and the paths where it cannot run.

The two samples are real `ncu --csv --page raw` output from an NVIDIA H200 (Nsight Compute
2025.3.1, driver 580.159.04), trimmed to the columns kloop reads (ncu prints ~300 device and launch
attribute columns besides). NCU_RAW_TRANSPOSE_AXPY: a naive shared-memory transpose (32-way bank
conflicts on the store) and two launches of an axpy. NCU_RAW_CUBLAS_GEMM: a 4096^3 bf16 torch
matmul, a cuBLAS sm90 wgmma kernel; the program's own print sits between ncu's lines.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tools import profile as P

NCU_RAW_TRANSPOSE_AXPY = """\
==WARNING== Note: Running with unmodified GPU clocks. If not controlled otherwise, profiling results may be inconsistent.
==PROF== Connected to process 486 (/tmp/k)
==PROF== Disconnected from process 486
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","device__attribute_display_name","dram__bytes_read.sum","dram__bytes_write.sum","gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum","l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum","l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum","launch__occupancy_limit_blocks","launch__occupancy_limit_registers","launch__occupancy_limit_shared_mem","launch__occupancy_limit_warps","launch__registers_per_thread","launch__shared_mem_per_block_dynamic","launch__shared_mem_per_block_static","launch__waves_per_multiprocessor","lts__t_sector_hit_rate.pct","sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active","sm__maximum_warps_per_active_cycle_pct","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio","smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio","smsp__average_warps_issue_stalled_drain_per_issue_active.ratio","smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio","smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio","smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_membar_per_issue_active.ratio","smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_misc_per_issue_active.ratio","smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio","smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio","smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio","smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
"","","","","","","","","","","","","byte","byte","%","ns","","","","","block","block","block","block","register/thread","byte/block","byte/block","","%","%","%","%","%","%","%","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst"
"0","486","k","127.0.0.1","tr(float *, float *)","1","7","(32, 32, 1)","(4096, 1, 1)","0","9.0","NVIDIA H200","16,780,800","477,696","12.81","28,032","16,280","4,099,872","147,352","4,230,944","32","4","3","2","16","0","4,096","15.52","50.47","0","0","100","0","21.67","92.73","13.96","0.34","0.77","17.85","0","0.09","0.00","41.31","0.12","0","17.52","0.00","0.62","2.22","20.38","0","0","2.06"
"1","486","k","127.0.0.1","ax(float *, float *)","1","7","(256, 1, 1)","(16384, 1, 1)","0","9.0","NVIDIA H200","16,780,288","519,936","28.75","12,544","0","0","0","0","32","16","32","8","16","0","0","15.52","52.11","0","2.38","100","2.38","32.58","64.85","0","0.57","0.13","1.58","0","0.16","0","48.03","0.00","0","1.86","0","2.24","0.42","2.90","0","0","2.96"
"2","486","k","127.0.0.1","ax(float *, float *)","1","7","(256, 1, 1)","(16384, 1, 1)","0","9.0","NVIDIA H200","16,780,544","511,488","28.15","12,800","0","0","0","0","32","16","32","8","16","0","0","15.52","51.82","0","2.30","100","2.30","31.92","62.37","0","0.57","0.13","1.58","0","0.16","0","48.11","0.00","0","1.87","0.00","1.00","0.42","2.89","0","0","2.97"
"""

NCU_RAW_CUBLAS_GEMM = """\
==WARNING== Note: Running with unmodified GPU clocks. If not controlled otherwise, profiling results may be inconsistent.
==PROF== Connected to process 564 (/usr/bin/python3.12)
hello from the program
==PROF== Disconnected from process 564
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","device__attribute_display_name","dram__bytes_read.sum","dram__bytes_write.sum","gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum","l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum","l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum","launch__occupancy_limit_blocks","launch__occupancy_limit_registers","launch__occupancy_limit_shared_mem","launch__occupancy_limit_warps","launch__registers_per_thread","launch__shared_mem_per_block_dynamic","launch__shared_mem_per_block_static","launch__waves_per_multiprocessor","lts__t_sector_hit_rate.pct","sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active","sm__maximum_warps_per_active_cycle_pct","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio","smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio","smsp__average_warps_issue_stalled_drain_per_issue_active.ratio","smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio","smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio","smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_membar_per_issue_active.ratio","smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_misc_per_issue_active.ratio","smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio","smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio","smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio","smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"
"","","","","","","","","","","","","byte","byte","%","ns","","","","","block","block","block","block","register/thread","byte/block","byte/block","","%","%","%","%","%","%","%","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst","inst"
"0","564","python3.12","127.0.0.1","nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT","1","7","(384, 1, 1)","(2, 66, 1)","0","9.0","NVIDIA H200","148,473,344","28,035,072","20.76","176,704","907","131,494","1,128,298","641,259","32","1","1","5","168","213,188","0","1","71.26","5.94","2.97","18.75","95.04","90.05","14.66","6.01","0.06","0.06","0.00","3.70","0.05","0","3.68","0.27","0","2.92","0.00","0.12","0.09","0.03","0.01","0","1.57"
"1","564","python3.12","127.0.0.1","nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT","1","7","(384, 1, 1)","(2, 66, 1)","0","9.0","NVIDIA H200","148,384,768","27,772,928","20.65","177,344","894","136,443","1,083,915","659,768","32","1","1","5","168","213,188","0","1","70.77","5.94","2.97","18.75","95.11","90.23","14.63","5.99","0.06","0.06","0.00","3.77","0.05","0","3.66","0.27","0","2.93","0.00","0.13","0.09","0.03","0.01","0","1.57"
"""


# ---------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------


def test_parse_raw_page_per_launch():
    ks = P.parse_ncu_csv(NCU_RAW_TRANSPOSE_AXPY)
    assert [k.id for k in ks] == ["0", "1", "2"]
    tr, ax1, ax2 = ks
    assert tr.name == "tr(float *, float *)" and tr.short_name == "tr"
    assert tr.block == "(32, 32, 1)" and tr.grid == "(4096, 1, 1)"
    assert tr.duration_us == pytest.approx(28.032)  # 28,032 ns: thousands separator and unit handled
    assert tr.sm_throughput_pct == pytest.approx(21.67)
    assert tr.dram_throughput_pct == pytest.approx(12.81)
    assert tr.achieved_occupancy_pct == pytest.approx(92.73)
    assert tr.theoretical_occupancy_pct == pytest.approx(100)
    assert tr.occupancy_limiter == "warps"
    assert tr.registers_per_thread == 16 and tr.shared_mem_static == 4096
    assert tr.bank_conflicts_ld == 16_280 and tr.bank_conflicts_st == 4_099_872
    assert tr.shared_wavefronts_st == 4_230_944
    assert tr.dram_read_bytes == 16_780_800
    assert tr.tensor_pipe_pct == 0
    # the top five stall reasons, largest first; 'selected' is never one of them
    assert [s.reason for s in tr.stalls] == ["long_scoreboard", "short_scoreboard", "drain", "mio_throttle", "barrier"]
    assert tr.stalls[0].warps_per_issue == pytest.approx(41.31)
    assert ax1.short_name == "ax" and ax1.duration_us == pytest.approx(12.544)
    assert ax2.duration_us == pytest.approx(12.8)
    # every numeric column is kept, including ones not mapped to a field
    assert tr.metrics["launch__occupancy_limit_blocks"] == 32


def test_parse_hopper_wgmma_gemm():
    (k1, k2) = P.parse_ncu_csv(NCU_RAW_CUBLAS_GEMM)  # the program's own stdout line is skipped
    assert k1.short_name == "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
    assert k1.tensor_pipe_pct == pytest.approx(95.04)
    assert k1.tensor_wgmma_inst_pct == pytest.approx(5.94)
    assert k1.tensor_hmma_inst_pct == pytest.approx(2.97)
    assert k1.occupancy_limiter == "registers and shared memory"
    assert k1.registers_per_thread == 168 and k1.shared_mem_dynamic == 213_188
    assert "gmma" in [s.reason for s in k1.stalls]
    assert k1.stalls[0].reason == "barrier"


def test_by_kernel_merges_launches():
    result = P.ProfileResult(status="ok", kernels=P.parse_ncu_csv(NCU_RAW_TRANSPOSE_AXPY))
    groups = result.by_kernel()
    assert [g.short_name for g in groups] == ["tr", "ax"]
    ax = groups[1]
    assert ax.launches == 2 and ax.id == "1,2"
    assert ax.duration_us == pytest.approx((12.544 + 12.8) / 2)  # median of two
    assert ax.dram_throughput_pct == pytest.approx((28.75 + 28.15) / 2)
    assert ax.stalls[0].reason == "long_scoreboard"


def test_parse_long_form():
    text = (
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'
        '"0","1","p","h","void k<4>(float*)","1","7","(128, 1, 1)","(10, 1, 1)","0","9.0","s","gpu__time_duration.sum","usecond","3.50"\n'
        '"0","1","p","h","void k<4>(float*)","1","7","(128, 1, 1)","(10, 1, 1)","0","9.0","s","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","n/a"\n'
        '"0","1","p","h","void k<4>(float*)","1","7","(128, 1, 1)","(10, 1, 1)","0","9.0","s",'
        '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","inst","1,234.5"\n'
    )
    (k,) = P.parse_ncu_csv(text)
    assert k.short_name == "k<4>"
    assert k.duration_us == pytest.approx(3.5)
    assert k.sm_throughput_pct is None  # n/a
    assert k.stalls[0].reason == "wait" and k.stalls[0].warps_per_issue == pytest.approx(1234.5)


def test_parse_nothing():
    assert P.parse_ncu_csv("") == []
    assert P.parse_ncu_csv("==WARNING== No kernels were profiled.\n") == []


@pytest.mark.parametrize(
    "full,short",
    [
        ("void ns::gemm<128, 64>(float const*, int)", "ns::gemm<128, 64>"),
        ("softmax_kernel", "softmax_kernel"),
        ("void f<(int)3>(float*)", "f<(int)3>"),
        ("tr(float *, float *)", "tr"),
    ],
)
def test_short_kernel_name(full, short):
    assert P.short_kernel_name(full) == short


# ---------------------------------------------------------------------------------------------
# interpreting a run's output
# ---------------------------------------------------------------------------------------------


def test_interpret_ok_and_format():
    r = P.interpret_ncu_output(NCU_RAW_TRANSPOSE_AXPY, "", 0, ["ncu", "x"])
    assert r.ok and len(r.kernels) == 3
    assert r.warnings == []  # the 'unmodified GPU clocks' note is expected, not a warning
    text = P.format_profile(r)
    assert "3 launches of 2 kernels" in text
    assert "tr  grid (4096, 1, 1), block (32, 32, 1), 16 regs/thread" in text
    assert "time 28.03 us | SM 21.7% | DRAM 12.8%" in text
    assert "ax  [2 launches" in text
    assert "long_scoreboard 41.31" in text
    assert "st 4,099,872" in text
    assert "bank conflicts are 94% of shared wavefronts" in text
    assert "occupancy 92.7% achieved of 100.0% theoretical (limited by warps)" in text
    assert "long_scoreboard: waiting on global/local memory" in text  # legend of the stalls shown
    # the axpy's 2.4% tensor-pipe reading is noise: no tensor advice for it
    ax_block = text.split("\nax  ")[1]
    assert "tensor pipe under half" not in ax_block and "mma.sync" not in ax_block


def test_format_gemm_reads_tensor_pipe():
    r = P.interpret_ncu_output(NCU_RAW_CUBLAS_GEMM, "", 0)
    text = P.format_profile(r)
    assert "tensor pipe 95.0% busy" in text or "tensor pipe 95.1% busy" in text
    assert "gmma: waiting for warpgroup MMA" in text
    assert "Hopper's slower path" not in text  # it does use wgmma


def test_interpret_nonzero_exit_with_kernels_is_ok_with_warning():
    r = P.interpret_ncu_output(NCU_RAW_TRANSPOSE_AXPY, "", 1)
    assert r.ok and any("exited with status 1" in w for w in r.warnings)


def test_interpret_no_kernel_matched_lists_available():
    out = (
        "==PROF== Connected to process 673 (/tmp/k)\n==PROF== Disconnected from process 673\n"
        "==WARNING== No kernels were profiled.\nAvailable Kernels:\n1. ax\n2. tr\n"
    )
    r = P.interpret_ncu_output(out, "", 0, ["ncu", "--kernel-name", "regex:zzz", "/tmp/k"])
    assert r.status == "error"
    assert "regex:zzz" in r.reason and "ax, tr" in r.reason
    assert P.format_profile(r).startswith("profile failed: no kernel launch matched")


@pytest.mark.parametrize(
    "output,expect",
    [
        ("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters",
         "not permitted"),
        ("==ERROR== Failed to profile: cudaErrorNoDevice: no CUDA-capable device is detected", "no usable GPU"),
        ("==ERROR== Profiling is not supported on this device", "not supported"),
    ],
)  # fmt: skip
def test_interpret_unavailable(output, expect):
    r = P.interpret_ncu_output("", output, 1)
    assert r.status == "unavailable" and expect in r.reason
    assert P.format_profile(r).startswith("profile unavailable: ")


def test_interpret_other_failure():
    r = P.interpret_ncu_output("", "==ERROR== The application returned an error code (1).\n", 1)
    assert r.status == "error" and "error code (1)" in r.reason
    assert "ncu said" in P.format_profile(r)


def test_ncu_command_line():
    argv = P.ncu_command("/x/ncu", ["python", "run.py"], "softmax", launch_count=3, launch_skip=2)
    assert argv[0] == "/x/ncu"
    assert argv[argv.index("--clock-control") + 1] == "none"
    assert argv[argv.index("--page") + 1] == "raw" and "--csv" in argv
    metrics = argv[argv.index("--metrics") + 1].split(",")
    for m in (P.M_SM, P.M_DRAM, P.M_TENSOR, P.M_OCCUPANCY, P.M_DURATION, P.M_BANK_LD, P.M_BANK_ST):
        assert m in metrics
    assert P.STALL_METRIC.format("long_scoreboard") in metrics
    assert argv[argv.index("--kernel-name") + 1] == "regex:softmax"
    assert argv[argv.index("-c") + 1] == "3" and argv[argv.index("--launch-skip") + 1] == "2"
    assert argv[-2:] == ["python", "run.py"]
    plain = P.ncu_command("ncu", ["a"], None, launch_count=None)
    assert "--kernel-name" not in plain and "-c" not in plain
    assert argv[argv.index("--kernel-name-base") + 1] == "function"


@pytest.mark.parametrize(
    "regex,base",
    [
        ("softmax", "function"),
        ("tr|cfun", "function"),
        ("_Z2trPfS_", "mangled"),
        ("_Z2trPfS_|_Z2axILi2EEvPfS0_", "mangled"),  # verified on an H200: matches tr and ax<2>
        ("^_Z2trPfS_$", "mangled"),
        ("_Z2trPfS_|cfun", "function"),  # mixed: extern "C" names are the same under both bases
        (None, "function"),
    ],
)
def test_kernel_name_base(regex, base):
    assert P.kernel_name_base_for(regex) == base
    if regex:
        argv = P.ncu_command("ncu", ["a"], regex)
        assert argv[argv.index("--kernel-name-base") + 1] == base


# ---------------------------------------------------------------------------------------------
# profile_command: the unavailable paths, and a full run through a stand-in ncu
# ---------------------------------------------------------------------------------------------


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\nimport sys, os, time\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def bindir(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "NCU_FALLBACK_DIRS", ())
    d = tmp_path / "bin"
    d.mkdir()
    return d


def _env(bindir: Path) -> dict[str, str]:
    return {"PATH": str(bindir), "HOME": str(bindir)}


SMI_OK = 'print("GPU 0: NVIDIA H200 (UUID: GPU-0000)")'


def test_unavailable_without_ncu_here():
    if P.find_ncu() is not None:
        pytest.skip("ncu is installed on this machine")
    r = P.profile_command(["true"], None)
    assert r.status == "unavailable" and "ncu" in r.reason
    assert P.format_profile(r).startswith("profile unavailable: ncu")


def test_unavailable_no_ncu(bindir):
    r = P.profile_command(["true"], "k", env=_env(bindir))
    assert r.status == "unavailable" and "not installed" in r.reason


def test_unavailable_no_driver(bindir):
    _script(bindir / "ncu", "sys.exit(0)")
    r = P.profile_command(["true"], None, env=_env(bindir))
    assert r.status == "unavailable" and "nvidia-smi not found" in r.reason


def test_unavailable_no_gpu(bindir):
    _script(bindir / "ncu", "sys.exit(0)")
    _script(
        bindir / "nvidia-smi",
        'print("NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."); sys.exit(9)',
    )
    r = P.profile_command(["true"], None, env=_env(bindir))
    assert r.status == "unavailable" and "no GPU visible" in r.reason and "NVIDIA-SMI has failed" in r.reason


def test_unavailable_counters_not_permitted(bindir):
    _script(bindir / "nvidia-smi", SMI_OK)
    _script(
        bindir / "ncu",
        'print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance '
        'Counters on the target device 0.", file=sys.stderr); sys.exit(1)',
    )
    r = P.profile_command(["true"], None, env=_env(bindir))
    assert r.status == "unavailable" and "ERR_NVGPUCTRPERM" in r.reason


def test_full_run_through_stand_in_ncu(bindir, tmp_path):
    sample = tmp_path / "sample.txt"
    sample.write_text(NCU_RAW_TRANSPOSE_AXPY)
    args_file = tmp_path / "args.txt"
    _script(bindir / "nvidia-smi", SMI_OK)
    _script(
        bindir / "ncu",
        f"open({str(args_file)!r}, 'w').write('\\n'.join(sys.argv[1:]))\n"
        f"sys.stdout.write(open({str(sample)!r}).read())",
    )
    r = P.profile_command(["./bench", "--shape", "big"], "tr|ax", env=_env(bindir), launch_count=5)
    assert r.ok, r.reason
    assert [k.short_name for k in r.kernels] == ["tr", "ax", "ax"]
    args = args_file.read_text().splitlines()
    assert args[-3:] == ["./bench", "--shape", "big"]
    assert "regex:tr|ax" in args and "none" in args
    assert r.command[0] == str(bindir / "ncu")


def test_timeout_is_an_error_not_an_exception(bindir):
    _script(bindir / "nvidia-smi", SMI_OK)
    _script(bindir / "ncu", "time.sleep(30)")
    t0 = time.monotonic()
    r = P.profile_command(["true"], None, env=_env(bindir), timeout=1)
    assert time.monotonic() - t0 < 20
    assert r.status == "error" and "did not finish" in r.reason


def test_bad_input_never_raises(bindir):
    assert P.profile_command([], None).status == "error"
    r = P.profile_command(["true"], "(", env=_env(bindir))
    assert r.status == "error" and "regular expression" in r.reason


# ---------------------------------------------------------------------------------------------
# kloop profile's path: ncu, the judge and its runners in the judge's sandbox, the profiler's
# injection variables carried to the runners (without them ncu saw no kernel: 2026-12-07, H200)
# ---------------------------------------------------------------------------------------------

PROFILED_JUDGE = """
import json, os, sys
from tools.runner import runner_env
env = runner_env()
seen = {"injection": env.get("CUDA_INJECTION64_PATH"), "outside_visible": os.path.exists(sys.argv[1]),
        "lockdown": "KLOOP_LOCKDOWN" in env, "key": any(sys.argv[2] in v for v in env.values()),
        "key_here": any(sys.argv[2] in v for v in os.environ.values())}
open(os.path.join(sys.argv[3], "seen.json"), "w").write(json.dumps(seen))
"""


def test_profiled_judge_is_sandboxed_and_its_runners_inherit_the_profiler(bindir, tmp_path, monkeypatch):
    from tools import sandbox
    from tools.judge_handle import profiled_judge_command

    key = "sk-ant-kloop-test-" + "0123456789abcdef" * 3
    monkeypatch.setenv("ANTHROPIC_API_KEY", key)
    (bindir / "sample.txt").write_text(NCU_RAW_TRANSPOSE_AXPY)
    outside = tmp_path / "outside.txt"  # a file of the host's that the sandbox must not show
    outside.write_text("host file")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    _script(bindir / "nvidia-smi", SMI_OK)
    # the stand-in does what ncu does: injects itself through an environment variable, runs the command
    # (from the Python executable on), prints its CSV
    _script(bindir / "ncu",
            "import subprocess\n"
            f"cmd = sys.argv[sys.argv.index({sys.executable!r}):]\n"
            "subprocess.run(cmd, env=dict(os.environ, CUDA_INJECTION64_PATH='/stand-in/libinj.so'), check=True)\n"
            f"sys.stdout.write(open({str(bindir / 'sample.txt')!r}).read())")
    cmd = [sys.executable, "-c", PROFILED_JUDGE, str(outside), key, str(scratch)]
    r = P.profile_command(cmd, "tr|ax", env=_env(bindir),
                          wrap=lambda argv: profiled_judge_command(argv, scratch=scratch, readable=[bindir]))
    assert r.ok, (r.reason, r.output_tail)
    seen = __import__("json").loads((scratch / "seen.json").read_text())
    assert seen["injection"] == "/stand-in/libinj.so"  # the runner would be profiled
    assert not seen["lockdown"]  # the injection talks over sockets: no syscall filter under the profiler
    assert not seen["key"] and not seen["key_here"]  # the environment is still the minimal one
    if sandbox.status().namespaces:
        assert r.command[0].endswith("bwrap") and "--unshare-net" in r.command
        assert not seen["outside_visible"]


def test_runner_env_drops_the_profilers_variables_when_not_profiled(monkeypatch):
    from tools.runner import runner_env
    from tools.sandbox import PROFILER_VAR

    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/stand-in/libinj.so")
    monkeypatch.delenv(PROFILER_VAR, raising=False)
    assert "CUDA_INJECTION64_PATH" not in runner_env()
    monkeypatch.setenv(PROFILER_VAR, "1")
    env = runner_env()
    assert env["CUDA_INJECTION64_PATH"] == "/stand-in/libinj.so" and PROFILER_VAR not in env


def test_ncu_install_dirs_are_what_exists(tmp_path, monkeypatch):
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    ncu = _script(toolkit / "bin" / "ncu", "sys.exit(0)")
    monkeypatch.setattr(P, "NCU_INSTALL_ROOTS", (tmp_path / "opt-nvidia", tmp_path / "missing"))
    (tmp_path / "opt-nvidia").mkdir()
    assert P.ncu_install_dirs(str(ncu)) == [toolkit, tmp_path / "opt-nvidia"]
