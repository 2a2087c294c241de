"""Draft-OPD (and its ablations) on recorded rollouts.

A step replays a few recorded sequences: for each, a random subset of its
blocks goes through packed replay (one target forward, one drafter forward)
and the configured objective compares the target's and the drafter's
distributions on every drafted position. Records come from serving capture
or from `online-opd rollout`; they are read as JSON lines here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from online_opd.config import TrainerConfig
from online_opd.opd.losses import get_loss
from online_opd.opd.replay import replay_sequence
from online_opd.traces.records import SequenceRecord

RECORD_GLOB = "*.jsonl"


def read_records(folder: Path) -> tuple[list[SequenceRecord], int]:
    """All records under `folder`; returns (records, number of lines skipped as malformed)."""
    records, skipped = [], 0
    files = sorted(Path(folder).glob(RECORD_GLOB))
    if not files:
        raise FileNotFoundError(f"{folder}: no {RECORD_GLOB} record files")
    for file in files:
        for line in file.read_text().splitlines():
            try:
                records.append(SequenceRecord.from_dict(json.loads(line)))
            except (ValueError, json.JSONDecodeError):
                skipped += 1
    return [r for r in records if r.blocks], skipped


def write_records(path: Path, records: list[SequenceRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    tmp.replace(path)


def objective_fn(cfg: TrainerConfig) -> Callable:
    """The configured objective with its hyper-parameters bound."""
    loss = get_loss(cfg.objective)
    if cfg.objective == "draft_opd":
        return lambda p, q, r: loss(p, q, r, gamma=cfg.gamma, lambda_acc=cfg.lambda_acc,
                                    lambda_rej=cfg.lambda_rej, first_rejected_only=cfg.first_rejected_only)
    if cfg.objective == "all_reverse":
        return lambda p, q, r: loss(p, q, r, gamma=cfg.gamma)
    return loss


def opd_step_fn(target, drafter, records: list[SequenceRecord], cfg: TrainerConfig):
    """A `train()` step function: replay `sequences_per_step` records per step."""
    objective = objective_fn(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)

    def step_fn(_step: int):
        picks = torch.randint(len(records), (cfg.sequences_per_step,), generator=gen).tolist()
        losses, acc, rej, num_tokens = [], [], [], 0
        for i in picks:
            rec = records[i]
            count = min(cfg.anchors_per_sequence, len(rec.blocks))
            chosen = torch.randperm(len(rec.blocks), generator=gen)[:count].sort().values.tolist()
            blocks = [rec.blocks[j] for j in chosen]
            end = max(b.anchor for b in blocks) + 1  # later tokens are never read
            tokens = torch.tensor(rec.tokens[:end], dtype=torch.int64)
            batch = replay_sequence(target, drafter, tokens, blocks)
            out = objective(batch.target_logits, batch.draft_logits, batch.num_accepted)
            losses.append(out.loss)
            acc.append(float(out.accepted.detach()))
            rej.append(float(out.rejected.detach()))
            num_tokens += end + len(blocks) * (drafter.cfg.block_size - 1)
        stats = {"accepted": sum(acc) / len(acc), "rejected": sum(rej) / len(rej),
                 "replayed_tokens": num_tokens}
        return torch.stack(losses).mean(), stats

    return step_fn
