"""Promotion gate on tiny real models: the simulator agrees with the reference
verifier (exactly at T = 0, in expectation at T > 0), and the paired decision
promotes a clearly better drafter, not an equal one, not on too little data."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from online_opd.config import GateConfig, TrainerConfig
from online_opd.opd.rollout import pooled_acceptance_length
from online_opd.opd.specdec import processed_probs, speculative_generate, verify_greedy, verify_rejection
from online_opd.opd.teacher_rows import top_k_teacher
from online_opd.release import gate as gate_module
from online_opd.release.gate import (
    evaluate_gate,
    gate_anchors,
    is_held_out,
    paired_lower_bound,
    simulate_record,
    split_held_out,
    walk_blocks,
)
from online_opd.traces.records import SequenceRecord, check_fidelity
from online_opd.traces.target_signal import PathTeacher, TargetHidden
from online_opd.train.loop import train
from online_opd.train.sequences import TrainSequence, compute_aux_hidden
from online_opd.train.sft import sample_anchors, sft_loss
from tests.dynamic_k import scheduled_greedy_record
from tests.tiny import VOCAB, tiny_drafter, tiny_target

K = 4
NEW_TOKENS = 28
SPLIT_PREFIX = 16


def _prompts(num: int, offset: int) -> list[list[int]]:
    return [torch.randint(1, 60, (4,), generator=torch.Generator().manual_seed(offset + i)).tolist()
            for i in range(num)]


def _record(target, drafter, prompt, name, temperature=0.0, top_p=1.0, top_k=0, seed=0):
    """The record a serving engine captures for one request."""
    gen = torch.Generator().manual_seed(seed)
    result = speculative_generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, temperature=temperature,
                                  top_p=top_p, top_k=top_k, generator=gen)
    return result.to_record(record_id=name, model_id="tiny", drafter_version="v0", temperature=temperature,
                            top_p=top_p, top_k=top_k)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=1)


@pytest.fixture(scope="module")
def serving(target):
    return tiny_drafter(target, block_size=K, seed=2)


@pytest.fixture(scope="module")
def records(target, serving):
    """Eight greedy requests served with the (random) serving drafter, as captured."""
    return [_record(target, serving, p, f"r{i}") for i, p in enumerate(_prompts(8, 0))]


@pytest.fixture(scope="module")
def trained(target, serving, records, tmp_path_factory):
    """The serving drafter after SFT on the records' sequences: clearly better on them.
    (A random-weight target has no structure to generalise to unseen prompts.)"""
    drafter = copy.deepcopy(serving)
    seqs = [TrainSequence(torch.tensor(r.tokens), r.prompt_len) for r in records]
    compute_aux_hidden(target, seqs, drafter.target_layer_ids, progress=False)
    gen = torch.Generator().manual_seed(0)
    anchors = [sample_anchors(s.prompt_len, s.num_tokens, 32, gen) for s in seqs]
    cfg = TrainerConfig(objective="sft", lr=1e-2, num_steps=60, warmup_ratio=0.0, checkpoint_every=1000)
    train(lambda step: sft_loss(drafter, seqs[step % 8], anchors[step % 8], decay=7.0), drafter, cfg,
          tmp_path_factory.mktemp("sft"), progress=False)
    return drafter.eval()


class GreedyOracle:
    """Proposes the target's own greedy continuation (K target forwards per anchor)."""

    target_layer_ids = (0, 2)

    def __init__(self, target, block_size):
        self.target = target
        self.cfg = type("Cfg", (), {"block_size": block_size})()

    def propose(self, _aux, anchors, _anchor_tokens, token_ids):
        blocks = []
        for a in anchors.tolist():
            seq = token_ids[: a + 1].tolist()
            for _ in range(self.cfg.block_size):
                seq.append(int(self.target.forward(torch.tensor(seq)).logits[-1].argmax()))
            blocks.append(seq[a + 1:])
        return torch.tensor(blocks)


