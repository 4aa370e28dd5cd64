"""How kloop writes numbers for people and agents: times, rates, speedups with their interval, devices."""

from __future__ import annotations

import math
from typing import Any, Mapping


def real(x: Any) -> float | None:
    """`x` as a finite float, or None (None, NaN, Inf, a bool, a string: what a report or a record may hold)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        f = float(x)
    except OverflowError:  # an int too large for a float
        return None
    return f if math.isfinite(f) else None


def json_safe(obj: Any) -> Any:
    """`obj` (JSON-like) with every NaN/Inf float replaced by None: strict JSON (RFC 8259 has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _unknown(x: Any) -> str:
    """How a figure that is not a finite number is written: '-' when missing, else what it is ('nan', 'inf')."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return str(x)
    return "?"


def fmt_time(seconds: float | None, micro: str = "us") -> str:
    """A duration with a unit that suits it: '123.5 ms', '1.823 ms', '444.9 us' ('-' when unknown);
    `micro` is the microsecond unit's spelling (pages write 'µs')."""
    s = real(seconds)
    if s is None:
        return _unknown(seconds)
    if s >= 1e-1:
        return f"{s * 1e3:.1f} ms"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} {micro}"


def fmt_us(seconds: float | None) -> str:
    """Microseconds to one decimal, for per-call figures set side by side in a reason ('12.3 us')."""
    s = real(seconds)
    return f"{s * 1e6:.1f} us" if s is not None else _unknown(seconds)


def fmt_ms(seconds: float, sep: str = " ") -> str:
    """Milliseconds to four decimals, for timings compared side by side ('1.2345 ms')."""
    s = real(seconds)
    return f"{s * 1e3:.4f}{sep}ms" if s is not None else f"{_unknown(seconds)}{sep}ms"


def fmt_rate(x: float | None) -> str:
    r = real(x)
    if r is None:
        return _unknown(x)
    return f"{r:.1f}" if r >= 10 else f"{r:.3f}"


def fmt_num(x: Any, spec: str = ".4f") -> str:
    """A number with a format spec; anything else as '-' (missing), 'nan', 'inf' or '?'."""
    r = real(x)
    return format(r, spec) if r is not None else _unknown(x)


def fmt_speedup(speedup: float | None, lo: float | None = None, hi: float | None = None) -> str:
    """'x1.1200 [1.1100, 1.1300]': a speedup and its interval (the gate's: each bound at its look's one-sided level) ('-' when there is none)."""
    if not speedup and not isinstance(speedup, float):
        return "-"
    if speedup == 0:
        return "-"
    return f"x{fmt_num(speedup)} [{fmt_num(lo)}, {fmt_num(hi)}]"


def device_label(device: Mapping[str, Any] | Any, clocks: bool = True) -> str:
    """Where a number was measured: 'NVIDIA H200, driver 580.1, CUDA 13.0, SM 1980/1980 MHz'.
    `device`: a DeviceInfo or its dict form (as run records keep it)."""
    d = device if isinstance(device, Mapping) else (device.model_dump() if hasattr(device, "model_dump") else {})
    parts = [str(d.get("name") or "unknown device")]
    if d.get("driver"):
        parts.append(f"driver {d['driver']}")
    if d.get("cuda_runtime"):
        parts.append(f"CUDA {d['cuda_runtime']}")
    if clocks and d.get("sm_clock_mhz"):
        parts.append(f"SM {d['sm_clock_mhz']}/{d.get('max_sm_clock_mhz') or '?'} MHz")
    return ", ".join(parts)


_ANONYMOUS = ("(anonymous namespace)", "{anonymous}", "_GLOBAL__N_1")
KERNEL_NAME_MAX = 48


def _top_level(text: str, stop) -> list[int]:
    """Indices in `text` where stop(text, i) holds outside any (), <> or [] nesting."""
    depth, out = 0, []
    for i, c in enumerate(text):
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth = max(0, depth - 1)
        elif depth == 0 and stop(text, i):
            out.append(i)
    return out


def kernel_name(demangled: str) -> str:
    """A kernel's short readable name from its demangled signature: no return type, no namespaces
    (`(anonymous namespace)::` or named), no argument list, template arguments kept without spaces:
    'void (anonymous namespace)::paged_decode_kernel<256, false>(__nv_bfloat16 const*, ...)' ->
    'paged_decode_kernel<256,false>'. A plain (extern "C" or undemangled) name comes back as it is;
    one longer than KERNEL_NAME_MAX is cut and ends in a hash of the whole, so cut names stay apart.
    Unique among several kernels: `kernel_names`."""
    text = " ".join(str(demangled).split())
    for anon in _ANONYMOUS:
        text = text.replace(anon + "::", "")
    # the argument list: the last top-level (...) group, with any cv/ref qualifiers after it
    body = text.rstrip()
    while body and not body.endswith(")") and body.rsplit(" ", 1)[-1] in ("const", "volatile", "&", "&&", "noexcept"):
        body = body.rsplit(" ", 1)[0].rstrip()
    if body.endswith(")"):
        depth = 0
        for i in range(len(body) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(body[i], 0)
            if depth == 0:
                if i > 0:
                    body = body[:i]
                break
    # the return type: everything up to the last top-level space
    spaces = _top_level(body, lambda t, i: t[i] == " ")
    if spaces:
        body = body[spaces[-1] + 1 :]
    # namespaces and enclosing classes: keep the last top-level `::` component
    scopes = _top_level(body, lambda t, i: t.startswith("::", i))
    if scopes:
        body = body[scopes[-1] + 2 :]
    body = body.replace(", ", ",").replace(" ", "") or text
    if len(body) > KERNEL_NAME_MAX:
        import hashlib

        body = body[: KERNEL_NAME_MAX - 7] + "~" + hashlib.sha1(text.encode()).hexdigest()[:6]
    return body


def kernel_names(demangled: list[str]) -> list[str]:
    """`kernel_name` of each, made unique in the list: a name two kernels share gets '~2', '~3', ...
    from its second holder on (in the order given)."""
    out, seen = [], {}
    for name in demangled:
        short = kernel_name(name)
        n = seen.get(short, 0) + 1
        seen[short] = n
        out.append(short if n == 1 else f"{short}~{n}")
    return out
