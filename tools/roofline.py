"""Peak rates of the devices kloop knows, for roofline floors: the briefing, the bench tool and the gate's physics floor."""

from __future__ import annotations

from typing import Any

from tools.task import Task

# Peak rates for the roofline: (value, where it comes from). Measured figures are from the device
# machine of this project (../shared/device/README.md, 2026-11-29); the rest are datasheet leads.
# FP8 (e4m3) dense: 1979 TFLOP/s on the H100/H200 SXM datasheets (3958 is with 2:4 sparsity); the
# H200 entry is what torch._scaled_mm reached here (68% of it), as bf16's is cuBLAS's 690 of 990.
PEAKS = {
    "H200": {"fp32": (67e12, "datasheet"), "bf16_tensor": (690e12, "measured: cuBLAS 8192^3 bf16 GEMM"),
             "fp8_tensor": (1349e12, "measured: torch._scaled_mm 8192^3"), "fp64": (34e12, "datasheet"),
             "bytes": (4.24e12, "measured: device copy, read + write")},
    "H100": {"fp32": (67e12, "datasheet"), "bf16_tensor": (990e12, "datasheet"), "fp8_tensor": (1979e12, "datasheet"),
             "fp64": (34e12, "datasheet"), "bytes": (3.35e12, "datasheet")},
}


def device_key(device: dict | None) -> str | None:
    name = str((device if isinstance(device, dict) else {}).get("name") or "")
    return next((k for k in PEAKS if k in name), None)


def peak_rates(task: Task, device: dict | None) -> tuple[float | None, float | None]:
    """(FLOP/s, bytes/s) for the task's compute unit on `device` (a measured DeviceInfo as a dict); None where unknown."""
    key = device_key(device)
    if key is None:
        return None, None
    peaks = PEAKS[key]
    return peaks[task.manifest.compute_unit][0], peaks["bytes"][0]


# The gate's physics floor: rates no device here can beat, so a time below max(FLOPs / rate,
# bytes / rate) is impossible (cached, skipped or mis-timed work). Generous on purpose: the fastest
# compute unit of the device, 1.5x its memory bandwidth (L2 hits after the flush), and for the CPU
# and unknown GPUs rates far above anything real.
CPU_FLOOR_RATES = (1e12, 1e12)
UNKNOWN_GPU_FLOOR_RATES = (4e15, 10e12)
BANDWIDTH_SLACK = 1.5


def floor_rates(device: Any) -> tuple[float, float]:
    """(FLOP/s, bytes/s) no call on `device` (a torch.device) can exceed."""
    if getattr(device, "type", "cpu") != "cuda":
        return CPU_FLOOR_RATES
    try:
        import torch

        name = torch.cuda.get_device_name(device)
    except Exception:
        name = ""
    key = device_key({"name": name})
    if key is None:
        return UNKNOWN_GPU_FLOOR_RATES
    peaks = PEAKS[key]
    return max(v for k, (v, _) in peaks.items() if k != "bytes"), BANDWIDTH_SLACK * peaks["bytes"][0]
