"""Tests for online_opd.opd.specdec: losslessness at T = 0, record fidelity, the
acceptance rules on hand-made distributions."""

import pytest
import torch

from online_opd.opd.specdec import (
    processed_probs,
    speculative_generate,
    target_generate,
    verify_greedy,
    verify_rejection,
)
from online_opd.traces.records import check_fidelity
from tests.tiny import REPLAY_PROMPT

K = 4
PROMPT = REPLAY_PROMPT


class OracleDrafter:
    """Drafts a known continuation (the target's greedy one) as one-hot logits."""

    def __init__(self, continuation, block_size=K, vocab_size=64, target_layer_ids=(0, 2)):
        self.continuation = list(continuation)
        self.block_size, self.vocab_size = block_size, vocab_size
        self.target_layer_ids = target_layer_ids

    def forward(self, aux_hidden, anchors, anchor_tokens):  # -> [M, K, vocab]
        rows = []
        for a in anchors.tolist():
            ids = (self.continuation[a + 1 : a + 1 + self.block_size] + [0] * self.block_size)[: self.block_size]
            rows.append(torch.nn.functional.one_hot(torch.tensor(ids), self.vocab_size).float() * 100)
        return torch.stack(rows)

    def propose(self, aux_hidden, anchors, anchor_tokens, token_ids=None):  # -> [M, K]
        return self.forward(aux_hidden, anchors, anchor_tokens).argmax(-1)


def _record(result, temperature=0.0):
    return result.to_record(record_id="t", model_id="tiny", drafter_version="v0", temperature=temperature)


@pytest.mark.parametrize("max_new", [1, 7, 20])
def test_greedy_spec_decode_is_lossless_with_random_drafter(target, drafter, max_new):
    expected = target_generate(target, PROMPT, max_new)
    result = speculative_generate(target, drafter, PROMPT, max_new_tokens=max_new)
    assert result.tokens == expected
    assert len(result.output_tokens) == max_new
    assert result.num_target_forwards == 1 + len(result.blocks)
    assert check_fidelity(_record(result)) == []
    if max_new > 1:
        assert result.blocks[0].anchor == len(PROMPT)  # first block follows the prefill's token


def test_oracle_drafter_accepts_every_block(target):
    max_new = 23
    continuation = target_generate(target, PROMPT, max_new + K + 1)
    result = speculative_generate(target, OracleDrafter(continuation), PROMPT, max_new_tokens=max_new)
    assert result.tokens == continuation[: len(PROMPT) + max_new]
    assert result.blocks and all(b.num_accepted == K for b in result.blocks)
    assert len(result.blocks) == -(-(max_new - 1) // (K + 1))  # K + 1 tokens per target forward
    assert check_fidelity(_record(result)) == []


def test_eos_stops_and_is_kept(target, drafter):
    reference = target_generate(target, PROMPT, 20)
    eos = reference[len(PROMPT) + 5]
    expected = target_generate(target, PROMPT, 20, eos_token_ids=[eos])
    assert expected[-1] == eos
    for d in (drafter, OracleDrafter(reference + [0] * (K + 1))):
        result = speculative_generate(target, d, PROMPT, max_new_tokens=20, eos_token_ids=[eos])
        assert result.tokens == expected
        assert check_fidelity(_record(result)) == []


def test_sampling_records_are_faithful_and_seeded(target, drafter):
    def run(seed, d):
        gen = torch.Generator().manual_seed(seed)
        return speculative_generate(
            target, d, PROMPT, max_new_tokens=25, temperature=0.8, top_p=0.95, top_k=20, generator=gen
        )

    continuation = target_generate(target, PROMPT, 40)
    for d in (drafter, OracleDrafter(continuation)):
        first = run(3, d)
        assert first.tokens == run(3, d).tokens
        assert len(first.output_tokens) == 25
        assert check_fidelity(_record(first, temperature=0.8)) == []


def test_verify_greedy_by_hand():
    logits = torch.full((4, 5), -100.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 3] = 100.0  # target argmax 2, 4, 1 | bonus 3
    assert verify_greedy(torch.tensor([2, 4, 0]), logits) == (2, 1)
    assert verify_greedy(torch.tensor([2, 4, 1]), logits) == (3, 3)
    assert verify_greedy(torch.tensor([0, 4, 1]), logits) == (0, 2)


def test_verify_rejection_by_hand():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert verify_rejection(torch.tensor([1, 2]), probs, gen) == (2, 0)  # p(d) = 1: always accepted
    probs = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    for _ in range(20):  # p(d_1) = 0: rejected, residual p with d_1 zeroed = {1: .5, 2: .5}
        r, token = verify_rejection(torch.tensor([0, 0]), probs, gen)
        assert r == 0 and token in (1, 2)
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    outcomes = [verify_rejection(torch.tensor([0]), probs, gen) for _ in range(400)]
    assert all(o in ((1, 2), (0, 1)) for o in outcomes)  # rejection samples the residual {1: 1}
    assert 150 < sum(o == (1, 2) for o in outcomes) < 250  # accepted with probability 0.5


def test_processed_probs_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert torch.allclose(processed_probs(logits, 1.0), torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    top2 = processed_probs(logits, 1.0, top_k=2)
    assert torch.allclose(top2, torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7]]))
    top_p = processed_probs(logits, 1.0, top_p=0.65)  # 0.4 + 0.3 >= 0.65: keep {2, 3}
    assert torch.allclose(top_p, torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7]]))
    assert torch.allclose(processed_probs(logits, 1.0, top_p=0.3), torch.tensor([[0.0, 0.0, 0.0, 1.0]]))


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"max_new_tokens": 3, "top_p": 0.0},
                                    {"max_new_tokens": 3, "temperature": -1.0}, {"max_new_tokens": 3, "top_k": -1}])
def test_bad_arguments_raise(target, drafter, kwargs):
    with pytest.raises(ValueError):
        speculative_generate(target, drafter, PROMPT, **kwargs)
