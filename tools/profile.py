"""Nsight Compute (`ncu`) wrapper: profile a command, parse the per-kernel figures, summarise them.

    result = profile_command(["python", "-m", "tools.worker", req, res], kernel_regex="softmax")
    print(format_profile(result))

It runs

    ncu --target-processes all --clock-control none --print-units base --csv --page raw
        --metrics <METRICS> [--kernel-name regex:<re>] [--launch-skip K] [-c N] cmd...

`--clock-control none` leaves the GPU clocks as they are, so the profile describes the kernel at
the clocks `bench` measures it at. `--page raw --csv` prints one row per profiled launch, one column
per metric (plus ncu's launch/device attributes), a units row under the header, and numbers with
thousands separators; metrics ncu does not know are silently left out (their figures read None).

Never raises for a missing tool or GPU: without `ncu`, without a GPU/driver, or when the
performance counters are not permitted, the result has status "unavailable" and says why.

The metric names were checked against `ncu --query-metrics --chip gh100` (Nsight Compute 2025.3).
"""

from __future__ import annotations

import csv
import io
import os
import re
import statistics
import subprocess
from pathlib import Path
from typing import Callable, Literal, Mapping, Sequence

from pydantic import BaseModel, Field

from tools.proc import find_program, kill_group, tail

# --- what is measured ------------------------------------------------------------------------

M_DURATION = "gpu__time_duration.sum"
M_SM = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
M_DRAM = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
M_L2_HIT = "lts__t_sector_hit_rate.pct"
M_DRAM_READ = "dram__bytes_read.sum"
M_DRAM_WRITE = "dram__bytes_write.sum"
# tensor pipe: cycles the pipe was busy (any MMA: HMMA/HGMMA/QGMMA/IMMA...), and the issue share by
# flavour: gmma = Hopper warpgroup wgmma (HGMMA/QGMMA in SASS); hmma = warp-level mma.sync, though it
# also ticks in wgmma kernels (seen: gmma 5.9%, hmma 3.0%, pipe 95% busy in a cuBLAS sm90 GEMM).
# An instruction share is small even when the pipe is saturated: one wgmma keeps it busy many cycles.
M_TENSOR = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
M_TENSOR_GMMA = "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active"
M_TENSOR_HMMA = "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"
M_OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
M_BANK_LD = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
M_BANK_ST = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
M_WAVEFRONTS_LD = "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"
M_WAVEFRONTS_ST = "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"
# always present on the raw page (launch attributes), no need to ask for them
M_THEORETICAL_OCC = "sm__maximum_warps_per_active_cycle_pct"
M_REGISTERS = "launch__registers_per_thread"
M_SMEM_STATIC = "launch__shared_mem_per_block_static"
M_SMEM_DYNAMIC = "launch__shared_mem_per_block_dynamic"
M_WAVES = "launch__waves_per_multiprocessor"
OCCUPANCY_LIMITS = {
    "registers": "launch__occupancy_limit_registers",
    "shared memory": "launch__occupancy_limit_shared_mem",
    "warps": "launch__occupancy_limit_warps",
    "blocks": "launch__occupancy_limit_blocks",
    "barriers": "launch__occupancy_limit_barriers",
}

# warp stall reasons, as "average number of warps stalled for this reason per issued instruction".
# 'selected' (the warp that issues) is not a stall and is left out; 'gmma' is Hopper's wait on
# warpgroup MMA completion (WARPGROUP.ARRIVES / wgmma.wait_group).
STALL_REASONS = (
    "barrier", "branch_resolving", "dispatch_stall", "drain", "gmma", "imc_miss", "lg_throttle",
    "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction",
    "not_selected", "short_scoreboard", "sleeping", "tex_throttle", "wait",
)  # fmt: skip
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
TOP_STALLS = 5
TENSOR_IN_USE_PCT = 10.0  # below this the tensor-pipe figures are noise (seen: 2.4% in a plain axpy)