def _reference_logits(target, record, anchor, draft):
    """[K+1, vocab] target logits after tokens[:a+1] + d_<k from a plain forward, as specdec verifies."""
    seq = torch.tensor(list(record.tokens[: anchor + 1]) + list(draft))
    return target.forward(seq, logits_at=torch.arange(anchor, anchor + len(draft) + 1)).logits


def test_greedy_simulation_equals_reference_verification(target, serving, trained, records):
    record = records[0]
    anchors = [b.anchor for b in record.blocks]
    expected, (trained_drafts, serving_drafts), _ = simulate_record(target, (trained, serving), record, anchors)
    # the drafter that served the request re-proposes its logged blocks and gets its logged r
    assert serving_drafts.tolist() == [list(b.draft_tokens) for b in record.blocks]
    assert expected[1].tolist() == [float(b.num_accepted) for b in record.blocks]
    # another drafter's blocks: exactly what greedy verification would accept
    reference = [verify_greedy(d, _reference_logits(target, record, a, d.tolist()))[0]
                 for a, d in zip(anchors, trained_drafts)]
    assert expected[0].tolist() == [float(r) for r in reference]
    assert sum(reference) > len(reference)  # the comparison includes multi-token accepts


def test_blocks_of_changing_length_are_scored_at_their_own_length(target, serving, trained):
    """A greedy request served with K = 4, 2, 0, 1, 3, 0, 0, 4, 1 drafted tokens per step: each drafter
    drafts min(K_m, K) tokens at a logged anchor, as vLLM does, and E[r] counts only those."""
    record = scheduled_greedy_record(target, serving, _prompts(1, 50)[0], NEW_TOKENS, (4, 2, 0, 1, 3, 0, 0, 4, 1))
    assert check_fidelity(record) == []
    lengths = [len(b.draft_tokens) for b in record.blocks]
    assert {1, 2, 3, 4} <= set(lengths) and any(b.num_plain_steps > 1 for b in record.blocks)
    anchors = [b.anchor for b in record.blocks]
    expected, (trained_drafts, serving_drafts), _ = simulate_record(target, (trained, serving), record, anchors,
                                                                 lengths)
    # the drafter that served re-proposes each logged block at its length and gets its logged r
    assert [d[:n] for d, n in zip(serving_drafts.tolist(), lengths)] == [list(b.draft_tokens) for b in record.blocks]
    assert expected[1].tolist() == [float(b.num_accepted) for b in record.blocks]
    # another drafter: exactly what greedy verification of its K_m-block accepts
    reference = [verify_greedy(d[:n], _reference_logits(target, record, a, d[:n].tolist()))[0]
                 for a, d, n in zip(anchors, trained_drafts, lengths)]
    assert expected[0].tolist() == [float(r) for r in reference]
    assert all(float(e) <= n for e, n in zip(expected[0], lengths))


def test_records_served_without_speculation_are_scored_on_the_serving_walk(target, serving, trained, records):
    """No logged anchors: both drafters are scored at the serving drafter's own greedy walk, which at
    T = 0 reproduces exactly the blocks serving it logged."""
    plain = [dataclasses.replace(r, blocks=()) for r in records]
    walks = [walk_blocks(target, serving, r, 64) for r in plain]
    for walk, served in zip(walks, records):
        assert len(walk) >= len(served.blocks) - 1 and walk == list(served.blocks[: len(walk)])
    result = evaluate_gate(target, trained, serving, plain, GateConfig())
    assert result.n_records == result.n_records_walked == 8 and result.n_blocks == sum(map(len, walks))
    assert result.tau_serving == pytest.approx(pooled_acceptance_length(walks), abs=1e-12)
    assert result.passed and result.tau_candidate > result.tau_serving + 0.5, result.reason
    same = evaluate_gate(target, copy.deepcopy(serving), serving, plain, GateConfig())
    assert same.diff_mean == 0.0 and not same.passed


