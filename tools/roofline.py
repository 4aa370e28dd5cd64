"""Peak rates of the devices kloop knows, for roofline floors: the briefing, the bench tool and the gate's physics floor."""

from __future__ import annotations

from tools.task import Task

# Peak rates for the roofline: (value, where it comes from). Measured figures are from the device
# machine of this project (../shared/device/README.md, 2026-11-29); the rest are datasheet leads.
PEAKS = {
    "H200": {"fp32": (67e12, "datasheet"), "bf16_tensor": (690e12, "measured: cuBLAS 8192^3 bf16 GEMM"),
             "fp8_tensor": (1349e12, "measured: torch._scaled_mm 8192^3"), "fp64": (34e12, "datasheet"),
             "bytes": (4.24e12, "measured: device copy, read + write")},
    "H100": {"fp32": (67e12, "datasheet"), "bf16_tensor": (990e12, "datasheet"), "fp8_tensor": (1979e12, "datasheet"),
             "fp64": (34e12, "datasheet"), "bytes": (3.35e12, "datasheet")},
}


def device_key(device: dict | None) -> str | None:
    name = (device or {}).get("name", "")
    return next((k for k in PEAKS if k in name), None)


def peak_rates(task: Task, device: dict | None) -> tuple[float | None, float | None]:
    """(FLOP/s, bytes/s) for the task's compute unit on `device` (a measured DeviceInfo as a dict); None where unknown."""
    key = device_key(device)
    if key is None:
        return None, None
    peaks = PEAKS[key]
    return peaks[task.manifest.compute_unit][0], peaks["bytes"][0]
