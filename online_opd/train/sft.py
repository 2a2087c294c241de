"""Supervised warm-up of a block drafter on target rollouts (DFlash-style).

For random anchors a in the response, the drafter drafts positions
a+1 .. a+K from context < a plus token a; the loss is cross-entropy against
the target's own tokens, weighted per block position k (1-based) by
exp(-(k-1)/decay), since early positions decide acceptance.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from online_opd.train.sequences import TrainSequence


def sample_anchors(
    prompt_len: int, num_tokens: int, num_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Up to `num_anchors` distinct anchors in [max(prompt_len, 1), num_tokens - 2]."""
    low, high = max(prompt_len, 1), num_tokens - 2
    if high < low:
        return torch.zeros(0, dtype=torch.int64)
    count = min(num_anchors, high - low + 1)
    perm = torch.randperm(high - low + 1, generator=generator)[:count]
    return (perm + low).sort().values


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[M, K] labels tokens[a+1+k], -100 past the end of the sequence."""
    idx = anchors[:, None] + 1 + torch.arange(block_size)[None, :]
    labels = torch.full(idx.shape, -100, dtype=torch.int64)
    valid = idx < tokens.shape[0]
    labels[valid] = tokens[idx[valid]]
    return labels


def position_weights(block_size: int, decay: float) -> torch.Tensor:
    """[K] exp(-(k-1)/decay) for k = 1..K."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


def sft_loss(
    drafter, seq: TrainSequence, anchors: torch.Tensor, *, decay: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted block cross-entropy for one sequence; returns (loss, stats)."""
    K = drafter.cfg.block_size
    context = seq.aux_hidden[: int(anchors.max())]
    logits = drafter(context, anchors, seq.tokens[anchors], seq.tokens)  # [M, K, V]
    labels = block_labels(seq.tokens, anchors, K)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                         ignore_index=-100, reduction="none").view_as(labels.float())
    weights = position_weights(K, decay)[None, :] * (labels != -100)
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-8)
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & (labels != -100)
        # expected accepted length if verified greedily: leading run of hits
        run = hits.int().cumprod(dim=1).sum(dim=1).float()
    return loss, {"ce": float(loss.detach()), "top1_pos1": float(hits[:, 0].float().mean()),
                  "accept_len": float(run.mean()) if len(run) else math.nan}
