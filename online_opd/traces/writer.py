"""Delivery of captured records off the serving hot path: a bounded queue and one writer thread.

``BufferWriter.submit`` never blocks the engine: a full queue drops the record
and counts it. The thread batches records into segments (online_opd/traces/buffer.py's
``SegmentWriter``: atomic, checksummed Parquet files) every ``flush_records``
records or ``flush_interval_s`` seconds and applies retention after each write.
While writes fail (read-only or full disk) it holds a bounded number of records
and retries, so a passing fault loses none of them.
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


class _FlushRequest:
    """Queued by ``BufferWriter.flush``: the thread writes what it holds, then sets ``done``."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.written = False


class BufferWriter:
    """Non-blocking sink for captured records: a bounded queue and one writer thread.

    ``submit`` is called on the serving path and never blocks: when the queue
    is full (the disk is slower than the traffic) or the writer is closed, the
    record is dropped and counted. The thread publishes a segment every
    ``flush_records`` records or ``flush_interval_s`` seconds, whichever comes
    first, then enforces retention.

    Failed writes (folder read-only, disk full, folder gone): the records are
    held in memory, at most ``max_held`` (the oldest beyond that are dropped
    and counted), and the write is retried every ``retry_interval_s``; the
    first write that succeeds again publishes what is held. Each outage is
    logged twice, when it starts and when it ends, and counted per failed
    attempt in ``write_errors``. At any moment
    ``submitted == written_records + dropped + queued + held + (records not yet due)``.
    Memory is bounded by ``maxsize + max_held`` records.
    """

    def __init__(self, root: str | os.PathLike, *, writer_id: str | None = None,
                 max_bytes: int | None = None, max_age_s: float | None = None,
                 flush_records: int = 1024, flush_interval_s: float = 5.0, maxsize: int = 10_000,
                 max_held: int | None = None, retry_interval_s: float = 2.0, retention_interval_s: float = 0.0,
                 start: bool = True) -> None:
        if flush_records < 1 or flush_interval_s <= 0 or maxsize < 1 or retry_interval_s <= 0:
            raise ValueError("flush_records, flush_interval_s, maxsize and retry_interval_s must be positive")
        if retention_interval_s < 0:
            raise ValueError(f"retention_interval_s must be >= 0, got {retention_interval_s}")
        self.retention_interval_s = retention_interval_s
        self._retained_at: float | None = None  # monotonic time of the last retention pass
        self.segment_writer = SegmentWriter(root, writer_id, max_bytes=max_bytes, max_age_s=max_age_s)
        self.flush_records = flush_records
        self.flush_interval_s = flush_interval_s
        self.max_held = maxsize if max_held is None else max(max_held, flush_records)
        self.retry_interval_s = retry_interval_s
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._lock = threading.Lock()
        self._closed = False
        self._outage: dict[str, Any] | None = None  # {"since", "attempts", "dropped"} while writes fail
        self._counters: dict[str, Any] = {"submitted": 0, "dropped": 0, "written_records": 0,
                                          "written_segments": 0, "write_errors": 0, "held": 0,
                                          "is_write_failing": False, "last_error": None}
        self._thread = threading.Thread(target=self._run, name="online-opd-buffer-writer", daemon=True)
        if start:
            self._thread.start()

    @property
    def writer_id(self) -> str:
        """The id in this writer's segment names (one per serving replica process)."""
        return self.segment_writer.writer_id

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

    def flush(self, timeout: float = 10.0) -> bool:
        """Write every record submitted so far now, without waiting for ``flush_records`` or
        ``flush_interval_s``; True when they are on storage within ``timeout`` (False: a write failed and
        they are held for retry, or the time ran out). The writer stays open."""
        with self._lock:
            closed = self._closed
        if closed or not self._thread.is_alive():
            return self._queue.empty()
        request = _FlushRequest()
        try:
            self._queue.put(request, timeout=timeout)
        except queue.Full:
            return False
        return request.done.wait(timeout) and request.written

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
        deadline = 0.0  # when ``pending`` is written (or retried) at the latest
        while True:
            wait = None if not pending else max(0.0, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._give_up(self._flush(pending))
                return
            if isinstance(item, _FlushRequest):
                pending = self._flush(pending) if pending else pending
                deadline = time.monotonic() + self.retry_interval_s
                item.written = not pending
                item.done.set()
                continue
            if item is not None:
                if not pending:
                    deadline = time.monotonic() + self.flush_interval_s
                pending.append(item)
            is_full = len(pending) >= self.flush_records and self._outage is None
            if pending and (is_full or time.monotonic() >= deadline):
                pending = self._flush(pending)
                deadline = time.monotonic() + self.retry_interval_s
            elif self._outage is not None:
                pending = self._hold(pending)

    def _flush(self, records: list[SequenceRecord]) -> list[SequenceRecord]:
        """Write ``records`` in segments of ``flush_records``; returns those left (held) after a failure."""
        for start in range(0, len(records), self.flush_records):
            chunk = records[start:start + self.flush_records]
            try:
                self.segment_writer.write(chunk)
            except Exception as exc:  # read-only, disk full, directory gone, ...: hold, retry, keep serving
                self._on_write_error(exc)
                return self._hold(records[start:])
            self._count(written_records=len(chunk), written_segments=1)
            self._on_write_ok()
            self._retain()
        self._set_held(0)
        return []

    def _retain(self) -> None:
        """Retention after a write, at most every ``retention_interval_s``: each pass lists the whole
        buffer, which on a bucket shared by many replicas is the costly part (README, sizing)."""
        now = time.monotonic()
        if self._retained_at is not None and now - self._retained_at < self.retention_interval_s:
            return
        self._retained_at = now
        try:
            self.segment_writer.enforce_retention()
        except Exception as exc:
            logger.warning("buffer writer: retention failed: %r", exc)
            with self._lock:
                self._counters["last_error"] = repr(exc)

    def _hold(self, records: list[SequenceRecord]) -> list[SequenceRecord]:
        """Keep the newest ``max_held`` records for a retry; the rest are dropped and counted."""
        excess = max(0, len(records) - self.max_held)
        self._set_held(len(records) - excess)
        if not excess:
            return records
        self._count(dropped=excess)
        self._outage["dropped"] += excess
        return records[excess:]

    def _give_up(self, records: list[SequenceRecord]) -> None:
        if records:
            logger.error("buffer writer: closing with %d records unwritten (%s): dropped", len(records),
                         self._counters["last_error"])
            self._count(dropped=len(records))
            self._set_held(0)

    def _on_write_error(self, exc: Exception) -> None:
        with self._lock:
            self._counters["write_errors"] += 1
            self._counters["last_error"] = repr(exc)
            self._counters["is_write_failing"] = True
        if self._outage is None:
            self._outage = {"since": time.monotonic(), "attempts": 0, "dropped": 0}
            logger.error("buffer writes to %s failing: %r; holding up to %d records in memory, retrying "
                         "every %gs", self.segment_writer.root, exc, self.max_held, self.retry_interval_s)
        self._outage["attempts"] += 1

    def _on_write_ok(self) -> None:
        if self._outage is None:
            return
        outage, self._outage = self._outage, None
        with self._lock:
            self._counters["is_write_failing"] = False
        logger.warning("buffer writes to %s resumed after %d failed attempts over %.1fs (%d records dropped "
                       "meanwhile)", self.segment_writer.root, outage["attempts"],
                       time.monotonic() - outage["since"], outage["dropped"])

    def _set_held(self, num_held: int) -> None:
        with self._lock:
            self._counters["held"] = num_held if self._outage is not None else 0


# ---------------------------------------------------------------- reading
