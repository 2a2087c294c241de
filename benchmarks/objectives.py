"""Offline objectives from one bootstrap, over several seeds, with 95% confidence intervals.

From a bootstrap drafter: target rollouts with vLLM on training prompts the
bootstrap did not see (`data.seed=1`, `data.num_prompts=96` unless
overridden; greedy, plus `data.rollout_samples` sampled ones per prompt at
`data.rollout_temperature` when set, cached apart under `sampled/`) and on `--num-held-out` held-out prompts (never trained on),
both cached under --out (each cache folder stamped with the data settings that made it, `data.json`:
a later run whose settings differ stops instead of reusing it). Records = the bootstrap's greedy T=0 blocks on the
training rollouts. Every arm trains from the bootstrap with
`trainer.seed = seed`: the Draft-OPD variants (draft_opd; its paper-style
batch pooling vs `loss_pooling: sequence`; `first_rejected_only`) and
target_rollout for --steps steps, continued SFT on the training rollouts
for the trainer seconds draft_opd took at that seed (benchmarks/
offline_opd_vs_sft.py's `run_arm`). Score = held-out simulated tau: the
pooled acceptance length of the drafter's greedy blocks over the held-out
rollouts (`rollout.greedy_blocks`, exact T=0 vLLM proposals per the parity
tests), so no engine runs per arm. Per arm: mean tau over seeds with a 95%
t-interval, the gain over the bootstrap, and the paired difference against
the --reference arm (draft_opd) at the same seed (same data, same sampling
generator). Prints JSON.

    python benchmarks/objectives.py --bootstrap runs/exp/bt-text --out runs/objectives \
        --json-out benchmarks/results/objectives.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import sys
from pathlib import Path

import torch
from intervals import t_interval  # sibling modules: benchmarks/ leads sys.path
from offline_opd_vs_sft import run_arm, sft_step_fn
from provenance import print_result

from online_opd.config import apply_overrides, load_config
from online_opd.models.target_model import TargetModel
from online_opd.opd.rollout import greedy_blocks, pooled_acceptance_length
from online_opd.traces.records import SequenceRecord
from online_opd.train.opd import opd_step_fn
from online_opd.train.sequences import compute_aux_hidden, load_sequences, save_sequences
from serve.pipeline import generate_rollouts, load_serving_drafter, prepare_sequences, resolve_target

DEFAULT_OVERRIDES = ("data.seed=1", "data.num_prompts=96")  # prompts the bootstrap (data.seed=0) did not see
REFERENCE_ARM = "draft_opd"
OPD_ARMS = {  # trainer-config updates of the arms trained on the bootstrap's records
    "draft_opd": {"objective": "draft_opd"},
    "draft_opd_sequence_pooling": {"objective": "draft_opd", "loss_pooling": "sequence"},
    "target_rollout": {"objective": "target_rollout"},
    "first_rejected_only": {"objective": "draft_opd", "first_rejected_only": True},
    "lk": {"objective": "lk"},  # -log acceptance rate on target_rollout's positions (arXiv 2602.23881)
    "lk_greedy": {"objective": "lk", "lk_temperature": 0.0},  # the same, teacher = the target's greedy token
}
ARMS = (*OPD_ARMS, "sft")


CACHE_STAMP = "data.json"


SAMPLING_FIELDS = ("rollout_samples", "rollout_temperature")  # decide the "sampled" cache only


def checked_cache(folder: Path, cfg, target: Path, split: str) -> None:
    """Stamp a new cache folder with what decides its rollouts (the target, the split, the data
    section: for the greedy caches, without its sampling fields); stop with a clear error when an
    existing stamp says other settings made it. A folder holding rollouts but no stamp (written before
    stamps) is used with a warning."""
    exclude = set() if split == "sampled" else set(SAMPLING_FIELDS)
    stamp = {"target": str(target), "split": split, "data": cfg.data.model_dump(mode="json", exclude=exclude)}
    path = folder / CACHE_STAMP
    if path.exists():
        made = json.loads(path.read_text())
        if made != stamp:
            raise SystemExit(f"{folder} caches rollouts made with {made}, not with {stamp}: "
                             "pass another --out (or delete that folder)")
    elif any(folder.glob("*.safetensors")):
        logging.warning("%s holds rollouts without %s (written before stamps): assuming they match %s",
                        folder, CACHE_STAMP, stamp)
    else:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(stamp, indent=2) + "\n")


def held_out_sequences(cfg, target: Path, folder: Path, num_prompts: int, layer_ids) -> list:
    """Greedy target rollouts on `num_prompts` held-out prompts with their target features, cached."""
    held_cfg = apply_overrides(cfg, [f"data.num_prompts={num_prompts}"])
    checked_cache(folder, held_cfg, target, "held_out")
    features = folder / "sequences.safetensors"
    if features.exists():
        return load_sequences(features, layer_ids)
    sequences = generate_rollouts(held_cfg, target, split="held_out")
    compute_aux_hidden(TargetModel.from_pretrained(target, dtype=torch.float32), sequences, tuple(layer_ids), desc="held-out features")
    folder.mkdir(parents=True, exist_ok=True)
    save_sequences(features, sequences, layer_ids)
    return sequences


def sampled_sequences(cfg, target: Path, folder: Path, layer_ids) -> list:
    """``data.rollout_samples`` sampled target rollouts per training prompt (serve/pipeline.py
    ``rollout_temperatures``) with their target features, cached apart from the greedy ones; none at 0."""
    if cfg.data.rollout_samples == 0:
        return []
    checked_cache(folder, cfg, target, "sampled")
    features = folder / "sequences.safetensors"
    if features.exists():
        return load_sequences(features, layer_ids)
    sequences = generate_rollouts(cfg, target, split="train", greedy=False)
    compute_aux_hidden(TargetModel.from_pretrained(target, dtype=torch.float32), sequences, tuple(layer_ids),
                       desc="sampled features")
    save_sequences(features, sequences, layer_ids)
    return sequences


def block_records(drafter, sequences, served_width: int | None = None) -> list[SequenceRecord]:
    """The drafter's greedy T=0 blocks on each rollout, as the records Draft-OPD replays; ``served_width``
    tokens per block (a server drafting K' < K), default the drafter's K."""
    records = []
    for i, seq in enumerate(sequences):
        blocks = greedy_blocks(drafter, seq, served_width)
        if blocks:
            records.append(SequenceRecord(f"train-{i}", "target", "bootstrap", 0.0, 1.0, 0,
                                          tuple(seq.tokens.tolist()), seq.prompt_len, tuple(blocks)))
    return records


def score(drafter, sequences) -> dict:
    """Held-out simulated tau and the acceptance rate at each draft position k (share of blocks with
    at least k tokens accepted)."""
    drafter.eval()
    blocks = [b for seq in sequences for b in greedy_blocks(drafter, seq)]
    width = drafter.cfg.block_size
    per_position = [sum(b.num_accepted >= k for b in blocks) / max(len(blocks), 1) for k in range(1, width + 1)]
    return {"tau": round(pooled_acceptance_length([blocks]), 4), "num_blocks": len(blocks),
            "acceptance_rate_per_position": [round(a, 4) for a in per_position]}


def step_fn_maker(arm: str, records, sequences):
    """``run_arm``'s `make_step_fn` for `arm`."""
    if arm == "sft":
        return lambda d, _t, tcfg: sft_step_fn(d, sequences, tcfg)
    updates = OPD_ARMS[arm]
    return lambda d, t, tcfg: opd_step_fn(t, d, records, tcfg.model_copy(update=updates))


def train_seed(cfg, args, target, seed: int, records, sequences, held) -> dict:
    """Every arm at one seed: {arm: {steps, trainer_seconds, tau, ...}}; SFT gets draft_opd's seconds."""
    seed_cfg = apply_overrides(cfg, [f"trainer.seed={seed}"])
    out, results = args.out / f"seed{seed}", {}
    for arm in sorted(args.arms, key=lambda a: a != REFERENCE_ARM):
        kwargs = {"budget": results[REFERENCE_ARM]["trainer_seconds"]} if arm == "sft" else {"steps": args.steps}
        path, figures = run_arm(arm, seed_cfg, args.bootstrap, target, out,
                                step_fn_maker(arm, records, sequences), **kwargs)
        drafter, _ = load_serving_drafter(path, target)
        results[arm] = {**figures, **score(drafter, held)}
        logging.info("seed %d %s: %s", seed, arm, results[arm])
    return results


def summarise(per_seed: dict[int, dict], boot_tau: float, arms, reference: str = REFERENCE_ARM) -> dict:
    """Per arm: tau over seeds with its interval, gain over the bootstrap, paired diff vs ``reference``."""
    seeds = sorted(per_seed)
    summary = {}
    for arm in arms:
        taus = [per_seed[s][arm]["tau"] for s in seeds]
        entry = {"tau": t_interval(taus), "gain_over_bootstrap": round(statistics.fmean(taus) - boot_tau, 4),
                 "steps": [per_seed[s][arm]["steps"] for s in seeds],
                 "trainer_seconds": [per_seed[s][arm]["trainer_seconds"] for s in seeds]}
        if arm != reference and reference in arms:
            diffs = [per_seed[s][arm]["tau"] - per_seed[s][reference]["tau"] for s in seeds]
            entry[f"paired_diff_vs_{reference}"] = t_interval(diffs)
            ratios = [per_seed[s][arm]["tau"] / per_seed[s][reference]["tau"] for s in seeds]
            entry[f"paired_ratio_vs_{reference}"] = t_interval(ratios)
        summary[arm] = entry
    return summary


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", type=Path, default=Path("configs/default.yaml"))
    parser.add_argument("--bootstrap", type=Path, default=Path("runs/exp/bt-text"), help="bootstrap run folder")
    parser.add_argument("--out", type=Path, default=Path("runs/objectives"), help="cache and arm runs")
    parser.add_argument("--steps", type=int, default=30, help="steps of each arm but SFT (equal seconds)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--reference", default=REFERENCE_ARM, choices=ARMS,
                        help="the arm every other arm is paired with, seed by seed")
    parser.add_argument("--num-held-out", type=int, default=48, help="held-out prompts scored")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--served-width", type=int, default=None, metavar="K'",
                        help="records' blocks drafted K' wide, as a server whose speculation policy drafts K' < K "
                             "logs them (trainer.widen_share's case); default the drafter's K")
    parser.add_argument("overrides", nargs="*", help=f"dotted config overrides (after {DEFAULT_OVERRIDES})")
    args = parser.parse_args()
    if "sft" in args.arms and REFERENCE_ARM not in args.arms:
        parser.error(f"--arms: sft trains for {REFERENCE_ARM}'s trainer seconds; add {REFERENCE_ARM}")
    if args.reference not in args.arms:
        parser.error(f"--reference {args.reference} is not among --arms {args.arms}")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = load_config(args.config, [*DEFAULT_OVERRIDES, *args.overrides])
    target = resolve_target(cfg)
    boot, _ = load_serving_drafter(args.bootstrap / "drafter", target)
    layer_ids = boot.target_layer_ids
    checked_cache(args.out / "train", cfg, target, "train")
    greedy_cfg = apply_overrides(cfg, ["data.rollout_samples=0"])  # the greedy rollouts, cached apart
    sequences = prepare_sequences(greedy_cfg, target, args.out / "train", layer_ids)
    sequences += sampled_sequences(cfg, target, args.out / "sampled", layer_ids)
    held = held_out_sequences(cfg, target, args.out / "held_out", args.num_held_out, layer_ids)
    if args.served_width is not None and not 1 <= args.served_width <= boot.cfg.block_size:
        raise SystemExit(f"--served-width {args.served_width}: the bootstrap drafter drafts 1..{boot.cfg.block_size}")
    records = block_records(boot, sequences, args.served_width)
    boot_score = score(boot, held)
    per_seed = {seed: train_seed(cfg, args, target, seed, records, sequences, held) for seed in args.seeds}
    result = {
        "command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "cpu_count": os.cpu_count(), "bootstrap": str(args.bootstrap), "steps": args.steps, "seeds": args.seeds,
        "overrides": [*DEFAULT_OVERRIDES, *args.overrides], "num_train_sequences": len(sequences),
        "num_records": len(records), "served_width": args.served_width, "num_held_out_sequences": len(held),
        "bootstrap_score": boot_score,
        "reference": args.reference,
        "summary": summarise(per_seed, boot_score["tau"], args.arms, args.reference), "per_seed": per_seed,
    }
    print_result(result, args.json_out)


if __name__ == "__main__":
    main()
