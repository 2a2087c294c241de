"""What a gate evaluation costs the online trainer, with the records' captured signal and without.

The gate (online_opd/release/gate.py) runs in the trainer's thread between steps, so its seconds are
seconds the trainer does not train. On a served run's buffer (`online-opd serve ... -o
capture.teacher_top_k=32 -o capture.hidden_sample_rate=1`, e.g. benchmarks/domain_shift.py
--capture-features), this takes the held-out records as the trainer routes them, the newest
`--records`, and evaluates candidate vs serving drafter (two registry versions) in turn with the
captured features and teacher rows (`gate.captured_teacher`, what a T > 0 record's blocks are verified
on), the features only (the packed target forward verifies), and neither, `--repeats` times each, on
`--threads` torch threads. It prints JSON: seconds per evaluation, the ratios, the taus and decisions
(bfloat16 served features and rows against the float32 recompute move them slightly), and, over the
records the rows cover, how far their E[r] per block lies from the forward's (top-k truncation and
bfloat16 together).

    python benchmarks/gate_cost.py --run-dir runs/ds-features/auto --candidate v0015 --serving v0006
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from online_opd.config import GateConfig, load_config  # noqa: E402
from online_opd.models.drafters.checkpoint import load_drafter  # noqa: E402
from online_opd.models.target_model import TargetModel  # noqa: E402
from online_opd.release.gate import evaluate_gate, gate_blocks, is_held_out, most_recent, simulate_record  # noqa: E402
from online_opd.release.registry import DrafterRegistry  # noqa: E402
from online_opd.traces.buffer import BufferReader  # noqa: E402
from serve.pipeline import resolve_target  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, required=True, help="a served run: buffer/ and registry/")
    p.add_argument("--candidate", required=True, help="registry version scored as the candidate")
    p.add_argument("--serving", required=True, help="registry version scored as the serving drafter")
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    p.add_argument("--held-out-fraction", type=float, default=0.15, help="as the run's gate.held_out_fraction")
    p.add_argument("--records", type=int, default=32)
    p.add_argument("--blocks", type=int, default=32, help="gate.max_blocks_per_record")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's online.num_threads)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    target = TargetModel.from_pretrained(resolve_target(cfg, progress=False), dtype=torch.float32)
    registry = DrafterRegistry(args.run_dir / "registry")
    drafters = {}
    for role, version in (("candidate", args.candidate), ("serving", args.serving)):
        drafter = load_drafter(registry.get(version).path)
        drafter.attach_target(target.embed_weight, target.lm_head_weight)
        drafters[role] = drafter.eval()
    reader = BufferReader(args.run_dir / "buffer")
    records = [r for info in reader.segments() for r in reader.read_segment(info)]
    held = [r for r in records if is_held_out(r, args.held_out_fraction, cfg.gate.split_prefix_tokens)]
    held = most_recent(held, args.records)
    with_features = sum(r.hidden is not None for r in held)
    modes = {"teacher": (True, True), "captured": (True, False), "recomputed": (False, False)}
    runs: dict[str, list] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode, (features, teacher) in modes.items():
            gate = GateConfig(max_records=args.records, max_blocks_per_record=args.blocks, min_records=2,
                              captured_features=features, captured_teacher=teacher)
            start = time.perf_counter()
            result = evaluate_gate(target, drafters["candidate"], drafters["serving"], held, gate)
            runs[mode].append((time.perf_counter() - start, result))
    summary = {}
    for mode, items in runs.items():
        last = items[-1][1]
        summary[mode] = {"seconds": [round(s, 2) for s, _ in items],
                         "median_s": round(statistics.median(s for s, _ in items), 2),
                         "tau_candidate": last.tau_candidate, "tau_serving": last.tau_serving,
                         "n_blocks": last.n_blocks, "passed": last.passed, "lower": last.record_diff_lower,
                         "records_on_teacher_rows": last.n_records_teacher}
    out = {"command": " ".join(sys.argv), "threads": args.threads, "held_out_records": len(held),
           "with_features": with_features, **summary,
           "speedup": round(summary["recomputed"]["median_s"] / summary["captured"]["median_s"], 3),
           "speedup_teacher": round(summary["captured"]["median_s"] / summary["teacher"]["median_s"], 3),
           "same_decision": len({summary[m]["passed"] for m in modes}) == 1,
           "teacher_rows_error": _row_error(target, drafters, held, args.blocks)}
    print(json.dumps(out, indent=2))
    return 0


def _row_error(target, drafters, records, max_blocks: int) -> dict:
    """Over the T > 0 records whose blocks the captured rows cover: |E[r] on the rows - E[r] on the
    forward| per block and drafter, and the same for the per-record paired difference the gate decides on."""
    block_errors, diff_errors = [], []
    pair = (drafters["candidate"], drafters["serving"])
    for rec in records:
        blocks = gate_blocks(rec, max_blocks)
        if rec.temperature == 0 or not blocks:
            continue
        anchors, lengths = [b.anchor for b in blocks], [b.drafted_width for b in blocks]
        read = simulate_record(target, pair, rec, anchors, lengths, captured_teacher=True)
        if not read.from_teacher:
            continue
        forward = simulate_record(target, pair, rec, anchors, lengths).expected
        block_errors += (read.expected - forward).abs().flatten().tolist()
        diff_errors.append(abs(float((read.expected[0] - read.expected[1]).mean() - (forward[0] - forward[1]).mean())))
    if not block_errors:
        return {"records": 0}
    return {"records": len(diff_errors), "block_expectations": len(block_errors),
            "block_abs_mean": statistics.fmean(block_errors), "block_abs_max": max(block_errors),
            "record_diff_abs_mean": statistics.fmean(diff_errors), "record_diff_abs_max": max(diff_errors)}


if __name__ == "__main__":
    sys.exit(main())
