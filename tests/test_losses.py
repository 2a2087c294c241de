"""Tests for online_opd.opd.losses: hand-worked KL values, gradients, validation."""

from __future__ import annotations

import math

import pytest
import torch

from online_opd.opd.losses import (
    LK_MIN_ACCEPTANCE,
    LOSSES,
    acceptance_rate,
    all_forward_loss,
    all_reverse_loss,
    draft_opd_loss,
    get_loss,
    lk_loss,
    position_masks,
    target_rollout_loss,
)

# ---------------------------------------------------------------------------
# Hand-picked (p, q) pairs on a 3-token vocabulary and their KLs, written out.
#   A: p = (0.5, 0.3, 0.2)  q = (0.2, 0.2, 0.6)
#   B: p = (0.8, 0.1, 0.1)  q = (0.4, 0.4, 0.2)
#   C: p = (0.2, 0.3, 0.5)  q = (0.5, 0.25, 0.25)
# F_X = KL(p || q) = sum p log(p/q);  R_X = KL(q || p) = sum q log(q/p)
# ---------------------------------------------------------------------------
P = {"A": (0.5, 0.3, 0.2), "B": (0.8, 0.1, 0.1), "C": (0.2, 0.3, 0.5)}
Q = {"A": (0.2, 0.2, 0.6), "B": (0.4, 0.4, 0.2), "C": (0.5, 0.25, 0.25)}

