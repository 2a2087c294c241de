"""Replay from the verifier's captured top-k against replay with a recomputed target forward.

Records come from a trace buffer captured with ``capture.teacher_top_k`` (e.g. the "teacher" server
of ``benchmarks/capture_overhead.py --teacher-top-k 32 --run-dir DIR``: DIR/round0-teacher/buffer).
The online trainer's models and settings: the embedded target in float32 (as the online trainer
loads it), the served drafter, ``trainer.objective`` and ``anchors_per_sequence`` from the config.
Each record's blocks are drawn once (``choose_blocks``, as a training step draws them) and the
same blocks are replayed in both modes:

- **throughput**: a training step's forward and backward per record (``replay_sequence`` and the
  objective), ``use_teacher`` False (the packed target forward over T + sum (K_m - 1) tokens) and
  True (a causal forward over T tokens, p rebuilt from the captured top-k), modes alternating per
  repeat. Replayed tokens (what the trainer counts: context plus drafted positions) per wall second
  and per CPU second of this process (``time.process_time``: every thread).
- **fidelity**: per drafted row, the captured teacher (served in the server's dtype, bfloat16 on a
  CPU with AMX) against the trainer's float32 recompute: KL(p_recomputed || p_rebuilt), total
  variation, the mass the k ids hold; for ``--top-k`` values at or below the captured k, the same
  with the captured rows cut to their first k ids, and with the top-k of the float32 recompute
  itself (the truncation alone, without the dtype difference): these rows rebuild the tail
  uniformly. Per record, the objective's value and its gradient in the drafter's weights with each
  cut teacher, its tail uniform (the trainer's way) or shaped by the student, against the
  recomputed teacher (relative difference, cosine, norm ratio).

    python benchmarks/teacher_replay.py --buffer runs/bench/teacher-overhead/round0-teacher/buffer \\
        --drafter runs/bootstrap/drafter --out benchmarks/results/teacher_replay.json

``--features``: records that also carry the target's features (``capture.hidden_sample_rate``, e.g.
``capture_overhead.py --teacher-top-k 32 --hidden-sample-rate 1``) only, and a third throughput mode,
"features" (the captured teacher and the record's features: the target runs only over the positions
before them, none when the server saw the whole sequence). Its fidelity: the served features (the
server's dtype) against the trainer's float32 aux (per value, |diff| / max(|value|, 1)), and per record
the step's loss and gradient with them against the same step on the trainer's own aux.

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
from online_opd.opd.replay import TEACHER_TAILS, replay_sequence  # noqa: E402
from online_opd.opd.teacher_rows import teacher_truncation, top_k_teacher  # noqa: E402
from online_opd.traces.buffer import BufferReader  # noqa: E402
from online_opd.traces.target_signal import TeacherTopK  # noqa: E402
from online_opd.train.opd import choose_blocks, objective_fn, offline_objective, replayable_blocks  # noqa: E402
from serve.launcher import benchmark_logging, emit_result  # noqa: E402
from serve.pipeline import load_serving_drafter, resolve_target  # noqa: E402

logger = logging.getLogger("teacher_replay")


def cut(teacher: TeacherTopK, k: int) -> TeacherTopK:
    """The captured teacher keeping only each row's first (largest) k ids."""
    return TeacherTopK(tuple(row[:k] for row in teacher.token_ids), tuple(row[:k] for row in teacher.logprobs))


def select(reader: BufferReader, block_size: int, count: int, features: bool = False) -> list:
    """The first `count` records whose replayable blocks all carry a teacher (and, with `features`, that
    carry the target's features), those blocks kept."""
    out = []
    for record in reader.iter_records():
        blocks = replayable_blocks(record, block_size)
        if blocks and all(b.teacher is not None for b in blocks) and (record.hidden is not None or not features):
            out.append(dataclasses.replace(record, blocks=blocks))
            if len(out) == count:
                break
    return out