STALL_MEANING = {
    "long_scoreboard": "waiting on global/local memory (L1TEX) results",
    "short_scoreboard": "waiting on shared memory / MUFU / other MIO results",
    "barrier": "waiting at __syncthreads / named barriers",
    "mio_throttle": "MIO queue full (shared-memory or special-instruction pressure)",
    "lg_throttle": "local/global memory queue full (too many small loads/stores, or spills)",
    "math_pipe_throttle": "a math pipe is saturated",
    "wait": "fixed-latency dependency (instruction latency)",
    "not_selected": "eligible but another warp issued (enough parallelism)",
    "gmma": "waiting for warpgroup MMA (wgmma) to finish",
    "membar": "waiting on a memory fence",
    "dispatch_stall": "dispatch stalled",
    "no_instruction": "instruction cache miss / waiting for instructions",
    "imc_miss": "constant cache miss",
    "branch_resolving": "waiting on branch resolution",
    "drain": "waiting for memory stores to drain at exit",
    "sleeping": "warp sleeping (nanosleep / yield)",
    "tex_throttle": "texture queue full",
    "misc": "miscellaneous",
}

METRICS: tuple[str, ...] = (
    M_DURATION, M_SM, M_DRAM, M_L2_HIT, M_DRAM_READ, M_DRAM_WRITE, M_TENSOR, M_TENSOR_GMMA,
    M_TENSOR_HMMA, M_OCCUPANCY, M_BANK_LD, M_BANK_ST, M_WAVEFRONTS_LD, M_WAVEFRONTS_ST,
) + tuple(STALL_METRIC.format(r) for r in STALL_REASONS)  # fmt: skip

DEFAULT_TIMEOUT_S = 600.0
TAIL_CHARS = 3000  # characters of ncu's output kept with an error
NCU_FALLBACK_DIRS: tuple[str, ...] = ("/usr/local/cuda/bin",)  # looked in when ncu is not on PATH
DEFAULT_LAUNCH_COUNT = 10

_TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


# --- result models ---------------------------------------------------------------------------


class Stall(BaseModel):
    reason: str
    warps_per_issue: float


class KernelProfile(BaseModel):
    """The figures of one profiled launch (or, from `by_kernel`, the mean over launches of one kernel)."""

    id: str
    name: str  # as ncu prints it (demangled, with parameter types)
    short_name: str
    launches: int = 1
    block: str | None = None
    grid: str | None = None
    duration_us: float | None = None
    sm_throughput_pct: float | None = None
    dram_throughput_pct: float | None = None
    l2_hit_pct: float | None = None
    dram_read_bytes: float | None = None
    dram_write_bytes: float | None = None
    tensor_pipe_pct: float | None = None
    tensor_wgmma_inst_pct: float | None = None
    tensor_hmma_inst_pct: float | None = None
    achieved_occupancy_pct: float | None = None
    theoretical_occupancy_pct: float | None = None
    occupancy_limiter: str | None = None
    registers_per_thread: float | None = None
    shared_mem_static: float | None = None
    shared_mem_dynamic: float | None = None
    waves_per_sm: float | None = None
    bank_conflicts_ld: float | None = None
    bank_conflicts_st: float | None = None
    shared_wavefronts_ld: float | None = None
    shared_wavefronts_st: float | None = None
    stalls: list[Stall] = Field(default_factory=list)  # the top ones, largest first
    metrics: dict[str, float] = Field(default_factory=dict)  # every numeric column ncu printed


class ProfileResult(BaseModel):
    status: Literal["ok", "unavailable", "error"]
    reason: str | None = None  # why unavailable / what went wrong
    kernels: list[KernelProfile] = Field(default_factory=list)  # one per profiled launch
    command: list[str] = Field(default_factory=list)
    returncode: int | None = None
    warnings: list[str] = Field(default_factory=list)
    output_tail: str = ""  # the last part of ncu's own output, for diagnosis

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def unavailable(cls, reason: str, **kw) -> "ProfileResult":
        return cls(status="unavailable", reason=reason, **kw)

    def by_kernel(self) -> list[KernelProfile]:
        """One entry per distinct kernel, in first-launch order: median duration, mean of the rest."""
        groups: dict[str, list[KernelProfile]] = {}
        for k in self.kernels:
            groups.setdefault(k.name, []).append(k)
        return [_merge(ks) for ks in groups.values()]


def _merge(ks: list[KernelProfile]) -> KernelProfile:
    if len(ks) == 1:
        return ks[0]
    first = ks[0]
    merged = first.model_copy(deep=True)
    merged.launches = len(ks)
    merged.id = ",".join(k.id for k in ks)
    for field in KernelProfile.model_fields:
        vals = [getattr(k, field) for k in ks]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals) and field != "launches":
            setattr(merged, field, statistics.median(vals) if field == "duration_us" else statistics.fmean(vals))
    names = {m for k in ks for m in k.metrics}
    merged.metrics = {
        m: statistics.fmean([k.metrics[m] for k in ks if m in k.metrics]) for m in names
    }
    merged.stalls = _top_stalls(merged.metrics)
    return merged