def test_drafters_with_other_block_sizes_share_the_packed_forward(target, trained, records):
    short = tiny_drafter(target, block_size=2, seed=3)
    record = records[1]
    anchors = gate_anchors(record, 10)
    together, (long_drafts, short_drafts), _ = simulate_record(target, (trained, short), record, anchors)
    assert long_drafts.shape == (len(anchors), K) and short_drafts.shape == (len(anchors), 2)
    alone, _, _ = simulate_record(target, (short,), record, anchors)
    assert torch.equal(together[1], alone[0])
    assert float(together[1].max()) <= 2


def test_equal_drafters_differ_by_exactly_zero_and_do_not_pass(target, serving, records):
    result = evaluate_gate(target, copy.deepcopy(serving), serving, records, GateConfig())
    assert result.n_records == 8 and result.n_blocks == sum(len(r.blocks) for r in records)
    assert result.tau_candidate == result.tau_serving and result.diff_mean == 0.0
    assert result.record_diff_mean == 0.0 and result.record_diff_lower == 0.0
    assert not result.passed and "<= margin 0" in result.reason


def test_trained_candidate_passes_against_the_random_serving_drafter(target, serving, trained, records):
    result = evaluate_gate(target, trained, serving, records, GateConfig())
    assert result.passed, result.reason
    assert result.tau_candidate > result.tau_serving + 0.5
    assert result.record_diff_lower > 0 and result.record_diff_stderr > 0
    json.dumps(result.to_dict(), allow_nan=False)
    # the same comparison turned around fails, and a high margin stops the promotion
    assert not evaluate_gate(target, serving, trained, records, GateConfig()).passed
    assert not evaluate_gate(target, trained, serving, records, GateConfig(margin=5.0)).passed


def test_too_few_records_fail_with_the_reason(target, serving, trained, records):
    result = evaluate_gate(target, trained, serving, records[:3], GateConfig())
    assert not result.passed and result.reason == "not enough held-out prompts: 3 prompts (3 records), min_records 8"
    assert result.n_records == 3 and result.tau_candidate > result.tau_serving  # figures still reported
    empty = evaluate_gate(target, trained, serving, [], GateConfig())
    assert empty.n_blocks == 0 and not empty.passed
    assert empty.to_dict()["tau_candidate"] is None
    json.dumps(empty.to_dict(), allow_nan=False)


def test_a_repeated_prompt_is_one_sample_not_many(target, serving, trained, records, monkeypatch):
    """Records sharing a held-out key (here: the same prompt, served again; at T = 0 the same sequence)
    are averaged into one sample: repeating 3 prompts 4 times changes neither the bound nor the count
    the decision needs, where counting records would claim 12 independent samples. A repeat is not
    simulated again: 3 simulations for the 12 records."""
    three = evaluate_gate(target, trained, serving, records[:3], GateConfig(min_records=2))
    again = [dataclasses.replace(r, record_id=f"{r.record_id}-again{i}") for i in range(4) for r in records[:3]]
    simulated = []
    real_simulate = gate_module.simulate_record
    monkeypatch.setattr(gate_module, "simulate_record",
                        lambda target, drafters, rec, *a, **kw: simulated.append(rec.record_id)
                        or real_simulate(target, drafters, rec, *a, **kw))
    repeated = evaluate_gate(target, trained, serving, again, GateConfig(min_records=2))
    assert len(simulated) == 3, simulated
    assert (repeated.n_records, repeated.n_prompts, three.n_prompts) == (12, 3, 3)
    assert repeated.record_diff_mean == pytest.approx(three.record_diff_mean, abs=1e-12)
    assert repeated.record_diff_lower == pytest.approx(three.record_diff_lower, abs=1e-12)
    assert repeated.n_blocks == 4 * three.n_blocks
    too_few = evaluate_gate(target, trained, serving, again, GateConfig(min_records=4))
    assert not too_few.passed and too_few.reason.startswith("not enough held-out prompts: 3 prompts (12 records)")


