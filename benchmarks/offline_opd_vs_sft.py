"""Offline Draft-OPD vs continued SFT from the same bootstrap, at equal trainer time.

From a bootstrap run folder (its drafter and its target rollouts with
features): record the bootstrap drafter's T=0 blocks on those rollouts, run
Draft-OPD on them for --steps steps (wall time W), run continued SFT on the
same rollouts for the same wall time W (same sequences and anchors per
step), optionally the naive target-rollout objective for W too, then serve
every drafter with vLLM on held-out prompts and report served tau. Prints JSON.

    python benchmarks/offline_opd_vs_sft.py --bootstrap runs/bootstrap --steps 150
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
from online_opd.drafters.checkpoint import save_drafter
from online_opd.records import SequenceRecord
from online_opd.rollout import acceptance_length, greedy_blocks
from online_opd.train.loop import train
from online_opd.train.opd import opd_step_fn
from online_opd.train.sequences import load_sequences
from online_opd.train.sft import sample_anchors, sft_loss
from serve.evaluate import evaluate
from serve.pipeline import load_serving_drafter, resolve_target


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


def run_arm(name, cfg, boot, target, out, make_step_fn, *, steps, budget):
    drafter, target_model = load_serving_drafter(boot / "drafter", target)
    tcfg = cfg.trainer.model_copy(update={"num_steps": steps, "checkpoint_every": steps})
    start = time.perf_counter()
    done = train(make_step_fn(drafter, target_model, tcfg), drafter, tcfg, out / name,
                 desc=name, time_budget_s=budget)
    seconds = time.perf_counter() - start
    path = save_drafter(drafter, out / name / "drafter", parent_version="bootstrap", step=done)
    return path, {"steps": done, "train_seconds": round(seconds, 1)}


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
    sequences = load_sequences(args.bootstrap / "sequences.safetensors", boot_drafter.target_layer_ids)
    blocks = [greedy_blocks(boot_drafter, s) for s in sequences]
    records = [SequenceRecord(uuid.uuid4().hex, "target", "bootstrap", 0.0, 1.0, 0, tuple(s.tokens.tolist()),
                              s.prompt_len, tuple(b)) for s, b in zip(sequences, blocks) if b]
    result = {"num_records": len(records), "bootstrap_simulated_tau": round(acceptance_length(blocks), 4)}

    def opd(objective):
        return lambda d, t, tcfg: opd_step_fn(t, d, records, tcfg.model_copy(update={"objective": objective}))

    arms = {}
    arms["draft_opd"] = run_arm("draft_opd", cfg, args.bootstrap, target, args.out, opd("draft_opd"),
                                steps=args.steps, budget=None)
    budget = arms["draft_opd"][1]["train_seconds"]
    arms["sft"] = run_arm("sft", cfg, args.bootstrap, target, args.out,
                          lambda d, t, tcfg: sft_step_fn(d, sequences, tcfg), steps=100000, budget=budget)
    if args.naive:
        arms["target_rollout"] = run_arm("target_rollout", cfg, args.bootstrap, target, args.out,
                                         opd("target_rollout"), steps=100000, budget=budget)
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