# --- parsing ---------------------------------------------------------------------------------


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    t = text.strip().replace(",", "")
    if not t or t.lower() in ("n/a", "nan", "-"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


def short_kernel_name(name: str) -> str:
    """'void ns::gemm<128, 64>(float const*, int)' -> 'ns::gemm<128, 64>'."""
    n = name.strip()
    if n.startswith("void "):
        n = n[5:]
    depth = 0
    for i, ch in enumerate(n):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0 and i > 0:
            return n[:i].strip()
    return n


def _top_stalls(metrics: Mapping[str, float], n: int = TOP_STALLS) -> list[Stall]:
    found = []
    for r in STALL_REASONS:
        v = metrics.get(STALL_METRIC.format(r))
        if v is not None and v > 0:
            found.append(Stall(reason=r, warps_per_issue=v))
    found.sort(key=lambda s: s.warps_per_issue, reverse=True)
    return found[:n]


def _kernel_from(ident: str, name: str, block: str | None, grid: str | None, values: dict[str, tuple[float | None, str]]) -> KernelProfile:
    metrics = {k: v for k, (v, _) in values.items() if v is not None}

    def get(m: str) -> float | None:
        return metrics.get(m)

    duration = None
    if M_DURATION in values and values[M_DURATION][0] is not None:
        v, unit = values[M_DURATION]
        duration = v * _TIME_UNITS.get(unit.strip().lower(), 1e-3)  # ncu's base unit is ns
    limiter = None  # the resource allowing the fewest blocks per SM (ties named together)
    limits = {label: get(m) for label, m in OCCUPANCY_LIMITS.items() if get(m) is not None}
    if limits:
        fewest = min(limits.values())
        limiter = " and ".join(label for label, v in limits.items() if v == fewest)
    return KernelProfile(
        id=ident,
        name=name,
        short_name=short_kernel_name(name),
        block=block or None,
        grid=grid or None,
        duration_us=duration,
        sm_throughput_pct=get(M_SM),
        dram_throughput_pct=get(M_DRAM),
        l2_hit_pct=get(M_L2_HIT),
        dram_read_bytes=get(M_DRAM_READ),
        dram_write_bytes=get(M_DRAM_WRITE),
        tensor_pipe_pct=get(M_TENSOR),
        tensor_wgmma_inst_pct=get(M_TENSOR_GMMA),
        tensor_hmma_inst_pct=get(M_TENSOR_HMMA),
        achieved_occupancy_pct=get(M_OCCUPANCY),
        theoretical_occupancy_pct=get(M_THEORETICAL_OCC),
        occupancy_limiter=limiter,
        registers_per_thread=get(M_REGISTERS),
        shared_mem_static=get(M_SMEM_STATIC),
        shared_mem_dynamic=get(M_SMEM_DYNAMIC),
        waves_per_sm=get(M_WAVES),
        bank_conflicts_ld=get(M_BANK_LD),
        bank_conflicts_st=get(M_BANK_ST),
        shared_wavefronts_ld=get(M_WAVEFRONTS_LD),
        shared_wavefronts_st=get(M_WAVEFRONTS_ST),
        stalls=_top_stalls(metrics),
        metrics=metrics,
    )


def parse_ncu_csv(text: str) -> list[KernelProfile]:
    """Per-launch figures from ncu's CSV output (the raw page; the long 'Metric Name' form also works).

    Lines before the header (the profiled program's own output, ==PROF== lines) are skipped.
    """
    lines = text.splitlines()
    start = None
    for i, line in enumerate(lines):
        if line.lstrip("\ufeff").startswith('"ID",'):
            start = i
            break
    if start is None:
        return []
    csv_lines = [ln.lstrip("\ufeff") for ln in lines[start:] if ln.lstrip("\ufeff").startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(csv_lines))))
    if not rows:
        return []
    header = rows[0]
    col = {h: i for i, h in enumerate(header)}
    body = [r for r in rows[1:] if len(r) == len(header)]
    if "Metric Name" in col and "Metric Value" in col:
        return _parse_long(body, col)
    units: list[str] = [""] * len(header)
    if body and body[0][col["ID"]] == "":
        units = body[0]
        body = body[1:]
    kernels = []
    skip = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
            "Block Size", "Grid Size", "Device", "CC"}  # fmt: skip
    for r in body:
        values = {h: (_number(r[i]), units[i]) for i, h in enumerate(header) if h not in skip}
        kernels.append(
            _kernel_from(r[col["ID"]], r[col.get("Kernel Name", 0)], _cell(r, col, "Block Size"), _cell(r, col, "Grid Size"), values)
        )
    return kernels