def test_sampled_records_match_rejection_sampling_in_expectation(target, serving, trained):
    sampling = {"temperature": 0.3, "top_p": 0.9, "top_k": 20}
    record = _record(target, serving, [9, 4, 33, 20], "s", seed=1, **sampling)
    anchors = [b.anchor for b in record.blocks][:6]
    expected, _, _ = simulate_record(target, (trained, serving), record, anchors)
    assert bool(((expected >= 0) & (expected <= K)).all())
    # the oracle's blocks are often accepted at this temperature: a demanding comparison
    oracle = GreedyOracle(target, K)
    expected, (drafts,), _ = simulate_record(target, (oracle,), record, anchors[:2])
    gen = torch.Generator().manual_seed(0)
    for i in range(2):
        logits = _reference_logits(target, record, anchors[i], drafts[i].tolist())
        probs = processed_probs(logits, sampling["temperature"], sampling["top_p"], sampling["top_k"])
        samples = [verify_rejection(drafts[i], probs, gen)[0] for _ in range(2000)]
        mean = sum(samples) / len(samples)
        stderr = math.sqrt(sum((s - mean) ** 2 for s in samples) / len(samples) / len(samples))
        assert 0.2 < float(expected[0, i]) < K - 0.2
        assert abs(float(expected[0, i]) - mean) < 4 * stderr
    # top_k = 1 leaves only the argmax: the same as greedy verification
    greedy, _, _ = simulate_record(target, (trained,), dataclasses.replace(record, temperature=0.0), anchors)
    top1, _, _ = simulate_record(target, (trained,), dataclasses.replace(record, top_k=1), anchors)
    assert torch.equal(greedy, top1)


def test_oracle_acceptance_falls_with_temperature(target, records):
    oracle = GreedyOracle(target, K)
    record = records[2]
    anchors = gate_anchors(record, 4)
    def mean_expected(rec):
        return float(simulate_record(target, (oracle,), rec, anchors)[0].mean())

    means = [mean_expected(dataclasses.replace(record, temperature=t)) for t in (0.0, 0.5, 1.0, 2.0)]
    assert means[0] == K  # the target's own greedy block is always accepted at T = 0
    assert all(a > b for a, b in zip(means, means[1:])) and means[-1] > 0
    nucleus = dataclasses.replace(record, temperature=1.0, top_p=0.5)
    assert mean_expected(nucleus) > means[2]  # top-p drops the tail, so the argmax gains mass


def test_anchor_cap_and_truncation(target, serving, trained, records):
    record = records[0]
    logged = [b.anchor for b in record.blocks]
    five = gate_anchors(record, 5)
    assert len(five) == 5 and five[0] == logged[0] and five[-1] == logged[-1] and set(five) <= set(logged)
    assert gate_anchors(record, 100, max_tokens=16) == [a for a in logged if a < 16]
    result = evaluate_gate(target, trained, serving, records, GateConfig(), max_blocks_per_record=3)
    assert result.n_blocks == 3 * 8
    newest = [dataclasses.replace(r, captured_at=float(i)) for i, r in enumerate(records)]
    capped = evaluate_gate(target, trained, serving, newest[::-1], GateConfig(min_records=2, max_records=2))
    assert capped.n_blocks == len(records[6].blocks) + len(records[7].blocks)


def test_paired_bound_uses_student_t_quantiles():
    # lower = mean - t_{c, n-1} * stderr, with t from printed tables:
    # t_{0.9,2} = 1.8856, t_{0.95,7} = 1.8946, t_{0.99,3} = 4.5407.
    mean, stderr, lower = paired_lower_bound([1.0, 2.0, 3.0], 0.9)  # sd 1, stderr 1/sqrt(3)
    assert mean == 2.0 and abs(stderr - 1 / math.sqrt(3)) < 1e-12
    assert abs(lower - (2.0 - 1.8856 / math.sqrt(3))) < 1e-4
    eight = [1.0, 3.0] * 4  # mean 2, sd sqrt(8/7), stderr sqrt(8/7)/sqrt(8) = 1/sqrt(7)
    assert abs(paired_lower_bound(eight, 0.95)[2] - (2.0 - 1.8946 / math.sqrt(7))) < 1e-4
    four = [0.0, 0.0, 2.0, 2.0]  # mean 1, sd sqrt(4/3), stderr 1/sqrt(3)
    assert abs(paired_lower_bound(four, 0.99)[2] - (1.0 - 4.5407 / math.sqrt(3))) < 1e-4
    assert paired_lower_bound([0.5], 0.9)[2] == -math.inf
    assert paired_lower_bound([0.5, 0.5], 0.9)[2] == 0.5
    assert paired_lower_bound([], 0.9)[2] == -math.inf


