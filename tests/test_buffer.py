"""The trace buffer on real files: round trips, atomic checksummed segments,
corrupt segments skipped, counted and quarantined, retention, the non-blocking writer
thread, tailing, figures, and the `buffer` CLI."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from online_opd.traces.buffer import (
    SEGMENT_SCHEMA,
    BufferReader,
    CorruptSegment,
    SegmentWriter,
    parse_segment_name,
    segment_name,
)
from online_opd.traces.records import BlockRecord, SequenceRecord, check_fidelity
from online_opd.traces.writer import BufferWriter
from serve import buffer_cli


def make_record(i: int, version: str = "v1", blocks: tuple[tuple[int, int], ...] = ((4, 2),),
                temperature: float = 0.7, captured_at: float = 1_700_000_000.5) -> SequenceRecord:
    """A record that passes ``check_fidelity``: ``blocks`` gives (K, r) per block, chained from the prompt."""
    prompt = [100 + i, 5, 6]
    tokens, block_records = list(prompt), []
    for k, r in blocks:
        anchor = len(tokens) - 1
        draft = [1000 + len(tokens) + j for j in range(k)]
        block_records.append(BlockRecord(anchor, tuple(draft), r))
        tokens += draft[:r] + [7]  # accepted drafts, then the target's own token (never a draft id)
    record = SequenceRecord(
        record_id=f"req-{i}", model_id="tiny-target", drafter_version=version, temperature=temperature,
        top_p=0.95, top_k=20, tokens=tuple(tokens), prompt_len=len(prompt), blocks=tuple(block_records),
        events=({"anchor_before": 2, "kind": "preemption", "note": "é"},) if i % 2 else (),
        captured_at=captured_at + i)
    assert check_fidelity(record) == []
    return record


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def rename_to_ms(path: Path, created_ms: int) -> Path:
    """Give a segment an older timestamp (its checksum does not depend on the name)."""
    _, writer_id, seq, digest = parse_segment_name(path.name)
    new = path.with_name(segment_name(created_ms, writer_id, seq, digest))
    os.replace(path, new)
    return new


def test_round_trip_gives_back_equal_records(tmp_path):
    records = [make_record(i, blocks=((4, 2), (4, 4), (4, 0))) for i in range(3)]
    records.append(SequenceRecord("empty", "m", "v0", 0.0, 1.0, 0, (), 0, ()))  # no tokens, no blocks
    plain = make_record(3, blocks=((4, 2), (2, 1)))  # a 2-token block with num_plain_steps set round-trips
    records.append(dataclasses.replace(plain, blocks=(plain.blocks[0],
                                                      dataclasses.replace(plain.blocks[1], num_plain_steps=3))))
    records[0] = dataclasses.replace(records[0], replica="node_a_4242")  # the capturing replica's writer id
    path = SegmentWriter(tmp_path, writer_id="w").write(records)
    info = BufferReader(tmp_path).segments()[0]
    assert info.path == path and BufferReader(tmp_path).read_segment(info) == records
    schema = pq.read_schema(path)
    assert schema.field("tokens").type == pa.list_(pa.int32())
    assert schema.field("blocks").type.value_type.field("num_accepted").type == pa.int16()
    assert schema.field("events").type == pa.string()


def test_segments_written_before_block_versions_still_read(tmp_path):
    """A segment whose block struct lacks drafter_version / is_context_pure, and that has no replica
    column, reads them as the defaults."""
    record = make_record(0, blocks=((4, 2), (4, 4)))
    old_block = pa.struct([("anchor", pa.int32()), ("draft_tokens", pa.list_(pa.int32())),
                           ("num_accepted", pa.int16())])
    fields = [pa.field("blocks", pa.list_(old_block)) if f.name == "blocks" else f for f in SEGMENT_SCHEMA
              if f.name != "replica"]
    row = record.to_dict()
    del row["replica"]
    row["blocks"] = [{k: b[k] for k in ("anchor", "draft_tokens", "num_accepted")} for b in row["blocks"]]
    row["events"] = json.dumps(row["events"])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([row], schema=pa.schema(fields)), sink)
    data = sink.getvalue().to_pybytes()
    (tmp_path / segment_name(1, "old", 0, hashlib.sha256(data).hexdigest())).write_bytes(data)
    assert list(BufferReader(tmp_path).iter_records()) == [record]


def test_stats_count_each_version_s_pure_blocks(tmp_path):
    base = make_record(0, "v1", ((4, 2), (4, 4), (4, 0)))
    b0, b1, b2 = base.blocks
    spans = dataclasses.replace(base, blocks=(b0, dataclasses.replace(b1, drafter_version="v2", is_context_pure=False),
                                              dataclasses.replace(b2, drafter_version="v2")))
    SegmentWriter(tmp_path, writer_id="w").write([spans])
    stats = BufferReader(tmp_path).stats()
    assert stats["mixed_blocks"] == 1
    assert {v: (s["records"], s["blocks"], s["accepted_tokens"]) for v, s in stats["drafter_versions"].items()} \
        == {"v1": (1, 1, 2), "v2": (1, 1, 0)}


def test_segments_are_named_by_time_writer_seq_and_checksum(tmp_path):
    writer = SegmentWriter(tmp_path, writer_id="replica-1.host")
    assert writer.write([]) is None and list(tmp_path.iterdir()) == []
    paths = [writer.write([make_record(i)]) for i in range(3)]
    assert sorted(p.name for p in paths) == [p.name for p in paths]  # names sort in write order
    for seq, path in enumerate(paths):
        created_ms, writer_id, parsed_seq, digest = parse_segment_name(path.name)
        assert (writer_id, parsed_seq) == ("replica_1_host", seq)
        assert abs(created_ms / 1000 - time.time()) < 60
        assert digest == hashlib.sha256(path.read_bytes()).hexdigest()[:32]
    assert sorted(os.listdir(tmp_path)) == [p.name for p in paths]  # no temporary left behind
    assert (writer.segments, writer.bytes) == (3, sum(p.stat().st_size for p in paths))


def test_torn_bitflipped_and_unparseable_segments_are_skipped_and_counted(tmp_path, caplog):
    writer = SegmentWriter(tmp_path, writer_id="w")
    good = writer.write([make_record(0), make_record(1)])
    torn = writer.write([make_record(2)])
    flipped = writer.write([make_record(3)])
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    garbage = b"not parquet at all"  # right checksum, wrong content
    (tmp_path / segment_name(int(time.time() * 1000) + 10_000, "w", 9, hashlib.sha256(garbage).hexdigest())
     ).write_bytes(garbage)

    reader = BufferReader(tmp_path)
    by_name = {s.name: s for s in reader.segments()}
    for path in (torn, flipped):
        with pytest.raises(CorruptSegment, match="sha256"):
            reader.read_segment(by_name[path.name])
    with pytest.raises(CorruptSegment, match="does not parse"):
        reader.read_segment(reader.segments()[-1])
    assert reader.read_segment(by_name[good.name])[0] == make_record(0)
    with caplog.at_level(logging.WARNING, logger="online_opd.traces.buffer"):
        assert [r.record_id for r in reader.iter_records()] == ["req-0", "req-1"]
        assert [r.record_id for r in reader.iter_records()] == ["req-0", "req-1"]
    assert len(reader.corrupt) == 3 and {torn.name, flipped.name} < set(reader.corrupt)
    skipped = [r for r in caplog.records if r.getMessage().startswith("buffer: skipping")]
    assert len(skipped) == 3  # once per segment
    moved = sorted(set(by_name) - {good.name})  # out of the listing, kept in quarantine/ for inspection
    assert reader.quarantined == set(moved) and sorted(os.listdir(tmp_path / "quarantine")) == moved
    assert [s.name for s in BufferReader(tmp_path).segments()] == [good.name]


def test_quarantined_segments_are_kept_for_inspection_within_the_bounds(tmp_path):
    writer = SegmentWriter(tmp_path, writer_id="w", max_age_s=3600)
    now = time.time()
    old = rename_to_ms(writer.write([make_record(0)]), int((now - 7200) * 1000))
    young = writer.write([make_record(1)])
    live = writer.write([make_record(2)])
    for path in (old, young):
        path.write_bytes(path.read_bytes()[:10])  # torn
    reader = BufferReader(tmp_path)
    assert [r.record_id for r in reader.iter_records()] == ["req-2"]
    assert sorted(os.listdir(tmp_path / "quarantine")) == sorted([old.name, young.name])
    result = writer.enforce_retention(now=now)
    assert (result["deleted_quarantined"], result["deleted_segments"], result["segments"]) == (1, 0, 1)
    assert os.listdir(tmp_path / "quarantine") == [young.name] and live.exists()
    writer.max_bytes = 0  # the quarantine alone is over the byte bound: its oldest go first
    assert writer.enforce_retention(now=now)["deleted_quarantined"] == 1
    assert os.listdir(tmp_path / "quarantine") == []


def test_tmp_and_foreign_files_are_ignored_and_stale_tmp_removed(tmp_path):
    writer = SegmentWriter(tmp_path, writer_id="w")
    path = writer.write([make_record(0)])
    stale, fresh = tmp_path / ".seg-dead.tmp", tmp_path / ".seg-live.tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "seg-bad.parquet").write_bytes(b"x")
    reader = BufferReader(tmp_path)
    assert [s.name for s in reader.segments()] == [path.name]
    assert len(list(reader.iter_records())) == 1 and reader.corrupt == {}
    result = writer.enforce_retention()
    assert result["deleted_tmp"] == 1 and result["deleted_segments"] == 0
    assert not stale.exists() and fresh.exists() and path.exists()


def test_retention_by_bytes_deletes_oldest_first(tmp_path):
    writer = SegmentWriter(tmp_path, writer_id="w")
    paths = [writer.write([make_record(i)] * (i + 1)) for i in range(5)]
    sizes = [p.stat().st_size for p in paths]
    writer.max_bytes = sizes[3] + sizes[4]
    result = writer.enforce_retention()
    assert result == {"deleted_segments": 3, "deleted_bytes": sum(sizes[:3]), "deleted_tmp": 0,
                      "deleted_quarantined": 0, "segments": 2, "bytes": sizes[3] + sizes[4]}
    assert [s.path for s in BufferReader(tmp_path).segments()] == paths[3:]
    assert (writer.segments, writer.bytes) == (2, sizes[3] + sizes[4])


def test_retention_by_age_uses_the_name_timestamp(tmp_path):
    writer = SegmentWriter(tmp_path, writer_id="w", max_age_s=3600)
    now = time.time()
    old = rename_to_ms(writer.write([make_record(0)]), int((now - 7200) * 1000))
    other_writer = rename_to_ms(SegmentWriter(tmp_path, writer_id="x").write([make_record(1)]),
                                int((now - 3700) * 1000))
    young = writer.write([make_record(2)])
    result = writer.enforce_retention(now=now)
    assert result["deleted_segments"] == 2 and result["segments"] == 1
    assert not old.exists() and not other_writer.exists() and young.exists()
    assert writer.enforce_retention(now=now + 7200)["segments"] == 0


def test_writer_drops_and_counts_when_the_queue_is_full_and_flushes_on_close(tmp_path):
    writer = BufferWriter(tmp_path, writer_id="w", maxsize=2, start=False)  # thread not draining yet
    assert [writer.submit(make_record(i)) for i in range(3)] == [True, True, False]
    assert writer.stats()["dropped"] == 1 and writer.stats()["queued"] == 2
    assert writer.close(timeout=5)
    assert not writer.submit(make_record(9))  # closed
    stats = writer.stats()
    assert {k: stats[k] for k in ("submitted", "dropped", "written_records", "written_segments",
                                  "write_errors")} == {"submitted": 4, "dropped": 2, "written_records": 2,
                                                       "written_segments": 1, "write_errors": 0}
    assert stats["buffer_segments"] == 1 and stats["buffer_bytes"] == sum(
        p.stat().st_size for p in tmp_path.iterdir())
    assert [r.record_id for r in BufferReader(tmp_path).iter_records()] == ["req-0", "req-1"]


def test_writer_flushes_by_count_and_by_interval(tmp_path):
    writer = BufferWriter(tmp_path, writer_id="w", flush_records=2, flush_interval_s=0.2, start=False)
    try:
        writer.submit(make_record(0))
        writer.submit(make_record(1))
        writer.start()  # both already queued: one segment by count
        wait_for(lambda: writer.stats()["written_records"] == 2)
        writer.submit(make_record(2))  # alone: goes out when the interval runs out
        wait_for(lambda: writer.stats()["written_records"] == 3)
        assert writer.stats()["written_segments"] == 2
    finally:
        writer.close(timeout=5)
    assert [len(BufferReader(tmp_path).read_segment(s)) for s in BufferReader(tmp_path).segments()] == [2, 1]


def test_writer_flush_writes_what_it_holds_now_and_stays_open(tmp_path):
    writer = BufferWriter(tmp_path, writer_id="w", flush_records=1000, flush_interval_s=3600)
    try:
        assert writer.flush(timeout=5)  # nothing held: done
        for i in range(3):
            writer.submit(make_record(i))
        assert writer.flush(timeout=5)  # neither the count nor the interval would have written them
        assert [r.record_id for r in BufferReader(tmp_path).iter_records()] == ["req-0", "req-1", "req-2"]
        assert writer.submit(make_record(3)) and writer.flush(timeout=5)  # still open
        assert writer.stats()["written_segments"] == 2
    finally:
        writer.close(timeout=5)
    assert writer.flush(timeout=1)  # closed with nothing queued


def test_writer_flush_reports_records_it_could_not_write(tmp_path):
    writer = BufferWriter(tmp_path / "buffer", writer_id="w", flush_records=1000, flush_interval_s=3600)
    (tmp_path / "buffer").rmdir()
    (tmp_path / "buffer").write_text("not a folder")  # every write fails: the records are held for retry
    try:
        writer.submit(make_record(0))
        assert not writer.flush(timeout=5)
        assert writer.stats()["write_errors"] >= 1
    finally:
        writer.close(timeout=5)


@pytest.mark.parametrize("interval_s, segments_left", [(0.0, 0), (3600.0, 2)])
def test_retention_runs_at_most_every_retention_interval(tmp_path, interval_s, segments_left):
    """A byte bound smaller than one segment: retention after every write deletes each segment; with
    an hour between passes only the first write's pass runs, and the next two segments stay."""
    writer = BufferWriter(tmp_path, writer_id="w", flush_records=1, flush_interval_s=0.05, max_bytes=1,
                          retention_interval_s=interval_s)
    try:
        for i in range(3):
            writer.submit(make_record(i))
            wait_for(lambda: writer.stats()["written_records"] == i + 1)
    finally:
        writer.close(timeout=5)
    assert len(BufferReader(tmp_path).segments()) == segments_left


