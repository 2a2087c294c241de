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
from online_opd.opd.losses import PATH_ONLY, DraftOPDLoss, get_loss, pool_losses
from online_opd.opd.objective_schedule import ObjectiveSchedule
from online_opd.opd.replay import ReplayBatch, replay_sequence
from online_opd.opd.rollout import simulated_record
from online_opd.opd.teacher_rows import path_block_teacher
from online_opd.traces.records import BlockRecord, SequenceRecord, path_rows
from online_opd.train import distributed as dp

RECORD_GLOB = "*.jsonl"
POOLINGS = ("batch", "sequence")  # how replay_records averages a step's records (TrainerConfig.loss_pooling)


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


def objective_fn(cfg: TrainerConfig, name: str | None = None) -> Callable:
    """Objective ``name`` (default: the configured one, which must not be "auto": see
    ``objective_schedule``) with the config's hyper-parameters bound: ``(p, q, r, num_drafted=None)``."""
    name = cfg.objective if name is None else name
    if name == "auto":
        raise ValueError("objective 'auto' is a schedule over two objectives: pick one with "
                         "ObjectiveSchedule (online) or offline_objective (offline)")
    loss = get_loss(name)
    kwargs: dict = {}
    if name == "draft_opd":
        kwargs = {"gamma": cfg.gamma, "lambda_acc": cfg.lambda_acc, "lambda_rej": cfg.lambda_rej,
                  "first_rejected_only": cfg.first_rejected_only}
    elif name == "all_reverse":
        kwargs = {"gamma": cfg.gamma}
    elif name == "lk":
        kwargs = {"temperature": cfg.lk_temperature}

    def objective(p, q, r, num_drafted=None):
        return loss(p, q, r, num_drafted=num_drafted, **kwargs)

    # reads positions k <= r + 1 only: replay may take its teacher from the rows along the sequence
    objective.path_only = name in PATH_ONLY or (name == "draft_opd" and cfg.first_rejected_only)
    return objective


def objective_schedule(cfg: TrainerConfig) -> ObjectiveSchedule | None:
    """The schedule of ``objective: auto`` (``trainer.auto``); None for a fixed objective."""
    return ObjectiveSchedule.from_config(cfg.auto) if cfg.objective == "auto" else None


def offline_objective(cfg: TrainerConfig, records: list[SequenceRecord], block_size: int) -> str:
    """The objective an offline run on ``records`` trains with: the configured one, or for "auto" the
    schedule's choice on the acceptance of every replayable block of the records (they are the traffic
    it sees; one decision, since offline records do not change)."""
    schedule = objective_schedule(cfg)
    if schedule is None:
        return cfg.objective
    for record in records:
        schedule.observe(b.num_accepted for b in replayable_blocks(record, block_size))
    return schedule.choose(1)


def replayable_blocks(record: SequenceRecord, block_size: int) -> tuple[BlockRecord, ...]:
    """The record's logged blocks a drafter of block size K can replay: the drafter's own (not the ngram
    fallback's), verified whole (not trimmed: BlockRecord.is_whole), 1..K tokens long."""
    return tuple(b for b in record.blocks if b.is_whole and 1 <= len(b.draft_tokens) <= block_size)


def plan_replay(target, drafter, record: SequenceRecord, simulate_below_coverage: float,
                captured_features: bool = True) -> tuple[SequenceRecord | None, bool]:
    """(the record as a step replays it, whether its blocks were simulated); None when no block is left.

    Coverage = tokens produced by the replayable logged blocks (r + 1 each) / decoded tokens (the output
    after the prefill's token): the share of the decode that speculated with blocks this drafter can
    replay. At or above ``simulate_below_coverage`` the record keeps those blocks. Below it (none at all
    for a request served without speculation) it is replayed on the blocks the *current* drafter would
    have drafted over it (``rollout.simulated_record``: one batched drafter forward, on the record's
    captured features with ``captured_features``, else on one target forward): at T = 0 exactly the
    blocks serving it would have logged, at T > 0 an exact sample of them
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
    simulated = simulated_record(target, drafter, record, captured_features)
    return (simulated if simulated.blocks else None), True


@dataclass
class ReplayedLoss:
    """One step's objective over its records (``replay_records``)."""

    # [] the objective over the step's records (pooled, or the mean over records: ``replay_records``),
    # differentiable in the drafter's weights; data-parallel: this rank's share of the global batch's
    # value (train/distributed.py), the shares summing to it
    loss: torch.Tensor
    accepted: float  # accepted-position term (over the global batch, pooled as the loss is)
    rejected: float  # rejected-position term (over the global batch, pooled as the loss is)
    num_replayed_tokens: int  # context tokens plus drafted positions sent through the forwards
    num_blocks: int = 0  # blocks replayed (the global batch's, on every rank)
    block_tokens: int = 0  # tokens the verifier emitted for those blocks: sum of r + 1
    num_widened: int = 0  # of them, replayed K wide on the sequence's tokens (``widened_blocks``)


