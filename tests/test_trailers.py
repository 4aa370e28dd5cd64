"""agent.trailers: evidence trailers, held to `git interpret-trailers --parse` on real commits."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from agent.trailers import TITLE_MAX, format_commit_message, parse_trailers, trailer_key

GIT_ENV = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}

EVIDENCE = [
    ("Kloop-Speedup", "1.084"),
    ("Kloop-Speedup-CI", "1.061..1.109 (95%, 40 pairs)"),
    ("Kloop-Time-n_4096", "12.31us -> 11.36us"),
    ("Kloop-Time-n.8192", "40.2us -> 37.0us"),
    ("Kloop-Regs-softmax_kernel", "32 (was 40), spills 0"),
    ("Kloop-GPU", "NVIDIA H200, driver 560.35.03, nvcc 12.6"),
    ("Kloop-Run", "20261129-0915-softmax-3fa2"),
    ("Kloop-Attempt", "7"),
]


def git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, input=input, env=GIT_ENV
    ).stdout.decode()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q", "-b", "main")
    git(tmp_path, "config", "user.name", "Test User")
    git(tmp_path, "config", "user.email", "test@example.com")
    return tmp_path


def git_parse(repo: Path, message: str) -> list[tuple[str, str]]:
    """Commit `message` verbatim, then ask git for its trailers."""
    git(repo, "commit", "-q", "--allow-empty", "--cleanup=verbatim", "-F", "-", input=message.encode())
    body = git(repo, "log", "-1", "--format=%B")
    out = git(repo, "interpret-trailers", "--parse", input=body.encode())
    pairs = []
    for line in out.splitlines():
        key, _, value = line.partition(":")
        pairs.append((key.strip(), value.strip()))
    return pairs


def test_trailer_key_sanitised():
    assert trailer_key("Kloop-Time", "n_4096") == "Kloop-Time-n-4096"
    assert trailer_key("Kloop-Regs", "softmax<float>::kernel") == "Kloop-Regs-softmax-float-kernel"
    assert trailer_key("Kloop-GPU") == "Kloop-GPU"
    with pytest.raises(ValueError):
        trailer_key("__")


def test_round_trip():
    msg = format_commit_message("Unroll the row loop by 4", "Fewer loop branches; loads can be batched.", EVIDENCE)
    lines = msg.splitlines()
    assert lines[0] == "Unroll the row loop by 4"
    assert lines[1] == ""
    assert msg.endswith("\n")
    assert parse_trailers(msg) == [(trailer_key(k), v) for k, v in EVIDENCE]


def test_values_and_title_sanitised():
    long_title = "Vectorise the loads with float4 and move the reduction into warp shuffles across the block"
    msg = format_commit_message(
        long_title + "\nsecond line",
        "A rationale.",
        [("Kloop-Note", "line one\nline two\r\n  line three"), ("Kloop-Empty", "")],
    )
    title = msg.splitlines()[0]
    assert len(title) <= TITLE_MAX and "\n" not in title and title.endswith("...")
    assert "float4" in title
    # the whole title is kept in the body
    assert "warp shuffles across the block second line" in " ".join(msg.split())
    assert parse_trailers(msg) == [("Kloop-Note", "line one line two line three"), ("Kloop-Empty", "")]


def test_rationale_wrapped_and_structure_kept():
    rationale = (
        "The kernel was latency bound: " + "each warp waits on its own load before the reduction starts. " * 4
        + "\n\nChanges:\n- load four rows at once\n- keep the partial sums in registers\n\n"
        "    for (int i = 0; i < 4; ++i)\n        acc[i] = x[i];\n"
    )
    msg = format_commit_message("Batch the loads", rationale, [("Kloop-Speedup", "1.2")])
    for line in msg.splitlines():
        assert len(line) <= 72 or " " not in line.strip()
    assert "- load four rows at once\n- keep the partial sums in registers" in msg
    assert "    for (int i = 0; i < 4; ++i)\n        acc[i] = x[i];" in msg
    assert parse_trailers(msg) == [("Kloop-Speedup", "1.2")]


def test_no_trailers_in_title_or_prose():
    assert parse_trailers("Key: value\n") == []  # the title is never a trailer
    assert parse_trailers("Title\n\nJust prose here.\n") == []
    assert parse_trailers("Title\n\nKey: v\nnot a trailer line\n") == []
    assert format_commit_message("Title", "", []) == "Title\n"


TRICKY = [
    # ours, with a rationale that quotes includes, a divider-looking line and colon-y prose
    format_commit_message(
        "Use shared memory for the tile",
        "#include <cuda/pipeline> is now needed.\n\n---\nNote: this paragraph looks like a trailer.\n\n"
        "Another: paragraph",
        EVIDENCE,
    ),
    format_commit_message("Only trailers", "", EVIDENCE[:2]),
    # hand-written messages exercising git's rules
    "Title\n\nBody.\n\nKey: value\nOther-Key: v2\n  continued here\n",
    "Title\n\nBody.\n\nSigned-off-by: A <a@b>\nsome prose line\nKey: v\n",
    "Title\n\nBody.\n\nKey: v\nprose\nprose again\nmore prose\n",
    "Title\n\nKey: v\n\n\n",
    "Title\n\nKey: a\n---\nPatch: not a trailer\n",
    "Title\n\nKey : spaced key\nKey2:no space\n(cherry picked from commit abc)\nSigned-off-by: X <x@y>\n",
    "Title\n\nBody\n\nBad_Key: underscore\nGood-Key: fine\n",
    "Title\nstill title\n\nKey: v\n# a comment\n",
]


@pytest.mark.parametrize("message", TRICKY)
def test_agrees_with_git_interpret_trailers(repo: Path, message: str):
    assert parse_trailers(message) == git_parse(repo, message)


def test_git_reads_our_commit(repo: Path):
    msg = format_commit_message("Unroll the row loop by 4", "Because it is faster.", EVIDENCE)
    assert git_parse(repo, msg) == parse_trailers(msg) == [(trailer_key(k), v) for k, v in EVIDENCE]
    # and git log's own trailer formatting sees them too
    keys = git(repo, "log", "-1", "--format=%(trailers:only,unfold,key=Kloop-Speedup,valueonly)").strip()
    assert keys == "1.084"


# ---- kernel names in trailers and `kloop log` (issue 13) -------------------------------------------

# as nvcc 13.0 + cu++filt name the shipped kernels (flash_attn_fwd, paged_decode: anonymous namespace)
FLASH_128 = ("void (anonymous namespace)::flash_attn_fwd_kernel<128>(__nv_bfloat16 const*, __nv_bfloat16 const*, "
             "__nv_bfloat16 const*, __nv_bfloat16*, float*, int, int, int, float)")
FLASH_64 = FLASH_128.replace("<128>", "<64>")
PAGED = ("void (anonymous namespace)::paged_decode_kernel<256, false>(__nv_bfloat16 const*, __nv_bfloat16 const*, "
         "__nv_bfloat16 const*, int const*, int const*, __nv_bfloat16*, float*, float*, int, int, int, int, int, float)")
SOFTMAX = "softmax_rows(__nv_bfloat16 const*, __nv_bfloat16*, int)"


@pytest.mark.parametrize("demangled,short", [
    (FLASH_128, "flash_attn_fwd_kernel<128>"),
    (FLASH_64, "flash_attn_fwd_kernel<64>"),
    (PAGED, "paged_decode_kernel<256,false>"),
    (SOFTMAX, "softmax_rows"),
    ("kloop_matmul", "kloop_matmul"),  # a C name (CPU tasks, extern "C") is kept as it is
    ("void ns::inner::kern<void (*)(int), 2>(float) const", "kern<void(*)(int),2>"),
    ("void {anonymous}::k<3>(int)", "k<3>"),
    ("void cute::device_kernel<cutlass::Gemm<(int)3, ns::T>>(Params)", "device_kernel<cutlass::Gemm<(int)3,ns::T>>"),
])
def test_kernel_name_is_short_and_readable(demangled, short):
    from tools.fmt import kernel_name

    assert kernel_name(demangled) == short


def test_kernel_name_of_a_long_or_undemangled_name_is_cut_with_a_hash():
    from tools.fmt import KERNEL_NAME_MAX, kernel_name

    a = "void k<" + ", ".join(f"Type{i}" for i in range(30)) + ">(int)"
    b = a.replace("Type29", "Other")
    assert len(kernel_name(a)) == KERNEL_NAME_MAX and kernel_name(a) != kernel_name(b)
    mangled = "_ZN50_GLOBAL__N__58976818_17_flash_attn_fwd_cu_24baaf9a21flash_attn_fwd_kernelILi128EEEvPK13__nv_bfloat16"
    assert len(kernel_name(mangled)) == KERNEL_NAME_MAX


def test_kernel_names_are_unique():
    from tools.fmt import kernel_names

    assert kernel_names([FLASH_128, FLASH_64]) == ["flash_attn_fwd_kernel<128>", "flash_attn_fwd_kernel<64>"]
    # the same short name in two namespaces: the second gets a suffix, in order
    assert kernel_names(["void a::k<1>(int)", "void b::k<1>(int)", "void k<2>(int)"]) == ["k<1>", "k<1>~2", "k<2>"]


def _figures(*names):
    return {"build": {"kernels": [{"name": n, "registers": 40 + i, "spill_store_bytes": 0, "spill_load_bytes": 0}
                                  for i, n in enumerate(names)]}}


def test_evidence_trailers_keep_every_cuda_kernel(repo: Path):
    """Two kernels of an anonymous namespace were both 'Kloop-Regs-void' (the log showed one)."""
    from agent.cli import _commit_rows
    from agent.session import evidence_trailers

    # `k<1,2>` and the second `k<1>` (`k<1>~2`) sanitise to the same key: the later one is numbered
    trailers = evidence_trailers(_figures(FLASH_128, FLASH_64, PAGED, "void a::k<1>(int)", "void b::k<1>(int)",
                                          "void k<1, 2>(int)"), None, "run-1", 2)
    regs = [(k, v) for k, v in trailers if k.startswith("Kloop-Regs-")]
    assert [k for k, _ in regs] == ["Kloop-Regs-flash-attn-fwd-kernel-128", "Kloop-Regs-flash-attn-fwd-kernel-64",
                                    "Kloop-Regs-paged-decode-kernel-256-false", "Kloop-Regs-k-1",
                                    "Kloop-Regs-k-1-2", "Kloop-Regs-k-1-2-2"]
    assert [v.split()[0] for _, v in regs] == ["40", "41", "42", "43", "44", "45"]
    msg = format_commit_message("Two kernels", "", trailers)
    assert git_parse(repo, msg) == parse_trailers(msg) == trailers
    rows = _commit_rows(repo, "main", None)
    assert len(rows) == 1 and list(rows[0]["registers"]) == [k.removeprefix("Kloop-Regs-") for k, _ in regs]


def test_trailers_keep_each_backward_kernels_stack_bytes(repo: Path):
    """A backward holds several kernels: each keeps its own registers, spills and local-memory (stack)
    bytes under its own short name, and `kloop log --json` reads them back per kernel."""
    from agent.cli import _commit_rows, _numbers
    from agent.session import evidence_trailers
    from tools.build import BuildResult, KernelResources

    names = ["void (anonymous namespace)::bwd_preprocess<128>(__nv_bfloat16 const*, float*)",
             "void (anonymous namespace)::bwd_dkdv<128, false>(__nv_bfloat16 const*, float*)",
             "void (anonymous namespace)::bwd_dq<128, false>(__nv_bfloat16 const*, float*)"]
    best = BuildResult(ok=True, key="k", build_dir="/nowhere", kernels=[
        KernelResources(name=names[1], mangled="_Zdkdv", registers=255, spill_store_bytes=28, spill_load_bytes=32, stack_bytes=32)])
    figures = {"build": {"kernels": [
        {"name": names[0], "registers": 26, "spill_store_bytes": 0, "spill_load_bytes": 0, "stack_bytes": 0},
        {"name": names[1], "registers": 194, "spill_store_bytes": 0, "spill_load_bytes": 0, "stack_bytes": 0},
        {"name": names[2], "registers": 80, "spill_store_bytes": 4, "spill_load_bytes": 4, "stack_bytes": 8}]}}
    regs = dict((k, v) for k, v in evidence_trailers(figures, best, "run-1", 1) if k.startswith("Kloop-Regs-"))
    assert regs == {"Kloop-Regs-bwd-preprocess-128": "26 regs, spills 0/0 B",
                    "Kloop-Regs-bwd-dkdv-128-false": "255 -> 194 regs, spills 28/32 -> 0/0 B, stack 32 -> 0 B",
                    "Kloop-Regs-bwd-dq-128-false": "80 regs, spills 4/4 B, stack 8 B"}
    git_parse(repo, format_commit_message("Backward", "", [("Kloop-Attempt", "1"), *regs.items()]))
    got = _numbers(_commit_rows(repo, "main", None)[0])["registers"]
    assert got["bwd-dkdv-128-false"] == {"registers": 194, "registers_before": 255, "spill_store_bytes": 0,
                                         "spill_load_bytes": 0, "stack_bytes": 0}
    assert got["bwd-dq-128-false"]["stack_bytes"] == 8 and "stack_bytes" not in got["bwd-preprocess-128"]


def test_log_still_reads_old_register_trailers(repo: Path):
    from agent.cli import _commit_rows, _numbers

    old = [("Kloop-Speedup", "1.1000"), ("Kloop-Regs-void", "40 -> 38 regs, spills 0/0 B"),
           ("Kloop-Regs-softmax-rows", "31 regs, spills 0/0 B"), ("Kloop-Run", "r"), ("Kloop-Attempt", "1")]
    git_parse(repo, format_commit_message("Old commit", "", old))
    rows = _commit_rows(repo, "main", None)
    assert rows[0]["registers"] == {"void": "40 -> 38 regs, spills 0/0 B", "softmax-rows": "31 regs, spills 0/0 B"}
    assert _numbers(rows[0])["registers"]["void"]["registers"] == 38