def test_writer_holds_records_while_writes_fail_and_writes_them_once_it_can(tmp_path, caplog):
    root = tmp_path / "buf"
    writer = BufferWriter(root, writer_id="w", flush_records=2, flush_interval_s=60, max_held=3,
                          retry_interval_s=0.05)
    try:
        root.rmdir()
        root.write_text("a file where the directory was")  # every write now fails
        with caplog.at_level(logging.WARNING, logger="online_opd.traces.writer"):
            for i in range(5):
                writer.submit(make_record(i))
            wait_for(lambda: writer.stats()["write_errors"] >= 3)
            stats = writer.stats()
            # the newest 3 are held for the retry, the 2 oldest dropped
            assert (stats["held"], stats["dropped"], stats["written_records"]) == (3, 2, 0)
            assert stats["is_write_failing"] and "File exists" in stats["last_error"]
            root.unlink()  # the writer recreates the directory on its next attempt
            wait_for(lambda: writer.stats()["written_records"] == 3)
        stats = writer.stats()
        assert stats["held"] == 0 and not stats["is_write_failing"]
        failing = [r for r in caplog.records if "failing" in r.getMessage()]
        resumed = [r for r in caplog.records if "resumed" in r.getMessage()]
        assert len(failing) == 1 and len(resumed) == 1, [r.getMessage() for r in caplog.records]
        assert "2 records dropped" in resumed[0].getMessage()
    finally:
        assert writer.close(timeout=5)
    stats = writer.stats()
    assert stats["submitted"] == stats["written_records"] + stats["dropped"] == 5
    assert [r.record_id for r in BufferReader(root).iter_records()] == ["req-2", "req-3", "req-4"]
    assert [len(BufferReader(root).read_segment(s)) for s in BufferReader(root).segments()] == [2, 1]