def choose_blocks(record: SequenceRecord, anchors_per_sequence: int, generator: torch.Generator,
                  ) -> list[BlockRecord]:
    """Up to ``anchors_per_sequence`` of the record's blocks, drawn with ``generator``, in order."""
    count = min(anchors_per_sequence, len(record.blocks))
    chosen = torch.randperm(len(record.blocks), generator=generator)[:count].sort().values
    return [record.blocks[j] for j in chosen.tolist()]


def replay_records(target, drafter, records: list[SequenceRecord], objective: Callable, *,
                   anchors_per_sequence: int, generator: torch.Generator, pooling: str = "batch",
                   device: torch.device | None = None, use_teacher: bool = True,
                   widen_share: float = 0.0) -> ReplayedLoss:
    """Up to ``anchors_per_sequence`` blocks of each record, drawn with ``generator``, replayed in one
    packed pass per record (replay.py) and scored with ``objective``.

    ``pooling`` "batch" (the paper): the objective over the union of all records' replayed positions,
    I_acc and I_rej of eq. 10-11 spanning the step (``losses.pool_losses``); "sequence": the objective
    per record, then the mean over the records (each record weighs the same however many positions
    it has). Data-parallel (train/distributed.py): ``records`` is the global batch, the same on every
    rank; each rank draws the blocks of all of them (so the generator stays in step) and replays its
    own slice. ``use_teacher``: blocks that carry the verifier's captured top-k (BlockRecord.teacher) take
    their target rows from it, and a record's captured features (SequenceRecord.hidden) replace the
    target forward where every block does (replay.py); False recomputes every block. With an objective
    that reads positions k <= r + 1 only (``objective.path_only``, set by ``objective_fn``) a block
    without its own teacher takes one from the record's rows along its tokens where they cover it
    (``teacher_rows.path_block_teacher``), and with ``widen_share`` > 0 that share of the blocks is
    replayed K wide on the sequence's tokens, with the trained weights' greedy acceptance
    (``widened_blocks``)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    chosen = [choose_blocks(record, anchors_per_sequence, generator) for record in records]
    path_only = getattr(objective, "path_only", False)
    widen = widen_share > 0 and path_only
    replayed = [widened_blocks(record, blocks, drafter.cfg.block_size, widen_share, generator) if widen
                else (blocks, []) for record, blocks in zip(records, chosen)]  # every rank draws for all
    lo, hi = dp.shard_bounds(len(records))
    outs, num_tokens = [], []
    for record, (blocks, widened) in zip(records[lo:hi], replayed[lo:hi]):
        if path_only and use_teacher:
            blocks = with_path_teachers(record, blocks)
        end = max(b.anchor for b in blocks) + 1  # later tokens are never read
        tokens = torch.tensor(record.tokens[:end], dtype=torch.int64, device=device)
        batch = replay_sequence(target, drafter, tokens, blocks, use_teacher=use_teacher,
                                hidden=record.hidden if use_teacher else None)
        if widened:
            batch = with_greedy_acceptance(batch, blocks, widened)
        outs.append(objective(batch.target_logits, batch.draft_logits, batch.num_accepted, batch.num_drafted))
        num_tokens.append(end + sum(len(b.draft_tokens) - 1 for b in blocks))
    out = (_mean_over_records(outs, num_tokens, len(records), device) if pooling == "sequence"
           else _pool_over_batch(outs, num_tokens, device))
    every = [b for blocks in chosen for b in blocks]
    return dataclasses.replace(out, num_blocks=len(every), block_tokens=sum(b.num_accepted + 1 for b in every),
                               num_widened=sum(len(widened) for _, widened in replayed))


def widened_blocks(record: SequenceRecord, blocks: list[BlockRecord], block_size: int, share: float,
                   generator: torch.Generator) -> tuple[list[BlockRecord], list[int]]:
    """(``blocks`` with each one replaced, with probability ``share`` drawn from ``generator``, by the K-wide
    block at its anchor on the sequence's own tokens, the indices replaced). For objectives reading
    positions k <= r + 1 only: their teacher is the target along the sequence, whatever the server
    drafted, so a block served at K' < K (the speculation policy's choice at that batch size) need not
    limit them to K' positions, nor a block the serving version drafted to the positions its acceptance
    reached. ``num_accepted`` of a replaced block is a placeholder (its width, so that
    ``path_block_teacher`` takes every row on the path): replay sets it from the drafter's own greedy
    drafts (``with_greedy_acceptance``), at the weights being trained. A block stops at the record's last
    token; one that would end narrower than served stays as served."""
    draws = torch.rand(len(blocks), generator=generator).tolist()
    last = len(record.tokens) - 1
    out, widened = list(blocks), []
    for i, (block, draw) in enumerate(zip(blocks, draws)):
        width = min(block_size, last - block.anchor)
        if draw < share and width >= len(block.draft_tokens):
            path = tuple(record.tokens[block.anchor + 1:block.anchor + 1 + width])
            out[i] = BlockRecord(anchor=block.anchor, draft_tokens=path, num_accepted=width,
                                 drafter_version=block.drafter_version)
            widened.append(i)
    return out, widened


def with_greedy_acceptance(batch: ReplayBatch, blocks: list[BlockRecord], rows: list[int]) -> ReplayBatch:
    """``batch`` with ``num_accepted`` of the blocks at ``rows`` (``widened_blocks``': their draft tokens
    are the sequence's) set to what T=0 verification would accept from the drafter's greedy drafts (the
    argmax of its logits, as ``propose`` drafts): the leading positions where that draft is the
    sequence's token."""
    where = torch.tensor(rows, dtype=torch.long, device=batch.num_accepted.device)
    width = batch.draft_logits.shape[1]
    path = torch.tensor([blocks[m].draft_tokens + (-1,) * (width - len(blocks[m].draft_tokens)) for m in rows],
                        dtype=torch.long, device=where.device)  # [R, W], -1 past the block: never a draft
    hits = batch.draft_logits[where].detach().argmax(-1) == path
    num_accepted = batch.num_accepted.clone()
    num_accepted[where] = hits.long().cumprod(-1).sum(-1)
    return dataclasses.replace(batch, num_accepted=num_accepted)


def with_path_teachers(record: SequenceRecord, blocks: list[BlockRecord]) -> list[BlockRecord]:
    """``blocks`` where each one without a teacher takes ``teacher_rows.path_block_teacher``'s from the record's
    rows along its tokens (when they cover it): for objectives reading positions k <= r + 1 only."""
    if all(b.teacher is not None for b in blocks) or (
            record.path_teacher is None and not any(b.teacher is not None for b in record.blocks)):
        return blocks
    rows = path_rows(record)
    out = []
    for block in blocks:
        teacher = block.teacher or path_block_teacher(block, rows)
        out.append(block if teacher is block.teacher else dataclasses.replace(block, teacher=teacher))
    return out


def _mean_over_records(outs: list[DraftOPDLoss], num_tokens: list[int], num_records: int,
                       device: torch.device | None) -> ReplayedLoss:
    """``pooling="sequence"``: the mean of the records' objectives (this rank's share of it)."""
    figures = dp.gather([(float(o.accepted.detach()), float(o.rejected.detach()), n)
                         for o, n in zip(outs, num_tokens)])
    return ReplayedLoss(loss=dp.share_of_mean([o.loss for o in outs], num_records, device),
                        accepted=sum(f[0] for f in figures) / len(figures),
                        rejected=sum(f[1] for f in figures) / len(figures),
                        num_replayed_tokens=sum(f[2] for f in figures))


def _pool_over_batch(outs: list[DraftOPDLoss], num_tokens: list[int],
                     device: torch.device | None) -> ReplayedLoss:
    """``pooling="batch"``: the objective over every replayed position of the global batch, this
    rank's share of it (the groups' weight totals and weighted sums come from every rank in one gather)."""
    totals = dp.gather([(o.accepted_weight, o.rejected_weight, float(o.accepted.detach()) * o.accepted_weight,
                         float(o.rejected.detach()) * o.rejected_weight, n) for o, n in zip(outs, num_tokens)])
    w_acc, w_rej, s_acc, s_rej, replayed = (sum(column) for column in zip(*totals)) if totals else (0, 0, 0, 0, 0)
    pooled = pool_losses(outs, (w_acc, w_rej)) if outs else None
    return ReplayedLoss(loss=torch.zeros((), device=device) if pooled is None else pooled.loss,
                        accepted=s_acc / w_acc if w_acc > 0 else 0.0, rejected=s_rej / w_rej if w_rej > 0 else 0.0,
                        num_replayed_tokens=int(replayed))


def opd_step_fn(target, drafter, records: list[SequenceRecord], cfg: TrainerConfig,
                generator: torch.Generator | None = None, device: torch.device | None = None):
    """A `train()` step function: replay `sequences_per_step` records per step, picked with
    ``generator`` (default: seeded with ``cfg.seed``; pass the same one to `train()` to resume it),
    on ``device`` (the models' device; None = the CPU). Data-parallel as `replay_records` is.
    ``objective: auto`` picks one objective for the run (``offline_objective``)."""
    objective = objective_fn(cfg, offline_objective(cfg, records, drafter.cfg.block_size))
    gen = generator if generator is not None else torch.Generator().manual_seed(cfg.seed)

    def step_fn(_step: int):
        picks = torch.randint(len(records), (cfg.sequences_per_step,), generator=gen).tolist()
        out = replay_records(target, drafter, [records[i] for i in picks], objective,
                             anchors_per_sequence=cfg.anchors_per_sequence, generator=gen,
                             pooling=cfg.loss_pooling, device=device, use_teacher=cfg.captured_teacher,
                             widen_share=cfg.widen_share)
        stats = {"accepted": out.accepted, "rejected": out.rejected,
                 "replayed_tokens": out.num_replayed_tokens, "block_tokens": out.block_tokens}
        return out.loss, stats

    return step_fn
