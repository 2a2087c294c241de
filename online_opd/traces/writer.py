"""Delivery of captured records off the serving hot path: a bounded queue and one writer thread.

``BufferWriter.submit`` never blocks the engine: a full queue drops the record
and counts it. The thread batches records into segments (online_opd/traces/buffer.py's
``SegmentWriter``: atomic, checksummed Parquet files) every ``flush_records``
records or ``flush_interval_s`` seconds and applies retention after each write.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from online_opd.traces.buffer import SegmentWriter
from online_opd.traces.records import SequenceRecord

logger = logging.getLogger(__name__)


_STOP = object()


class BufferWriter:
    """Non-blocking sink for captured records: a bounded queue and one writer thread.

    ``submit`` is called on the serving path and never blocks: when the queue
    is full (the disk is slower than the traffic) or the writer is closed, the
    record is dropped and counted. The thread publishes a segment every
    ``flush_records`` records or ``flush_interval_s`` seconds, whichever comes
    first, then enforces retention. A failed write is logged and counted and
    its records count as dropped; the thread keeps going. At any moment
    ``submitted == written_records + dropped + (records still queued or pending)``.
    Memory is bounded by ``maxsize + flush_records`` records.
    """

    def __init__(self, root: str | os.PathLike, *, writer_id: str | None = None,
                 max_bytes: int | None = None, max_age_s: float | None = None,
                 flush_records: int = 1024, flush_interval_s: float = 5.0, maxsize: int = 10_000,
                 start: bool = True) -> None:
        if flush_records < 1 or flush_interval_s <= 0 or maxsize < 1:
            raise ValueError("flush_records, flush_interval_s and maxsize must be positive")
        self.segment_writer = SegmentWriter(root, writer_id, max_bytes=max_bytes, max_age_s=max_age_s)
        self.flush_records = flush_records
        self.flush_interval_s = flush_interval_s
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._lock = threading.Lock()
        self._closed = False
        self._counters: dict[str, Any] = {"submitted": 0, "dropped": 0, "written_records": 0,
                                          "written_segments": 0, "write_errors": 0, "last_error": None}
        self._thread = threading.Thread(target=self._run, name="online-opd-buffer-writer", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start the writer thread (for ``start=False``: e.g. construct before a fork)."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def submit(self, record: SequenceRecord) -> bool:
        """Queue ``record`` for writing; False (and counted as dropped) when full or closed."""
        with self._lock:
            self._counters["submitted"] += 1
            if not self._closed:
                try:
                    self._queue.put_nowait(record)
                    return True
                except queue.Full:
                    pass
            self._counters["dropped"] += 1
            return False

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop accepting records, flush what is queued, join the thread; True when it finished."""
        with self._lock:
            already = self._closed
            self._closed = True
        self.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not already:
            try:
                self._queue.put(_STOP, timeout=timeout)  # the thread drains the queue, so this gets in
            except queue.Full:
                logger.error("buffer writer: queue still full after %ss, records left unwritten", timeout)
                return False
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """Counters plus the directory's bytes and segments (a running tally, no directory scan)."""
        with self._lock:
            out = dict(self._counters)
        out["queued"] = self._queue.qsize()
        out["buffer_bytes"] = self.segment_writer.bytes
        out["buffer_segments"] = self.segment_writer.segments
        return out

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, delta in deltas.items():
                self._counters[key] += delta

    def _run(self) -> None:
        pending: list[SequenceRecord] = []
        deadline = 0.0
        while True:
            wait = None if not pending else max(0.0, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._flush(pending)
                return
            if item is not None:
                if not pending:
                    deadline = time.monotonic() + self.flush_interval_s
                pending.append(item)
            if len(pending) >= self.flush_records or (pending and time.monotonic() >= deadline):
                self._flush(pending)
                pending = []

    def _flush(self, records: list[SequenceRecord]) -> None:
        if not records:
            return
        try:
            self.segment_writer.write(records)
        except Exception as exc:  # disk full, directory gone, ...: count, keep serving
            logger.warning("buffer writer: dropping %d records, segment write failed: %r", len(records), exc)
            with self._lock:
                self._counters["write_errors"] += 1
                self._counters["dropped"] += len(records)
                self._counters["last_error"] = repr(exc)
            return
        self._count(written_records=len(records), written_segments=1)
        try:
            self.segment_writer.enforce_retention()
        except Exception as exc:
            logger.warning("buffer writer: retention failed: %r", exc)
            with self._lock:
                self._counters["last_error"] = repr(exc)


# ---------------------------------------------------------------- reading
