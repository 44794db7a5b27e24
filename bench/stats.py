"""Small statistics the benchmark reports: nearest-rank percentiles, gaps between stream chunks.

Nearest-rank rather than interpolated percentiles: "p95" is then a latency some request really
had, the smallest that at least 95% of requests finished within (with few samples, the maximum).
"""
from __future__ import annotations

import math
import statistics
from typing import Callable, Iterable, Optional, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank q-th percentile (0 < q <= 100) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def p95(values: Sequence[float]) -> float:
    return percentile(values, 95)


def rounded(func: Callable[[Sequence[float]], float], values: Sequence[float],
            digits: int, scale: float = 1.0) -> Optional[float]:
    """func(values) * scale rounded, or None (not a crash) when there are no values, e.g. when
    every request of a crowd failed."""
    return round(func(values) * scale, digits) if values else None


def gaps(times: Sequence[float]) -> list[float]:
    """Seconds between successive timestamps: the waits a reader of the stream sees."""
    return [b - a for a, b in zip(times, times[1:])]


def timed_gaps(times: Sequence[float]) -> list[tuple[float, float]]:
    """(start, end) of each gap, to tell in which period of a run a gap fell."""
    return list(zip(times, times[1:]))


def overlaps(span: tuple[float, float], window: tuple[float, float]) -> bool:
    """Whether a gap (start, end) overlaps the window (start, end) at all: a stall that began
    before a long prompt arrived but lasted into its prefill is charged to the prefill."""
    return span[0] < window[1] and span[1] > window[0]


def gap_summary(values: Iterable[float], prefix: str = "gap") -> dict:
    """Median, p95 and max of gaps in milliseconds, plus how many there were."""
    values = list(values)
    return {f"{prefix}_count": len(values),
            f"{prefix}_median_ms": rounded(statistics.median, values, 1, 1000),
            f"{prefix}_p95_ms": rounded(p95, values, 1, 1000),
            f"{prefix}_max_ms": rounded(max, values, 1, 1000)}


def ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    """value / base, or None where either is missing or base is 0."""
    if value is None or not base:
        return None
    return value / base


def median_of(values: Iterable[Optional[float]]) -> Optional[float]:
    """Median of the values that exist (repeats of a measurement where some failed)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
