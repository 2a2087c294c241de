"""Tests for online_opd.opd.replay: packed replay equals the per-block reference,
target rows match the real sequence, gradients reach the drafter only."""

import dataclasses

import pytest
import torch

from online_opd.opd.losses import draft_opd_loss
from online_opd.opd.replay import packed_block_mask, replay_sequence, replay_sequence_naive
from online_opd.opd.specdec import speculative_generate, target_generate
from online_opd.traces.records import BlockRecord
from tests.tiny import REPLAY_PROMPT, tiny_eagle3_drafter

K = 4
PROMPT = REPLAY_PROMPT


@pytest.fixture(scope="module")
def hand_made(target):
    """Greedy target sequence with chained blocks of r = 2, 0, K, 1, K (the last runs past T)."""
    tokens = target_generate(target, PROMPT, 14)  # T = 20
    blocks, anchor = [], len(PROMPT)
    for r in (2, 0, K, 1, K):
        truth = (tokens[anchor + 1 : anchor + 1 + K] + [7] * K)[:K]
        draft = truth[:r] + [(t + 1) % 64 for t in truth[r:]]  # wrong from position r + 1 on
        blocks.append(BlockRecord(anchor=anchor, draft_tokens=tuple(draft), num_accepted=r))
        anchor += r + 1
    assert blocks[-1].anchor + K >= len(tokens)
    return torch.tensor(tokens), blocks


@pytest.fixture(scope="module")
def mixed(target):
    """Greedy target sequence served with K changing per step: blocks of K_m = 4, 2, 1, 3, 1, 4 tokens
    (r = 1, 2, 0, 3, 1, 2) with 0, 2, 0, 1, 3 plain (undrafted) steps between them."""
    tokens = target_generate(target, PROMPT, 24)  # T = 30
    blocks, anchor = [], len(PROMPT)
    for length, r, plain in ((4, 1, 0), (2, 2, 2), (1, 0, 0), (3, 3, 1), (1, 1, 3), (4, 2, 0)):
        truth = tokens[anchor + 1 : anchor + 1 + length]
        draft = truth[:r] + [(t + 1) % 64 for t in truth[r:]]
        blocks.append(BlockRecord(anchor=anchor, draft_tokens=tuple(draft), num_accepted=r))
        anchor += r + 1 + plain
    assert blocks[-1].anchor + 4 < len(tokens)
    return torch.tensor(tokens), blocks


def _assert_same(packed, naive):
    torch.testing.assert_close(packed.target_logits, naive.target_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed.draft_logits, naive.draft_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(packed.num_accepted, naive.num_accepted)
    assert torch.equal(packed.num_drafted, naive.num_drafted)


def test_packed_equals_naive_on_hand_made_blocks(target, drafter, hand_made):
    tokens, blocks = hand_made
    packed = replay_sequence(target, drafter, tokens, blocks)
    assert packed.target_logits.shape == packed.draft_logits.shape == (len(blocks), K, 64)
    _assert_same(packed, replay_sequence_naive(target, drafter, tokens, blocks))


class NoisyOracle:
    """Drafts the target's greedy continuation, wrong from position 2, 0, K (never), 1, 3, 2, ... on."""

    target_layer_ids = (0, 2)
    pattern = (2, 0, K, 1, 3)

    def __init__(self, continuation):
        self.continuation = list(continuation) + [0] * K
        self.num_calls = 0

    def propose(self, aux_hidden, anchors, anchor_tokens, token_ids=None):  # -> [1, K]
        a = int(anchors[0])
        draft = self.continuation[a + 1 : a + 1 + K]
        bad = self.pattern[self.num_calls % len(self.pattern)]
        self.num_calls += 1
        return torch.tensor([draft[:bad] + [(t + 1) % 64 for t in draft[bad:]]])


@pytest.mark.parametrize("source", ["dflash_sampled", "noisy_oracle_greedy"])
def test_packed_equals_naive_on_spec_decode_blocks(target, drafter, source):
    if source == "dflash_sampled":
        gen = torch.Generator().manual_seed(0)
        result = speculative_generate(target, drafter, PROMPT, max_new_tokens=30, temperature=1.0, generator=gen)
    else:
        oracle = NoisyOracle(target_generate(target, PROMPT, 40))
        result = speculative_generate(target, oracle, PROMPT, max_new_tokens=30)
        assert {0, K} <= {b.num_accepted for b in result.blocks}
        assert any(0 < b.num_accepted < K for b in result.blocks)
    tokens = torch.tensor(result.tokens)
    assert len(result.blocks) >= 3
    _assert_same(
        replay_sequence(target, drafter, tokens, result.blocks),
        replay_sequence_naive(target, drafter, tokens, result.blocks),
    )


def test_target_rows_on_the_verified_prefix_match_the_sequence(target, drafter, hand_made):
    tokens, blocks = hand_made
    full = target.forward(tokens).logits  # [T, vocab]
    packed = replay_sequence(target, drafter, tokens, blocks)
    for m, block in enumerate(blocks):
        for k in range(1, min(block.num_accepted + 1, K) + 1):  # prefix x_<=a, d_<k is verified
            pos = block.anchor + k - 1
            if pos < len(tokens):
                torch.testing.assert_close(packed.target_logits[m, k - 1], full[pos], atol=1e-4, rtol=1e-4)


def test_packed_mask_by_hand():
    mask = packed_block_mask(torch.tensor([1, 2]), num_tokens=3, num_appended=2)
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],  # sequence: causal
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],  # block 0 (anchor 1): positions <= 1, own block causally
        [1, 1, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],  # block 1 (anchor 2)
        [1, 1, 1, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_gradients_reach_the_drafter_only(target, drafter, hand_made):
    tokens, blocks = hand_made
    drafter.zero_grad(set_to_none=True)
    batch = replay_sequence(target, drafter, tokens, blocks)
    assert not batch.target_logits.requires_grad
    draft_opd_loss(batch.target_logits, batch.draft_logits, batch.num_accepted).loss.backward()
    grads = {n: p.grad for n, p in drafter.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["fc.weight"].abs().sum() > 0 and grads["layers.0.mlp.down_proj.weight"].abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in target.model.parameters())
    naive_grads = _naive_grads(target, drafter, tokens, blocks)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, naive_grads[name], atol=1e-5, rtol=1e-4)
    drafter.zero_grad(set_to_none=True)


