"""The 95% interval the step-time benchmarks report: over per-round ratios (each round's variant against that round's
bare loop), so drift between rounds cancels."""

from __future__ import annotations

import math
import statistics


def ci95(ratios: list[float]) -> list[float] | None:
    """Mean of ``ratios`` +- 1.96 standard errors, or None with fewer than two."""
    if len(ratios) < 2:
        return None
    mean, half = statistics.mean(ratios), 1.96 * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return [mean - half, mean + half]
