"""Packed replay: target and drafter distributions on recorded draft blocks.

Draft-OPD trains on p_{m,k} = p(. | x_<=a_m, d_m,<k) and q_{m,k} for every
drafted position k = 1..K of every block m, including positions after the
first rejection (whose prefix holds rejected draft tokens the sequence never
contained). ``replay_sequence`` gets all of them from ONE target forward per
sequence by packing the blocks after the sequence:

    input    = x_0 .. x_{T-1} | d_1[0..K-2] | d_2[0..K-2] | ...
    position = 0 .. T-1       | a_1+1 .. a_1+K-1 | a_2+1 .. a_2+K-1 | ...

with a boolean mask: sequence tokens are causal among themselves; block m's
tokens see sequence positions <= a_m and, causally, their own block; no
token sees another block. Then p_{m,1} is the row of sequence position a_m
and p_{m,k} (k >= 2) the row of block m's appended token k-1; the K-th
drafted token is never fed (its continuation is not needed). The same
forward's aux hidden states at the sequence positions feed the drafter,
which drafts all M blocks in one packed forward of its own.

Memory (N = T + M (K-1) packed tokens, no grad on the target): the target
holds one layer's activations O(N hidden) at a time, the N x N bool mask,
and O(heads N^2) attention scores where the attention kernel materialises
them; only the M K rows that are needed are projected to the vocabulary
(M K vocab floats). The drafter keeps its activations for backward:
M (K+1) query slots against T + M (K+1) keys per layer, plus M K vocab
draft logits, which dominate for large vocabularies (chunk the blocks of a
long sequence across calls if that is too much).

``replay_sequence_naive`` is the per-block reference (one target forward
and one drafter forward per block) used by tests and the benchmark.
What lives elsewhere: the loss (losses.py), records (records.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from online_opd.models.target_model import TargetModel
from online_opd.traces.records import BlockRecord


@dataclass
class ReplayBatch:
    target_logits: torch.Tensor  # [M, K, vocab] p logits, no grad
    draft_logits: torch.Tensor  # [M, K, vocab] q logits, grad through the drafter
    num_accepted: torch.Tensor  # [M] int64 r_m


def _block_tensors(
    blocks: Sequence[BlockRecord],
    num_tokens: int,
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the blocks; return anchors [M], drafts [M, K], num_accepted [M]."""
    if not blocks:
        raise ValueError("replay needs at least one block")
    for i, block in enumerate(blocks):
        if len(block.draft_tokens) != block_size:
            raise ValueError(
                f"blocks[{i}] has {len(block.draft_tokens)} draft tokens; the drafter drafts K={block_size}"
            )
        if not (0 <= block.anchor < num_tokens):
            raise ValueError(f"blocks[{i}].anchor {block.anchor} outside [0, {num_tokens})")
        if not (0 <= block.num_accepted <= block_size):
            raise ValueError(f"blocks[{i}].num_accepted {block.num_accepted} outside 0..{block_size}")
    anchors = torch.tensor([b.anchor for b in blocks], dtype=torch.long, device=device)
    drafts = torch.tensor([b.draft_tokens for b in blocks], dtype=torch.long, device=device)
    num_accepted = torch.tensor([b.num_accepted for b in blocks], dtype=torch.long, device=device)
    return anchors, drafts, num_accepted


def packed_block_mask(
    anchors: torch.Tensor,  # [M]
    num_tokens: int,
    num_appended: int,
) -> torch.Tensor:
    """[N, N] bool, N = T + M * num_appended (see the module docstring)."""
    device, num_blocks = anchors.device, anchors.shape[0]
    total = num_tokens + num_blocks * num_appended
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    mask[:num_tokens, :num_tokens] = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril_()
    block_of_row = torch.arange(num_blocks, device=device).repeat_interleave(num_appended)  # [M * (K-1)]
    slot = torch.arange(num_appended, device=device).repeat(num_blocks)  # [M * (K-1)]
    rows = slice(num_tokens, total)
    mask[rows, :num_tokens] = torch.arange(num_tokens, device=device)[None, :] <= anchors[block_of_row][:, None]
    same_block = block_of_row[:, None] == block_of_row[None, :]
    mask[rows, rows] = same_block & (slot[None, :] <= slot[:, None])
    return mask


def packed_target_forward(
    target: TargetModel,
    tokens: torch.Tensor,  # [T]
    anchors: torch.Tensor,  # [M]
    drafts: torch.Tensor,  # [M, K]
    layer_ids: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits [M, K, vocab], aux hidden [T, F]) from one packed forward."""
    num_tokens, (num_blocks, block_size) = tokens.shape[0], drafts.shape
    num_appended = block_size - 1
    offsets = torch.arange(1, block_size, device=tokens.device)  # [K-1]
    input_ids = torch.cat([tokens, drafts[:, :num_appended].reshape(-1)])
    position_ids = torch.cat(
        [torch.arange(num_tokens, device=tokens.device), (anchors[:, None] + offsets).reshape(-1)]
    )
    appended_rows = num_tokens + torch.arange(num_blocks * num_appended, device=tokens.device)
    logits_at = torch.cat([anchors[:, None], appended_rows.view(num_blocks, num_appended)], dim=1)  # [M, K]
    mask = packed_block_mask(anchors, num_tokens, num_appended)
    out = target.forward(input_ids, layer_ids, position_ids, mask, logits_at.reshape(-1))
    return out.logits.view(num_blocks, block_size, -1), out.aux_hidden[:num_tokens]


def replay_sequence(
    target: TargetModel,
    drafter,
    tokens: torch.Tensor,  # [T] prompt + output ids
    blocks: Sequence[BlockRecord],
) -> ReplayBatch:
    """Replay M recorded blocks of one sequence: one packed target forward
    (no grad) and one packed drafter forward (with grad)."""
    block_size = drafter.cfg.block_size
    anchors, drafts, num_accepted = _block_tensors(blocks, tokens.shape[0], block_size, tokens.device)
    target_logits, aux = packed_target_forward(target, tokens, anchors, drafts, tuple(drafter.target_layer_ids))
    draft_logits = drafter(aux, anchors, tokens[anchors], tokens)  # [M, K, vocab]
    return ReplayBatch(target_logits, draft_logits, num_accepted)


def replay_sequence_naive(
    target: TargetModel,
    drafter,
    tokens: torch.Tensor,  # [T] prompt + output ids
    blocks: Sequence[BlockRecord],
) -> ReplayBatch:
    """Per-block reference: for each block a target forward on
    tokens[:a+1] + d[:K-1] and a drafter forward with that single anchor."""
    block_size, layer_ids = drafter.cfg.block_size, tuple(drafter.target_layer_ids)
    anchors, drafts, num_accepted = _block_tensors(blocks, tokens.shape[0], block_size, tokens.device)
    target_rows, draft_rows = [], []
    for anchor, draft in zip(anchors.tolist(), drafts):
        seq = torch.cat([tokens[: anchor + 1], draft[: block_size - 1]])
        logits_at = torch.arange(anchor, anchor + block_size, device=tokens.device)
        out = target.forward(seq, layer_ids, logits_at=logits_at)  # logits: [K, vocab]
        target_rows.append(out.logits)
        anchor_t = torch.tensor([anchor], device=tokens.device)
        draft_rows.append(drafter(out.aux_hidden[: anchor + 1], anchor_t, tokens[anchor_t], tokens)[0])
    return ReplayBatch(torch.stack(target_rows), torch.stack(draft_rows), num_accepted)
