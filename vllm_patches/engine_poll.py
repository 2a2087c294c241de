"""What the API server reads of the engine without asking its workers: vLLM's own Prometheus series in this
process (spec-decode counters, token counters, request gauges), and from them when a poll of the workers
(``collective_rpc``) is due (``PollPacer``). endpoint.py runs the poll loop; metrics.py exposes the figures.
"""

from __future__ import annotations

import math

from prometheus_client.registry import CollectorRegistry

SPEC_SERIES = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")
# vLLM's series that move while the engine has work: token counters and request gauges
ACTIVITY_SERIES = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
                   "vllm:num_requests_waiting")


def sample_sums(registry: CollectorRegistry, names: tuple[str, ...]) -> dict[str, float]:
    """Each named sample summed over its labels (engines), in one pass over a registry in this process."""
    totals = dict.fromkeys(names, 0.0)
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def spec_totals(registry: CollectorRegistry) -> tuple[float, float]:
    """vLLM's cumulative (drafts, accepted tokens) from a registry in this process."""
    return tuple(sample_sums(registry, SPEC_SERIES).values())  # type: ignore[return-value]


def engine_activity(sums: dict[str, float]) -> tuple[float, ...]:
    """A signature of the engine's work from ``sample_sums`` of ``ACTIVITY_SERIES``: it changes exactly
    when tokens were computed since the last one, or while requests are running or waiting."""
    return tuple(sums[name] for name in ACTIVITY_SERIES)


class PollPacer:
    """When the server polls the engine's workers: every poll while the engine works and for
    ``settle_s`` after it stopped (the buffer writer flushes and retries after the traffic), then once
    every ``idle_poll_s``.

    Why not always: each ``collective_rpc`` is a read of vLLM's shared-memory message queue, and a
    reader busy-waits on that queue for a second after every read (vLLM's ``SpinCondition``). Polled
    every few seconds, an idle engine's worker spins on its core a good part of the time; polled more
    often than once a second (the test configs), it never stops. On CPU that core is the one vLLM bound
    the worker's OpenMP threads to, and a process that pins itself there, as MKL does to count cores
    when torch is imported, can wait for minutes (a trainer child, a second replica on the machine)."""

    def __init__(self, settle_s: float, idle_poll_s: float):
        self.settle_s = settle_s
        self.idle_poll_s = idle_poll_s
        self._activity: tuple[float, ...] | None = None
        self._active_at = -math.inf  # no work seen yet: a fresh engine is idle
        self._polled_at: float | None = None

    def due(self, now: float, activity: tuple[float, ...]) -> bool:
        """Whether to poll the workers now, given vLLM's activity signature."""
        if self._activity is not None and activity != self._activity:
            self._active_at = now
        self._activity = activity
        return (self._polled_at is None or now - self._active_at <= self.settle_s
                or now - self._polled_at >= self.idle_poll_s)

    def polled(self, now: float) -> None:
        self._polled_at = now