F_A = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.6)
F_B = 0.8 * math.log(0.8 / 0.4) + 0.1 * math.log(0.1 / 0.4) + 0.1 * math.log(0.1 / 0.2)
F_C = 0.2 * math.log(0.2 / 0.5) + 0.3 * math.log(0.3 / 0.25) + 0.5 * math.log(0.5 / 0.25)
R_A = 0.2 * math.log(0.2 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.6 * math.log(0.6 / 0.2)
R_B = 0.4 * math.log(0.4 / 0.8) + 0.4 * math.log(0.4 / 0.1) + 0.2 * math.log(0.2 / 0.1)
R_C = 0.5 * math.log(0.5 / 0.2) + 0.25 * math.log(0.25 / 0.3) + 0.25 * math.log(0.25 / 0.5)
# acceptance rate alpha_X = sum min(p, q); LK loss L_X = -ln alpha_X
ALPHA = {"A": 0.2 + 0.2 + 0.2, "B": 0.4 + 0.1 + 0.1, "C": 0.2 + 0.25 + 0.25}
L_A, L_B, L_C = (-math.log(ALPHA[x]) for x in "ABC")

# Two blocks, K = 3: block 0 is positions (A, B, C), block 1 is (C, A, B).
BLOCKS = (("A", "B", "C"), ("C", "A", "B"))


def _logits(table: dict, shift: float) -> torch.Tensor:
    # log-probabilities plus a constant: softmax recovers the probabilities exactly.
    probs = torch.tensor([[table[name] for name in block] for block in BLOCKS], dtype=torch.float64)
    return probs.log() + shift  # [2, 3, 3]


TARGET = _logits(P, 1.5)
DRAFT = _logits(Q, -0.7)


def _r(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _close(tensor: torch.Tensor, expected: float) -> None:
    assert tensor.dim() == 0
    assert tensor.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


# One position, p = (0.5, 0.5), q = (0.25, 0.75):
#   KL(p || q) = 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75)   = 0.5 ln(4/3)            = 0.143841036226
#   KL(q || p) = 0.25 ln(0.25 / 0.5) + 0.75 ln(0.75 / 0.5) = 0.75 ln 1.5 - 0.25 ln 2 = 0.130812035941
P_HALF = torch.tensor([[[0.5, 0.5]]], dtype=torch.float64).log()  # [1, 1, 2]
Q_QUARTER = torch.tensor([[[0.25, 0.75]]], dtype=torch.float64).log()  # [1, 1, 2]


def test_accepted_position_is_forward_kl_and_rejected_position_reverse_kl():
    _close(draft_opd_loss(P_HALF, Q_QUARTER, _r(1)).loss, 0.143841036226)
    _close(draft_opd_loss(P_HALF, Q_QUARTER, _r(0)).loss, 0.130812035941)
    _close(all_forward_loss(P_HALF, Q_QUARTER, _r(0)).loss, 0.143841036226)
    _close(all_reverse_loss(P_HALF, Q_QUARTER, _r(1)).loss, 0.130812035941)


# --- draft_opd_loss ---------------------------------------------------------


def test_all_accepted_rejected_group_is_empty():
    out = draft_opd_loss(TARGET, DRAFT, _r(3, 3), lambda_acc=3.0)
    # accepted: block 0 A, B, C + block 1 C, A, B -> uniform mean over 6
    _close(out.accepted, (F_A + F_B + F_C + F_C + F_A + F_B) / 6)
    _close(out.rejected, 0.0)
    _close(out.loss, out.accepted.item())  # empty group leaves eq. 13 entirely
    assert (out.num_accepted_positions, out.num_rejected_positions) == (6, 0)


def test_none_accepted_accepted_group_is_empty():
    out = draft_opd_loss(TARGET, DRAFT, _r(0, 0), gamma=0.5)
    # w = (1, 0.5, 0.25): block 0 A, B, C; block 1 C, A, B; Z = 2 * 1.75 = 3.5
    expected = (1 * R_A + 0.5 * R_B + 0.25 * R_C + 1 * R_C + 0.5 * R_A + 0.25 * R_B) / 3.5
    _close(out.rejected, expected)
    _close(out.accepted, 0.0)
    _close(out.loss, expected)
    assert (out.num_accepted_positions, out.num_rejected_positions) == (0, 6)


def test_partial_acceptance_gamma_weights():
    out = draft_opd_loss(TARGET, DRAFT, _r(0, 2), gamma=0.5)
    # accepted: block 1 k=1 (C), k=2 (A)
    l_acc = (F_C + F_A) / 2
    # rejected: block 0 k=1 A (w=1), k=2 B (w=0.5), k=3 C (w=0.25); block 1 k=3 B (w=0.25); Z = 2.0
    l_rej = (1 * R_A + 0.5 * R_B + 0.25 * R_C + 0.25 * R_B) / 2.0
    _close(out.accepted, l_acc)
    _close(out.rejected, l_rej)
    _close(out.loss, (l_acc + l_rej) / 2)
    assert (out.num_accepted_positions, out.num_rejected_positions) == (2, 4)


def test_default_gamma_is_0_8():
    out = draft_opd_loss(TARGET, DRAFT, _r(1, 3))
    # rejected: block 0 k=2 B (w=0.8), k=3 C (w=0.64)
    _close(out.rejected, (0.8 * R_B + 0.64 * R_C) / (0.8 + 0.64))


def test_first_rejected_only():
    out = draft_opd_loss(TARGET, DRAFT, _r(0, 2), gamma=0.5, first_rejected_only=True)
    # rejected: block 0 k=1 A (w=1); block 1 k=3 B (w=0.25)
    l_rej = (1 * R_A + 0.25 * R_B) / 1.25
    _close(out.accepted, (F_C + F_A) / 2)
    _close(out.rejected, l_rej)
    _close(out.loss, ((F_C + F_A) / 2 + l_rej) / 2)
    assert out.num_rejected_positions == 2

    out = draft_opd_loss(TARGET, DRAFT, _r(3, 1), gamma=0.5, first_rejected_only=True)
    # block 0 fully accepted: no rejected position; block 1 k=2 A (w=0.5) alone
    _close(out.rejected, R_A)
    assert out.num_rejected_positions == 1


def test_lambda_weighting():
    out = draft_opd_loss(TARGET, DRAFT, _r(0, 2), gamma=0.5, lambda_acc=3.0, lambda_rej=1.0)
    l_acc = (F_C + F_A) / 2
    l_rej = (1 * R_A + 0.5 * R_B + 0.25 * R_C + 0.25 * R_B) / 2.0
    _close(out.loss, (3.0 * l_acc + 1.0 * l_rej) / 4.0)


def test_zero_lambda_on_the_only_group_gives_graph_connected_zero():
    draft = DRAFT.clone().requires_grad_(True)
    out = draft_opd_loss(TARGET, draft, _r(3, 3), lambda_acc=0.0)
    _close(out.loss, 0.0)
    out.loss.backward()
    assert torch.equal(draft.grad, torch.zeros_like(draft))


def test_empty_batch_is_zero_and_differentiable():
    draft = torch.zeros(0, 3, 4, requires_grad=True)
    for fn in LOSSES.values():
        out = fn(torch.zeros(0, 3, 4), draft, torch.zeros(0, dtype=torch.long))
        assert out.loss.item() == 0.0 and out.accepted.item() == 0.0 and out.rejected.item() == 0.0
        out.loss.backward()


# --- ablations --------------------------------------------------------------


def test_all_forward_loss():
    out = all_forward_loss(TARGET, DRAFT, _r(0, 2))
    _close(out.loss, (F_A + F_B + F_C + F_C + F_A + F_B) / 6)
    _close(out.accepted, (F_C + F_A) / 2)  # block 1 k=1, 2
    _close(out.rejected, (F_A + F_B + F_C + F_B) / 4)  # block 0 all, block 1 k=3


def test_all_reverse_loss():
    out = all_reverse_loss(TARGET, DRAFT, _r(0, 2), gamma=0.5)
    # all positions, w = (1, 0.5, 0.25) per block, Z = 3.5
    _close(out.loss, (1 * R_A + 0.5 * R_B + 0.25 * R_C + 1 * R_C + 0.5 * R_A + 0.25 * R_B) / 3.5)
    _close(out.accepted, (1 * R_C + 0.5 * R_A) / 1.5)
    _close(out.rejected, (1 * R_A + 0.5 * R_B + 0.25 * R_C + 0.25 * R_B) / 2.0)


def test_target_rollout_loss():
    out = target_rollout_loss(TARGET, DRAFT, _r(0, 2))
    # block 0: k <= 1 -> A; block 1: k <= 3 -> C, A, B
    _close(out.loss, (F_A + F_C + F_A + F_B) / 4)
    _close(out.accepted, (F_C + F_A) / 2)
    _close(out.rejected, (F_A + F_B) / 2)  # first rejected: block 0 A, block 1 B
    assert (out.num_accepted_positions, out.num_rejected_positions) == (2, 2)

    out = target_rollout_loss(TARGET, DRAFT, _r(3, 1))
    # block 0: r == K -> k <= 3 -> A, B, C; block 1: k <= 2 -> C, A
    _close(out.loss, (F_A + F_B + F_C + F_C + F_A) / 5)


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    log_p, log_q = torch.log_softmax(TARGET, -1), torch.log_softmax(DRAFT, -1)
    alpha = acceptance_rate(log_p, log_q)
    expected = [[ALPHA[x] for x in block] for block in BLOCKS]
    assert alpha.tolist() == [pytest.approx(row, rel=1e-12) for row in expected]
    tv = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    torch.testing.assert_close(alpha, 1 - tv)  # alpha = 1 - TV(p, q)


def test_lk_loss_on_the_verified_trajectory():
    out = lk_loss(TARGET, DRAFT, _r(0, 2))
    # positions of target_rollout: block 0 k <= 1 -> A; block 1 k <= 3 -> C, A, B
    _close(out.loss, (L_A + L_C + L_A + L_B) / 4)
    _close(out.accepted, (L_C + L_A) / 2)
    _close(out.rejected, (L_A + L_B) / 2)
    assert (out.num_accepted_positions, out.num_rejected_positions) == (2, 2)
    assert out.group_lambdas is None


def test_lk_loss_gradient_by_hand_and_its_limits():
    # p = (0.5, 0.5), q = (0.25, 0.75): alpha = 0.25 + 0.5 = 0.75, only q_0 < p_0, so
    # d alpha / dz_j = q_0 (delta_0j - q_j) = (0.1875, -0.1875) and d(-ln alpha)/dz = (-0.25, 0.25)
    draft = Q_QUARTER.clone().requires_grad_(True)
    out = lk_loss(P_HALF, draft, _r(0))
    _close(out.loss, -math.log(0.75))
    out.loss.backward()
    assert draft.grad[0, 0].tolist() == pytest.approx([-0.25, 0.25], abs=1e-12)
    # a one-hot teacher: -ln alpha is the cross-entropy of its token
    onehot = torch.tensor([[[60.0, 0.0]]], dtype=torch.float64)
    _close(lk_loss(onehot, Q_QUARTER, _r(0)).loss, -math.log(0.25))
    # a reduced draft vocabulary (-inf outside): p renormalised over it, p = (0.625, 0.375), q = (0.4, 0.6)
    target = torch.tensor([[[0.5, 0.3, 0.2]]], dtype=torch.float64).log()
    draft = torch.tensor([[[0.4, 0.6, 0.0]]], dtype=torch.float64).log().requires_grad_(True)
    out = lk_loss(target, draft, _r(1))
    _close(out.loss, -math.log(0.4 + 0.375))
    out.loss.backward()
    assert torch.isfinite(draft.grad).all() and draft.grad[0, 0, 2] == 0
    # next to no common mass (alpha ~ 2e-44): the floor keeps the loss and its gradient finite
    draft = torch.tensor([[[-50.0, 50.0]]], dtype=torch.float64).requires_grad_(True)
    apart = lk_loss(torch.tensor([[[50.0, -50.0]]], dtype=torch.float64), draft, _r(0))
    assert apart.loss.item() == pytest.approx(-math.log(LK_MIN_ACCEPTANCE), rel=1e-9)
    apart.loss.backward()
    assert torch.isfinite(draft.grad).all()


def test_lk_loss_teacher_temperature():
    # T = 0: p one-hot on the target's argmax (A: token 0, q_0 = 0.2; B: token 0, 0.4; C: token 2, 0.25)
    ce = {"A": -math.log(0.2), "B": -math.log(0.4), "C": -math.log(0.25)}
    draft = DRAFT.clone().requires_grad_(True)
    out = lk_loss(TARGET, draft, _r(0, 2), temperature=0)
    _close(out.loss, (ce["A"] + ce["C"] + ce["A"] + ce["B"]) / 4)
    out.loss.backward()  # the cross-entropy's gradient q - onehot at block 0, position 1 (A)
    assert draft.grad[0, 0].tolist() == pytest.approx([(0.2 - 1) / 4, 0.2 / 4, 0.6 / 4], abs=1e-12)
    # a tie shares the teacher's mass: p = (0.5, 0.5) at T = 0 is p itself
    _close(lk_loss(P_HALF, Q_QUARTER, _r(0), temperature=0).loss, -math.log(0.75))
    # T = 2: p ~ sqrt(p) renormalised
    p2 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).sqrt()
    p2 = p2 / p2.sum()
    alpha = torch.minimum(p2, torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)).sum().item()
    _close(lk_loss(TARGET[:1, :1], DRAFT[:1, :1], _r(0), temperature=2.0).loss, -math.log(alpha))
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            lk_loss(TARGET, DRAFT, _r(0, 2), temperature=bad)