def _seq_record(prompt: list[int], output: list[int], record_id: str) -> SequenceRecord:
    return SequenceRecord(record_id=record_id, model_id="tiny", drafter_version="v0", temperature=0.8,
                          top_p=1.0, top_k=0, tokens=tuple(prompt + output), prompt_len=len(prompt), blocks=())


def test_held_out_split_keeps_shared_prompts_on_one_side():
    """n > 1 siblings, repeated prompts and later turns of a conversation share content: whatever their
    record ids and outputs, they land on the side of the conversation's first prompt tokens."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50_000, (int(n),), generator=gen).tolist()
               for n in torch.randint(SPLIT_PREFIX, 3 * SPLIT_PREFIX, (400,), generator=gen)]
    sides = set()
    for i, prompt in enumerate(prompts):
        turn_1 = _seq_record(prompt, [1, 2, 3], f"a{i}")
        siblings = [_seq_record(prompt, [7 + j] * (j + 1), f"b{i}-{j}") for j in range(3)]  # n = 3
        repeat = _seq_record(prompt, [1, 2, 3], f"c{i}")
        turn_2 = _seq_record(list(turn_1.tokens) + [11, 12, 13], [4], f"d{i}")  # its prompt holds turn 1
        side = {is_held_out(r, 0.5, SPLIT_PREFIX) for r in (turn_1, *siblings, repeat, turn_2)}
        assert len(side) == 1, f"prompt {i} was split across sides"
        sides |= side
    assert sides == {True, False}
    # the key is the prompt prefix: records differing there, with one id, can land apart
    first = [_seq_record(p, [1], "same-id") for p in prompts]
    assert len({is_held_out(r, 0.5, SPLIT_PREFIX) for r in first}) == 2
    short = _seq_record(prompts[0][:5], [1, 2], "short")  # a prompt shorter than the prefix: all of it
    assert is_held_out(short, 0.5, SPLIT_PREFIX) == is_held_out(_seq_record(prompts[0][:5], [9], "x"), 0.5, 5)


def test_held_out_split_fraction_and_nesting():
    gen = torch.Generator().manual_seed(1)
    records = [_seq_record(torch.randint(0, 50_000, (12,), generator=gen).tolist(), [1], f"r{i}")
               for i in range(4000)]
    share = sum(is_held_out(r, 0.1, SPLIT_PREFIX) for r in records) / len(records)
    assert 0.09 < share < 0.11  # binomial sd 0.005
    assert all(is_held_out(r, 0.3, SPLIT_PREFIX) for r in records if is_held_out(r, 0.1, SPLIT_PREFIX))


def test_split_held_out_partitions(records):
    train_part, held = split_held_out(records, 0.5, SPLIT_PREFIX)
    assert sorted(r.record_id for r in train_part + held) == sorted(r.record_id for r in records)
    assert all(is_held_out(r, 0.5, SPLIT_PREFIX) for r in held)
    assert not any(is_held_out(r, 0.5, SPLIT_PREFIX) for r in train_part)


def _with_features(target, drafter, record, rows=None, start=0):
    """The record carrying the target's features at the drafter's layers (float32, as recomputed), or
    ``rows`` instead, for positions ``start`` .. T - 2, as capture.hidden_sample_rate stores them."""
    tokens = torch.tensor(record.tokens)
    if rows is None:
        rows = target.forward(tokens, tuple(drafter.target_layer_ids), logits_at=tokens[:0]).aux_hidden[:-1]
    return dataclasses.replace(record, hidden=TargetHidden.from_tensor(start, rows[start:]))


def test_the_gate_reads_captured_features_and_they_decide_the_drafters_context(target, serving, trained, records):
    """With the features the target computes, the gate's figures equal the recomputed ones, also with a
    prefix-cache hit (rows from position 3 on: the forward covers 0-2); with wrong rows (zeros) they
    change, so the rows are what the drafters read; captured_features=false ignores them."""
    exact = [_with_features(target, serving, r) for r in records]
    from_three = [_with_features(target, serving, r, start=3) for r in records]
    zeros = [_with_features(target, serving, r, rows=torch.zeros(len(r.tokens) - 1, 2 * target.hidden_size))
             for r in records]
    base = evaluate_gate(target, trained, serving, records, GateConfig())
    for variant in (exact, from_three):
        result = evaluate_gate(target, trained, serving, variant, GateConfig())
        assert (result.tau_candidate, result.tau_serving, result.n_blocks) == pytest.approx(
            (base.tau_candidate, base.tau_serving, base.n_blocks), abs=1e-9)
    wrong = evaluate_gate(target, trained, serving, zeros, GateConfig())
    assert wrong.tau_candidate != pytest.approx(base.tau_candidate, abs=1e-6)
    ignored = evaluate_gate(target, trained, serving, zeros, GateConfig(captured_features=False))
    assert (ignored.tau_candidate, ignored.tau_serving) == (base.tau_candidate, base.tau_serving)


def test_greedy_records_are_verified_from_their_own_tokens(target, serving, trained, records):
    """At T = 0 the gate reads r off the record's tokens (no target forward): equal to the target's
    greedy verification for every block inside the record, for the trained drafter, the serving one
    (its logged r) and the oracle; a block reaching past the last token is cut there."""
    oracle = GreedyOracle(target, K)
    inside = cut = 0
    for record in records[:4]:
        anchors = [b.anchor for b in record.blocks]
        verified, drafts, _ = simulate_record(target, (trained, serving, oracle), record, anchors)
        read, same_drafts, _ = simulate_record(target, (trained, serving, oracle), record, anchors,
                                            greedy_from_tokens=True)
        assert all(torch.equal(a, b) for a, b in zip(drafts, same_drafts))
        assert read[1].tolist() == [float(b.num_accepted) for b in record.blocks]
        for m, a in enumerate(anchors):
            room = len(record.tokens) - 1 - a  # tokens after the anchor
            if room >= K:
                inside += 1
                assert torch.equal(read[:, m], verified[:, m])
            else:
                cut += 1
                assert bool((read[:, m] <= verified[:, m]).all()) and float(read[2, m]) == room
        assert read[2].tolist() == [float(min(K, len(record.tokens) - 1 - a)) for a in anchors]
    assert inside > 20 and cut >= 1
    with_forward = evaluate_gate(target, trained, serving, [dataclasses.replace(r, temperature=1e-9) for r in records],
                                 GateConfig())  # > 0: verified by the target forward
    result = evaluate_gate(target, trained, serving, records, GateConfig())
    assert result.passed == with_forward.passed and result.n_blocks == with_forward.n_blocks


def _with_captured_rows(target, record, k):
    """``record`` as a capture with ``capture.teacher_top_k = k`` keeps it: every logged block's K_m + 1
    verifier rows, and the plain steps' rows along its tokens where no block verified them."""
    tokens = torch.tensor(record.tokens)
    blocks = []
    with torch.no_grad():
        for b in record.blocks:
            seq = torch.cat([tokens[: b.anchor + 1], torch.tensor(b.draft_tokens)])
            blocks.append(dataclasses.replace(b, teacher=top_k_teacher(target.forward(seq).logits[b.anchor:], k)))
        verified = {b.anchor + j for b in record.blocks for j in range(min(b.num_accepted, len(b.draft_tokens)) + 1)}
        plain = [p for p in range(record.prompt_len - 1, len(record.tokens) - 1) if p not in verified]
        path = PathTeacher(tuple(plain), top_k_teacher(target.forward(tokens).logits[plain], k)) if plain else None
    return dataclasses.replace(record, blocks=tuple(blocks), path_teacher=path)


