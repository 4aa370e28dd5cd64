"""The gate statistic of commit 7546d11 (tools/stats.py there, verbatim but for this docstring): a 20%
trimmed mean of per-pair log ratios with Yuen's standard error. Kept only so the tests can show the
statistical cheats it accepted (tests/test_cheats_runtime.py); the gate no longer uses it."""

from __future__ import annotations

import math
from dataclasses import dataclass

TRIM = 0.2


@dataclass(frozen=True)
class Estimate:
    mean: float  # trimmed mean of the log ratios
    se: float  # its standard error
    n: int

    def interval(self, z: float | None = None) -> tuple[float, float]:
        z = t_quantile_975(self.effective_df()) if z is None else z
        return self.mean - z * self.se, self.mean + z * self.se

    def effective_df(self) -> int:
        g = int(TRIM * self.n)
        return max(1, self.n - 2 * g - 1)


def t_quantile_975(df: int) -> float:
    """Two-sided 95% quantile of Student's t (Cornish-Fisher to within 0.5% for df >= 3)."""
    if df <= 0:
        return float("inf")
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
    if df in table:
        return table[df]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def trimmed_estimate(values: list[float], trim: float = TRIM) -> Estimate:
    """Yuen's trimmed mean and its standard error."""
    n = len(values)
    if n == 0:
        return Estimate(0.0, float("inf"), 0)
    xs = sorted(values)
    g = int(trim * n)
    kept = xs[g : n - g] if n - 2 * g > 0 else xs
    mean = sum(kept) / len(kept)
    if n < 3:
        return Estimate(mean, float("inf"), n)
    lo, hi = xs[g], xs[n - g - 1]
    wins = [min(max(x, lo), hi) for x in xs]
    wmean = sum(wins) / n
    wvar = sum((x - wmean) ** 2 for x in wins) / (n - 1)
    h = n - 2 * g
    se = math.sqrt(wvar) / ((h / n) * math.sqrt(n)) if h > 0 else float("inf")
    return Estimate(mean, se, n)


def combine(estimates: list[Estimate], weights: list[float]) -> Estimate:
    """Weighted mean of per-shape log estimates (independent samples)."""
    total = sum(weights)
    if not estimates or total <= 0:
        return Estimate(0.0, float("inf"), 0)
    mean = sum(w * e.mean for e, w in zip(estimates, weights)) / total
    var = sum((w / total) ** 2 * e.se**2 for e, w in zip(estimates, weights))
    return Estimate(mean, math.sqrt(var), sum(e.n for e in estimates))


def median(values: list[float]) -> float:
    return quantile(values, 0.5)


def weighted_geomean(values: list[float], weights: list[float]) -> float | None:
    """exp(sum w*log v / sum w) over the positive values; None when there are none."""
    pairs = [(v, w) for v, w in zip(values, weights) if v > 0]
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        return None
    return math.exp(sum(w * math.log(v) for v, w in pairs) / total)


def quantile(values: list[float], q: float) -> float:
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