def _naive_grads(target, drafter, tokens, blocks):
    drafter.zero_grad(set_to_none=True)
    batch = replay_sequence_naive(target, drafter, tokens, blocks)
    draft_opd_loss(batch.target_logits, batch.draft_logits, batch.num_accepted,
                   num_drafted=batch.num_drafted).loss.backward()
    return {n: p.grad.clone() for n, p in drafter.named_parameters()}


def test_mixed_block_lengths_packed_equals_naive_with_gradients(target, drafter, mixed):
    tokens, blocks = mixed
    packed = replay_sequence(target, drafter, tokens, blocks)
    assert packed.target_logits.shape == packed.draft_logits.shape == (len(blocks), K, 64)
    assert packed.num_drafted.tolist() == [4, 2, 1, 3, 1, 4]
    _assert_same(packed, replay_sequence_naive(target, drafter, tokens, blocks))
    padding = torch.arange(K)[None, :] >= packed.num_drafted[:, None]  # rows k > K_m
    assert int(padding.sum()) == 2 + 3 + 1 + 3
    assert not packed.target_logits[padding].any() and not packed.draft_logits[padding].any()
    full = target.forward(tokens).logits  # rows on the verified prefix are the sequence's own
    for m, block in enumerate(blocks):
        for k in range(1, min(block.num_accepted + 1, len(block.draft_tokens)) + 1):
            torch.testing.assert_close(packed.target_logits[m, k - 1], full[block.anchor + k - 1],
                                       atol=1e-4, rtol=1e-4)
    drafter.zero_grad(set_to_none=True)
    draft_opd_loss(packed.target_logits, packed.draft_logits, packed.num_accepted,
                   num_drafted=packed.num_drafted).loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    assert grads["fc.weight"].abs().sum() > 0
    naive_grads = _naive_grads(target, drafter, tokens, blocks)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, naive_grads[name], atol=1e-5, rtol=1e-4)
    drafter.zero_grad(set_to_none=True)


def test_a_short_dflash_block_is_drafted_with_its_own_mask_slots(target, drafter, mixed):
    """vLLM drafts K_m < K tokens from K_m mask slots that see each other: the replayed q of a 2-block is
    the 2-slot forward, not the first rows of the 4-slot one."""
    tokens, blocks = mixed
    short = blocks[1]
    assert len(short.draft_tokens) == 2
    batch = replay_sequence(target, drafter, tokens, [short])
    aux = target.forward(tokens, drafter.target_layer_ids).aux_hidden
    anchor = torch.tensor([short.anchor])
    two = drafter(aux, anchor, tokens[anchor], tokens, num_draft_tokens=2)[0]
    four = drafter(aux, anchor, tokens[anchor], tokens)[0]
    torch.testing.assert_close(batch.draft_logits[0], two, atol=1e-4, rtol=1e-4)
    assert (batch.draft_logits[0] - four[:2]).abs().max() > 1e-3


def test_mixed_block_lengths_with_an_eagle3_chain(target, mixed):
    """EAGLE-3 is teacher-forced and causal: packed equals naive, and a K_m-chain is the first K_m rows
    of a K-chain fed the same drafts."""
    tokens, blocks = mixed
    eagle = tiny_eagle3_drafter(target, block_size=K, seed=3)
    packed = replay_sequence(target, eagle, tokens, blocks)
    _assert_same(packed, replay_sequence_naive(target, eagle, tokens, blocks))
    full = replay_sequence(target, eagle, tokens, [blocks[0]])  # a 4-block
    cut = dataclasses.replace(blocks[0], draft_tokens=blocks[0].draft_tokens[:3], num_accepted=1)
    torch.testing.assert_close(replay_sequence(target, eagle, tokens, [cut]).draft_logits[0, :3],
                               full.draft_logits[0, :3], atol=1e-5, rtol=1e-4)


def test_packed_mask_with_blocks_of_different_lengths_by_hand():
    mask = packed_block_mask(torch.tensor([1, 2, 2]), num_tokens=3, num_appended=torch.tensor([2, 0, 1]))
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],  # sequence: causal
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],  # block 0 (anchor 1, two appended)
        [1, 1, 0, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],  # block 2 (anchor 2, one appended); block 1 appends nothing
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize(
    "block, match",
    [
        (BlockRecord(anchor=3, draft_tokens=(1, 2, 3, 4, 5), num_accepted=0), "draft tokens"),
        (BlockRecord(anchor=3, draft_tokens=(), num_accepted=0), "draft tokens"),
        (BlockRecord(anchor=3, draft_tokens=(1, 2), num_accepted=3), "num_accepted"),
        (BlockRecord(anchor=99, draft_tokens=(1, 2, 3, 4), num_accepted=0), "anchor"),
        (BlockRecord(anchor=3, draft_tokens=(1, 2, 3, 4), num_accepted=5), "num_accepted"),
    ],
)
def test_bad_blocks_raise(target, drafter, block, match):
    with pytest.raises(ValueError, match=match):
        replay_sequence(target, drafter, torch.tensor(PROMPT), [block])