@pytest.fixture(scope="module")
def sampled(target, serving):
    """Six requests served at T = 0.8 with the serving drafter, captured with the whole vocabulary's rows."""
    return [_with_captured_rows(target, _record(target, serving, p, f"t{i}", temperature=0.8, seed=i), VOCAB)
            for i, p in enumerate(_prompts(6, 40))]


def test_sampled_blocks_are_verified_on_the_captured_rows(target, serving, trained, sampled):
    """At T > 0 with every row a drafter needs captured (the serving drafter re-proposes its logged blocks;
    the rest lie on the sequence), the gate reads them instead of the packed forward: with all of the
    vocabulary kept, the same E[r] within float32 rounding. A truncated top-k moves it but keeps it in
    [0, K_m]. The oracle's blocks leave the logged ones and the path: no rows, so the forward."""
    for record in sampled:
        blocks = gate_module.gate_blocks(record, 64)
        anchors, lengths = [b.anchor for b in blocks], [b.drafted_width for b in blocks]
        forward = simulate_record(target, (serving,), record, anchors, lengths)
        read = simulate_record(target, (serving,), record, anchors, lengths, captured_teacher=True)
        assert read.from_teacher and not forward.from_teacher
        assert torch.equal(read.proposals[0], forward.proposals[0])
        torch.testing.assert_close(read.expected, forward.expected, atol=1e-5, rtol=1e-5)
        top3 = simulate_record(target, (serving,), _with_captured_rows(target, record, 3), anchors, lengths,
                               captured_teacher=True)
        assert top3.from_teacher and bool(((top3.expected >= 0) & (top3.expected <= torch.tensor(lengths))).all())
    oracle = simulate_record(target, (GreedyOracle(target, K), serving), sampled[0], anchors[:2], lengths[:2],
                             captured_teacher=True)
    assert not oracle.from_teacher


