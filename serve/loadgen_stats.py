"""`online-opd loadgen` results: one `RequestResult` per request and `summarize`, the run's figures.

The runner (serve/loadgen_runner.py) fills the results; nothing here sends a request.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RequestResult", "summarize"]


@dataclass
class RequestResult:
    """One request as written to ``--out`` (one JSON line each).

    Times: ``start_time`` is Unix time (joins with server logs), the others are
    ``time.perf_counter`` differences.  Token counts come from the server's
    ``usage`` (None when it sent none); ``ttft_s`` is the first chunk that
    carries text, so it is None without streaming.
    """

    index: int
    prompt_id: str
    opted_out: bool
    start_time: float
    start_offset_s: float = 0.0  # since the run started
    queued_s: float = 0.0  # open loop: waited for an in-flight slot after its arrival time
    latency_s: float | None = None
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error_type: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_type is None


def _percentile(values: Sequence[float], q: int) -> float | None:
    """The ``q``-th percentile (integer q in 1..99); None for no values.

    ``method="inclusive"`` interpolates linearly between the order statistics
    at (n - 1) * q / 100, as numpy's default does.
    """
    if len(values) < 2:  # statistics.quantiles needs two points before Python 3.13
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(results: Sequence[RequestResult], wall_s: float, *, stream: bool) -> dict[str, Any]:
    """Aggregate of finished requests.  Rates use successful requests over the whole wall time;
    latency/TTFT percentiles are over successful requests only (a failure's latency says
    little about serving speed)."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.completion_tokens or 0 for r in ok)
    wall = max(wall_s, 1e-9)

    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    latencies = [r.latency_s for r in ok if r.latency_s is not None]
    summary: dict[str, Any] = {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "opted_out": sum(r.opted_out for r in results),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "output_tokens": output_tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(output_tokens / wall, 3),
        "requests_per_s": round(len(ok) / wall, 4),
        "latency_p50_s": rounded(_percentile(latencies, 50)),
        "latency_p95_s": rounded(_percentile(latencies, 95)),
    }
    if stream:
        summary["ttft_p50_s"] = rounded(_percentile([r.ttft_s for r in ok if r.ttft_s is not None], 50))
    summary["errors"] = dict(Counter(r.error_type for r in results if not r.ok).most_common())
    return summary