def _cell(row: list[str], col: dict[str, int], name: str) -> str | None:
    return row[col[name]] if name in col else None


def _parse_long(body: list[list[str]], col: dict[str, int]) -> list[KernelProfile]:
    by_id: dict[str, dict] = {}
    for r in body:
        ident = r[col["ID"]]
        entry = by_id.setdefault(
            ident,
            {"name": _cell(r, col, "Kernel Name") or "?", "block": _cell(r, col, "Block Size"),
             "grid": _cell(r, col, "Grid Size"), "values": {}},
        )  # fmt: skip
        unit = r[col["Metric Unit"]] if "Metric Unit" in col else ""
        entry["values"][r[col["Metric Name"]]] = (_number(r[col["Metric Value"]]), unit)
    return [_kernel_from(i, e["name"], e["block"], e["grid"], e["values"]) for i, e in by_id.items()]


# --- running ---------------------------------------------------------------------------------

_UNAVAILABLE_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"ERR_NVGPUCTRPERM", re.I),
     "GPU performance counters are not permitted for this user (ERR_NVGPUCTRPERM); profiling needs root or "
     "the driver option NVreg_RestrictProfilingToAdminUsers=0"),
    (re.compile(r"no CUDA[- ]capable device|cudaErrorNoDevice|CUDA_ERROR_NO_DEVICE|no (supported )?(GPU|device)s? (was |were )?(found|detected)", re.I),
     "no usable GPU"),
    (re.compile(r"(is|are) not supported on this (device|GPU|platform)|Device not supported|unsupported (GPU|device)", re.I),
     "profiling is not supported on this GPU"),
    (re.compile(r"Failed to (initialize|load) (the )?(driver|CUDA)|CUDA driver version is insufficient|NVIDIA driver.*(not|n't) (loaded|running)", re.I),
     "the CUDA driver is not usable"),
]  # fmt: skip


def find_ncu(env: Mapping[str, str] | None = None) -> str | None:
    """Path of the ncu executable: on PATH, else under $CUDA_HOME/bin or /usr/local/cuda/bin."""
    e = os.environ if env is None else env
    return find_program("ncu", {"PATH": "", **e}, cuda_dirs=NCU_FALLBACK_DIRS)


# where the ncu launcher looks for its Nsight Compute install besides the toolkit's own folder (bin/..)
NCU_INSTALL_ROOTS: tuple[Path, ...] = (Path("/opt/nvidia"),)


def ncu_install_dirs(ncu: str) -> list[Path]:
    """What ncu reads besides the system: the toolkit it sits in (bin/..) and /opt/nvidia, where they
    exist. A sandbox around ncu must let it read these (on the H100/H200 machines Nsight Compute lives
    under /opt/nvidia, outside the toolkit)."""
    dirs = [Path(ncu).resolve().parent.parent, *NCU_INSTALL_ROOTS]
    return [d for d in dirs if d.is_dir()]


def gpu_unavailable_reason(env: Mapping[str, str] | None = None, timeout: float = 30) -> str | None:
    """Why no GPU can be profiled here (None when `nvidia-smi -L` lists at least one GPU)."""
    e = os.environ if env is None else env
    smi = find_program("nvidia-smi", {"PATH": "", **e}, cuda_dirs=())
    if smi is None:
        return "no NVIDIA driver here (nvidia-smi not found on PATH)"
    try:
        p = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout, env=dict(e), errors="replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi -L failed: {exc}"
    listing = (p.stdout or "") + (p.stderr or "")
    if p.returncode != 0 or not re.search(r"^GPU \d+:", p.stdout or "", re.M):
        first = next((ln.strip() for ln in listing.splitlines() if ln.strip()), f"exit status {p.returncode}")
        return f"no GPU visible (nvidia-smi -L: {first})"
    return None


