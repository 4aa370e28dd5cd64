"""Describe the machine a number was measured on: GPU, driver, CUDA, clocks; or the CPU."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import TYPE_CHECKING

from tools.proc import find_program
from tools.protocol import DeviceInfo

if TYPE_CHECKING:  # torch is imported where it is used: `missing_device` on a CPU task needs none
    import torch


def _nvidia_smi(index: int) -> dict[str, str]:
    exe = find_program("nvidia-smi", cuda_dirs=())
    if not exe:
        return {}
    fields = ["driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem"]
    try:
        out = subprocess.run(
            [exe, f"--id={index}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    values = [v.strip() for v in out.split(",")]
    return dict(zip(fields, values)) if len(values) == len(fields) else {}


def _int(v: str | None) -> int | None:
    try:
        return int(float(v)) if v not in (None, "", "[N/A]") else None
    except ValueError:
        return None


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(device: torch.device) -> DeviceInfo:
    import torch

    host = platform.node()
    if device.type != "cuda":
        return DeviceInfo(kind="cpu", name=f"{cpu_name()} ({os.cpu_count()} threads)", torch=torch.__version__, host=host)
    index = device.index or 0
    props = torch.cuda.get_device_properties(index)
    smi = _nvidia_smi(index)
    return DeviceInfo(
        kind="cuda", name=props.name, driver=smi.get("driver_version"), cuda_runtime=torch.version.cuda,
        torch=torch.__version__, sm_clock_mhz=_int(smi.get("clocks.sm")), max_sm_clock_mhz=_int(smi.get("clocks.max.sm")),
        mem_clock_mhz=_int(smi.get("clocks.mem")), sm_count=props.multi_processor_count,
        l2_bytes=getattr(props, "L2_cache_size", None), host=host,
    )


def gpu_available() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":  # no device visible to CUDA: no need to load torch to say so
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def missing_device(target: str) -> str | None:
    """Why a task of `target` cannot be checked or timed on this machine (None: it can). Building,
    the SASS and the audit need no device; a CUDA task's check, timing and profile need a visible GPU."""
    if target not in ("cuda", "triton"):
        return None
    try:
        return None if gpu_available() else "no CUDA device here"
    except Exception as exc:  # a broken driver is as good as no device
        return f"no usable CUDA device here ({exc})"