def test_one_missing_row_sends_the_whole_record_to_the_forward(target, serving, sampled):
    """Both drafters' scores on a record come from one source: drop the rows of one block whose
    proposal leaves the sequence before its last position, and every block of the record is verified
    by the forward, bit for bit what captured_teacher=false gives."""
    record = sampled[0]
    blocks = gate_module.gate_blocks(record, 64)
    anchors, lengths = [b.anchor for b in blocks], [b.drafted_width for b in blocks]
    [off_path] = [i for i, b in enumerate(record.blocks) if b.num_accepted < len(b.draft_tokens) - 1][:1]
    holed = dataclasses.replace(record, blocks=tuple(dataclasses.replace(b, teacher=None) if i == off_path else b
                                                     for i, b in enumerate(record.blocks)))
    read = simulate_record(target, (serving,), holed, anchors, lengths, captured_teacher=True)
    forward = simulate_record(target, (serving,), holed, anchors, lengths)
    assert not read.from_teacher and torch.equal(read.expected, forward.expected)


def test_the_gate_counts_records_scored_on_captured_rows(target, serving, trained, sampled):
    """evaluate_gate reports how many records it scored on captured rows; with the whole vocabulary kept
    its figures equal the forward's whatever the mix of sources. A candidate a little off the serving
    drafter keeps some records on the rows; the trained one leaves the logged blocks in every record."""
    nudged = copy.deepcopy(serving)
    with torch.no_grad():
        for param in nudged.parameters():
            param.add_(0.003 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    counts = []
    for candidate in (nudged, trained):
        read = evaluate_gate(target, candidate, serving, sampled, GateConfig(min_records=2))
        forward = evaluate_gate(target, candidate, serving, sampled, GateConfig(min_records=2, captured_teacher=False))
        assert forward.n_records_teacher == 0
        assert (read.tau_candidate, read.tau_serving, read.record_diff_lower) == pytest.approx(
            (forward.tau_candidate, forward.tau_serving, forward.record_diff_lower), abs=1e-5)
        counts.append(read.n_records_teacher)
    assert 0 < counts[0] < len(sampled) and counts[1] == 0, counts
