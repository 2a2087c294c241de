"""The trace buffer on an S3-compatible object store: a real local S3 server (moto's server mode,
in this process on a free port), reached through pyarrow's S3 file system exactly as a replica
reaches a bucket, with the endpoint and credentials in the standard AWS environment variables.

What this proves: the protocol path (pyarrow.fs over HTTP: LIST, one PUT per segment, GET,
copy + DELETE for quarantine, DELETE for retention) and our semantics on it: two writers' segments
all read back equal to what was written and byte-identical to the local buffer's, tailing with a
cursor, a corrupt object quarantined while reading goes on, retention deleting objects,
``buffer stats``/``show`` figures, the writer thread, and the errors for a bad scheme, a missing
bucket and a registry URI.

What it does not prove: moto emulates S3's API, not S3. Consistency under load, latency, throttling
(503 SlowDown) and retries, multipart uploads of large segments, and many nodes writing to one
bucket at once are not exercised here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import httpx
import pytest

from online_opd.config import ConfigError, load_config
from online_opd.traces.buffer import BufferReader, SegmentWriter, parse_segment_name, segment_name
from online_opd.traces.storage import canonical_location
from online_opd.traces.writer import BufferWriter
from serve import buffer_cli, report
from serve.launcher import free_port
from tests.test_buffer import make_record


@pytest.fixture(scope="module")
def endpoint():
    """A moto S3 server (`moto_server`) on a free local port for this module's tests, in a process of
    its own: moto's server is a Flask app, and Flask's context proxies left in this process's
    ``sys.modules`` break vLLM's CPU kernel overrides, which probe every module (tests/test_cpu_fixes.py)."""
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.HTTPError:
                assert server.poll() is None and time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
def s3(endpoint, monkeypatch, tmp_path):
    """A fresh bucket; the AWS variables point at the server. Yields (boto3 client, bucket name)."""
    for key in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    client = boto3.client("s3")
    bucket = f"buf-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


