"""Draft-OPD as the paper defines it (docs/draft_opd_vs_paper.md): I_acc and I_rej span a step.

Eq. 10-11 average over the index sets I_acc = {(m, k): k <= r_m} and I_rej = {(m, k): k > r_m} of
every replayed block m of the step, so a step's sequences are pooled ("batch"), not averaged
sequence by sequence ("sequence", the alternative kept behind ``trainer.loss_pooling``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from online_opd.config import ConfigError, TrainerConfig, load_config
from online_opd.opd.losses import all_forward_loss, draft_opd_loss, lk_loss, pool_losses
from online_opd.opd.replay import replay_sequence
from online_opd.opd.rollout import greedy_blocks
from online_opd.traces.records import SequenceRecord
from online_opd.train.opd import choose_blocks, objective_fn, replay_records
from online_opd.train.sequences import TrainSequence, compute_aux_hidden
from tests.tiny import greedy_sequences, tiny_drafter, tiny_target

# One position, p = (0.5, 0.5), q = (0.25, 0.75):
#   F = KL(p || q) = 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75)   = 0.5 ln(4/3)            = 0.143841036226
#   R = KL(q || p) = 0.25 ln(0.25 / 0.5) + 0.75 ln(0.75 / 0.5) = 0.75 ln 1.5 - 0.25 ln 2 = 0.130812035941
F_HALF, R_HALF = 0.143841036226, 0.130812035941
HALF = torch.tensor([0.5, 0.5], dtype=torch.float64).log()
QUARTER = torch.tensor([0.25, 0.75], dtype=torch.float64).log()

# Sequence 1: one block of K = 2 drafted positions, q = QUARTER at both, r = 1:
#   I_acc = {k=1: F}, I_rej = {k=2: R, w = gamma}.
# Sequence 2: two blocks of K = 2, q = p everywhere (KL 0), r = 2 each: I_acc = 4 positions of 0.
P1, Q1, R1 = HALF.expand(1, 2, 2), QUARTER.expand(1, 2, 2).clone().requires_grad_(True), torch.tensor([1])
P2, Q2, R2 = HALF.expand(2, 2, 2), HALF.expand(2, 2, 2).clone().requires_grad_(True), torch.tensor([2, 2])


def _close(tensor: torch.Tensor, expected: float) -> None:
    assert tensor.dim() == 0
    assert tensor.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_pooled_draft_opd_is_eq_10_to_13_over_both_sequences_by_hand():
    parts = [draft_opd_loss(P1, Q1, R1, gamma=0.5), draft_opd_loss(P2, Q2, R2, gamma=0.5)]
    pooled = pool_losses(parts)
    _close(pooled.accepted, F_HALF / 5)  # eq. 10: |I_acc| = 1 + 4
    _close(pooled.rejected, R_HALF)  # eq. 11: one rejected position, its weight cancels in Z
    _close(pooled.loss, (F_HALF / 5 + R_HALF) / 2)  # eq. 13, lambda_acc = lambda_rej = 1
    assert (pooled.num_accepted_positions, pooled.num_rejected_positions) == (5, 1)
    # per sequence then averaged: ((F + R) / 2 + 0) / 2, sequence 2 having no rejected group
    _close((parts[0].loss + parts[1].loss) / 2, (F_HALF + R_HALF) / 4)


def test_pooling_equals_one_call_on_the_union_of_the_blocks_with_gradients():
    pooled = pool_losses([draft_opd_loss(P1, Q1, R1, gamma=0.8, lambda_acc=2.0),
                          draft_opd_loss(P2, Q2, R2, gamma=0.8, lambda_acc=2.0)])
    grads = torch.autograd.grad(pooled.loss, (Q1, Q2))
    q1, q2 = Q1.detach().clone().requires_grad_(True), Q2.detach().clone().requires_grad_(True)
    whole = draft_opd_loss(torch.cat([P1, P2]), torch.cat([q1, q2]), torch.cat([R1, R2]), gamma=0.8, lambda_acc=2.0)
    _close(pooled.loss, whole.loss.item())
    for got, want in zip(grads, torch.autograd.grad(whole.loss, (q1, q2))):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_single_group_objective_pools_positions_by_hand():
    parts = [all_forward_loss(P1, Q1, R1), all_forward_loss(P2, Q2, R2)]
    # KL(p || q) on 2 + 4 drafted positions: F, F, 0, 0, 0, 0; per sequence: mean(F, 0)
    _close(pool_losses(parts).loss, 2 * F_HALF / 6)
    _close((parts[0].loss + parts[1].loss) / 2, F_HALF / 2)


def test_data_parallel_shares_sum_to_the_pooled_loss():
    parts = [draft_opd_loss(P1, Q1, R1, gamma=0.5), draft_opd_loss(P2, Q2, R2, gamma=0.5)]
    totals = (sum(p.accepted_weight for p in parts), sum(p.rejected_weight for p in parts))
    assert totals == (5.0, 0.5)  # |I_acc| = 5; Z = gamma^(2-1)
    shares = [pool_losses([part], totals) for part in parts]  # one part per rank
    _close(shares[0].loss + shares[1].loss, (F_HALF / 5 + R_HALF) / 2)
    _close(shares[1].loss, 0.0)  # rank 1 holds only zero-KL accepted positions, but I_rej is not empty globally


def test_a_group_empty_everywhere_leaves_eq_13_and_stays_differentiable():
    pooled = pool_losses([draft_opd_loss(P2, Q2, R2), draft_opd_loss(P2, Q2, R2)])
    _close(pooled.loss, 0.0)
    assert pooled.num_rejected_positions == 0
    pooled.loss.backward()
    assert Q2.grad is not None
    Q2.grad = None


def test_pooling_refuses_parts_of_different_objectives_and_no_parts():
    with pytest.raises(ValueError, match="different objectives"):
        pool_losses([draft_opd_loss(P1, Q1, R1), all_forward_loss(P1, Q1, R1)])
    with pytest.raises(ValueError, match="at least one part"):
        pool_losses([])


def _tiny_records():
    target = tiny_target(seed=1)
    drafter = tiny_drafter(target, seed=2)
    seqs = [TrainSequence(tokens, plen) for tokens, plen in greedy_sequences(target, length=24)]
    compute_aux_hidden(target, seqs, drafter.target_layer_ids, progress=False)
    records = [SequenceRecord(f"r{i}", "tiny", "v0", 0.0, 1.0, 0, tuple(s.tokens.tolist()), s.prompt_len,
                              tuple(greedy_blocks(drafter, s))) for i, s in enumerate(seqs)]
    return target, drafter, records


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:  # [M, W, vocab] -> [M, width, vocab]
    return F.pad(t, (0, 0, 0, width - t.shape[1]))


def _replayed_blocks(target, drafter, records):
    """The blocks ``replay_records`` draws (5 anchors, generator seed 3), replayed record by record:
    (the per-record batches, their (target logits, draft logits, accepted, drafted) padded to K and
    concatenated)."""
    gen = torch.Generator().manual_seed(3)
    batches = [replay_sequence(target, drafter, torch.tensor(r.tokens), choose_blocks(r, 5, gen)) for r in records]
    K = drafter.cfg.block_size
    return batches, (torch.cat([_padded(b.target_logits, K) for b in batches]),
                     torch.cat([_padded(b.draft_logits, K) for b in batches]),
                     torch.cat([b.num_accepted for b in batches]), torch.cat([b.num_drafted for b in batches]))


def test_replay_records_pools_the_step_or_averages_its_sequences():
    target, drafter, records = _tiny_records()
    objective = objective_fn(TrainerConfig(objective="draft_opd", gamma=0.5))
    got = {pooling: replay_records(target, drafter, records, objective, anchors_per_sequence=5,
                                   generator=torch.Generator().manual_seed(3), pooling=pooling).loss.item()
           for pooling in ("batch", "sequence")}
    batches, (logits_p, logits_q, accepted, drafted) = _replayed_blocks(target, drafter, records)
    with torch.no_grad():
        union = draft_opd_loss(logits_p, logits_q, accepted, gamma=0.5, num_drafted=drafted)
        per_record = [draft_opd_loss(b.target_logits, b.draft_logits, b.num_accepted, gamma=0.5,
                                     num_drafted=b.num_drafted).loss for b in batches]
    assert union.num_accepted_positions > 0 and union.num_rejected_positions > 0
    assert got["batch"] == pytest.approx(union.loss.item(), rel=1e-5)
    assert got["sequence"] == pytest.approx(torch.stack(per_record).mean().item(), rel=1e-5)
    assert abs(got["batch"] - got["sequence"]) > 1e-3 * abs(got["batch"])  # the two poolings differ here
    with pytest.raises(ValueError, match="pooling must be one of"):
        replay_records(target, drafter, records, objective, anchors_per_sequence=5,
                       generator=torch.Generator(), pooling="token")


def test_loss_pooling_defaults_to_the_paper_and_is_validated():
    assert load_config().trainer.loss_pooling == "batch"
    assert load_config(overrides=["trainer.loss_pooling=sequence"]).trainer.loss_pooling == "sequence"
    with pytest.raises(ConfigError, match="loss_pooling"):
        load_config(overrides=["trainer.loss_pooling=token"])


def test_lk_objective_replays_pooled_over_the_step_and_trains_online_or_as_auto_weak():
    # trainer.objective=lk scores a step's replayed blocks like every other objective: -log alpha over
    # the union of the records' verified-trajectory positions, and gives the drafter a gradient
    target, drafter, records = _tiny_records()
    objective = objective_fn(load_config(overrides=["trainer.objective=lk"]).trainer)
    out = replay_records(target, drafter, records, objective, anchors_per_sequence=5,
                         generator=torch.Generator().manual_seed(3), pooling="batch")
    _, (logits_p, logits_q, accepted, drafted) = _replayed_blocks(target, drafter, records)
    with torch.no_grad():
        union = lk_loss(logits_p, logits_q, accepted, num_drafted=drafted)
    assert union.num_accepted_positions + union.num_rejected_positions > 0
    assert out.loss.item() == pytest.approx(union.loss.item(), rel=1e-5) and out.loss.item() > 0
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    gen = torch.Generator().manual_seed(4)
    t, d, r = torch.randn(3, 2, 5, generator=gen), torch.randn(3, 2, 5, generator=gen), torch.tensor([0, 1, 2])
    greedy = objective_fn(load_config(overrides=["trainer.objective=lk", "trainer.lk_temperature=0"]).trainer)
    assert greedy(t, d, r).loss.item() == pytest.approx(lk_loss(t, d, r, temperature=0).loss.item(), rel=1e-6)
    assert greedy(t, d, r).loss.item() != pytest.approx(lk_loss(t, d, r).loss.item(), rel=1e-3)
    assert load_config(overrides=["trainer.auto.weak=lk"]).trainer.auto.weak == "lk"
    assert load_config(overrides=["bootstrap.objective=lk"]).bootstrap.objective == "lk"
