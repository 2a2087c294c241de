"""Greedy speculative decoding simulated from a known target rollout.

At temperature 0 speculative decoding is lossless, so the verified tokens
of a rollout are the target's greedy tokens whatever the drafter. A block
drafter's proposal at anchor a depends only on tokens[:a+1] (and the target
features of positions < a), so the blocks a drafter *would* have drafted,
and how many the greedy verifier accepts, follow from the rollout alone:
propose at every candidate anchor in one batched forward, then walk
a -> a + r + 1. This gives exact T=0 block records and acceptance length
without running the target, for offline rollouts and for the gate.

At T > 0 the same walk over a record's sampled tokens is an exact *sample*
of serving with the drafter (greedy drafts, vLLM's rejection sampler), not
just an approximation. Serving accepts d_j with probability p_j(d_j) and, on
a rejection, emits a token from the residual max(0, p_j - onehot(d_j)),
which never is d_j: so the emitted token equals d_j exactly when d_j is
accepted, and every emitted token is distributed as p_j. The recorded tokens
are draws from the target's processed distribution p (temperature, top-k,
top-p) whatever served them (speculative decoding is lossless), and
"accept d_j iff x_{a+j} == d_j" is this very coupling: P(accept) = p_j(d_j),
and given a rejection x_{a+j} follows the residual. The walk's (a, d, r) thus
have the joint law of the blocks that serving with the drafter would have
logged together with these tokens. Two conditions: the tokens were sampled
from the same target with these sampling parameters, and the drafter drafts
greedily (vLLM's default; a sampling drafter would need its q).

``simulated_record`` turns a record (no blocks, or blocks from another
drafter or K) into one carrying the drafter's walk, ready for replay.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from online_opd.opd.replay import sequence_aux
from online_opd.traces.records import BlockRecord, SequenceRecord, acceptance_length, path_rows
from online_opd.traces.target_signal import PathTeacher
from online_opd.train.sequences import TrainSequence


@torch.no_grad()
def propose_all(drafter, seq: TrainSequence, anchors: torch.Tensor, chunk: int = 256,
                num_draft_tokens: int | None = None) -> torch.Tensor:
    """Greedy blocks [len(anchors), K'] at every anchor, in chunks of `chunk` anchors; K' =
    ``num_draft_tokens`` (drafted as vLLM drafts K' < K tokens), default the drafter's K."""
    width = drafter.cfg.block_size if num_draft_tokens is None else num_draft_tokens
    kwargs = {} if width == drafter.cfg.block_size else {"num_draft_tokens": width}
    out = []
    for lo in range(0, len(anchors), chunk):
        part = anchors[lo:lo + chunk]
        context = seq.aux_hidden[: int(part.max())]
        out.append(drafter.propose(context, part, seq.tokens[part], seq.tokens, **kwargs))
    return torch.cat(out) if out else torch.zeros(0, width, dtype=torch.int64)


def greedy_blocks(drafter, seq: TrainSequence, num_draft_tokens: int | None = None) -> list[BlockRecord]:
    """The block records of greedy speculative decoding over `seq`'s output, drafting ``num_draft_tokens``
    (K' as a server drafting K' < K tokens does; default the drafter's K) per block."""
    first, last = seq.prompt_len, seq.num_tokens - 1  # anchors in [first, last)
    if last <= first:
        return []
    anchors = torch.arange(first, last, device=seq.tokens.device)
    drafts = propose_all(drafter, seq, anchors, num_draft_tokens=num_draft_tokens).tolist()
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


def is_settled(block: BlockRecord, num_tokens: int) -> bool:
    """Whether the record shows the block's whole outcome: its first rejected position, or (all K
    accepted) its last drafted one, lies inside the record's `num_tokens` tokens."""
    return block.anchor + min(block.num_accepted + 1, len(block.draft_tokens)) < num_tokens


@torch.no_grad()
def simulated_record(target, drafter, record: SequenceRecord, captured_features: bool = True) -> SequenceRecord:
    """`record` with the blocks greedy speculative decoding with `drafter` would have logged over its
    tokens (module docstring: exact at T = 0, an exact sample at T > 0), from the target's features and
    one batched drafter forward, keeping the captured rows along its tokens (``records.path_rows``: the
    plain steps' and the dropped logged blocks' on-path ones, as its ``path_teacher``). The features:
    with ``captured_features``, the record's own (``SequenceRecord.hidden``, the rows vLLM handed the
    serving drafter) where they cover it, the target
    running only over the positions before them (``replay.sequence_aux``); else one target forward. A
    block whose outcome runs past the end of the record (``is_settled``) is left out: the record cannot
    tell whether it would have been accepted."""
    device = target.embed_weight.device
    tokens = torch.tensor(record.tokens, dtype=torch.int64, device=device)
    hidden = record.hidden if captured_features else None
    # positions 0 .. T - 2: the walk's last anchor is T - 2 and reads the features before it (propose_all)
    aux, _ = sequence_aux(target, tokens[:-1], tuple(drafter.target_layer_ids), hidden)
    blocks = greedy_blocks(drafter, TrainSequence(tokens, record.prompt_len, aux))
    return dataclasses.replace(record, blocks=tuple(b for b in blocks if is_settled(b, len(record.tokens))),
                               events=(), path_teacher=PathTeacher.from_rows(path_rows(record)))


def pooled_acceptance_length(blocks_per_seq: list[list[BlockRecord]]) -> float:
    """``acceptance_length`` of all blocks of all sequences pooled; NaN when there are none."""
    blocks = [b for seq in blocks_per_seq for b in seq]
    tau = acceptance_length(sum(b.num_accepted for b in blocks), len(blocks))
    return math.nan if tau is None else tau
