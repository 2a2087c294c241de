"""Greedy records served with a number of speculative tokens that changes per step (0 = a plain step),
as vLLM's capture logs them (``num_speculative_tokens_per_batch_size``). At T = 0 the output is the
target's greedy continuation whatever the drafter, so the record follows from it and the drafter alone."""

from __future__ import annotations

from typing import Sequence

import torch

from online_opd.opd.specdec import target_generate
from online_opd.traces.records import BlockRecord, SequenceRecord


def scheduled_greedy_record(target, drafter, prompt: list[int], num_new_tokens: int, schedule: Sequence[int],
                            record_id: str = "dyn") -> SequenceRecord:
    """The record of serving `prompt` greedily for `num_new_tokens` tokens with `drafter` drafting
    ``schedule[i % len]`` tokens at step i (0: a plain step, the target adds one token). The prefill is
    the first plain step; the last block keeps the verifier's r when the output is cut inside it."""
    block_size = drafter.cfg.block_size
    tokens = target_generate(target, prompt, num_new_tokens + block_size)  # the verifier sees past the end
    seq = torch.tensor(tokens)
    aux = target.forward(seq, tuple(drafter.target_layer_ids), logits_at=seq[:0]).aux_hidden
    end = len(prompt) + num_new_tokens
    blocks, anchor, num_plain, step = [], len(prompt), 1, 0
    while anchor < end - 1:
        k = schedule[step % len(schedule)]
        step += 1
        if k == 0:
            anchor, num_plain = anchor + 1, num_plain + 1
            continue
        kwargs = {} if k == block_size else {"num_draft_tokens": k}
        draft = drafter.propose(aux[:anchor], torch.tensor([anchor]), seq[[anchor]], seq, **kwargs)[0].tolist()
        truth = tokens[anchor + 1 : anchor + 1 + k]
        r = 0
        while r < len(truth) and draft[r] == truth[r]:
            r += 1
        blocks.append(BlockRecord(anchor, tuple(draft), r, num_plain_steps=num_plain))
        anchor, num_plain = anchor + r + 1, 0
    return SequenceRecord(record_id=record_id, model_id="tiny", drafter_version="v0", temperature=0.0,
                          top_p=1.0, top_k=0, tokens=tuple(tokens[:end]), prompt_len=len(prompt),
                          blocks=tuple(blocks))
