"""Simulated greedy rollouts equal real greedy speculative decoding."""

from __future__ import annotations

import dataclasses
import math
import statistics
from types import SimpleNamespace

import torch

from online_opd.opd.rollout import greedy_blocks, is_settled, pooled_acceptance_length, simulated_record
from online_opd.opd.specdec import speculative_generate
from online_opd.release.gate import simulate_record
from online_opd.traces.records import BlockRecord, SequenceRecord, check_fidelity
from online_opd.train.sequences import TrainSequence
from tests.tiny import tiny_drafter, tiny_target


def speculated_sequence():
    """(drafter, prompt, reference speculative decoding's result, its tokens with the target's features)."""
    target = tiny_target(seed=4)
    drafter = tiny_drafter(target, block_size=4, seed=5)
    prompt = [3, 17, 9, 22, 41, 5]
    result = speculative_generate(target, drafter, prompt, max_new_tokens=40)
    seq = TrainSequence(torch.tensor(result.tokens), len(prompt))
    seq.aux_hidden = target.forward(seq.tokens, layer_ids=drafter.target_layer_ids).aux_hidden
    return drafter, prompt, result, seq


def test_simulated_blocks_equal_reference_speculative_decoding():
    drafter, prompt, result, seq = speculated_sequence()
    simulated = greedy_blocks(drafter, seq)
    # the reference also drafts after the last token it keeps; compare the shared prefix
    assert simulated == result.blocks[: len(simulated)]
    assert len(result.blocks) - len(simulated) <= 1
    record = SequenceRecord("r", "tiny", "v0", 0.0, 1.0, 0, tuple(result.tokens), len(prompt),
                            tuple(simulated))
    assert check_fidelity(record) == []
    assert pooled_acceptance_length([simulated]) == 1 + sum(b.num_accepted for b in simulated) / len(simulated)


def test_narrower_blocks_are_drafted_as_a_server_drafting_fewer_tokens_does():
    """``num_draft_tokens`` K' < K: every block has K' tokens, the drafter's K'-wide proposal at its anchor (a
    DFlash K'-block, not the first K' of a K-block), and the walk is a valid record."""
    drafter, prompt, result, seq = speculated_sequence()
    for width in (1, 2):
        blocks = greedy_blocks(drafter, seq, num_draft_tokens=width)
        assert blocks and all(len(b.draft_tokens) == width for b in blocks)
        for b in blocks:
            a = torch.tensor([b.anchor])
            assert list(b.draft_tokens) == drafter.propose(seq.aux_hidden[: b.anchor], a, seq.tokens[a], seq.tokens,
                                                           num_draft_tokens=width)[0].tolist()
        record = SequenceRecord("r", "tiny", "v0", 0.0, 1.0, 0, tuple(result.tokens), len(prompt), tuple(blocks))
        assert check_fidelity(record) == []

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


class CachedOracle:
    """Proposes the target's greedy continuation (block_size target forwards per new context)."""

    target_layer_ids = (0, 2)

    def __init__(self, target, block_size: int):
        self.target, self.cfg, self.cache = target, SimpleNamespace(block_size=block_size), {}

    def propose(self, _aux, anchors, _anchor_tokens, token_ids):
        return torch.tensor([self._block(tuple(token_ids[: a + 1].tolist())) for a in anchors.tolist()])

    def _block(self, context: tuple[int, ...]) -> list[int]:
        if context not in self.cache:
            seq = list(context)
            for _ in range(self.cfg.block_size):
                seq.append(int(self.target.forward(torch.tensor(seq)).logits[-1].argmax()))
            self.cache[context] = seq[len(context):]
        return self.cache[context]


def test_the_walk_over_sampled_tokens_accepts_as_rejection_sampling_would():
    """T > 0: on tokens sampled from the target (here served by another drafter: it plays no part), the
    walk's r at an anchor has mean E[r] = sum_k prod_{j<=k} p_j(d_j), what vLLM's rejection sampler
    accepts of the same greedy block in expectation (the gate's analytic value, test_gate checks it
    against the sampler). So simulated blocks of a plain-served record are a sample of serving."""
    target = tiny_target(seed=4, init_range=0.5)
    oracle, other = CachedOracle(target, block_size=2), tiny_drafter(target, block_size=2, seed=5)
    prompt, gen = [3, 17, 9, 22], torch.Generator().manual_seed(0)
    walked, analytic = [], []
    for i in range(240):
        result = speculative_generate(target, other, prompt, max_new_tokens=3, temperature=0.5, generator=gen)
        record = result.to_record(record_id=f"s{i}", model_id="tiny", drafter_version="v0", temperature=0.5)
        first = simulated_record(target, oracle, record).blocks[0]
        assert first.anchor == len(prompt)
        walked.append(first.num_accepted)
        analytic.append(float(simulate_record(target, (oracle,), record, [first.anchor])[0][0, 0]))
    gaps = [w - e for w, e in zip(walked, analytic)]
    assert 0.5 < statistics.fmean(analytic) < 1.5  # neither always nor never accepted
    assert abs(statistics.fmean(gaps)) < 4 * statistics.stdev(gaps) / math.sqrt(len(gaps))
    assert len(set(walked)) == 3  # r = 0, 1 and 2 all occur


def test_simulated_record_leaves_out_blocks_whose_outcome_runs_past_the_end():
    target = tiny_target(seed=4)
    drafter = tiny_drafter(target, block_size=3, seed=5)
    seq = TrainSequence(torch.arange(1, 29), 5)  # 28 tokens: x_i = i + 1
    record = SequenceRecord("r", "tiny", "v0", 0.0, 1.0, 0, tuple(range(1, 29)), 5, ())

    class Oracle(CachedOracle):  # the true continuation: every block fully accepted
        def _block(self, context):
            return [(context[-1] + j) % 64 for j in range(1, 4)]

    blocks = simulated_record(target, Oracle(target, 3), record).blocks
    # the walk's last block, at anchor 25, accepts 2 of 3 and meets the end: its third draft is unverified
    assert [b.anchor for b in blocks] == list(range(5, 24, 4))
    assert all(b.num_accepted == 3 and is_settled(b, 28) for b in blocks)
    assert not is_settled(BlockRecord(25, (27, 28, 29), 2), 28) and is_settled(BlockRecord(25, (27, 0, 0), 1), 28)
    assert check_fidelity(dataclasses.replace(record, blocks=blocks)) == []
    assert simulated_record(target, drafter, record).blocks == tuple(
        b for b in greedy_blocks(drafter, _with_features(target, drafter, seq)) if is_settled(b, 28))


def _with_features(target, drafter, seq: TrainSequence) -> TrainSequence:
    seq.aux_hidden = target.forward(seq.tokens, layer_ids=drafter.target_layer_ids).aux_hidden
    return seq