def keys(client, bucket: str, prefix: str = "") -> dict[str, int]:
    """Every object under ``prefix`` as key -> size, as S3 itself lists them, less the empty ``dir/``
    markers pyarrow puts after a delete so that the "directory" goes on existing."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", []) if not o["Key"].endswith("/")}


def body(client, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def test_two_replicas_write_and_every_record_reads_back_as_on_local_disk(s3, tmp_path):
    client, bucket = s3
    uri = f"s3://{bucket}/traces/run1"
    batches = [("replica_a", [make_record(0), make_record(1)]), ("replica_b", [make_record(2)]),
               ("replica_a", [make_record(3, "v2")]), ("replica_b", [make_record(4), make_record(5)])]
    remote = {w: SegmentWriter(uri, writer_id=w) for w in ("replica_a", "replica_b")}
    local = {w: SegmentWriter(tmp_path, writer_id=w) for w in ("replica_a", "replica_b")}
    written = []
    for writer_id, records in batches:
        written.append((remote[writer_id].write(records), local[writer_id].write(records)))

    for remote_uri, local_path in written:  # one object per segment, the local file's very bytes
        key = remote_uri.removeprefix(f"s3://{bucket}/")
        assert parse_segment_name(key.rsplit("/", 1)[1])[1:] == parse_segment_name(local_path.name)[1:]
        assert body(client, bucket, key) == local_path.read_bytes()
    assert sorted(keys(client, bucket)) == sorted(u.removeprefix(f"s3://{bucket}/") for u, _ in written)

    all_records = [r for _, records in batches for r in records]
    remote_reader, local_reader = BufferReader(uri), BufferReader(tmp_path)
    got = list(remote_reader.iter_records())
    assert sorted(got, key=lambda r: r.record_id) == all_records  # none lost, each equal to what was written
    by_writer = [(s.writer_id, s.seq) for s in remote_reader.segments()]
    assert by_writer == [(s.writer_id, s.seq) for s in local_reader.segments()]
    assert by_writer == [("replica_a", 0), ("replica_b", 0), ("replica_a", 1), ("replica_b", 1)]
    tally = remote["replica_b"].enforce_retention()  # no bounds: deletes nothing, recounts both writers' segments
    assert (tally["deleted_segments"], tally["segments"], tally["bytes"]) == (0, 4, sum(keys(client, bucket).values()))


def test_tail_follows_new_segments_with_a_cursor(s3):
    client, bucket = s3
    uri = f"s3://{bucket}/tail/"  # a trailing slash names the same prefix
    writer, reader = SegmentWriter(uri, writer_id="w"), BufferReader(uri)
    assert reader.tail(None) == ([], None)
    first = writer.write([make_record(0), make_record(1)])
    records, cursor = reader.tail(None)
    assert [r.record_id for r in records] == ["req-0", "req-1"] and cursor == first.rsplit("/", 1)[1]
    assert reader.tail(cursor) == ([], cursor)
    second = writer.write([make_record(2)])
    assert reader.tail(cursor, settle_s=3600) == ([], cursor)  # too young to trust yet
    records, cursor = reader.tail(cursor)
    assert [r.record_id for r in records] == ["req-2"] and cursor == second.rsplit("/", 1)[1]
    assert [r.record_id for r in BufferReader(f"s3://{bucket}/tail").iter_records(after=first.rsplit("/", 1)[1])] \
        == ["req-2"]


def test_a_corrupt_object_is_quarantined_and_reading_goes_on(s3):
    client, bucket = s3
    uri = f"s3://{bucket}/q"
    writer = SegmentWriter(uri, writer_id="w")
    good = [writer.write([make_record(i)]) for i in range(2)]
    now_ms = int(time.time() * 1000)
    flipped = segment_name(now_ms + 1, "w", 7, hashlib.sha256(b"what was meant").hexdigest())
    unparsable = b"not parquet at all"  # right checksum, wrong content
    garbage = segment_name(now_ms + 2, "w", 8, hashlib.sha256(unparsable).hexdigest())
    client.put_object(Bucket=bucket, Key=f"q/{flipped}", Body=b"what arrived")
    client.put_object(Bucket=bucket, Key=f"q/{garbage}", Body=unparsable)
    writer.write([make_record(2)])

    reader = BufferReader(uri)
    records, cursor = reader.tail(None)
    assert [r.record_id for r in records] == ["req-0", "req-1", "req-2"]
    assert set(reader.corrupt) == reader.quarantined == {flipped, garbage}
    assert "sha256" in reader.corrupt[flipped] and "does not parse" in reader.corrupt[garbage]
    top = {k.removeprefix("q/") for k in keys(client, bucket, "q/") if "/" not in k.removeprefix("q/")}
    assert top == {u.rsplit("/", 1)[1] for u in good} | {cursor}
    assert body(client, bucket, f"q/quarantine/{flipped}") == b"what arrived"  # kept for inspection
    again = BufferReader(uri)
    assert [s.name for s in again.segments()] == sorted(top)
    stats = again.stats()
    assert (stats["segments"], stats["records"], stats["corrupt_segments"], stats["quarantined_segments"]) \
        == (3, 3, 2, 2)
    writer.max_age_s = 0.0  # retention bounds the quarantine too, on its own
    assert writer.enforce_retention(now=time.time() + 1)["deleted_quarantined"] == 2
    assert not any(k.startswith("q/quarantine/") for k in keys(client, bucket, "q/"))


def test_retention_deletes_objects_by_bytes_then_by_age(s3):
    client, bucket = s3
    uri = f"s3://{bucket}/ret"
    writer = SegmentWriter(uri, writer_id="w")
    uris = [writer.write([make_record(i)] * (i + 1)) for i in range(5)]
    sizes = [keys(client, bucket)[u.removeprefix(f"s3://{bucket}/")] for u in uris]
    writer.max_bytes = sizes[3] + sizes[4]
    assert writer.enforce_retention() == {"deleted_segments": 3, "deleted_bytes": sum(sizes[:3]), "deleted_tmp": 0,
                                          "deleted_quarantined": 0, "segments": 2, "bytes": sizes[3] + sizes[4]}
    assert sorted(keys(client, bucket, "ret/")) == [u.removeprefix(f"s3://{bucket}/") for u in uris[3:]]

    old_key = uris[3].removeprefix(f"s3://{bucket}/")
    _, writer_id, seq, digest = parse_segment_name(old_key.rsplit("/", 1)[1])
    aged = f"ret/{segment_name(int(time.time() * 1000) - 3_600_000, writer_id, seq, digest)}"
    client.copy_object(Bucket=bucket, Key=aged, CopySource={"Bucket": bucket, "Key": old_key})  # an hour old
    client.delete_object(Bucket=bucket, Key=old_key)
    writer.max_bytes, writer.max_age_s = None, 60.0
    result = writer.enforce_retention()
    assert (result["deleted_segments"], result["deleted_bytes"], result["segments"]) == (1, sizes[3], 1)
    assert sorted(keys(client, bucket, "ret/")) == [uris[4].removeprefix(f"s3://{bucket}/")]


def test_the_writer_thread_delivers_to_the_bucket(s3):
    client, bucket = s3
    uri = f"s3://{bucket}/thread"
    writer = BufferWriter(uri, writer_id="replica_a", flush_records=2, flush_interval_s=0.05)
    for i in range(5):
        assert writer.submit(make_record(i))
    assert writer.close(timeout=30)
    stats = writer.stats()
    assert (stats["written_records"], stats["written_segments"], stats["write_errors"]) == (5, 3, 0)
    assert [r.record_id for r in BufferReader(uri).iter_records()] == [f"req-{i}" for i in range(5)]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="online-opd")
    buffer_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    code = buffer_cli.run(parser.parse_args(list(argv)))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_buffer_stats_and_show_on_a_bucket(s3, capsys):
    client, bucket = s3
    uri = f"s3://{bucket}/cli"
    SegmentWriter(uri, writer_id="a").write([make_record(0, "v1", ((4, 2), (4, 4)), captured_at=100.0)])
    SegmentWriter(uri, writer_id="b").write([make_record(1, "v1", ((4, 0),), captured_at=100.0),
                                             make_record(2, "v2", ((3, 1),), captured_at=100.0)])
    code, out, _ = _cli(capsys, "buffer", "stats", uri)
    stats = json.loads(out)
    assert code == 0 and stats["root"] == uri
    assert (stats["segments"], stats["records"], stats["corrupt_segments"]) == (2, 3, 0)
    assert stats["bytes"] == sum(keys(client, bucket, "cli/").values())
    assert (stats["oldest_captured_at"], stats["newest_captured_at"]) == (100.0, 102.0)
    assert stats["drafter_versions"]["v1"] == {"records": 2, "blocks": 3, "drafted_tokens": 12,
                                               "accepted_tokens": 6, "tau": 3.0, "acceptance_rate": 0.5}
    code, out, _ = _cli(capsys, "buffer", "show", uri, "--limit", "2")
    assert code == 0 and [json.loads(line)["record_id"] for line in out.splitlines()] == ["req-0", "req-1"]
    code, _, err = _cli(capsys, "buffer", "stats", "s3://no-such-bucket-here/x")
    assert code == 2 and "s3://no-such-bucket-here/x is not in an existing bucket" in err
    code, _, err = _cli(capsys, "buffer", "stats", "ftp://host/buffer")
    assert code == 2 and "unsupported scheme 'ftp'" in err


def test_a_writer_refuses_a_missing_bucket(s3):
    with pytest.raises(FileNotFoundError, match=r"bucket 'no-such-bucket-here' .* does not exist"):
        SegmentWriter("s3://no-such-bucket-here/p", writer_id="w")


@pytest.mark.parametrize(("override", "field", "says"), [
    ("capture.buffer_dir=ftp://host/buffer", "capture.buffer_dir", "unsupported scheme 'ftp'"),
    ("capture.buffer_dir=s3:///buffer", "capture.buffer_dir", "names no bucket"),
    ("serve.registry_dir=s3://bucket/registry", "serve.registry_dir", "compare-and-swap"),
    ("serve.run_dir=s3://bucket/run", "serve.run_dir", "compare-and-swap"),
])
def test_a_location_the_buffer_or_registry_cannot_use_is_a_config_error(override, field, says):
    value = override.partition("=")[2]
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    line = rf"^  - {re.escape(field)}: .*{re.escape(says)}.* \(got {re.escape(repr(value))}\)$"
    assert re.search(line, str(info.value), re.MULTILINE), str(info.value)


def test_a_uri_buffer_reaches_the_engine_and_the_trainer_unresolved(tmp_path, monkeypatch):
    from serve.server import serve_env
    from vllm_patches import CAPTURE_ENV

    cfg = load_config(overrides=["capture.buffer_dir=s3://bucket/traces/"])
    env = serve_env(cfg, tmp_path, tmp_path, capture=True)
    assert json.loads(env[CAPTURE_ENV])["buffer_dir"] == "s3://bucket/traces"
    monkeypatch.chdir(tmp_path)
    assert canonical_location("buf") == str(tmp_path / "buf") == canonical_location(tmp_path / "buf/")
    assert canonical_location("s3://bucket/traces/") == "s3://bucket/traces" != canonical_location("s3://bucket/t")
    assert os.path.isabs(json.loads(serve_env(load_config(), tmp_path, tmp_path, capture=True)[CAPTURE_ENV])
                         ["buffer_dir"])


@pytest.mark.slow
def test_the_online_trainer_polls_and_resumes_from_a_bucket(s3, tmp_path):
    """``OnlineTrainer`` on tiny real models with its buffer in the bucket: ``poll`` tails both
    replicas' segments, and a resumed trainer rebuilds its pools from the bucket up to its cursor."""
    import torch

    from online_opd.config import OnlineOPDConfig
    from online_opd.opd.specdec import speculative_generate
    from online_opd.release.gate import split_held_out
    from online_opd.release.registry import DrafterRegistry
    from online_opd.train.online import OnlineTrainer
    from tests.tiny import tiny_drafter, tiny_target

    _, bucket = s3
    target = tiny_target(seed=1)
    target.model.save_pretrained(tmp_path / "target")
    drafter = tiny_drafter(target, block_size=4, seed=2)
    records = []
    for i in range(8):
        prompt = torch.randint(1, 60, (4,), generator=torch.Generator().manual_seed(i)).tolist()
        records.append(speculative_generate(target, drafter, prompt, max_new_tokens=16).to_record(
            record_id=f"req-{i}", model_id="tiny", drafter_version="v0001", temperature=0.0))
    uri = f"s3://{bucket}/trainer"
    SegmentWriter(uri, writer_id="replica_a").write(records[:4])
    last = SegmentWriter(uri, writer_id="replica_b").write(records[4:]).rsplit("/", 1)[1]
    registry = DrafterRegistry(tmp_path / "registry")
    registry.promote(registry.publish(drafter).version, reason="bootstrap")
    cfg = OnlineOPDConfig.model_validate({
        "gate": {"min_records": 2, "max_records": 8, "held_out_fraction": 0.3, "split_prefix_tokens": 4},
        "online": {"settle_s": 0.0, "min_records": 2}})
    paths = {"target_path": tmp_path / "target", "buffer_dir": uri, "registry_dir": tmp_path / "registry",
             "state_dir": tmp_path / "state"}

    trainer = OnlineTrainer(cfg, **paths)
    assert trainer.poll() == len(records) and trainer.pools.cursor == last
    train, held_out = split_held_out(records, 0.3, 4)
    assert 0 < len(held_out) < len(records)
    assert [r.record_id for r in trainer.pools.window] == [r.record_id for r in train]
    assert [r.record_id for r in trainer.pools.held_out] == [r.record_id for r in held_out]
    trainer.save()
    resumed = OnlineTrainer(cfg, **paths)
    assert resumed.pools.cursor == last
    assert [r.record_id for r in resumed.pools.window] == [r.record_id for r in train]
    assert resumed.poll() == 0


def test_report_reads_a_bucket(s3, tmp_path, capsys):
    client, bucket = s3
    uri = f"s3://{bucket}/rep"
    SegmentWriter(uri, writer_id="a").write([make_record(0, "v1", ((4, 2), (4, 4)), captured_at=100.0),
                                             make_record(1, "v2", ((3, 1),), captured_at=200.0)])
    parser = argparse.ArgumentParser(prog="online-opd")
    report.add_parser(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "report.png"
    assert report.run(parser.parse_args(["report", "--buffer", uri, "--out", str(out), "--json"])) == 0
    summary = json.loads(capsys.readouterr().out)["buffer"]
    assert summary["root"] == uri and summary["records"] == 2 and out.read_bytes()[:4] == b"\x89PNG"
    assert {v: s["tau"] for v, s in summary["drafter_versions"].items()} == {"v1": 4.0, "v2": 2.0}
    missing = parser.parse_args(["report", "--buffer", f"s3://{bucket}-gone/x", "--out", str(out)])
    assert report.run(missing) == 2 and "is not in an existing bucket" in capsys.readouterr().err
