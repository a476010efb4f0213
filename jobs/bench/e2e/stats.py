"""Numbers over seeds: medians where a seed that missed the target counts as infinitely slow,
the spread of the seeds, and ratios that are missing when either side is."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["median", "median_with_misses", "ratio", "spread"]


def median_with_misses(values: Sequence[float | None]) -> float | None:
    """Median where None (a miss) counts as +infinity; None when the median is a miss."""
    if not values:
        return None
    keyed = sorted(math.inf if v is None else float(v) for v in values)
    n = len(keyed)
    mid = keyed[n // 2] if n % 2 else (keyed[n // 2 - 1] + keyed[n // 2]) / 2
    return None if math.isinf(mid) else mid


def spread(values: Sequence[float | None]) -> list[float | None]:
    """[min, max] over seeds; max is None if any seed missed."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return [None, None]
    return [min(got), None if len(got) < len(values) else max(got)]


def median(values: Sequence[float | None]) -> float | None:
    """Median of the numbers present (None when there are none)."""
    got = [float(v) for v in values if v is not None]
    return statistics.median(got) if got else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None
