"""How kloop writes numbers for people and agents: times, rates, speedups with their interval, devices."""

from __future__ import annotations

from typing import Any, Mapping


def fmt_time(seconds: float | None, micro: str = "us") -> str:
    """A duration with a unit that suits it: '123.5 ms', '1.823 ms', '444.9 us' ('-' when unknown);
    `micro` is the microsecond unit's spelling (pages write 'µs')."""
    if seconds is None:
        return "-"
    if seconds >= 1e-1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} {micro}"


def fmt_ms(seconds: float, sep: str = " ") -> str:
    """Milliseconds to four decimals, for timings compared side by side ('1.2345 ms')."""
    return f"{seconds * 1e3:.4f}{sep}ms"


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x >= 10 else f"{x:.3f}"


def fmt_speedup(speedup: float | None, lo: float | None = None, hi: float | None = None) -> str:
    """'x1.1200 [1.1100, 1.1300]': a speedup and its 95% interval ('-' when there is none)."""
    if not speedup:
        return "-"
    return f"x{speedup:.4f} [{lo or 0:.4f}, {hi or 0:.4f}]"


def device_label(device: Mapping[str, Any] | Any, clocks: bool = True) -> str:
    """Where a number was measured: 'NVIDIA H200, driver 580.1, CUDA 13.0, SM 1980/1980 MHz'.
    `device`: a DeviceInfo or its dict form (as run records keep it)."""
    d = device if isinstance(device, Mapping) else device.model_dump()
    parts = [d.get("name") or "unknown device"]
    if d.get("driver"):
        parts.append(f"driver {d['driver']}")
    if d.get("cuda_runtime"):
        parts.append(f"CUDA {d['cuda_runtime']}")
    if clocks and d.get("sm_clock_mhz"):
        parts.append(f"SM {d['sm_clock_mhz']}/{d.get('max_sm_clock_mhz') or '?'} MHz")
    return ", ".join(parts)
