"""The trace buffer: durable, append-only Parquet segments of ``SequenceRecord``s.

Serving replicas capture records (vllm_patches/) and hand them to a
``BufferWriter`` (online_opd/traces/writer.py), whose background thread batches them into segment files;
the trainer tails the directory with a ``BufferReader`` (docs/architecture.md#buffer-segments).

Segment files. One Parquet file per batch, named
``seg-{unix_ms:013d}-{writer_id}-{seq:06d}-{sha256[:32]}.parquet``: names sort
in time order (so a name is a cursor for tailing), ``writer_id`` keeps several
replicas writing to one directory apart, and the name carries the checksum of
the file's bytes, so a reader can tell a torn or bit-flipped segment without
any side file. A segment is published atomically (online_opd/traces/storage.py:
a temporary file renamed in a local folder, one PUT on an object store).
Readers ignore every name that is not a segment name (the ``.tmp`` files
included). A segment whose bytes do not match its name or do not parse is
never fatal: the reader logs it, counts it and moves it under ``quarantine/``
(kept for inspection, out of every later listing), and reading goes on.

Bounds. ``SegmentWriter.enforce_retention`` deletes the oldest segments while
the directory holds more than ``max_bytes`` and every segment older than
``max_age_s`` (age from the timestamp in the name), whichever writer wrote it.
Quarantined segments are bounded the same way, on their own: they count toward
neither bound of the live segments, and are deleted once past ``max_age_s`` or
while the quarantine alone holds more than ``max_bytes``.

Storage. ``root`` is a local folder or an ``s3://bucket/prefix`` URI; every
byte goes through ``open_store(root)`` (storage.py), and this module is the
same code for both, so naming, verification, cursors and records are too.

Cursor caveat with several writers: a replica whose segment takes longer to
publish (or whose clock is behind) can publish a name that sorts before a
cursor that a reader has already moved past. ``tail(..., settle_s=...)``
leaves segments younger than ``settle_s`` for the next call to avoid this.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from online_opd.files import is_temp_name
from online_opd.traces.records import BlockRecord, SequenceRecord, acceptance_length, pure_blocks_by_version
from online_opd.traces.storage import QUARANTINE_DIR, Store, StoredFile, open_store

logger = logging.getLogger(__name__)

SEGMENT_SCHEMA = pa.schema([
    ("record_id", pa.string()),
    ("model_id", pa.string()),
    ("drafter_version", pa.string()),
    ("temperature", pa.float64()),  # float64, not float32: round trips give back the same Python float
    ("top_p", pa.float64()),
    ("top_k", pa.int32()),
    ("tokens", pa.list_(pa.int32())),
    ("prompt_len", pa.int32()),
    ("blocks", pa.list_(pa.struct([
        ("anchor", pa.int32()),
        ("draft_tokens", pa.list_(pa.int32())),
        ("num_accepted", pa.int16()),
        ("drafter_version", pa.string()),  # absent in older segments: read as null (the record's)
        ("is_context_pure", pa.bool_()),  # absent in older segments: read as null (pure)
        ("num_plain_steps", pa.int32()),  # absent in older segments: read as null (0)
        ("proposer", pa.string()),  # absent in older segments: read as null ("drafter")
        ("num_drafted", pa.int16()),  # absent in older segments: read as null (verified whole)
        # BlockRecord.teacher's [K + 1][k] tables, float32 as captured (exact round trip);
        # absent in older segments: read as null (no teacher signal)
        ("teacher_ids", pa.list_(pa.list_(pa.int32()))),
        ("teacher_logprobs", pa.list_(pa.list_(pa.float32()))),
    ]))),
    ("events", pa.string()),  # JSON list: events are free-form dicts
    ("captured_at", pa.float64()),
    ("replica", pa.string()),  # absent in older segments: read as "" (unknown)
    # SequenceRecord.hidden (TargetHidden): null when not captured; absent in older segments (null)
    ("hidden_start", pa.int32()),
    ("hidden_width", pa.int32()),
    ("hidden_dtype", pa.string()),
    ("hidden_data", pa.large_binary()),
    # SequenceRecord.path_teacher (PathTeacher): null when not captured; absent in older segments (null)
    ("path_teacher_positions", pa.list_(pa.int32())),
    ("path_teacher_ids", pa.list_(pa.list_(pa.int32()))),
    ("path_teacher_logprobs", pa.list_(pa.list_(pa.float32()))),
])
_HIDDEN_COLUMNS = ("hidden_start", "hidden_width", "hidden_dtype", "hidden_data")
_PATH_TEACHER_COLUMNS = ("path_teacher_positions", "path_teacher_ids", "path_teacher_logprobs")
_OPTIONAL_COLUMNS = frozenset({"replica", *_HIDDEN_COLUMNS, *_PATH_TEACHER_COLUMNS})

_SEGMENT_RE = re.compile(r"^seg-(\d{13})-([A-Za-z0-9_]{1,32})-(\d{6})-([0-9a-f]{32})\.parquet$")
_STALE_TMP_S = 3600.0  # a .tmp this old belongs to a writer that died mid-write


class CorruptSegment(ValueError):
    """A segment whose bytes do not match the checksum in its name, or that does not parse."""


@dataclass(frozen=True)
class SegmentInfo:
    """One published segment, as its name and size describe it."""

    name: str
    path: Path | str  # a local path, or the object's URI
    bytes: int
    created_ms: int
    writer_id: str
    seq: int
    digest: str  # the first 32 hex digits of the sha256 of the file


def sanitize_writer_id(writer_id: str) -> str:
    """Writer id safe inside a segment name: ``[A-Za-z0-9_]``, at most 32 characters."""
    clean = re.sub(r"[^A-Za-z0-9_]", "_", writer_id)[:32]
    if not clean:
        raise ValueError(f"writer_id {writer_id!r} has no usable characters")
    return clean


def default_writer_id(pid: int | None = None) -> str:
    """Host and process (this one, or `pid`): distinct per replica without any configuration."""
    return sanitize_writer_id(f"{socket.gethostname()[:20]}_{os.getpid() if pid is None else pid}")


def segment_name(created_ms: int, writer_id: str, seq: int, sha256_hex: str) -> str:
    return f"seg-{created_ms:013d}-{writer_id}-{seq:06d}-{sha256_hex[:32]}.parquet"


def parse_segment_name(name: str) -> tuple[int, str, int, str] | None:
    """``(created_ms, writer_id, seq, digest)``, or None when ``name`` is not a segment."""
    m = _SEGMENT_RE.match(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)


# ---------------------------------------------------------------- encoding


def encode_segment(records: Iterable[SequenceRecord]) -> bytes:
    """Parquet bytes of one segment (column-wise, the cheap way to build an Arrow table)."""
    records = list(records)
    columns: dict[str, list[Any]] = {
        "record_id": [r.record_id for r in records],
        "model_id": [r.model_id for r in records],
        "drafter_version": [r.drafter_version for r in records],
        "temperature": [r.temperature for r in records],
        "top_p": [r.top_p for r in records],
        "top_k": [r.top_k for r in records],
        "tokens": [list(r.tokens) for r in records],
        "prompt_len": [r.prompt_len for r in records],
        "blocks": [[_block_row(b) for b in r.blocks] for r in records],
        "events": [json.dumps([dict(e) for e in r.events]) for r in records],
        "captured_at": [r.captured_at for r in records],
        "replica": [r.replica for r in records],
        **{f"hidden_{name}": [None if r.hidden is None else getattr(r.hidden, name) for r in records]
           for name in ("start", "width", "dtype", "data")},
        **{column: [None if r.path_teacher is None else value(r.path_teacher) for r in records]
           for column, value in (("path_teacher_positions", lambda t: list(t.positions)),
                                 ("path_teacher_ids", lambda t: t.rows.to_dict()["token_ids"]),
                                 ("path_teacher_logprobs", lambda t: t.rows.to_dict()["logprobs"]))},
    }
    table = pa.Table.from_pydict(columns, schema=SEGMENT_SCHEMA)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def decode_segment(data: bytes) -> list[SequenceRecord]:
    """Records from Parquet bytes; ValueError (or an Arrow error) when they do not parse."""
    table = pq.read_table(pa.BufferReader(data))
    missing = set(SEGMENT_SCHEMA.names) - set(table.column_names) - _OPTIONAL_COLUMNS
    if missing:
        raise ValueError(f"missing columns {sorted(missing)}")
    records = []
    for row in table.to_pylist():
        row["events"] = json.loads(row["events"])
        hidden = {name.removeprefix("hidden_"): row.pop(name, None) for name in _HIDDEN_COLUMNS}
        if hidden["data"] is not None:
            row["hidden"] = hidden  # SequenceRecord.from_dict validates it
        path = [row.pop(name, None) for name in _PATH_TEACHER_COLUMNS]
        if any(column is not None for column in path):  # one without the others: from_dict's error
            row["path_teacher"] = {"positions": path[0], "token_ids": path[1], "logprobs": path[2]}
        if isinstance(row.get("blocks"), list):
            row["blocks"] = [_block_dict(b) if isinstance(b, dict) else b for b in row["blocks"]]
        records.append(SequenceRecord.from_dict(row))  # validates every field
    return records


def _block_row(block: BlockRecord) -> dict[str, Any]:
    """A block's struct in a segment: ``to_dict`` (the JSON shape) with the teacher's tables as two
    columns of their own (nested lists Arrow can type, no JSON string to parse per block)."""
    row = block.to_dict()
    teacher = row.pop("teacher", None)
    if teacher is not None:
        row["teacher_ids"], row["teacher_logprobs"] = teacher["token_ids"], teacher["logprobs"]
    return row


def _block_dict(row: dict[str, Any]) -> dict[str, Any]:
    """``_block_row`` undone: the dict ``BlockRecord.from_dict`` reads (which validates the teacher; one
    table without the other is an error there, not a missing teacher)."""
    ids, logprobs = row.pop("teacher_ids", None), row.pop("teacher_logprobs", None)
    if ids is not None or logprobs is not None:
        row["teacher"] = {"token_ids": ids, "logprobs": logprobs}
    return row


# ---------------------------------------------------------------- listing


def _scan(store: Store, quarantined: bool = False) -> tuple[list[SegmentInfo], list[StoredFile]]:
    """Segments sorted by name, and the ``.tmp`` files; other names are ignored."""
    segments, tmps = [], []
    for f in store.list(quarantined):
        if is_temp_name(f.name):
            tmps.append(f)
            continue
        parsed = parse_segment_name(f.name)
        if parsed is None:
            continue
        created_ms, writer_id, seq, digest = parsed
        segments.append(SegmentInfo(f.name, f.location, f.size, created_ms, writer_id, seq, digest))
    segments.sort(key=lambda s: s.name)
    return segments, tmps


# ---------------------------------------------------------------- writing


class SegmentWriter:
    """Publishes batches of records as segments and enforces the directory's bounds.

    Not thread-safe: one owner (``BufferWriter``'s thread, or a script).
    ``bytes``/``segments`` are a running tally of the whole directory, exact
    after each ``enforce_retention`` and updated by each ``write`` in between.
    """

    def __init__(self, root: str | os.PathLike, writer_id: str | None = None,
                 max_bytes: int | None = None, max_age_s: float | None = None) -> None:
        self.store = open_store(root)
        self.root = self.store.root  # a Path, or the URI without query parameters
        self.writer_id = sanitize_writer_id(writer_id) if writer_id is not None else default_writer_id()
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._seq = 0
        self._last_ms = 0
        self.store.prepare()
        segments, _ = _scan(self.store)
        self.bytes = sum(s.bytes for s in segments)
        self.segments = len(segments)

    def write(self, records: Iterable[SequenceRecord]) -> Path | str | None:
        """Publish one segment holding ``records``; its path (a URI on an object store), or None
        (and no file) when there are none."""
        records = list(records)
        if not records:
            return None
        data = encode_segment(records)
        digest = hashlib.sha256(data).hexdigest()

        def final_name() -> str:
            # Never go back in time within one writer, so its own names stay in order.
            self._last_ms = max(self._last_ms, int(time.time() * 1000))
            return segment_name(self._last_ms, self.writer_id, self._seq, digest)

        path = self.store.publish(data, final_name)
        self._seq += 1
        self.bytes += len(data)
        self.segments += 1
        return path

    def enforce_retention(self, now: float | None = None) -> dict[str, int]:
        """Delete segments past the age bound, then the oldest while over the byte bound.

        Segments of every writer in the directory count. Quarantined segments are
        bounded the same way on their own (kept for inspection, not forever). Also
        removes ``.tmp`` files older than an hour (left by a writer that died mid-write).
        """
        now = time.time() if now is None else now
        segments, tmps = _scan(self.store)
        keep, deleted_segments, deleted_bytes = self._delete_past_bounds(segments, now)
        quarantined = self._delete_past_bounds(_scan(self.store, quarantined=True)[0], now, QUARANTINE_DIR)[1]
        deleted_tmp = 0
        for tmp in tmps:
            try:
                if now - tmp.mtime > _STALE_TMP_S:
                    self.store.delete(tmp.name)
                    deleted_tmp += 1
            except FileNotFoundError:
                pass
        self.bytes = sum(s.bytes for s in keep)
        self.segments = len(keep)
        return {"deleted_segments": deleted_segments, "deleted_bytes": deleted_bytes,
                "deleted_tmp": deleted_tmp, "deleted_quarantined": quarantined,
                "segments": self.segments, "bytes": self.bytes}

    def _delete_past_bounds(self, segments: list[SegmentInfo], now: float,
                            folder: str | None = None) -> tuple[list[SegmentInfo], int, int]:
        """(kept, number deleted, bytes deleted): ``segments`` (oldest first, under ``folder``) past
        ``max_age_s``, then the oldest while their total is over ``max_bytes``."""
        total = sum(s.bytes for s in segments)
        keep: list[SegmentInfo] = []
        deleted = deleted_bytes = 0
        for seg in segments:  # oldest first
            too_old = self.max_age_s is not None and (now * 1000 - seg.created_ms) > self.max_age_s * 1000
            too_big = self.max_bytes is not None and total > self.max_bytes
            if not (too_old or too_big):
                keep.append(seg)
                continue
            try:
                self.store.delete(seg.name if folder is None else f"{folder}/{seg.name}")
            except FileNotFoundError:  # another writer's retention got there first
                pass
            else:
                deleted += 1
                deleted_bytes += seg.bytes
            total -= seg.bytes
        return keep, deleted, deleted_bytes


class BufferReader:
    """Reads and tails a buffer directory; corrupt segments are skipped, counted and quarantined, not raised."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.store = open_store(root)
        self.root = self.store.root  # a Path, or the URI without query parameters
        self.corrupt: dict[str, str] = {}  # segment name -> reason, each logged once
        self.quarantined: set[str] = set()  # segments this reader moved under quarantine/

    def exists(self) -> bool:
        """Whether the folder (the bucket, for a URI) exists: False before anything was captured."""
        return self.store.exists()

    def segments(self) -> list[SegmentInfo]:
        """Published segments sorted by name (= time order); other files are ignored."""
        return _scan(self.store)[0]

    def quarantined_segments(self) -> list[SegmentInfo]:
        """Segments under ``quarantine/`` (moved there by any reader), sorted by name."""
        return _scan(self.store, quarantined=True)[0]

    def read_segment(self, info: SegmentInfo) -> list[SequenceRecord]:
        """The segment's records; CorruptSegment when its bytes do not match its name or do not parse.

        FileNotFoundError (not CorruptSegment) when retention deleted it meanwhile.
        """
        data = self.store.read(info.name)
        digest = hashlib.sha256(data).hexdigest()[:32]
        if digest != info.digest:
            raise CorruptSegment(f"segment {info.name}: sha256 of its {len(data)} bytes starts {digest}, "
                                 f"the name says {info.digest} (torn or corrupted file)")
        try:
            return decode_segment(data)
        except Exception as exc:
            raise CorruptSegment(f"segment {info.name}: checksum matches but it does not parse: {exc}") from exc

    def iter_segments(self, after: str | None = None, settle_s: float = 0.0,
                       ) -> Iterator[tuple[SegmentInfo, list[SequenceRecord]]]:
        """Segments whose name sorts after ``after``, each with its records, oldest first.

        A corrupt segment comes with no records (and is counted in ``corrupt``
        and quarantined); one that retention deleted after the listing is left out.
        One that cannot be read (an I/O error) also comes with no records and is
        counted, but stays where it is.
        """
        newest_ms = (time.time() - settle_s) * 1000
        for info in self.segments():
            if after is not None and info.name <= after:
                continue
            if settle_s > 0 and info.created_ms > newest_ms:
                return  # names sort by time: everything further is younger still
            try:
                records = self.read_segment(info)
            except FileNotFoundError:
                continue  # removed by retention after the listing
            except (CorruptSegment, OSError) as exc:
                if info.name not in self.corrupt:
                    logger.warning("buffer: skipping %s", exc)
                    self.corrupt[info.name] = str(exc)
                    if isinstance(exc, CorruptSegment):
                        self._quarantine(info)
                records = []
            yield info, records

    def _quarantine(self, info: SegmentInfo) -> None:
        """Move a corrupt segment out of the listing; a failed move (read-only access) is logged, not raised."""
        try:
            where = self.store.quarantine(info.name)
        except FileNotFoundError:  # another reader moved it, or retention deleted it
            return
        except OSError as exc:
            logger.warning("buffer: could not quarantine %s (%r): it stays, skipped by every read", info.name, exc)
            return
        self.quarantined.add(info.name)
        logger.warning("buffer: quarantined %s as %s", info.name, where)

    def iter_records(self, after: str | None = None, settle_s: float = 0.0) -> Iterator[SequenceRecord]:
        """Records of every segment whose name sorts after ``after``, oldest first."""
        for _, records in self.iter_segments(after, settle_s):
            yield from records

    def tail(self, cursor: str | None = None, settle_s: float = 0.0,
             ) -> tuple[list[SequenceRecord], str | None]:
        """New records since ``cursor`` and the cursor to pass next time.

        ``settle_s`` > 0 leaves segments younger than that for a later call
        (see the module docstring on several writers).
        """
        out: list[SequenceRecord] = []
        for info, records in self.iter_segments(cursor, settle_s):
            out.extend(records)
            cursor = info.name  # corrupt segments are passed too: counted once, not retried
        return out, cursor

    def stats(self) -> dict[str, Any]:
        """Whole-buffer figures (reads every segment): sizes, capture times, acceptance per drafter,
        records per capturing replica ("unknown" for records written before records named it).

        ``segments``/``bytes`` count the segments left after this pass; ``corrupt_segments``
        counts those found corrupt in it and those quarantined before (``quarantined_segments``).
        ``tau`` is the mean accepted length per block, counting the target's own
        token: ``1 + accepted / blocks``. Each version counts the pure blocks it
        drafted (records.py "Drafter versions"); ``mixed_blocks`` counts the rest.
        """
        infos = self.segments()
        figures = _record_figures(recs for _, recs in self.iter_segments(None))
        live = [s for s in infos if s.name not in self.quarantined]
        in_quarantine = {s.name for s in self.quarantined_segments()}
        corrupt = {s.name for s in infos if s.name in self.corrupt} | in_quarantine
        return {
            "root": str(self.root),
            "segments": len(live),
            "bytes": sum(s.bytes for s in live),
            "records": figures["records"],
            "corrupt_segments": len(corrupt),
            "quarantined_segments": len(in_quarantine),
            "oldest_captured_at": figures["oldest_captured_at"],
            "newest_captured_at": figures["newest_captured_at"],
            "drafter_versions": figures["drafter_versions"],
            "mixed_blocks": figures["mixed_blocks"],
            "records_per_replica": figures["records_per_replica"],
        }


def _record_figures(segments: Iterable[list[SequenceRecord]]) -> dict[str, Any]:
    """``BufferReader.stats``'s figures over the records of ``segments``."""
    per_version: dict[str, dict[str, Any]] = {}
    records, mixed_blocks = 0, 0
    captured, per_replica = [], {}
    for recs in segments:
        for rec in recs:
            records += 1
            per_replica[rec.replica or "unknown"] = per_replica.get(rec.replica or "unknown", 0) + 1
            if rec.captured_at > 0:
                captured.append(rec.captured_at)
            by_version = pure_blocks_by_version(rec) or {rec.drafter_version: []}
            mixed_blocks += len(rec.blocks) - sum(len(blocks) for blocks in by_version.values())
            for version, blocks in by_version.items():
                v = per_version.setdefault(version, {"records": 0, "blocks": 0, "drafted_tokens": 0,
                                                     "accepted_tokens": 0})
                v["records"] += 1
                v["blocks"] += len(blocks)
                v["drafted_tokens"] += sum(len(b.draft_tokens) for b in blocks)
                v["accepted_tokens"] += sum(b.num_accepted for b in blocks)
    for v in per_version.values():
        v["tau"] = acceptance_length(v["accepted_tokens"], v["blocks"])
        v["acceptance_rate"] = v["accepted_tokens"] / v["drafted_tokens"] if v["drafted_tokens"] else None
    return {"records": records, "oldest_captured_at": min(captured) if captured else None,
            "newest_captured_at": max(captured) if captured else None,
            "drafter_versions": dict(sorted(per_version.items())), "mixed_blocks": mixed_blocks,
            "records_per_replica": dict(sorted(per_replica.items()))}
