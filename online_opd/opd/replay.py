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

Captured teacher signal. A block whose record carries the verifier's top-k
(``BlockRecord.teacher``: vLLM computed p_{m,k} for k = 1..K_m when it verified
the block, records.py) needs no target rows recomputed: its rows are rebuilt
from the captured ones (opd/teacher_rows.py: the tail mass spread as
``teacher_tail`` says, "uniform" or "student"), and the block appends nothing
to the packed forward. When every block carries it, the
target runs one plain causal forward over the T sequence tokens, for the
drafter's aux hidden states only (no block mask, no appended tokens, no
vocabulary projection: T tokens instead of T + M (K-1)); otherwise the packed
forward carries the blocks without it, and its aux at the sequence positions
is the same (sequence tokens never see appended ones). ``use_teacher=False``
recomputes every block. The drafter side is unchanged. Blocks of a record
served without speculation take their teacher from the rows along the
sequence (``teacher_rows.path_block_teacher``).

Captured features. A record may also carry the target's aux hidden states as the
server computed them (``SequenceRecord.hidden``, positions ``start`` onward).
Passed as ``hidden`` with every block captured, that forward shrinks to the
positions before ``start`` (none when the capture saw the whole sequence): the
target runs over ``start`` tokens instead of T, and the drafter reads the
serving engine's own features (its dtype, cast to the target's). Rows of
another width (a drafter reading other layers) or with a non-finite value are
ignored: the forward runs over the whole sequence as before.

``replay_sequence_naive`` is the per-block reference (one target forward
and one drafter forward per block, never the captured teacher) used by tests
and the benchmark.
What lives elsewhere: the loss (losses.py), records (records.py), captured rows (teacher_rows.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from online_opd.models.target_model import TargetModel
from online_opd.opd.teacher_rows import reconstruct_rows
from online_opd.traces.records import BlockRecord
from online_opd.traces.target_signal import TargetHidden

TEACHER_TAILS = ("uniform", "student")  # how a captured teacher's uncaptured mass is spread (replay_sequence)


@dataclass
class ReplayBatch:
    # [M, W, vocab] p logits, no grad; W = longest block, rows k > K_m zero. float32 where some block's rows
    # came from its captured teacher (log-probabilities), else the target's dtype
    target_logits: torch.Tensor
    draft_logits: torch.Tensor  # [M, W, vocab] q logits, grad through the drafter; rows k > K_m zero
    num_accepted: torch.Tensor  # [M] int64 r_m
    num_drafted: torch.Tensor  # [M] int64 K_m, block m's own length (1..drafter K)
    num_target_tokens: int = 0  # tokens the target forward(s) ran over (0 = not counted)


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


def _captured_target(
    target: TargetModel,
    tokens: torch.Tensor,  # [T]
    blocks: Sequence[BlockRecord],
    captured: list[bool],  # [M] block m's target rows come from its teacher
    anchors: torch.Tensor,  # [M]
    drafts: torch.Tensor,  # [M, W]
    num_drafted: torch.Tensor,  # [M] K_m
    layer_ids: tuple[int, ...],
    hidden: TargetHidden | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """(target logits [M, W, vocab] float32 (or wider), zero in rows k > K_m and in the captured rows; aux
    hidden [T, F]; tokens the target ran over; the captured rows, one (where [R, 2] (block, slot), ids
    [R, k], logprobs [R, k]) per distinct k) when some blocks carry a captured teacher. The other blocks'
    rows come from a packed forward over them only, which also gives the aux; with none left, the aux come
    from ``hidden`` and a plain causal forward over the positions before it (``sequence_aux``).
    ``_fill_captured`` rebuilds the captured rows."""
    device, (num_blocks, width), num_tokens = tokens.device, drafts.shape, tokens.shape[0]
    recompute = [m for m, c in enumerate(captured) if not c]
    if recompute:
        idx = torch.tensor(recompute, dtype=torch.long, device=device)
        packed, aux = packed_target_forward(target, tokens, anchors[idx], drafts[idx], layer_ids,
                                            num_drafted[idx])
        dtype = torch.promote_types(packed.dtype, torch.float32)
        num_tokens += sum(len(blocks[m].draft_tokens) - 1 for m in recompute)
    else:
        aux, num_tokens = sequence_aux(target, tokens, layer_ids, hidden)
        dtype = torch.float32
    logits = torch.zeros(num_blocks, width, target.vocab_size, dtype=dtype, device=device)
    if recompute:
        logits[idx] = packed.to(dtype)
    by_k: dict[int, list[tuple[int, int]]] = {}  # k -> its (block, slot) rows k = 1..K_m
    for m, block in enumerate(blocks):
        if captured[m]:
            by_k.setdefault(block.teacher.top_k, []).extend((m, j) for j in range(len(block.draft_tokens)))
    groups = []
    for rows in by_k.values():
        teachers = [(blocks[m].teacher, j) for m, j in rows]
        ids = torch.tensor([t.token_ids[j] for t, j in teachers], dtype=torch.long, device=device)  # [R, k]
        lps = torch.tensor([t.logprobs[j] for t, j in teachers], dtype=torch.float32, device=device)  # [R, k]
        groups.append((torch.tensor(rows, dtype=torch.long, device=device), ids, lps))  # where: [R, 2]
    return logits, aux, num_tokens, groups


def sequence_aux(target: TargetModel, tokens: torch.Tensor, layer_ids: tuple[int, ...],
                 hidden: TargetHidden | None = None) -> tuple[torch.Tensor, int]:
    """(aux hidden [T, F] at the sequence positions, tokens the target ran over): the captured rows from
    ``hidden.start`` on where they reach position T - 1 and have the width F = layers x hidden size, a
    plain causal forward (no vocabulary projection) over the positions before them; else over all T."""
    num_tokens = tokens.shape[0]
    start = _usable_start(hidden, num_tokens, len(layer_ids) * target.hidden_size)
    if start is None:
        start, rows = num_tokens, None
    else:
        try:
            rows = hidden.to_tensor()[: num_tokens - start].to(device=tokens.device, dtype=target.dtype)
        except ValueError:  # a non-finite value: recompute
            start, rows = num_tokens, None
    parts = []
    if start > 0:  # an empty logits_at: no row goes through the vocabulary projection
        parts.append(target.forward(tokens[:start], layer_ids,
                                    logits_at=tokens.new_empty(0, dtype=torch.long)).aux_hidden)
    if rows is not None:
        parts.append(rows)
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), start


def _usable_start(hidden: TargetHidden | None, num_tokens: int, width: int) -> int | None:
    if hidden is None or hidden.width != width or hidden.start >= num_tokens or hidden.end < num_tokens:
        return None
    return hidden.start


def _fill_captured(
    logits: torch.Tensor,  # [M, W, vocab] target logits, written in place
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],  # _captured_target's captured rows
    draft_logits: torch.Tensor | None,  # [M, W, vocab] the student's tail shape; None = uniform tail
) -> None:
    for where, ids, lps in groups:
        shape = None
        if draft_logits is not None:
            shape = torch.log_softmax(draft_logits[where[:, 0], where[:, 1]].detach().float(), dim=-1)
        logits[where[:, 0], where[:, 1]] = reconstruct_rows(ids, lps, logits.shape[-1], shape).to(logits.dtype)