def kernel_name_base_for(kernel_regex: str | None) -> str:
    """What ncu matches --kernel-name against: 'mangled' when every alternative of the regex is a
    mangled C++ name (`_Z...`), else 'function' (the name without parameters or templates).
    extern "C" kernels have one name under both."""
    if kernel_regex:
        alts = [a.strip().lstrip("^") for a in kernel_regex.split("|")]
        if alts and all(a.startswith("_Z") for a in alts):
            return "mangled"
    return "function"


def ncu_command(
    ncu: str,
    cmd: Sequence[str],
    kernel_regex: str | None = None,
    launch_count: int | None = DEFAULT_LAUNCH_COUNT,
    launch_skip: int = 0,
    metrics: Sequence[str] = METRICS,
    kernel_name_base: str | None = None,
) -> list[str]:
    argv = [
        ncu, "--target-processes", "all", "--clock-control", "none", "--print-units", "base",
        "--csv", "--page", "raw", "--metrics", ",".join(metrics),
    ]  # fmt: skip
    if kernel_regex:
        base = kernel_name_base or kernel_name_base_for(kernel_regex)
        argv += ["--kernel-name-base", base, "--kernel-name", f"regex:{kernel_regex}"]
    if launch_skip:
        argv += ["--launch-skip", str(int(launch_skip))]
    if launch_count:
        argv += ["-c", str(int(launch_count))]
    return argv + list(cmd)


def profile_command(
    cmd: Sequence[str],
    kernel_regex: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    launch_count: int | None = DEFAULT_LAUNCH_COUNT,
    launch_skip: int = 0,
    extra_metrics: Sequence[str] = (),
    cwd: str | os.PathLike | None = None,
    check_gpu: bool = True,
    kernel_name_base: Literal["function", "demangled", "mangled"] | None = None,
    wrap: Callable[[list[str]], tuple[list[str], dict[str, str]]] | None = None,
) -> ProfileResult:
    """Profile the kernels `cmd` launches that match `kernel_regex` (a Python-compatible regex).

    The regex is matched against the function name (no parameters, e.g. 'softmax_kernel'), or
    against mangled names when it is a '|'-list of `_Z...` names; `kernel_name_base` overrides.

    `env` is the whole environment of the run (default: this process's); `wrap`, when given, turns the
    whole ncu command into the (argv, env) actually run (a sandbox around ncu and what it profiles,
    tools/judge_handle.profiled_judge_command). At most `launch_count`
    launches are profiled, after skipping `launch_skip` matching ones. Never raises: a missing
    ncu/GPU/permission gives status "unavailable", anything else that fails gives "error".
    """
    cmd = list(cmd)
    if not cmd:
        return ProfileResult(status="error", reason="no command to profile")
    if kernel_regex is not None:
        try:
            re.compile(kernel_regex)
        except re.error as exc:
            return ProfileResult(status="error", reason=f"kernel_regex {kernel_regex!r} is not a valid regular expression: {exc}")
    run_env = dict(os.environ if env is None else env)
    ncu = find_ncu(run_env)
    if ncu is None:
        return ProfileResult.unavailable("ncu (Nsight Compute) is not installed here: not on PATH nor in $CUDA_HOME/bin", command=cmd)
    if check_gpu:
        why = gpu_unavailable_reason(run_env)
        if why:
            return ProfileResult.unavailable(why, command=cmd)
    metrics = list(METRICS) + [m for m in extra_metrics if m not in METRICS]
    argv = ncu_command(ncu, cmd, kernel_regex, launch_count, launch_skip, metrics, kernel_name_base)
    if wrap is not None:
        argv, run_env = wrap(argv)
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
            env=run_env, cwd=cwd, start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        return ProfileResult.unavailable(f"cannot run ncu ({ncu}): {exc}", command=argv)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return ProfileResult(
            status="error", reason=f"ncu did not finish within {timeout:g} s (profiling replays each kernel many "
            "times; profile fewer launches or a smaller shape)", command=argv, output_tail=tail((out or "") + (err or ""), TAIL_CHARS),
        )  # fmt: skip
    return interpret_ncu_output(out or "", err or "", proc.returncode, argv)


def _diagnostics(text: str) -> str:
    """ncu's own lines (==PROF==/==ERROR==/==WARNING==), not the CSV or the program's output."""
    return "\n".join(ln for ln in text.splitlines() if ln.startswith("==") or "ERR_" in ln)


