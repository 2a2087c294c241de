"""Offline Draft-OPD vs continued SFT from the same bootstrap, at equal trainer time.

From a bootstrap drafter: generate fresh target rollouts with vLLM on
training prompts the bootstrap did not see (`data.seed` of this run),
record the bootstrap drafter's T=0 blocks on them, run Draft-OPD on those
records for --steps steps (trainer time W, summed from its metrics), run
continued SFT on the same rollouts for as many steps as fit in W (step time
probed on 5 steps first; same sequences and anchors per step, and a cosine
schedule over those steps),
optionally the naive target-rollout objective for W too, then serve every
drafter with vLLM on held-out prompts and report served tau. Prints JSON.

    python benchmarks/offline_opd_vs_sft.py --bootstrap runs/bootstrap --steps 100 \
        data.seed=1 data.num_prompts=96
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import uuid
from pathlib import Path

import torch

from online_opd.config import load_config
from online_opd.models.drafters.checkpoint import save_drafter
from online_opd.opd.rollout import greedy_blocks, pooled_acceptance_length
from online_opd.traces.records import SequenceRecord
from online_opd.train.loop import train
from online_opd.train.opd import opd_step_fn
from online_opd.train.sft import sample_anchors, sft_loss
from serve.evaluate import evaluate
from serve.pipeline import load_serving_drafter, prepare_sequences, resolve_target


def sft_step_fn(drafter, sequences, tcfg):
    gen = torch.Generator().manual_seed(tcfg.seed)

    def step_fn(_step):
        losses = []
        for i in torch.randint(len(sequences), (tcfg.sequences_per_step,), generator=gen).tolist():
            seq = sequences[i]
            anchors = sample_anchors(seq.prompt_len, seq.num_tokens, tcfg.anchors_per_sequence, gen)
            losses.append(sft_loss(drafter, seq, anchors, decay=tcfg.sft_position_decay)[0])
        return torch.stack(losses).mean(), {}

    return step_fn


def trainer_seconds(run_dir: Path) -> float:
    """Seconds the trainer spent in its steps (resumes included), from metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return sum(json.loads(line)["step_s"] for line in lines)


def probe_step_seconds(step_fn, num: int = 5) -> float:
    start = time.perf_counter()
    for i in range(num):
        step_fn(i)[0].backward()
    return (time.perf_counter() - start) / num


def run_arm(name, cfg, boot, target, out, make_step_fn, *, steps=None, budget=None):
    """Train one arm from the bootstrap drafter: `steps` steps, or as many as fit in `budget` s."""
    drafter, target_model = load_serving_drafter(boot / "drafter", target)
    if steps is None:
        probe_cfg = cfg.trainer.model_copy(update={"seed": cfg.trainer.seed + 1})
        per_step = probe_step_seconds(make_step_fn(drafter, target_model, probe_cfg))
        drafter.zero_grad(set_to_none=True)
        steps = max(1, int(budget / per_step))
    tcfg = cfg.trainer.model_copy(update={"num_steps": steps, "checkpoint_every": steps})
    done = train(make_step_fn(drafter, target_model, tcfg), drafter, tcfg, out / name, desc=name)
    path = save_drafter(drafter, out / name / "drafter", parent_version="bootstrap", step=done)
    return path, {"steps": done, "trainer_seconds": round(trainer_seconds(out / name), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument("--bootstrap", type=Path, required=True, help="bootstrap run folder")
    parser.add_argument("--steps", type=int, default=150, help="Draft-OPD steps (sets the time budget)")
    parser.add_argument("--out", type=Path, default=Path("runs/opd_vs_sft"))
    parser.add_argument("--naive", action="store_true", help="also the target-rollout forward-KL arm")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = load_config(args.config, args.overrides)
    target = resolve_target(cfg)
    boot_drafter, _ = load_serving_drafter(args.bootstrap / "drafter", target)
    sequences = prepare_sequences(cfg, target, args.out / "rollouts", boot_drafter.target_layer_ids)
    blocks = [greedy_blocks(boot_drafter, s) for s in sequences]
    records = [SequenceRecord(uuid.uuid4().hex, "target", "bootstrap", 0.0, 1.0, 0, tuple(s.tokens.tolist()),
                              s.prompt_len, tuple(b)) for s, b in zip(sequences, blocks) if b]
    result = {"num_records": len(records), "bootstrap_simulated_tau": round(pooled_acceptance_length(blocks), 4)}

    def opd(objective):
        return lambda d, t, tcfg: opd_step_fn(t, d, records, tcfg.model_copy(update={"objective": objective}))

    arms = {}
    arms["draft_opd"] = run_arm("draft_opd", cfg, args.bootstrap, target, args.out, opd("draft_opd"),
                                steps=args.steps)
    budget = arms["draft_opd"][1]["trainer_seconds"]
    arms["sft"] = run_arm("sft", cfg, args.bootstrap, target, args.out,
                          lambda d, t, tcfg: sft_step_fn(d, sequences, tcfg), budget=budget)
    if args.naive:
        arms["target_rollout"] = run_arm("target_rollout", cfg, args.bootstrap, target, args.out,
                                         opd("target_rollout"), budget=budget)
    served = {"bootstrap": args.bootstrap / "drafter", **{k: v[0] for k, v in arms.items()}}
    eval_cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"baseline": False})})
    for name, path in served.items():
        figures = evaluate(eval_cfg, path)
        result[name] = {**(arms[name][1] if name in arms else {}),
                        "served_tau": figures["acceptance_length"],
                        "acceptance_rate_per_position": figures["acceptance_rate_per_position"]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