def test_writer_closing_during_an_outage_drops_what_it_holds(tmp_path):
    root = tmp_path / "buf"
    writer = BufferWriter(root, writer_id="w", flush_records=1, flush_interval_s=60, retry_interval_s=60)
    root.rmdir()
    root.write_text("not a directory")
    writer.submit(make_record(0))
    wait_for(lambda: writer.stats()["write_errors"] == 1)
    assert writer.close(timeout=5)
    stats = writer.stats()
    assert (stats["written_records"], stats["dropped"], stats["held"], stats["write_errors"]) == (0, 1, 0, 2)


def test_tail_returns_only_new_records(tmp_path):
    writer = SegmentWriter(tmp_path, writer_id="w")
    reader = BufferReader(tmp_path)
    assert reader.tail(None) == ([], None)
    first = writer.write([make_record(0), make_record(1)])
    records, cursor = reader.tail(None)
    assert [r.record_id for r in records] == ["req-0", "req-1"] and cursor == first.name
    assert reader.tail(cursor) == ([], cursor)
    second = writer.write([make_record(2)])
    assert reader.tail(cursor, settle_s=3600) == ([], cursor)  # too young to trust yet
    records, cursor = reader.tail(cursor)
    assert [r.record_id for r in records] == ["req-2"] and cursor == second.name
    assert [r.record_id for r in reader.iter_records(after=first.name)] == ["req-2"]


