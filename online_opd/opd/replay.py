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
which drafts all M blocks in one packed forward of its own, on the same
prefix as the target: a chained drafter (EAGLE-3) is fed the logged drafts
d_<k at step k (teacher-forced), never its own argmax, which differs from
them whenever the drafts came from other weights or were sampled; a DFlash
block conditions every position on x_<=a only.

Blocks of different lengths. A server that changes the number of
speculative tokens per step (vLLM num_speculative_tokens_per_batch_size)
logs blocks of K_m <= K tokens. Block m then appends its K_m - 1 first drafts
(none when K_m = 1), rows k > K_m of the [M, W, vocab] outputs (W = the
longest block) are zero padding that ``ReplayBatch.num_drafted`` tells the
loss to skip, and the drafter runs once per distinct length, drafting K_m
tokens as vLLM did: a DFlash K_m-block has K_m mask slots that attend to
each other, so it is not the first K_m rows of a K-block (an EAGLE-3 chain
is causal, so it is). Each extra length costs the drafter's context pass
again (fc and the context K/V over T positions).

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
import torch.nn.functional as F

from online_opd.models.target_model import TargetModel
from online_opd.traces.records import BlockRecord


@dataclass
class ReplayBatch:
    target_logits: torch.Tensor  # [M, W, vocab] p logits, no grad; W = longest block, rows k > K_m zero
    draft_logits: torch.Tensor  # [M, W, vocab] q logits, grad through the drafter; rows k > K_m zero
    num_accepted: torch.Tensor  # [M] int64 r_m
    num_drafted: torch.Tensor  # [M] int64 K_m, block m's own length (1..drafter K)


