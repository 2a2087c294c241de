"""Greedy speculative decoding simulated from a known target rollout.

At temperature 0 speculative decoding is lossless, so the verified tokens
of a rollout are the target's greedy tokens whatever the drafter. A block
drafter's proposal at anchor a depends only on tokens[:a+1] (and the target
features of positions < a), so the blocks a drafter *would* have drafted,
and how many the greedy verifier accepts, follow from the rollout alone:
propose at every candidate anchor in one batched forward, then walk
a -> a + r + 1. This gives exact T=0 block records and acceptance length
without running the target, for offline rollouts and for the gate.
"""

from __future__ import annotations

import torch

from online_opd.traces.records import BlockRecord
from online_opd.train.sequences import TrainSequence


@torch.no_grad()
def propose_all(drafter, seq: TrainSequence, anchors: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Greedy blocks [len(anchors), K] at every anchor, in chunks of `chunk` anchors."""
    out = []
    for lo in range(0, len(anchors), chunk):
        part = anchors[lo:lo + chunk]
        context = seq.aux_hidden[: int(part.max())]
        out.append(drafter.propose(context, part, seq.tokens[part], seq.tokens))
    return torch.cat(out) if out else torch.zeros(0, drafter.cfg.block_size, dtype=torch.int64)


def greedy_blocks(drafter, seq: TrainSequence) -> list[BlockRecord]:
    """The block records of greedy speculative decoding over `seq`'s output."""
    first, last = seq.prompt_len, seq.num_tokens - 1  # anchors in [first, last)
    if last <= first:
        return []
    anchors = torch.arange(first, last)
    drafts = propose_all(drafter, seq, anchors).tolist()
    tokens = seq.tokens.tolist()
    blocks, a = [], first
    while a < last:
        draft = drafts[a - first]
        truth = tokens[a + 1 : a + 1 + len(draft)]
        r = 0
        while r < len(truth) and draft[r] == truth[r]:
            r += 1
        blocks.append(BlockRecord(anchor=a, draft_tokens=tuple(draft), num_accepted=r))
        a += r + 1
    return blocks


def acceptance_length(blocks_per_seq: list[list[BlockRecord]]) -> float:
    """tau = 1 + accepted / drafts, vLLM's definition, pooled over sequences."""
    blocks = [b for seq in blocks_per_seq for b in seq]
    if not blocks:
        return float("nan")
    return 1.0 + sum(b.num_accepted for b in blocks) / len(blocks)
