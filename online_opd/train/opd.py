"""Draft-OPD (and its ablations) on recorded rollouts.

A step replays a few recorded sequences: for each, a random subset of its
blocks goes through packed replay (one target forward, one drafter forward)
and the configured objective compares the target's and the drafter's
distributions on every drafted position (``replay_records``, shared with the
online trainer). Records come from serving capture or from `online-opd
rollout`; they are read as JSON lines here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from online_opd.config import TrainerConfig
from online_opd.files import atomic_write_text
from online_opd.opd.losses import get_loss
from online_opd.opd.replay import replay_sequence
from online_opd.opd.rollout import simulated_record
from online_opd.traces.records import BlockRecord, SequenceRecord

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
    atomic_write_text(path, "".join(json.dumps(r.to_dict()) + "\n" for r in records))


def objective_fn(cfg: TrainerConfig) -> Callable:
    """The configured objective with its hyper-parameters bound: ``(p, q, r, num_drafted=None)``."""
    loss = get_loss(cfg.objective)
    kwargs: dict = {}
    if cfg.objective == "draft_opd":
        kwargs = {"gamma": cfg.gamma, "lambda_acc": cfg.lambda_acc, "lambda_rej": cfg.lambda_rej,
                  "first_rejected_only": cfg.first_rejected_only}
    elif cfg.objective == "all_reverse":
        kwargs = {"gamma": cfg.gamma}
    return lambda p, q, r, num_drafted=None: loss(p, q, r, num_drafted=num_drafted, **kwargs)


def replayable_blocks(record: SequenceRecord, block_size: int) -> tuple[BlockRecord, ...]:
    """The record's logged blocks a drafter of block size K can replay: 1..K tokens long."""
    return tuple(b for b in record.blocks if 1 <= len(b.draft_tokens) <= block_size)


def plan_replay(target, drafter, record: SequenceRecord,
                simulate_below_coverage: float) -> tuple[SequenceRecord | None, bool]:
    """(the record as a step replays it, whether its blocks were simulated); None when no block is left.

    Coverage = tokens produced by the replayable logged blocks (r + 1 each) / decoded tokens (the output
    after the prefill's token): the share of the decode that speculated with blocks this drafter can
    replay. At or above ``simulate_below_coverage`` the record keeps those blocks. Below it (none at all
    for a request served without speculation) it is replayed on the blocks the *current* drafter would
    have drafted over it (``rollout.simulated_record``: one target forward and one batched drafter
    forward): at T = 0 exactly the blocks serving it would have logged, at T > 0 an exact sample of them
    (the emitted token equals the draft iff the verifier accepts it, and the recorded tokens are draws
    from the target), so the rule holds at every temperature and sampled traffic needs no speculative
    steps to be learnt from. Such blocks are also fully on-policy, unlike logged ones, which the serving
    drafter drafted and which lag the trainer's weights.
    """
    blocks = replayable_blocks(record, drafter.cfg.block_size)
    num_decoded = len(record.tokens) - record.prompt_len - 1
    coverage = sum(b.num_accepted + 1 for b in blocks) / num_decoded if num_decoded > 0 else 1.0
    if coverage >= simulate_below_coverage:
        return (dataclasses.replace(record, blocks=blocks) if blocks else None), False
    simulated = simulated_record(target, drafter, record)
    return (simulated if simulated.blocks else None), True


@dataclass
class ReplayedLoss:
    """One step's objective over its records (``replay_records``)."""

    loss: torch.Tensor  # [] mean over the records; differentiable in the drafter's weights
    accepted: float  # mean accepted-position term
    rejected: float  # mean rejected-position term
    num_replayed_tokens: int  # context tokens plus drafted positions sent through the forwards


def replay_records(target, drafter, records: list[SequenceRecord], objective: Callable, *,
                   anchors_per_sequence: int, generator: torch.Generator,
                   device: torch.device | None = None) -> ReplayedLoss:
    """Up to ``anchors_per_sequence`` blocks of each record, drawn with ``generator``, replayed in one
    packed pass per record (replay.py) and scored with ``objective``."""
    losses, accepted, rejected, num_tokens = [], [], [], 0
    for record in records:
        count = min(anchors_per_sequence, len(record.blocks))
        chosen = torch.randperm(len(record.blocks), generator=generator)[:count].sort().values
        blocks = [record.blocks[j] for j in chosen.tolist()]
        end = max(b.anchor for b in blocks) + 1  # later tokens are never read
        tokens = torch.tensor(record.tokens[:end], dtype=torch.int64, device=device)
        batch = replay_sequence(target, drafter, tokens, blocks)
        out = objective(batch.target_logits, batch.draft_logits, batch.num_accepted, batch.num_drafted)
        losses.append(out.loss)
        accepted.append(float(out.accepted.detach()))
        rejected.append(float(out.rejected.detach()))
        num_tokens += end + sum(len(b.draft_tokens) - 1 for b in blocks)
    return ReplayedLoss(loss=torch.stack(losses).mean(), accepted=sum(accepted) / len(accepted),
                        rejected=sum(rejected) / len(rejected), num_replayed_tokens=num_tokens)


def opd_step_fn(target, drafter, records: list[SequenceRecord], cfg: TrainerConfig,
                generator: torch.Generator | None = None):
    """A `train()` step function: replay `sequences_per_step` records per step, picked with
    ``generator`` (default: seeded with ``cfg.seed``; pass the same one to `train()` to resume it)."""
    objective = objective_fn(cfg)
    gen = generator if generator is not None else torch.Generator().manual_seed(cfg.seed)

    def step_fn(_step: int):
        picks = torch.randint(len(records), (cfg.sequences_per_step,), generator=gen).tolist()
        out = replay_records(target, drafter, [records[i] for i in picks], objective,
                             anchors_per_sequence=cfg.anchors_per_sequence, generator=gen)
        stats = {"accepted": out.accepted, "rejected": out.rejected,
                 "replayed_tokens": out.num_replayed_tokens}
        return out.loss, stats

    return step_fn
