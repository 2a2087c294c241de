"""`online-opd scrape`: record a server's ``/metrics`` over time as JSON lines.

Why a scraper of our own when Prometheus exists: a benchmark or a laptop run
rarely has a Prometheus server, yet ``online-opd report`` needs the counters
over time (served acceptance from ``vllm:spec_decode_*``, the drafter version,
trainer steps). Each line of the output file is one scrape::

    {"time": 1700000000.12, "metrics": {"vllm:spec_decode_num_drafts_total": 1234.0, ...}}

flattened by ``parse_metrics`` (one key per sample, ``name{label=value,...}``
with labels sorted, the per-engine ``engine``/``model_name`` labels dropped and
samples that then collide summed), which ``serve.launcher.ServerProcess.metrics``
also uses, so the tests' and the report's view of a scrape is the same. Non-finite values
(a drafter version without a number is NaN) are written as ``null`` to keep
every line strict JSON for ``jq``.

A failed scrape (server restarting, timeout) is logged and skipped, never
fatal: the loop is meant to outlive the server it watches. Each line is flushed
as it is written, so ``report`` can read the file while the scraper runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

from serve.signals import stop_on_signals

__all__ = ["DROPPED_LABELS", "add_parser", "parse_metrics", "run", "scrape", "scrape_loop"]

logger = logging.getLogger(__name__)

# Per-engine labels: summed away so keys stay stable across engine counts and model names.
DROPPED_LABELS = ("engine", "model_name")


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text exposition as ``{"name{label=value,...}": value}`` (see the module docstring)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in DROPPED_LABELS}
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                                 if labels else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """GET ``<url>/metrics`` once and flatten it; httpx errors and HTTP error statuses raise."""
    import httpx

    reply = httpx.get(f"{url.rstrip('/')}/metrics", timeout=timeout)
    reply.raise_for_status()
    return parse_metrics(reply.text)


def _jsonable(metrics: dict[str, float]) -> dict[str, float | None]:
    return {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}


def scrape_loop(url: str, out: Path, interval_s: float, stop: threading.Event | None = None,
                duration_s: float | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Scrape every ``interval_s`` seconds, appending one JSON line per success to ``out``.

    Runs until ``stop`` is set or ``duration_s`` has passed (the first scrape is
    at 0, the last at or before ``duration_s``). Ticks are on a fixed schedule
    from the start, not "interval after the last reply", so a slow scrape does
    not stretch the series; a tick missed entirely is skipped, not made up.
    ``timeout`` (default: the interval, at most 10 s) bounds one request.
    Returns ``{"out", "scrapes", "errors", "seconds"}``.
    """
    if interval_s <= 0:
        raise ValueError(f"interval must be positive, got {interval_s}")
    if duration_s is not None and duration_s < 0:
        raise ValueError(f"duration must not be negative, got {duration_s}")
    stop = stop or threading.Event()
    timeout = timeout if timeout is not None else min(interval_s, 10.0)
    out.parent.mkdir(parents=True, exist_ok=True)
    scrapes = errors = 0
    start = time.monotonic()
    tick = 0
    with open(out, "a", encoding="utf-8") as f:
        while not stop.is_set():
            try:
                metrics = scrape(url, timeout=timeout)
            except Exception as exc:  # connection refused, timeout, 5xx, bad exposition: keep going
                errors += 1
                logger.warning("scrape %s/metrics failed: %r", url.rstrip("/"), exc)
            else:
                f.write(json.dumps({"time": time.time(), "metrics": _jsonable(metrics)}) + "\n")
                f.flush()
                scrapes += 1
            elapsed = time.monotonic() - start
            tick = max(tick + 1, math.ceil(elapsed / interval_s))  # skip ticks a slow scrape overran
            if duration_s is not None and tick * interval_s > duration_s:
                break
            stop.wait(max(0.0, start + tick * interval_s - time.monotonic()))
    return {"out": str(out), "scrapes": scrapes, "errors": errors,
            "seconds": round(time.monotonic() - start, 3)}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``scrape`` command to ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "scrape", help="record a server's /metrics as JSON lines (input of `online-opd report`)",
        description="Scrape <url>/metrics every --interval seconds and append one JSON line per scrape "
                    "to --out, until --duration has passed or Ctrl-C. Failed scrapes are logged and "
                    "skipped. A summary JSON is printed on stdout at the end.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="JSONL file to append to")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes (default: %(default)s)")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: never)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``scrape``: Ctrl-C / SIGTERM end the loop cleanly and the summary is still printed."""
    if args.interval <= 0:
        print(f"online-opd scrape: --interval must be positive, got {args.interval}", file=sys.stderr)
        return 2
    with stop_on_signals() as stop:
        summary = scrape_loop(args.url, args.out, args.interval, stop=stop, duration_s=args.duration)
    print(json.dumps(summary, indent=2))
    return 0