def step(target, drafter, objective, tokens, blocks, use_teacher: bool,
         tail: str = "student", hidden=None) -> tuple[float, torch.Tensor]:
    """One record's training-step forward and backward: (the objective's value, its gradient, flat)."""
    drafter.zero_grad(set_to_none=True)
    batch = replay_sequence(target, drafter, tokens, blocks, use_teacher=use_teacher, teacher_tail=tail,
                            hidden=hidden)
    loss = objective(batch.target_logits, batch.draft_logits, batch.num_accepted, batch.num_drafted).loss
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None])
    return float(loss.detach()), grad


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity in float64 (float32's can exceed 1 for near-parallel vectors this long)."""
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def summary(values: list[float]) -> dict:
    values = sorted(values)
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p95": values[min(len(values) - 1, int(0.95 * len(values)))], "max": values[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffer", type=Path, required=True, help="trace buffer captured with teacher_top_k")
    parser.add_argument("--drafter", type=Path, default=ROOT / "runs" / "bootstrap" / "drafter")
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--records", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per mode (alternating)")
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 4, 8, 16, 32],
                        help="cuts of the captured rows to measure (at most the captured k)")
    parser.add_argument("--features", action="store_true",
                        help="records with the target's features only, and the 'features' mode (docstring)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    benchmark_logging()
    cfg = load_config(args.config)
    torch.manual_seed(args.seed)
    drafter, target = load_serving_drafter(args.drafter, resolve_target(cfg))
    block_size = drafter.cfg.block_size
    records = select(BufferReader(args.buffer), block_size, args.records, args.features)
    if not records:
        raise SystemExit(f"{args.buffer}: no record whose replayable blocks carry a teacher "
                         "(capture with -o capture.teacher_top_k=N" +
                         (" -o capture.hidden_sample_rate=F)" if args.features else ")"))
    objective_name = offline_objective(cfg.trainer, records, block_size)  # auto: one choice
    objective = objective_fn(cfg.trainer, objective_name)
    generator = torch.Generator().manual_seed(args.seed)
    work = []  # (tokens, blocks, trained tokens) per record, the blocks drawn as a step draws them
    for record in records:
        blocks = choose_blocks(record, cfg.trainer.anchors_per_sequence, generator)
        end = max(b.anchor for b in blocks) + 1
        work.append((torch.tensor(record.tokens[:end]), blocks, end + sum(len(b.draft_tokens) - 1 for b in blocks)))
    hidden = [record.hidden for record in records]
    captured_k = min(b.teacher.top_k for _, blocks, _ in work for b in blocks)
    cuts = sorted({k for k in args.top_k if k <= captured_k})
    logger.info("%d records, %d blocks, captured k=%d", len(work), sum(len(b) for _, b, _ in work), captured_k)

    # throughput: the same records and blocks in both modes, alternating
    modes = ("recompute", "captured", "features") if args.features else ("recompute", "captured")
    timing = {mode: {"wall_s": 0.0, "cpu_s": 0.0} for mode in modes}
    step(target, drafter, objective, *work[0][:2], use_teacher=False)  # warm-up
    for r in range(args.repeats):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            wall, cpu = time.perf_counter(), time.process_time()
            for (tokens, blocks, _), h in zip(work, hidden):
                step(target, drafter, objective, tokens, blocks, use_teacher=mode != "recompute",
                     tail="uniform", hidden=h if mode == "features" else None)
            timing[mode]["wall_s"] += time.perf_counter() - wall
            timing[mode]["cpu_s"] += time.process_time() - cpu
    trained = sum(n for _, _, n in work) * args.repeats
    for mode in timing:
        t = timing[mode]
        t["tokens_per_wall_s"] = round(trained / t["wall_s"], 1)
        t["tokens_per_cpu_s"] = round(trained / t["cpu_s"], 1)
        t["wall_s"], t["cpu_s"] = round(t["wall_s"], 2), round(t["cpu_s"], 2)

    # fidelity: rows, then the objective and its gradient
    rows: dict[str, dict[str, list[float]]] = {}
    grads: dict[str, dict[str, list[float]]] = {}

    def add_rows(name: str, figures: dict[str, torch.Tensor]) -> None:
        for key, values in figures.items():
            rows.setdefault(name, {}).setdefault(key, []).extend(values.tolist())

    features: dict[str, list[float]] = {"value_rel_diff_mean": [], "value_rel_diff_max": [], "loss_rel_diff": [],
                                        "grad_cosine": [], "grad_rel_norm": []}
    for (tokens, blocks, _), h in zip(work, hidden):
        if args.features:
            with torch.no_grad():
                aux = target.forward(tokens, tuple(drafter.target_layer_ids),
                                     logits_at=tokens.new_empty(0)).aux_hidden.float()[h.start:]
            served = h.to_tensor().float()[: aux.shape[0]]
            rel = (served - aux).abs() / aux.abs().clamp(min=1.0)
            features["value_rel_diff_mean"].append(float(rel.mean()))
            features["value_rel_diff_max"].append(float(rel.max()))
            own_loss, own_grad = step(target, drafter, objective, tokens, blocks, True, tail="uniform")
            loss, grad = step(target, drafter, objective, tokens, blocks, True, tail="uniform", hidden=h)
            features["loss_rel_diff"].append(abs(loss - own_loss) / max(abs(own_loss), 1e-12))
            features["grad_cosine"].append(cosine(grad, own_grad))
            features["grad_rel_norm"].append(float(grad.norm() / own_grad.norm()))
        with torch.no_grad():
            full = replay_sequence(target, drafter, tokens, blocks, use_teacher=False).target_logits
        for m, block in enumerate(blocks):
            full_rows = full[m, :len(block.draft_tokens)].float()  # [K_m, vocab]
            for k in cuts:
                add_rows(f"captured_k{k}", teacher_truncation(full_rows, cut(block.teacher, k)))
                add_rows(f"recomputed_k{k}", teacher_truncation(full_rows, top_k_teacher(full_rows, k)))
        reference_loss, reference_grad = step(target, drafter, objective, tokens, blocks, use_teacher=False)
        for k in cuts:
            cut_blocks = [dataclasses.replace(b, teacher=cut(b.teacher, k)) for b in blocks]
            for tail in TEACHER_TAILS:
                loss, grad = step(target, drafter, objective, tokens, cut_blocks, use_teacher=True, tail=tail)
                g = grads.setdefault(f"captured_k{k}_{tail}_tail",
                                     {"loss_rel_diff": [], "grad_cosine": [], "grad_rel_norm": []})
                g["loss_rel_diff"].append(abs(loss - reference_loss) / max(abs(reference_loss), 1e-12))
                g["grad_cosine"].append(cosine(grad, reference_grad))
                g["grad_rel_norm"].append(float(grad.norm() / reference_grad.norm()))

    result = {
        "benchmark": "teacher_replay",
        "buffer": str(args.buffer), "drafter": str(args.drafter), "objective": objective_name,
        "objective_configured": cfg.trainer.objective,
        "records": len(work), "blocks": sum(len(b) for _, b, _ in work), "captured_top_k": captured_k,
        "anchors_per_sequence": cfg.trainer.anchors_per_sequence, "repeats": args.repeats,
        "trained_tokens_per_pass": trained // args.repeats,
        "throughput": timing,
        "speedup_wall": round(timing["recompute"]["wall_s"] / timing["captured"]["wall_s"], 3),
        "speedup_cpu": round(timing["recompute"]["cpu_s"] / timing["captured"]["cpu_s"], 3),
        **({"features_speedup_wall": round(timing["recompute"]["wall_s"] / timing["features"]["wall_s"], 3),
            "features_speedup_cpu": round(timing["recompute"]["cpu_s"] / timing["features"]["cpu_s"], 3),
            "features_start_zero": sum(h.start == 0 for h in hidden),
            "features_vs_trainer_aux": {key: {s: round(v, 6) for s, v in summary(values).items()}
                                        for key, values in features.items()}} if args.features else {}),
        "rows": {name: {key: {s: round(v, 6) for s, v in summary(values).items()} for key, values in figs.items()}
                 for name, figs in rows.items()},
        "objective_vs_recomputed": {name: {key: {s: round(v, 6) for s, v in summary(values).items()}
                                           for key, values in figs.items()}
                                    for name, figs in grads.items()},
        "note": "rows: per drafted position, KL(p_recomputed || p_rebuilt), total variation, captured mass; "
                "captured_k*: the server's rows cut to k; recomputed_k*: the trainer's own float32 top-k "
                "(truncation alone); both with the uniform tail. objective_vs_recomputed: per record, the step's "
                "loss and gradient with the captured teacher (student or uniform tail) against the recompute.",
    }
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
