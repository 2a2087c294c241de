"""Supervised warm-up of a block drafter on target rollouts (DFlash-style)
and on existing text with the target's greedy labels (teacher-forced).

For random anchors a in the response, the drafter drafts positions
a+1 .. a+K from context < a plus token a; the loss is cross-entropy against
the target's own tokens, weighted per block position k (1-based) by
exp(-(k-1)/decay), since early positions decide acceptance.

On text, the target's own token at a+k is labels[a+k] (its greedy choice
after text[:a+k]), which is what it would emit at block position k only if
the block so far followed it: position k is supervised iff
text[a+j] == labels[a+j] for all 1 <= j < k (k = 1 always). On a greedy
rollout labels == tokens, so this is the plain loss above.
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


def block_labels(
    tokens: torch.Tensor,  # [T] int64
    anchors: torch.Tensor,  # [M] int64
    block_size: int,
    greedy: torch.Tensor | None = None,  # [T] int64, the target's greedy token at each position
) -> torch.Tensor:
    """[M, K] labels: tokens[a+1+k] (greedy[a+1+k] when given, masked from the first block
    position whose text token left the greedy path onwards), -100 past the end or masked."""
    idx = anchors[:, None] + 1 + torch.arange(block_size)[None, :]
    labels = torch.full(idx.shape, -100, dtype=torch.int64)
    valid = idx < tokens.shape[0]
    if greedy is None:
        labels[valid] = tokens[idx[valid]]
        return labels
    safe = idx.clamp(max=tokens.shape[0] - 1)
    agrees = (tokens[safe] == greedy[safe]) & valid
    # supervised at k iff agrees at every j < k: a shifted cumulative product, column 0 always on
    on_path = torch.cat([torch.ones_like(agrees[:, :1]), agrees[:, :-1]], dim=1).int().cumprod(dim=1).bool()
    keep = valid & on_path
    labels[keep] = greedy[idx[keep]]
    return labels


def to_draft_space(labels: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target-id labels (-100 = none) as indices into the draft vocabulary `draft_ids`
    (ascending target ids); -100 for a label outside it."""
    index = torch.full((vocab_size,), -100, dtype=torch.int64, device=labels.device)
    index[draft_ids] = torch.arange(len(draft_ids), device=labels.device)
    return torch.where(labels >= 0, index[labels.clamp_min(0)], labels)


def position_weights(block_size: int, decay: float) -> torch.Tensor:
    """[K] exp(-(k-1)/decay) for k = 1..K."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


def narrow_block_widths(num_blocks: int, block_size: int, share: float, generator: torch.Generator) -> torch.Tensor:
    """[num_blocks] widths: block_size, or with probability `share` a width drawn uniformly from
    1..block_size-1 (the K' < K blocks the speculation policy serves)."""
    narrow = torch.rand(num_blocks, generator=generator) < share
    widths = torch.randint(1, max(block_size, 2), (num_blocks,), generator=generator)
    return torch.where(narrow & (block_size > 1), widths, torch.full_like(widths, block_size))


def sft_loss(
    drafter, seq: TrainSequence, anchors: torch.Tensor, *, decay: float, widths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted block cross-entropy for one sequence; returns (loss, stats). `widths` [M]: block m
    drafted from w_m mask slots (DFlash ``block_widths``), its positions beyond w_m unsupervised."""
    K = drafter.cfg.block_size
    context = seq.aux_hidden[: int(anchors.max())]
    labels = block_labels(seq.tokens, anchors, K, seq.labels)
    extra = {}
    if widths is not None:
        widths = widths.to(labels.device)  # drawn on the CPU generator; the trainer may run on a GPU
        extra["block_widths"] = widths
        labels = labels.masked_fill(torch.arange(K, device=labels.device)[None, :] >= widths[:, None], -100)
    if getattr(drafter.cfg, "draft_vocab_size", None) is None:
        logits = drafter(context, anchors, seq.tokens[anchors], seq.tokens, **extra)  # [M, K, V]
    else:  # scored over the draft vocabulary; a label outside it cannot be drafted: not supervised
        logits = drafter(context, anchors, seq.tokens[anchors], seq.tokens, draft_space=True, **extra)  # [M, K, V']
        labels = to_draft_space(labels, drafter.draft_token_ids(), drafter.cfg.vocab_size)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                         ignore_index=-100, reduction="none").view_as(labels.float())
    weights = position_weights(K, decay)[None, :] * (labels != -100)
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-8)
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & (labels != -100)
        # expected accepted length if verified greedily: leading run of hits
        run = hits.int().cumprod(dim=1).sum(dim=1).float()
        supervised = (labels != -100).float().mean(dim=0)  # [K] share of anchors supervised at k
    return loss, {"ce": float(loss.detach()), "top1_pos1": float(hits[:, 0].float().mean()),
                  "accept_len": float(run.mean()) if len(run) else math.nan,
                  **{f"supervised_pos{k + 1}": float(share) for k, share in enumerate(supervised)}}