def test_stats_figures_on_hand_made_records(tmp_path):
    writer = SegmentWriter(tmp_path, writer_id="w")
    writer.write([make_record(0, "v1", ((4, 2), (4, 4)), captured_at=100.0),
                  make_record(1, "v1", ((4, 0),), captured_at=100.0)])
    writer.write([dataclasses.replace(make_record(2, "v2", ((3, 1),), captured_at=100.0), replica="b_2"),
                  dataclasses.replace(make_record(3, "v3", (), captured_at=100.0), replica="a_1")])
    bad = writer.write([make_record(4, captured_at=100.0)])
    bad.write_bytes(b"torn")
    stats = BufferReader(tmp_path).stats()
    assert (stats["segments"], stats["records"], stats["corrupt_segments"]) == (2, 4, 1)
    assert stats["bytes"] == sum(p.stat().st_size for p in tmp_path.iterdir() if p.is_file())
    again = BufferReader(tmp_path).stats()  # the torn segment was quarantined: still counted as corrupt
    assert (again["segments"], again["corrupt_segments"], again["quarantined_segments"]) == (2, 1, 1)
    assert (stats["oldest_captured_at"], stats["newest_captured_at"]) == (100.0, 103.0)
    assert stats["records_per_replica"] == {"a_1": 1, "b_2": 1, "unknown": 2}
    versions = stats["drafter_versions"]
    assert versions["v1"] == {"records": 2, "blocks": 3, "drafted_tokens": 12, "accepted_tokens": 6,
                              "tau": 3.0, "acceptance_rate": 0.5}
    assert versions["v2"]["tau"] == 2.0 and versions["v2"]["acceptance_rate"] == pytest.approx(1 / 3)
    assert versions["v3"]["blocks"] == 0 and versions["v3"]["tau"] is None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="online-opd")
    buffer_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = buffer_cli.run(_parser().parse_args(list(argv)))
    return code, capsys.readouterr().out


