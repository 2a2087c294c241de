"""`online-opd buffer`: look into a trace buffer (a folder, or an ``s3://bucket/prefix`` URI).

``buffer stats DIR`` prints whole-buffer figures as JSON (segments, bytes,
records, corrupt segments, acceptance per drafter version); ``buffer show DIR``
prints one JSON line per record, oldest first, so it pipes into ``jq``. Each
line names its segment: pass the last one as ``--after`` to page on. Corrupt
segments are skipped with a warning on stderr, as the trainer skips them.

Wired into ``serve/cli.py`` through ``add_parser`` and ``run``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from online_opd.traces.buffer import BufferReader
from online_opd.traces.records import SequenceRecord, acceptance_length


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``buffer`` command (actions ``stats`` and ``show``) to ``subparsers``."""
    p = subparsers.add_parser("buffer", help="inspect a trace-buffer directory")
    bsub = p.add_subparsers(dest="buffer_command", required=True, metavar="ACTION")
    s = bsub.add_parser("stats", help="segments, bytes, records and acceptance per drafter version, as JSON")
    s.add_argument("dir", help="buffer directory, or s3://bucket/prefix")
    s = bsub.add_parser("show", help="one JSON line per record, oldest first")
    s.add_argument("dir", help="buffer directory, or s3://bucket/prefix")
    s.add_argument("--limit", type=int, default=20, help="records to print (default 20; 0 = all)")
    s.add_argument("--after", default=None, metavar="NAME",
                   help="start after this segment name (the 'segment' field of a printed line)")
    s.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer folder or hub id: also print the decoded prompt and output text")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``buffer stats|show``; 0 on success, 2 when the directory (bucket) does not exist or the
    location is not one (a URI of another scheme)."""
    try:
        reader = BufferReader(args.dir)
    except ValueError as exc:
        print(f"online-opd buffer: {exc}", file=sys.stderr)
        return 2
    if not reader.exists():
        what = "a directory" if isinstance(reader.root, Path) else "in an existing bucket"
        print(f"online-opd buffer: {args.dir} is not {what}", file=sys.stderr)
        return 2
    if args.buffer_command == "stats":
        print(json.dumps(reader.stats(), indent=2))
        return 0
    if args.buffer_command == "show":
        tokenizer = None
        if args.tokenizer:
            from transformers import AutoTokenizer  # only here: the rest of the command needs no model files
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        shown = 0
        for info, records in reader.iter_segments(args.after):
            for record in records:
                if args.limit and shown >= args.limit:
                    return 0
                print(json.dumps(record_summary(record, info.name, tokenizer)))
                shown += 1
        return 0
    raise ValueError(f"unknown buffer action {args.buffer_command!r}")


def record_summary(record: SequenceRecord, segment: str, tokenizer: Any = None) -> dict[str, Any]:
    """What ``show`` prints for one record: sampling, sizes, acceptance, the blocks."""
    drafted = sum(len(b.draft_tokens) for b in record.blocks)
    accepted = sum(b.num_accepted for b in record.blocks)
    out: dict[str, Any] = {
        "segment": segment,
        "record_id": record.record_id,
        "drafter_version": record.drafter_version,
        "temperature": record.temperature,
        "prompt_len": record.prompt_len,
        "num_tokens": len(record.tokens),
        "num_blocks": len(record.blocks),
        "accepted": accepted,
        "drafted": drafted,
        "tau": acceptance_length(accepted, len(record.blocks)),
        "blocks": [b.to_dict() for b in record.blocks],
    }
    if tokenizer is not None:
        out["prompt_text"] = tokenizer.decode(list(record.tokens[: record.prompt_len]))
        out["output_text"] = tokenizer.decode(list(record.tokens[record.prompt_len:]))
    return out