def interpret_ncu_output(stdout: str, stderr: str, returncode: int | None, argv: Sequence[str] = ()) -> ProfileResult:
    """Turn one ncu run's output into a ProfileResult (separate from running it, for tests)."""
    combined = stdout + ("\n" if stdout and stderr else "") + stderr
    out_tail = tail(combined, TAIL_CHARS)
    argv = list(argv)
    kernels = parse_ncu_csv(stdout) or parse_ncu_csv(combined)
    warnings = [ln.split("==", 2)[-1].strip() for ln in combined.splitlines() if ln.startswith(("==WARNING==", "==ERROR=="))]
    warnings = [w for w in warnings if "unmodified GPU clocks" not in w]
    if kernels:
        if returncode:
            warnings.append(f"the profiled command exited with status {returncode}")
        return ProfileResult(status="ok", kernels=kernels, command=argv, returncode=returncode, warnings=warnings, output_tail=out_tail)
    for pattern, why in _UNAVAILABLE_PATTERNS:
        m = pattern.search(combined)
        if m:
            line = next((ln.strip() for ln in combined.splitlines() if pattern.search(ln)), m.group(0))
            return ProfileResult.unavailable(f"{why} ({line[:300]})", command=argv, returncode=returncode, output_tail=out_tail)
    if "No kernels were profiled" in combined:
        avail = _available_kernels(combined)
        reason = "no kernel launch matched"
        if any("--kernel-name" == a for a in argv):
            i = argv.index("--kernel-name")
            reason += f" --kernel-name {argv[i + 1]}"
        reason += "; kernels the command launched: " + (", ".join(avail) if avail else "none (did it launch any?)")
        return ProfileResult(status="error", reason=reason, command=argv, returncode=returncode, warnings=warnings, output_tail=out_tail)
    diag = _diagnostics(combined)
    reason = f"ncu exited with status {returncode} and profiled no kernel"
    if diag:
        reason += ": " + diag.splitlines()[-1][:300]
    return ProfileResult(status="error", reason=reason, command=argv, returncode=returncode, warnings=warnings, output_tail=out_tail)


def _available_kernels(text: str) -> list[str]:
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if ln.strip().startswith("Available Kernels"):
            out = []
            for nxt in lines[i + 1 :]:
                m = re.match(r"\s*\d+\.\s+(.+)", nxt)
                if not m:
                    break
                out.append(m.group(1).strip())
            return out
    return []


# --- summary ---------------------------------------------------------------------------------


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}%"


def _count(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}"


def _bytes(v: float | None) -> str:
    if v is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def _readings(k: KernelProfile) -> list[str]:
    """A few plain-language readings of the figures; conservative on purpose."""
    out = []
    if k.dram_throughput_pct is not None and k.dram_throughput_pct >= 80:
        out.append("DRAM near peak: memory-bound and close to done; only moving fewer bytes helps")
    if k.sm_throughput_pct is not None and k.dram_throughput_pct is not None:
        if max(k.sm_throughput_pct, k.dram_throughput_pct) < 40:
            out.append("neither SM nor DRAM is busy: latency-bound (too little work in flight, stalls, or a launch too small to fill the GPU)")
    # a few % of tensor-pipe activity shows up even in kernels without MMAs: only read real use
    tensor = k.tensor_pipe_pct or 0.0
    if tensor >= 80:
        out.append("tensor pipe near saturation: compute-bound at the MMA rate; what is left is overlap (epilogue, prologue, tails)")
    if TENSOR_IN_USE_PCT <= tensor < 50:
        out.append("tensor pipe under half busy: the MMAs are not fed fast enough (loads, pipeline depth, sync)")
    if tensor >= TENSOR_IN_USE_PCT and k.tensor_wgmma_inst_pct == 0:
        out.append("no wgmma (HGMMA/QGMMA) instructions: the tensor work is warp-level mma.sync, Hopper's slower path")
    conflicts = (k.bank_conflicts_ld or 0) + (k.bank_conflicts_st or 0)
    wavefronts = (k.shared_wavefronts_ld or 0) + (k.shared_wavefronts_st or 0)
    if conflicts and wavefronts and conflicts / wavefronts > 0.1:
        out.append(f"shared-memory bank conflicts are {100 * conflicts / wavefronts:.0f}% of shared wavefronts: pad or swizzle")
    if k.stalls and k.stalls[0].reason == "long_scoreboard":
        out.append("top stall is global-memory latency: more bytes in flight (wider/earlier loads, cp.async/TMA pipelining)")
    return out