def test_cli_stats_and_show_print_json(tmp_path, capsys):
    writer = SegmentWriter(tmp_path, writer_id="w")
    first = writer.write([make_record(0, blocks=((4, 2), (4, 4))), make_record(1)])
    writer.write([make_record(2)])

    code, out = _cli(capsys, "buffer", "stats", str(tmp_path))
    assert code == 0 and json.loads(out)["records"] == 3

    code, out = _cli(capsys, "buffer", "show", str(tmp_path))
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [x["record_id"] for x in lines] == ["req-0", "req-1", "req-2"]
    assert lines[0]["segment"] == first.name
    assert {k: lines[0][k] for k in ("accepted", "drafted", "num_blocks", "tau", "prompt_len")} == {
        "accepted": 6, "drafted": 8, "num_blocks": 2, "tau": 4.0, "prompt_len": 3}
    assert lines[0]["blocks"][0] == {"anchor": 2, "draft_tokens": [1003, 1004, 1005, 1006], "num_accepted": 2,
                                     "drafter_version": None, "is_context_pure": True, "num_plain_steps": 0,
                                     "proposer": "drafter"}

    _, out = _cli(capsys, "buffer", "show", str(tmp_path), "--limit", "1")
    assert [json.loads(line)["record_id"] for line in out.splitlines()] == ["req-0"]
    _, out = _cli(capsys, "buffer", "show", str(tmp_path), "--after", first.name)
    assert [json.loads(line)["record_id"] for line in out.splitlines()] == ["req-2"]
    assert _cli(capsys, "buffer", "stats", str(tmp_path / "missing"))[0] == 2


def test_show_summary_decodes_text_with_a_tokenizer():
    class Letters:  # stands in for a transformers tokenizer: only ``decode`` is used
        def decode(self, ids):
            return " ".join(str(i) for i in ids)

    summary = buffer_cli.record_summary(make_record(0), "seg", Letters())
    assert summary["prompt_text"] == "100 5 6" and summary["output_text"].startswith("1003 1004 7")