def _block_tensors(
    blocks: Sequence[BlockRecord],
    num_tokens: int,
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the blocks; return anchors [M], drafts [M, W] (zero-padded), num_accepted [M],
    num_drafted [M]."""
    if not blocks:
        raise ValueError("replay needs at least one block")
    for i, block in enumerate(blocks):
        if not (1 <= len(block.draft_tokens) <= block_size):
            raise ValueError(
                f"blocks[{i}] has {len(block.draft_tokens)} draft tokens; the drafter drafts 1..K={block_size}"
            )
        if not (0 <= block.anchor < num_tokens):
            raise ValueError(f"blocks[{i}].anchor {block.anchor} outside [0, {num_tokens})")
        if not (0 <= block.num_accepted <= len(block.draft_tokens)):
            raise ValueError(f"blocks[{i}].num_accepted {block.num_accepted} outside 0..{len(block.draft_tokens)}")
    width = max(len(b.draft_tokens) for b in blocks)
    padded = [b.draft_tokens + (0,) * (width - len(b.draft_tokens)) for b in blocks]
    anchors = torch.tensor([b.anchor for b in blocks], dtype=torch.long, device=device)
    drafts = torch.tensor(padded, dtype=torch.long, device=device)
    num_accepted = torch.tensor([b.num_accepted for b in blocks], dtype=torch.long, device=device)
    num_drafted = torch.tensor([len(b.draft_tokens) for b in blocks], dtype=torch.long, device=device)
    return anchors, drafts, num_accepted, num_drafted


def _ragged_rows(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # counts: [M]
    """(block of each row, slot of the row inside its block), each [sum(counts)]."""
    block_of_row = torch.arange(counts.shape[0], device=counts.device).repeat_interleave(counts)
    starts = counts.cumsum(0) - counts  # [M]
    slot = torch.arange(block_of_row.shape[0], device=counts.device) - starts[block_of_row]
    return block_of_row, slot


def packed_block_mask(
    anchors: torch.Tensor,  # [M]
    num_tokens: int,
    num_appended: int | torch.Tensor,  # tokens appended per block: one count, or [M] counts
) -> torch.Tensor:
    """[N, N] bool, N = T + sum of the appended counts (see the module docstring)."""
    device, num_blocks = anchors.device, anchors.shape[0]
    counts = torch.as_tensor(num_appended, dtype=torch.long, device=device).expand(num_blocks)
    block_of_row, slot = _ragged_rows(counts)  # [A] each
    total = num_tokens + block_of_row.shape[0]
    mask = torch.zeros(total, total, dtype=torch.bool, device=device)
    mask[:num_tokens, :num_tokens] = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril_()
    rows = slice(num_tokens, total)
    mask[rows, :num_tokens] = torch.arange(num_tokens, device=device)[None, :] <= anchors[block_of_row][:, None]
    same_block = block_of_row[:, None] == block_of_row[None, :]
    mask[rows, rows] = same_block & (slot[None, :] <= slot[:, None])
    return mask


def packed_target_forward(
    target: TargetModel,
    tokens: torch.Tensor,  # [T]
    anchors: torch.Tensor,  # [M]
    drafts: torch.Tensor,  # [M, W], block m's drafts in its first K_m columns
    layer_ids: tuple[int, ...],
    num_drafted: torch.Tensor | None = None,  # [M] K_m in 1..W; None = W for every block
) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits [M, W, vocab], zero in rows k > K_m; aux hidden [T, F]) from one packed
    forward. Block m appends its K_m - 1 first drafts (the last drafted token is never fed)."""
    device, num_tokens, (num_blocks, width) = tokens.device, tokens.shape[0], drafts.shape
    if num_drafted is None:
        num_drafted = torch.full((num_blocks,), width, dtype=torch.long, device=device)
    num_appended = num_drafted - 1  # [M]
    block_of_row, slot = _ragged_rows(num_appended)
    input_ids = torch.cat([tokens, drafts[block_of_row, slot]])
    position_ids = torch.cat([torch.arange(num_tokens, device=device), anchors[block_of_row] + 1 + slot])
    k = torch.arange(width, device=device)[None, :]  # [1, W] 0-based position in the block
    first_row = num_tokens + num_appended.cumsum(0) - num_appended  # [M] block m's first appended row
    logits_at = torch.where(k == 0, anchors[:, None], first_row[:, None] + k - 1)  # [M, W] row of p_{m,k+1}
    is_drafted = k < num_drafted[:, None]  # [M, W]
    mask = packed_block_mask(anchors, num_tokens, num_appended)
    out = target.forward(input_ids, layer_ids, position_ids, mask, logits_at[is_drafted])
    logits = out.logits.new_zeros(num_blocks, width, out.logits.shape[-1])
    logits[is_drafted] = out.logits
    return logits, out.aux_hidden[:num_tokens]


def _length_kwargs(length: int, block_size: int) -> dict:
    """Drafter keyword for a block of `length` tokens: none at the drafter's own K."""
    return {} if length == block_size else {"num_draft_tokens": length}


def packed_draft_logits(
    drafter,
    aux: torch.Tensor,  # [T, F] target features at the sequence positions
    tokens: torch.Tensor,  # [T]
    anchors: torch.Tensor,  # [M]
    drafts: torch.Tensor,  # [M, W]
    num_drafted: torch.Tensor,  # [M] K_m
) -> torch.Tensor:
    """Draft logits [M, W, vocab], zero in rows k > K_m: one drafter forward per distinct block
    length, each drafting K_m tokens as the server did (a DFlash K_m-block has K_m mask slots)."""
    block_size, width = drafter.cfg.block_size, drafts.shape[1]
    parts, order = [], []
    for length in num_drafted.unique().tolist():
        idx = (num_drafted == length).nonzero().squeeze(1)
        logits = drafter(aux, anchors[idx], tokens[anchors[idx]], tokens, draft_tokens=drafts[idx, :length],
                         **_length_kwargs(length, block_size))  # [M_k, K_m, vocab]
        parts.append(F.pad(logits, (0, 0, 0, width - length)))
        order.append(idx)
    if len(parts) == 1:
        return parts[0]
    inverse = torch.empty_like(num_drafted)
    inverse[torch.cat(order)] = torch.arange(num_drafted.shape[0], device=num_drafted.device)
    return torch.cat(parts)[inverse]


def replay_sequence(
    target: TargetModel,
    drafter,
    tokens: torch.Tensor,  # [T] prompt + output ids
    blocks: Sequence[BlockRecord],
) -> ReplayBatch:
    """Replay M recorded blocks of one sequence, each 1..K tokens long: one packed target forward
    (no grad) and one packed drafter forward per distinct block length (with grad)."""
    anchors, drafts, num_accepted, num_drafted = _block_tensors(
        blocks, tokens.shape[0], drafter.cfg.block_size, tokens.device)
    target_logits, aux = packed_target_forward(target, tokens, anchors, drafts, tuple(drafter.target_layer_ids),
                                               num_drafted)
    draft_logits = packed_draft_logits(drafter, aux, tokens, anchors, drafts, num_drafted)  # [M, W, vocab]
    return ReplayBatch(target_logits, draft_logits, num_accepted, num_drafted)


def replay_sequence_naive(
    target: TargetModel,
    drafter,
    tokens: torch.Tensor,  # [T] prompt + output ids
    blocks: Sequence[BlockRecord],
) -> ReplayBatch:
    """Per-block reference: for each block a target forward on
    tokens[:a+1] + d[:K_m-1] and a drafter forward with that single anchor."""
    block_size, layer_ids = drafter.cfg.block_size, tuple(drafter.target_layer_ids)
    anchors, drafts, num_accepted, num_drafted = _block_tensors(blocks, tokens.shape[0], block_size, tokens.device)
    width = drafts.shape[1]
    target_rows, draft_rows = [], []
    for anchor, draft, length in zip(anchors.tolist(), drafts, num_drafted.tolist()):
        seq = torch.cat([tokens[: anchor + 1], draft[: length - 1]])
        logits_at = torch.arange(anchor, anchor + length, device=tokens.device)
        out = target.forward(seq, layer_ids, logits_at=logits_at)  # logits: [K_m, vocab]
        target_rows.append(F.pad(out.logits, (0, 0, 0, width - length)))
        anchor_t = torch.tensor([anchor], device=tokens.device)
        q = drafter(out.aux_hidden[: anchor + 1], anchor_t, tokens[anchor_t], tokens,
                    draft_tokens=draft[None, :length], **_length_kwargs(length, block_size))[0]
        draft_rows.append(F.pad(q, (0, 0, 0, width - length)))
    return ReplayBatch(torch.stack(target_rows), torch.stack(draft_rows), num_accepted, num_drafted)
