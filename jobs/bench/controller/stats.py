"""Statistics of the controller load benchmark: percentiles of the ingest latencies and the
verdict on whether the controller's memory stays bounded under load."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["BOUNDED_GROWTH", "latency_summary", "memory_verdict", "percentile"]

BOUNDED_GROWTH = 0.10  # max RSS growth over the second half of the load


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile of an already sorted sequence (0 when empty)."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float]:
    """Percentiles (p50, p90, p99, p99.9), mean and max in ms, and the sample count."""
    values = sorted(latencies_s)
    out = {f"p{q}_ms": percentile(values, q) * 1e3 for q in (50, 90, 99)}
    out["p99_9_ms"] = percentile(values, 99.9) * 1e3
    out["mean_ms"] = statistics.fmean(values) * 1e3 if values else 0.0
    out["max_ms"] = values[-1] * 1e3 if values else 0.0
    out["samples"] = len(values)
    return out


def memory_verdict(timeline: Sequence[dict[str, float]], duration: float) -> dict[str, Any]:
    """RSS growth over the second half of the load: bounded when the largest RSS sample of the
    second half is less than :data:`BOUNDED_GROWTH` above the RSS at its midpoint."""
    during = [s for s in timeline if 0 <= s["t_s"] <= duration]
    if not during:
        return {"bounded": False, "reason": "no samples"}
    mid = min(during, key=lambda s: abs(s["t_s"] - duration / 2))
    second = [s for s in during if s["t_s"] >= mid["t_s"]]
    peak = max(s["rss_mb"] for s in second)
    growth = (peak - mid["rss_mb"]) / mid["rss_mb"]
    slope = 0.0
    if len(second) >= 2 and second[-1]["t_s"] > second[0]["t_s"]:
        xs, ys = [s["t_s"] for s in second], [s["rss_mb"] for s in second]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return {"rss_mid_mb": mid["rss_mb"], "rss_mid_t_s": mid["t_s"], "rss_second_half_max_mb": peak,
            "second_half_growth": growth, "second_half_slope_mb_per_min": slope * 60,
            "bounded": growth < BOUNDED_GROWTH, "threshold": BOUNDED_GROWTH}