def replay_sequence(
    target: TargetModel,
    drafter,
    tokens: torch.Tensor,  # [T] prompt + output ids
    blocks: Sequence[BlockRecord],
    use_teacher: bool = True,
    teacher_tail: str = "uniform",
    hidden: TargetHidden | None = None,
) -> ReplayBatch:
    """Replay M recorded blocks of one sequence, each 1..K tokens long: the target's rows from the
    verifier's captured top-k where a block carries it (``use_teacher``; its tail shaped as
    ``teacher_tail`` says, "uniform" or "student": module docstring), from one packed target forward (no
    grad) for the rest, and one packed drafter forward per distinct block length (with grad). With every
    block captured, the drafter's aux come from the record's captured features where ``hidden`` has
    them (module docstring)."""
    if teacher_tail not in TEACHER_TAILS:
        raise ValueError(f"teacher_tail must be one of {TEACHER_TAILS}, got {teacher_tail!r}")
    anchors, drafts, num_accepted, num_drafted = _block_tensors(
        blocks, tokens.shape[0], drafter.cfg.block_size, tokens.device)
    layer_ids = tuple(drafter.target_layer_ids)
    captured = [use_teacher and b.teacher is not None for b in blocks]
    groups: list = []
    if any(captured):
        target_logits, aux, num_target_tokens, groups = _captured_target(
            target, tokens, blocks, captured, anchors, drafts, num_drafted, layer_ids, hidden)
    else:
        target_logits, aux = packed_target_forward(target, tokens, anchors, drafts, layer_ids, num_drafted)
        num_target_tokens = tokens.shape[0] + sum(len(b.draft_tokens) - 1 for b in blocks)
    draft_logits = packed_draft_logits(drafter, aux, tokens, anchors, drafts, num_drafted)  # [M, W, vocab]
    if groups:
        _fill_captured(target_logits, groups, draft_logits if teacher_tail == "student" else None)
    return ReplayBatch(target_logits, draft_logits, num_accepted, num_drafted, num_target_tokens)


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
    num_target_tokens = sum(b.anchor + len(b.draft_tokens) for b in blocks)  # a + 1 + K_m - 1 per block
    return ReplayBatch(torch.stack(target_rows), torch.stack(draft_rows), num_accepted, num_drafted,
                       num_target_tokens)
