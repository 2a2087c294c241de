"""`online-opd rollout` and `online-opd train --records`: offline Draft-OPD.

`rollout` produces T=0 speculative-decoding records of a drafter on target
rollouts (vLLM generates the greedy tokens; the blocks and accept counts
follow exactly from them, see `online_opd.opd.rollout`). `train` runs the
configured objective on any folder of records, including captured ones, in this
process or data-parallel on Ray Train workers (serve/trainer_dp.py).
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import torch

from online_opd.config import OnlineOPDConfig
from online_opd.models.drafters.checkpoint import read_manifest, save_drafter
from online_opd.opd.rollout import greedy_blocks, pooled_acceptance_length
from online_opd.traces.records import SequenceRecord
from online_opd.train import distributed as dp
from online_opd.train.loop import train
from online_opd.train.opd import offline_objective, opd_step_fn, read_records, write_records
from serve.pipeline import load_serving_drafter, prepare_sequences, resolve_target
from serve.signals import stop_on_signals

logger = logging.getLogger(__name__)


def record_rollouts(cfg: OnlineOPDConfig, drafter_path: Path, out: Path, *, progress: bool = True) -> dict:
    target = resolve_target(cfg, progress=progress)
    drafter, _ = load_serving_drafter(drafter_path, target)
    sequences = prepare_sequences(cfg, target, out / "work", drafter.target_layer_ids, progress=progress)
    version = read_manifest(drafter_path).get("version", drafter_path.name)
    records, per_seq = [], []
    for seq in sequences:
        blocks = greedy_blocks(drafter, seq)
        per_seq.append(blocks)
        records.append(SequenceRecord(
            record_id=uuid.uuid4().hex, model_id=str(target.name), drafter_version=version,
            temperature=0.0, top_p=1.0, top_k=0, tokens=tuple(seq.tokens.tolist()),
            prompt_len=seq.prompt_len, blocks=tuple(blocks)))
    write_records(out / "records-00000.jsonl", records)
    return {"records": str(out), "num_records": len(records),
            "num_blocks": sum(len(b) for b in per_seq),
            "simulated_acceptance_length": round(pooled_acceptance_length(per_seq), 4)}


def train_on_records(cfg: OnlineOPDConfig, records_dir: Path, init: Path | None, run_dir: Path,
                     *, progress: bool = True) -> Path:
    """`online-opd train`: the configured objective on the records, in this process, or with
    ``trainer.num_workers > 1`` on that many data-parallel Ray Train workers (serve/trainer_dp.py);
    returns the trained drafter's folder."""
    if init is None:
        raise ValueError("train needs a drafter to start from: --init PATH or drafter.init_from")
    records = read_usable_records(records_dir)
    if cfg.trainer.num_workers > 1:
        from serve.trainer_dp import train_on_records_dp  # imports ray.train

        return Path(train_on_records_dp(cfg, records_dir, init, run_dir)["drafter"])
    return train_rank(cfg, records, init, run_dir, progress=progress)


def read_usable_records(records_dir: Path) -> list[SequenceRecord]:
    records, skipped = read_records(records_dir)
    if skipped:
        logger.warning("%s: skipped %d malformed record lines", records_dir, skipped)
    if not records:
        raise ValueError(f"{records_dir}: no usable records")
    return records


def train_rank(cfg: OnlineOPDConfig, records: list[SequenceRecord], init: Path, run_dir: Path, *,
               device: torch.device | None = None, progress: bool = True) -> Path:
    """Offline training in this process: the only one, or one rank of a torch.distributed group
    (online_opd/train/distributed.py), where rank 0 alone writes the state and the drafter. ``device``:
    where the models go (None = ``trainer.device``). Returns the drafter's folder."""
    target = resolve_target(cfg, progress=progress)
    drafter, target_model = load_serving_drafter(init, target)
    device = device if device is not None else torch.device(cfg.trainer.device)
    if device.type != "cpu":
        target_model.model.to(device)
        drafter.attach_target(target_model.embed_weight, target_model.lm_head_weight)
        drafter.to(device)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    generator = torch.Generator().manual_seed(cfg.trainer.seed)
    objective = offline_objective(cfg.trainer, records, drafter.cfg.block_size)  # auto: one choice
    if objective != cfg.trainer.objective:
        logger.info("trainer.objective auto: training with %s (position-1 acceptance of the records' blocks)",
                    objective)
    step_fn = opd_step_fn(target_model, drafter, records, cfg.trainer, generator=generator, device=device)
    with stop_on_signals() as stop:
        last = train(step_fn, drafter, cfg.trainer, run_dir, progress=progress,
                     desc=f"train ({objective})", generator=generator, stop=stop)
    if not dp.is_main_process():
        return run_dir / "drafter"
    parent = read_manifest(init).get("version")
    return save_drafter(drafter, run_dir / "drafter", parent_version=parent, step=last,
                        metrics={"objective": cfg.trainer.objective, "objective_in_use": objective,
                                 "num_records": len(records),
                                 "num_workers": dp.world_size()})
