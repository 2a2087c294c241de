"""Simulated greedy rollouts equal real greedy speculative decoding."""

from __future__ import annotations

import torch

from online_opd.opd.rollout import acceptance_length, greedy_blocks
from online_opd.opd.specdec import speculative_generate
from online_opd.traces.records import SequenceRecord, check_fidelity
from online_opd.train.sequences import TrainSequence
from tests.tiny import tiny_drafter, tiny_target


def test_simulated_blocks_equal_reference_speculative_decoding():
    target = tiny_target(seed=4)
    drafter = tiny_drafter(target, block_size=4, seed=5)
    prompt = [3, 17, 9, 22, 41, 5]
    result = speculative_generate(target, drafter, prompt, max_new_tokens=40)
    seq = TrainSequence(torch.tensor(result.tokens), len(prompt))
    seq.aux_hidden = target.forward(seq.tokens, layer_ids=drafter.target_layer_ids).aux_hidden
    simulated = greedy_blocks(drafter, seq)
    # the reference also drafts after the last token it keeps; compare the shared prefix
    assert simulated == result.blocks[: len(simulated)]
    assert len(result.blocks) - len(simulated) <= 1
    record = SequenceRecord("r", "tiny", "v0", 0.0, 1.0, 0, tuple(result.tokens), len(prompt),
                            tuple(simulated))
    assert check_fidelity(record) == []
    assert acceptance_length([simulated]) == 1 + sum(b.num_accepted for b in simulated) / len(simulated)


def test_perfect_agreement_accepts_whole_blocks():
    target = tiny_target(seed=4)
    drafter = tiny_drafter(target, block_size=3, seed=5)
    seq = TrainSequence(torch.arange(1, 30), 5)
    seq.aux_hidden = target.forward(seq.tokens, layer_ids=drafter.target_layer_ids).aux_hidden

    class Oracle:  # proposes the true continuation: every block fully accepted
        cfg = drafter.cfg

        def propose(self, _aux, anchors, _tokens, _token_ids=None):
            return torch.stack([seq.tokens[a + 1 : a + 4] if a + 4 <= 29 else
                                torch.cat([seq.tokens[a + 1 :], torch.zeros(a + 4 - 29, dtype=torch.int64)])
                                for a in anchors.tolist()])

    blocks = greedy_blocks(Oracle(), seq)
    assert [b.anchor for b in blocks] == list(range(5, 28, 4))
    assert all(b.num_accepted == min(3, 28 - b.anchor) for b in blocks)