def format_kernel(k: KernelProfile) -> str:
    head = f"{k.short_name}"
    if k.launches > 1:
        head += f"  [{k.launches} launches; median time, mean figures]"
    geo = []
    if k.grid:
        geo.append(f"grid {k.grid}")
    if k.block:
        geo.append(f"block {k.block}")
    if k.registers_per_thread is not None:
        geo.append(f"{k.registers_per_thread:.0f} regs/thread")
    smem = (k.shared_mem_static or 0) + (k.shared_mem_dynamic or 0)
    if k.shared_mem_static is not None or k.shared_mem_dynamic is not None:
        geo.append(f"smem {_bytes(smem)}/block")
    if k.waves_per_sm is not None:
        geo.append(f"{k.waves_per_sm:.2f} waves")
    lines = [head + ("  " + ", ".join(geo) if geo else "")]
    t = "n/a" if k.duration_us is None else f"{k.duration_us:,.2f} us"
    lines.append(
        f"  time {t} | SM {_pct(k.sm_throughput_pct)} | DRAM {_pct(k.dram_throughput_pct)} "
        f"(read {_bytes(k.dram_read_bytes)}, write {_bytes(k.dram_write_bytes)}) | L2 hit {_pct(k.l2_hit_pct)}"
    )
    lines.append(
        f"  tensor pipe {_pct(k.tensor_pipe_pct)} busy (issue share: gmma/wgmma {_pct(k.tensor_wgmma_inst_pct)}, "
        f"hmma {_pct(k.tensor_hmma_inst_pct)})"
    )
    occ = f"  occupancy {_pct(k.achieved_occupancy_pct)} achieved"
    if k.theoretical_occupancy_pct is not None:
        occ += f" of {_pct(k.theoretical_occupancy_pct)} theoretical"
    if k.occupancy_limiter:
        occ += f" (limited by {k.occupancy_limiter})"
    lines.append(occ)
    if k.stalls:
        lines.append("  top stalls (warps stalled per issued instruction): " + ", ".join(f"{s.reason} {s.warps_per_issue:.2f}" for s in k.stalls))
    else:
        lines.append("  top stalls: n/a")
    bank = f"  shared-memory bank conflicts: ld {_count(k.bank_conflicts_ld)}, st {_count(k.bank_conflicts_st)}"
    if k.shared_wavefronts_ld or k.shared_wavefronts_st:
        bank += f" (shared wavefronts: ld {_count(k.shared_wavefronts_ld)}, st {_count(k.shared_wavefronts_st)})"
    lines.append(bank)
    for r in _readings(k):
        lines.append(f"  -> {r}")
    return "\n".join(lines)


def format_profile(result: ProfileResult, max_kernels: int = 8) -> str:
    """A compact text summary: one block per distinct kernel (launches of one kernel merged)."""
    if result.status == "unavailable":
        return f"profile unavailable: {result.reason}"
    if result.status == "error":
        text = f"profile failed: {result.reason}"
        diag = _diagnostics(result.output_tail)
        if diag:
            text += "\nncu said:\n" + "\n".join(diag.splitlines()[-8:])
        elif result.output_tail.strip():
            text += "\noutput (tail):\n" + result.output_tail[-1500:]
        return text
    groups = result.by_kernel()
    lines = [
        f"ncu profile: {len(result.kernels)} launch{'es' if len(result.kernels) != 1 else ''} of {len(groups)} "
        f"kernel{'s' if len(groups) != 1 else ''} (clocks as in bench, not locked; profiling replays each launch, "
        "so time here is not the gate's time)"
    ]
    for k in groups[:max_kernels]:
        lines.append(format_kernel(k))
    if len(groups) > max_kernels:
        lines.append(f"... {len(groups) - max_kernels} more kernels not shown")
    if result.warnings:
        lines.append("warnings: " + "; ".join(result.warnings[:5]))
    stalls_seen = {s.reason for k in groups[:max_kernels] for s in k.stalls}
    legend = [f"{r}: {STALL_MEANING[r]}" for r in STALL_REASONS if r in stalls_seen and r in STALL_MEANING]
    if legend:
        lines.append("stall reasons: " + "; ".join(legend))
    return "\n".join(lines)
