"""Student-t intervals for the benchmarks that compare arms over seeds (objectives.py, domain_shift_seeds.py)."""

from __future__ import annotations

import statistics

from scipy import stats


def t_interval(values: list[float], confidence: float = 0.95) -> dict:
    """Mean with its two-sided Student-t interval over `values` (None bounds with fewer than 2)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": round(mean, 4), "ci95": None, "n": len(values)}
    sem = statistics.stdev(values) / len(values) ** 0.5
    low, high = stats.t.interval(confidence, len(values) - 1, loc=mean, scale=sem) if sem > 0 else (mean, mean)
    return {"mean": round(mean, 4), "ci95": [round(float(low), 4), round(float(high), 4)], "n": len(values)}
