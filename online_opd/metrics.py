"""Prometheus series online-opd adds beside vLLM's ``vllm:spec_decode_*`` counters.

One scrape target: the server's ``/metrics``. Series are ``online_opd_*``, labels
stay low-cardinality (no request ids). Figures that live in the engine process
(capture counters, buffer size, drafter version) are polled from the worker
with ``collective_rpc`` and exposed by :class:`PolledCollector`; figures that
the server process owns (reloads, trainer, gate) are ordinary prometheus-client
metrics created by :func:`server_metrics`.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

PREFIX = "online_opd"

# counters polled from the capturing worker: stats key -> (series name, help)
CAPTURE_COUNTERS = {
    "captured": ("records_captured", "Sequence records handed to the buffer writer."),
    "dropped": ("records_dropped", "Records dropped because the writer fell behind or failed."),
    "opted_out": ("records_opted_out", "Requests that opted out of capture (vllm_xargs)."),
    "not_sampled": ("records_not_sampled", "Requests left out by the capture sample rate."),
    "blocks": ("blocks_captured", "Verified draft blocks in captured records."),
    "errors": ("capture_errors", "Internal capture errors (counted, never raised into vLLM)."),
}


def version_number(version: str | None) -> float:
    """``v0012`` -> 12.0 (the last integer in the name); NaN when there is none."""
    match = re.search(r"(\d+)(?!.*\d)", version or "")
    return float(match.group(1)) if match else float("nan")


class PolledCollector(Collector):
    """Exposes the latest engine status (``OnlineOPDWorkerExtension.online_opd_status``)."""

    def __init__(self, latest: Callable[[], dict | None]):
        self._latest = latest

    def collect(self):
        status = self._latest()
        if not status:
            return
        capture = status.get("capture") or {}
        for key, (name, doc) in CAPTURE_COUNTERS.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(capture.get(key, 0)))
            yield family
        writer = capture.get("writer") or {}
        for key, name, doc in [("buffer_bytes", "buffer_bytes", "Bytes of trace-buffer segments on disk."),
                               ("buffer_segments", "buffer_segments", "Trace-buffer segment files on disk.")]:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            family.add_metric([], float(writer.get(key, 0)))
            yield family
        version = status.get("version")
        family = GaugeMetricFamily(f"{PREFIX}_drafter_version",
                                   "Drafter version the engine serves (number in its name).")
        family.add_metric([], version_number(version))
        yield family
        info = GaugeMetricFamily(f"{PREFIX}_drafter_info", "Drafter version serving (label).",
                                 labels=["version"])
        info.add_metric([str(version)], 1.0)
        yield info


def server_metrics(registry: CollectorRegistry) -> dict[str, Any]:
    """Metrics owned by the server process (reloads, rollbacks, gate, trainer)."""
    return {
        "reloads": Counter(f"{PREFIX}_reloads", "Drafter hot reloads by result (ok, refused, failed).",
                           ["result"], registry=registry),
        "reload_seconds": Histogram(
            f"{PREFIX}_reload_duration_seconds", "Time the engine spent inside a drafter reload call.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=registry),
        "rollbacks": Counter(f"{PREFIX}_rollbacks", "Drafter versions rolled back after a live check.",
                             registry=registry),
        "poll_errors": Counter(f"{PREFIX}_status_poll_errors", "Failed polls of the engine's status.",
                               registry=registry),
    }
