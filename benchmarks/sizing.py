"""Capture and buffer sizing from a real trace buffer, for the README's "Sizing" section.

Reads every segment of a buffer (a folder or ``s3://bucket/prefix``) and prints per record, per
token and per verified block: the segment bytes on storage, and the record counts behind them.
It splits the bytes into what a record costs and what each segment adds (Parquet's footer and
column metadata: from the same records encoded as one segment). With ``--served-tokens-per-s``
(one replica's output rate) and ``--trainer-tokens-per-s`` (the trainer's replayed tokens per
second of wall time) it scales them to N replicas under the deployment's flush settings: buffer
growth per day, segment writes (S3 PUTs) per second, and the trainer's share of the traffic.

    python benchmarks/sizing.py /tmp/soak/buffer --served-tokens-per-s 28.3 --trainer-tokens-per-s 40.6
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from online_opd.traces.buffer import BufferReader, encode_segment  # noqa: E402

DAY_S = 86_400


def measure(location: str) -> dict:
    reader = BufferReader(location)
    segments = reader.segments()
    num_records = num_tokens = num_output = num_blocks = num_drafted = 0
    everything = []
    for info in segments:
        for record in reader.read_segment(info):
            everything.append(record)
            num_records += 1
            num_tokens += len(record.tokens)
            num_output += len(record.tokens) - record.prompt_len
            num_blocks += len(record.blocks)
            num_drafted += sum(len(b.draft_tokens) for b in record.blocks)
    num_bytes = sum(info.bytes for info in segments)
    if not num_records:
        raise SystemExit(f"{location}: no records to measure")
    one_segment = len(encode_segment(everything))  # Parquet's per-segment cost paid once
    overhead = (num_bytes - one_segment) / max(len(segments) - 1, 1)  # what each further segment adds
    return {"segments": len(segments), "records": num_records, "bytes": num_bytes, "tokens": num_tokens,
            "output_tokens": num_output, "blocks": num_blocks, "drafted_tokens": num_drafted,
            "bytes_per_record": num_bytes / num_records, "bytes_per_token": num_bytes / num_tokens,
            "bytes_per_output_token": num_bytes / num_output, "bytes_per_block": num_bytes / max(num_blocks, 1),
            "records_per_segment": num_records / len(segments),
            "output_tokens_per_record": num_output / num_records,
            "bytes_per_record_in_one_segment": one_segment / num_records,
            "bytes_per_output_token_in_one_segment": one_segment / num_output,
            "segment_overhead_bytes": overhead, "record_bytes": (one_segment - overhead) / num_records}


def scale(m: dict, served: float, trainer: float | None, replicas: list[int], flush_records: int,
          flush_interval_s: float) -> list[dict]:
    """Per replica count, with the capture flush settings of a deployment (each replica's writer
    writes a segment per ``flush_records`` records or per ``flush_interval_s``, whichever comes
    first): buffer bytes per day, segment writes (S3 PUTs) per second, records and segments per
    day (what a trainer's LIST walks), and the share of the traffic one trainer can replay."""
    rows = []
    for n in replicas:
        records_per_s = served / m["output_tokens_per_record"]  # per replica
        segments_per_s = max(records_per_s / flush_records, 1.0 / flush_interval_s)
        bytes_per_s = records_per_s * m["record_bytes"] + segments_per_s * m["segment_overhead_bytes"]
        row = {"replicas": n, "output_tokens_per_s": n * served,
               "buffer_gib_per_day": n * bytes_per_s * DAY_S / 2**30,
               "segment_puts_per_s": n * segments_per_s, "segments_per_day": n * segments_per_s * DAY_S,
               "records_per_day": n * records_per_s * DAY_S}
        if trainer:
            # the trainer replays a record's whole sequence plus its blocks; tokens per output token:
            replay_per_output = (m["tokens"] + m["drafted_tokens"]) / m["output_tokens"]
            row["trainer_coverage"] = trainer / (n * served * replay_per_output)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("buffer", help="buffer folder or s3://bucket/prefix")
    p.add_argument("--served-tokens-per-s", type=float, default=None, help="one replica's output tokens/s")
    p.add_argument("--trainer-tokens-per-s", type=float, default=None,
                   help="the trainer's replayed tokens per wall second")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 10, 100])
    p.add_argument("--flush-records", type=int, default=256, help="capture.flush_records of the deployment")
    p.add_argument("--flush-interval-s", type=float, default=5.0, help="capture.flush_interval_s of the deployment")
    args = p.parse_args()
    out = {"buffer": args.buffer, "measured": measure(args.buffer)}
    if args.served_tokens_per_s:
        out["inputs"] = {"served_tokens_per_s": args.served_tokens_per_s,
                         "trainer_tokens_per_s": args.trainer_tokens_per_s}
        out["inputs"].update(flush_records=args.flush_records, flush_interval_s=args.flush_interval_s)
        out["scaled"] = scale(out["measured"], args.served_tokens_per_s, args.trainer_tokens_per_s, args.replicas,
                              args.flush_records, args.flush_interval_s)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
