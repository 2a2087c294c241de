"""Simulated blocks from a record's captured features against simulated blocks from a target forward.

A record served mostly without speculation (``online.simulate_below_coverage``) is replayed on the blocks
the trainer's drafter would have drafted over it (``rollout.simulated_record``). The drafter's context
there comes either from one target forward over the record (``captured_features=False``) or from the
record's captured features (``SequenceRecord.hidden``, ``capture.hidden_sample_rate``; the default with
``trainer.captured_teacher``). For records of a trace buffer that carry features, this times both ways
(alternating per repeat), the training step that follows on the simulated blocks (its forward and
backward), and reports how
often the two walks draft the same block at the anchors both visit (the features are the server's dtype,
bfloat16 on a CPU with AMX; the trainer's target is float32).

The step's teacher: simulated blocks carry no verifier rows of their own. Records captured with the
plain steps' rows (``SequenceRecord.path_teacher``) give a path-only objective (``--objective``
target_rollout or lk) its teacher from them (``train.opd.with_path_teachers``: no target forward);
without them the packed target forward runs. With such records both steps are timed, alternating, on
the same simulated blocks, with the relative difference of their losses (the top-k truncation).

    python benchmarks/simulated_replay.py --buffer runs/ds-features4/auto/buffer \\
        --drafter runs/bootstrap/drafter --out benchmarks/results/simulated_replay.json

One JSON object on stdout (also written to --out); logs on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from online_opd.config import load_config  # noqa: E402
from online_opd.opd.rollout import simulated_record  # noqa: E402
from online_opd.traces.buffer import BufferReader  # noqa: E402
from online_opd.train.opd import objective_fn, replay_records, with_path_teachers  # noqa: E402
from serve.launcher import benchmark_logging, emit_result  # noqa: E402
from serve.pipeline import load_serving_drafter, resolve_target  # noqa: E402

logger = logging.getLogger("simulated_replay")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffer", type=Path, required=True, help="trace buffer captured with features")
    parser.add_argument("--drafter", type=Path, default=ROOT / "runs" / "bootstrap" / "drafter")
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per mode (alternating)")
    parser.add_argument("--objective", default="target_rollout", help="the step's objective (not auto)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    benchmark_logging()
    cfg = load_config(args.config)
    drafter, target = load_serving_drafter(args.drafter, resolve_target(cfg))
    records = [r for r in BufferReader(args.buffer).iter_records() if r.hidden is not None][: args.records]
    if not records:
        raise SystemExit(f"{args.buffer}: no record with features (capture with -o capture.teacher_top_k=N "
                         "-o capture.hidden_sample_rate=F)")
    objective = objective_fn(cfg.trainer, args.objective)
    logger.info("%d records with features, %d tokens", len(records), sum(len(r.tokens) for r in records))

    simulated_record(target, drafter, records[0], False)  # warm-up
    modes = {"target_forward": False, "captured_features": True}
    seconds = {mode: 0.0 for mode in modes}
    # the step after it, one record at a time as a step replays each: with the record's captured rows along
    # its tokens (SequenceRecord.path_teacher, for a path-only objective) and without them
    teachers = ("path_teacher", "target_forward") if any(r.path_teacher is not None for r in records) \
        else ("target_forward",)
    step_seconds, losses, simulated = dict.fromkeys(teachers, 0.0), {t: [] for t in teachers}, {}
    for repeat in range(args.repeats):
        for mode in (list(modes) if repeat % 2 == 0 else list(modes)[::-1]):
            start = time.perf_counter()
            simulated[mode] = [simulated_record(target, drafter, r, modes[mode]) for r in records]
            seconds[mode] += time.perf_counter() - start
        for teacher in (teachers if repeat % 2 == 0 else teachers[::-1]):
            start = time.perf_counter()
            for rec in simulated["captured_features"]:
                if rec.blocks:
                    rec = rec if teacher == "path_teacher" else dataclasses.replace(rec, path_teacher=None)
                    drafter.zero_grad(set_to_none=True)
                    out = replay_records(target, drafter, [rec], objective,
                                         anchors_per_sequence=cfg.trainer.anchors_per_sequence,
                                         generator=torch.Generator().manual_seed(repeat))
                    out.loss.backward()
                    losses[teacher].append(float(out.loss.detach()))
            step_seconds[teacher] += time.perf_counter() - start
    common = same = 0  # drafts at the anchors both walks visit (a walk shifts after an r that differs)
    for ra, rb in zip(simulated["target_forward"], simulated["captured_features"]):
        by_anchor = {b.anchor: b.draft_tokens for b in rb.blocks}
        for block in ra.blocks:
            if block.anchor in by_anchor:
                common += 1
                same += block.draft_tokens == by_anchor[block.anchor]
    count = args.repeats * len(records)
    result = {
        "command": " ".join(sys.argv), "records": len(records), "repeats": args.repeats,
        "tokens_per_record": sum(len(r.tokens) for r in records) / len(records),
        "simulate_s_per_record": {m: round(s / count, 4) for m, s in seconds.items()},
        "speed_up": round(seconds["target_forward"] / seconds["captured_features"], 3),
        "replay_step_s_per_record": {t: round(s / count, 4) for t, s in step_seconds.items()},
        "simulation_share_of_record_time": {
            m: round(s / (s + step_seconds[teachers[0]]), 3) for m, s in seconds.items()},
        "blocks": {m: sum(len(r.blocks) for r in simulated[m]) for m in modes},
        "anchors_in_both_walks": common, "equal_drafts_there": same,
        "records_with_equal_walks": sum(ra.blocks == rb.blocks for ra, rb in zip(
            simulated["target_forward"], simulated["captured_features"])),
    }
    if "path_teacher" in teachers:  # the same steps, the same blocks: the loss differs by the top-k truncation
        covered = [b.teacher is not None for rec in simulated["captured_features"]
                   for b in with_path_teachers(rec, list(rec.blocks))]
        diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["path_teacher"], losses["target_forward"])]
        result["path_teacher"] = {
            "objective": args.objective, "records_with_it": sum(r.path_teacher is not None for r in records),
            "blocks_covered": sum(covered), "blocks": len(covered),
            "step_speed_up": round(step_seconds["target_forward"] / step_seconds["path_teacher"], 3),
            "loss_rel_diff_median": round(statistics.median(diffs), 4) if diffs else None,
            "loss_rel_diff_max": round(max(diffs), 4) if diffs else None,
        }
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
