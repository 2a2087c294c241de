"""The shape of what a server drafted: per buffer, the blocks by width K' (tokens drafted) and the plain steps
between them, from the records the capture wrote. The speculation policy picks K' per batch size from its
step-cost fit, so two runs of one setup can serve very differently; path-only objectives (LK, target-rollout
KL) learn K' positions at most from a block (``trainer.widen_share`` widens them), and records served mostly
plain are replayed on simulated K-wide blocks instead (``online.simulate_below_coverage``).

    python benchmarks/served_widths.py runs/b45/tr-s1/naive/buffer runs/b44/ds30-s1/auto/buffer

Prints JSON: per buffer, records, blocks, plain steps and the share of blocks of each width.
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from online_opd.traces.buffer import BufferReader


def widths(buffer: Path) -> dict:
    by_width: collections.Counter = collections.Counter()
    records = plain = 0
    for record in BufferReader(buffer).iter_records():
        records += 1
        for block in record.blocks:
            by_width[len(block.draft_tokens)] += 1
            plain += block.num_plain_steps
    blocks = sum(by_width.values())
    return {"records": records, "blocks": blocks, "plain_steps_between_blocks": plain,
            "width_share": {k: round(v / blocks, 3) for k, v in sorted(by_width.items())} if blocks else {}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("buffers", nargs="+", type=Path, help="capture buffer folders (<run>/buffer)")
    args = p.parse_args()
    print(json.dumps({str(b): widths(b) for b in args.buffers}, indent=1))


if __name__ == "__main__":
    main()
