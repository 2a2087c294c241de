"""/metrics with several API servers: vLLM runs prometheus-client in multiprocess mode, where every answer
is read from the metric files of all API server processes and never from a process's collectors. API
server 0 polls and ``MultiprocessMirror`` copies its collectors' figures (metrics.py) into multiprocess
metrics after every poll (endpoint.py).
"""

from __future__ import annotations

import math
import os

from prometheus_client import Counter, Gauge
from prometheus_client.registry import Collector


def is_multiprocess() -> bool:
    """True when prometheus-client runs in multiprocess mode (vLLM sets this for N > 1 API servers)."""
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir"))


class MultiprocessMirror:
    """Collectors' figures copied into multiprocess-mode metrics, so that /metrics shows them.

    ``update`` collects each collector and writes what it yields: a counter sample is increased by
    its change since the last copy (one that went down, like a restarted trainer's, counts as a reset
    and is increased by its new value); a gauge sample is set (mode ``mostrecent``: one process, the
    leader, writes it). A gauge sample written before and not yielded now (the trainer went down,
    a drafter version stopped serving, a batch-size range left the schedule) is set to NaN:
    prometheus-client cannot remove samples in multiprocess mode. Counter samples stay.
    """

    def __init__(self, collectors: list[Collector]):
        self._collectors = list(collectors)
        self._metrics: dict[str, Counter | Gauge] = {}
        self._counts: dict[tuple[str, tuple[str, ...]], float] = {}
        self._gauges: set[tuple[str, tuple[str, ...]]] = set()

    def update(self) -> None:
        written: set[tuple[str, tuple[str, ...]]] = set()
        for collector in self._collectors:
            for family in collector.collect():
                for sample in family.samples:
                    if family.type == "counter" and sample.name.endswith("_total"):
                        self._count(family, sample.labels, sample.value)
                    elif family.type == "gauge":
                        self._child(family, sample.labels).set(sample.value)
                        written.add((family.name, tuple(sample.labels.values())))
        for name, values in self._gauges - written:
            metric = self._metrics[name]
            (metric.labels(*values) if values else metric).set(math.nan)
        self._gauges |= written

    def _count(self, family, labels: dict[str, str], value: float) -> None:
        key = (family.name, tuple(labels.values()))
        last = self._counts.get(key, 0.0)
        delta = value - last if value >= last else value
        self._counts[key] = value
        child = self._child(family, labels)  # made even at 0: the sample shows, as its collector shows it
        if delta > 0:
            child.inc(delta)

    def _child(self, family, labels: dict[str, str]):
        metric = self._metrics.get(family.name)
        if metric is None:
            kind = Counter if family.type == "counter" else Gauge
            extra = {} if kind is Counter else {"multiprocess_mode": "mostrecent"}
            metric = self._metrics[family.name] = kind(family.name, family.documentation, list(labels),
                                                       registry=None, **extra)
        return metric.labels(*labels.values()) if labels else metric