# --- general properties -----------------------------------------------------

ALL_VARIANTS = [
    ("draft_opd", lambda t, d, r: draft_opd_loss(t, d, r)),
    ("draft_opd_first", lambda t, d, r: draft_opd_loss(t, d, r, gamma=0.5, first_rejected_only=True)),
    ("all_forward", all_forward_loss),
    ("all_reverse", lambda t, d, r: all_reverse_loss(t, d, r, gamma=0.7)),
    ("target_rollout", target_rollout_loss),
    ("lk", lk_loss),
    ("lk_greedy", lambda t, d, r: lk_loss(t, d, r, temperature=0)),
]
VARIANT_FNS = [fn for _, fn in ALL_VARIANTS]
VARIANT_IDS = [name for name, _ in ALL_VARIANTS]


def _random_batch(seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(4, 3, 3, generator=gen, dtype=dtype)  # [num_blocks=4, K=3, vocab=3]
    draft = torch.randn(4, 3, 3, generator=gen, dtype=dtype)
    return target, draft, _r(0, 1, 2, 3)


@pytest.mark.parametrize("fn", [fn for name, fn in ALL_VARIANTS if name != "lk_greedy"],
                         ids=[name for name in VARIANT_IDS if name != "lk_greedy"])  # one-hot p: p = q is no minimum
def test_zero_when_p_equals_q(fn):
    target, _, r = _random_batch()
    for draft in (target.clone(), target + 5.0):  # softmax is shift-invariant
        out = fn(target, draft, r)
        for value in (out.loss, out.accepted, out.rejected):
            assert abs(value.item()) < 1e-12


@pytest.mark.parametrize("fn", VARIANT_FNS, ids=VARIANT_IDS)
def test_gradcheck_draft_logits(fn):
    target, draft, r = _random_batch(1)
    draft.requires_grad_(True)

    def f(d):
        out = fn(target, d, r)
        return out.loss, out.accepted, out.rejected

    assert torch.autograd.gradcheck(f, (draft,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", VARIANT_FNS, ids=VARIANT_IDS)
def test_target_gets_no_gradient(fn):
    target, draft, r = _random_batch(2)
    target.requires_grad_(True)
    draft.requires_grad_(True)
    out = fn(target, draft, r)
    assert torch.autograd.grad(out.loss, target, allow_unused=True)[0] is None
    out = fn(target, draft, r)
    out.loss.backward()
    assert target.grad is None
    assert draft.grad is not None and draft.grad.abs().sum() > 0


def test_half_precision_logits_are_upcast():
    target, draft, r = _random_batch(3, dtype=torch.bfloat16)
    out = draft_opd_loss(target, draft, r)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


def test_gradients_by_hand_on_one_position():
    # d KL(p || softmax(z)) / dz = q - p                        = (-0.25, 0.25)
    # d KL(softmax(z) || p) / dz_j = q_j (ln(q_j / p_j) - KL(q || p))
    #   = (0.25 (ln 0.5 - 0.130812035941), 0.75 (ln 1.5 - 0.130812035941)) = (-0.205989804125, 0.205989804125)
    for r, expected in ((1, [-0.25, 0.25]), (0, [-0.205989804125, 0.205989804125])):
        draft = Q_QUARTER.clone().requires_grad_(True)
        draft_opd_loss(P_HALF, draft, _r(r)).loss.backward()
        assert draft.grad[0, 0].tolist() == pytest.approx(expected, abs=1e-11)


def test_position_masks():
    acc, rej = position_masks(_r(0, 2, 3), 3)
    assert acc.dtype == torch.bool and acc.shape == (3, 3)
    assert acc.tolist() == [[False, False, False], [True, True, False], [True, True, True]]
    assert rej.tolist() == [[True, True, True], [False, False, True], [False, False, False]]
    _, first = position_masks(_r(0, 2, 3), 3, first_rejected_only=True)
    assert first.tolist() == [[True, False, False], [False, False, True], [False, False, False]]


def test_get_loss_computes_the_objective_its_name_says():
    # r = (0, 2), defaults gamma = 0.8: w = (1, 0.8, 0.64); block 0 is (A, B, C), block 1 is (C, A, B)
    rej = (R_A + 0.8 * R_B + 0.64 * R_C + 0.64 * R_B) / (1 + 0.8 + 0.64 + 0.64)
    expected = {
        "draft_opd": ((F_C + F_A) / 2 + rej) / 2,
        "all_forward": (F_A + F_B + F_C + F_C + F_A + F_B) / 6,
        "all_reverse": (R_A + 0.8 * R_B + 0.64 * R_C + R_C + 0.8 * R_A + 0.64 * R_B) / (2 * 2.44),
        "target_rollout": (F_A + F_C + F_A + F_B) / 4,
        "lk": (L_A + L_C + L_A + L_B) / 4,
    }
    assert sorted(LOSSES) == sorted(expected)
    for name, value in expected.items():
        _close(get_loss(name)(TARGET, DRAFT, _r(0, 2)).loss, value)
    with pytest.raises(ValueError, match="unknown loss 'sft'; valid names: all_forward, all_reverse, "
                                         "draft_opd, lk, target_rollout"):
        get_loss("sft")


def test_blocks_shorter_than_k_leave_their_padding_rows_out():
    # r = (0, 2), block 1 drafted K_1 = 2 tokens (C, A): its third row is padding, filled with junk
    # logits that would change every objective if it were read. gamma = 0.8: w = (1, 0.8, 0.64).
    junk_t, junk_d = TARGET.clone(), DRAFT.clone()
    junk_t[1, 2], junk_d[1, 2] = torch.tensor([9.0, -9.0, 0.0]), torch.tensor([-9.0, 9.0, 0.0])
    drafted = _r(3, 2)
    expected = {
        "draft_opd": ((F_C + F_A) / 2 + (R_A + 0.8 * R_B + 0.64 * R_C) / 2.44) / 2,
        "all_forward": (F_A + F_B + F_C + F_C + F_A) / 5,
        "all_reverse": (R_A + 0.8 * R_B + 0.64 * R_C + R_C + 0.8 * R_A) / (2.44 + 1.8),
        "target_rollout": (F_C + F_A + F_A) / 3,  # block 1 fully accepted: no first rejected row
        "lk": (L_C + L_A + L_A) / 3,
    }
    for name, value in expected.items():
        draft = junk_d.clone().requires_grad_(True)
        out = get_loss(name)(junk_t, draft, _r(0, 2), num_drafted=drafted)
        _close(out.loss, value)
        out.loss.backward()
        assert not draft.grad[1, 2].any() and draft.grad[1, :2].abs().sum() > 0
    acc, rej = position_masks(_r(0, 2), 3, num_drafted=drafted)
    assert acc.tolist() == [[False, False, False], [True, True, False]]
    assert rej.tolist() == [[True, True, True], [False, False, False]]


@pytest.mark.parametrize("drafted, match", [
    (_r(3, 4), r"num_drafted values must lie in 1..K=3"),
    (_r(0, 3), r"num_drafted values must lie in 1..K=3"),
    (_r(3, 1), "num_accepted exceeds num_drafted"),
    (_r(3), "num_drafted must be an integer tensor shaped like num_accepted"),
])
def test_bad_num_drafted_raises(drafted, match):
    with pytest.raises(ValueError, match=match):
        draft_opd_loss(TARGET, DRAFT, _r(0, 2), num_drafted=drafted)


# --- validation -------------------------------------------------------------

_T = torch.zeros(2, 3, 4)


@pytest.mark.parametrize(
    "target, draft, r, kwargs, match",
    [
        (_T, torch.zeros(2, 3, 5), _r(0, 1), {}, "shapes differ"),
        (_T[0], _T[0], _r(0, 1), {}, r"shape \[num_blocks, K, vocab\]"),
        (_T.long(), _T, _r(0, 1), {}, "target_logits must be a floating-point"),
        (_T, _T, _r(0, 1, 2), {}, "num_accepted has 3 entries but the logits have 2 blocks"),
        (_T, _T, _r(0, 4), {}, r"num_accepted values must lie in 0..K=3"),
        (_T, _T, _r(-1, 0), {}, r"num_accepted values must lie in 0..K=3"),
        (_T, _T, torch.tensor([0.0, 1.0]), {}, "num_accepted must be an integer tensor"),
        (_T, _T, torch.zeros(2, 1, dtype=torch.long), {}, r"num_accepted must have shape \[num_blocks\]"),
        (_T, _T, [0, 1], {}, "num_accepted must be a torch.Tensor"),
        (_T, _T, _r(0, 1), {"gamma": 0.0}, "gamma must be"),
        (_T, _T, _r(0, 1), {"lambda_acc": -1.0}, "lambda_acc and lambda_rej"),
        (_T, _T, _r(0, 1), {"lambda_acc": 0.0, "lambda_rej": 0.0}, "lambda_acc and lambda_rej"),
    ],
)
def test_bad_input_raises_value_error(target, draft, r, kwargs, match):
    with pytest.raises(ValueError, match=match):
        draft_opd_loss(target, draft, r, **kwargs)


@pytest.mark.parametrize("fn", [all_forward_loss, all_reverse_loss, target_rollout_loss])
def test_ablations_validate_too(fn):
    with pytest.raises(ValueError, match="num_accepted values"):
        fn(_T, _T, _r(0, 9))


def test_position_masks_validates():
    with pytest.raises(ValueError, match="num_accepted values"):
        position_masks(_r(0, 4), 3)
    with pytest.raises(ValueError, match="K must be >= 1"):
        position_masks(_r(0, 0), 0)
