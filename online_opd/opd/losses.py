"""Draft-OPD distillation objectives (paper eq. 8-13) and the ablation baselines.

Pure tensor functions over a batch of ``num_blocks`` replayed draft blocks of
``K`` positions: target and draft next-token logits on the same draft prefix
(eq. 6-7), and per block how many positions the verifier accepted. k = 1..K is
the 1-based position, r = num_accepted, p = softmax(target_logits) (teacher,
never differentiated), q = softmax(draft_logits) (student).

Blocks may be shorter than K (the server drafted K_m < K tokens at that step):
``num_drafted`` [num_blocks] gives K_m, the rows k > K_m are padding that no
objective reads, and r_m <= K_m. Without it every block is K long.

    I_acc = {(m, k): k <= r_m}                                   (eq. 8)
    I_rej = {(m, k): r_m < k <= K_m}                             (eq. 9)
    L_acc = mean_{I_acc} KL(p || q)                              (eq. 10)
    L_rej = sum_{I_rej} w_k KL(q || p) / sum_{I_rej} w_k         (eq. 11)
    w_k   = gamma^(k-1)                                          (eq. 12)
    L     = (l_acc L_acc + l_rej L_rej) / (l_acc + l_rej)        (eq. 13)

Beside them ``lk_loss``: -log of the acceptance rate sum_v min(p, q) (LK losses, arXiv 2602.23881)
on the verified trajectory, the positions of ``target_rollout_loss``.

Every objective returns a ``DraftOPDLoss``: ``.loss`` is what to backpropagate,
``.accepted`` / ``.rejected`` are that objective restricted to the accepted /
rejected group (each normalised within its group) for logging. A group with no
positions in the batch reports a graph-connected 0 and is left out of ``.loss``.
Logits are assumed finite; half-precision logits are upcast to float32.

``pool_losses`` combines the results of several calls (one per replayed sequence)
into the objective over their union, so I_acc and I_rej span a whole training
step as in eq. 10-11, also when the step is split across data-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class DraftOPDLoss:
    """Result of a distillation objective on one batch of draft blocks."""

    loss: torch.Tensor  # [] objective to minimise
    accepted: torch.Tensor  # [] objective over accepted positions (L_acc)
    rejected: torch.Tensor  # [] objective over rejected positions (L_rej)
    num_accepted_positions: int  # |I_acc| in the batch
    num_rejected_positions: int  # |I_rej| in the batch (as used by the objective)
    accepted_weight: float = 0.0  # denominator of .accepted: |I_acc|, or sum_{I_acc} w_k where weighted
    rejected_weight: float = 0.0  # denominator of .rejected: Z of eq. 11, or |I_rej| where unweighted
    # (lambda_acc, lambda_rej) of eq. 13; None: .loss is one weighted mean over both groups
    group_lambdas: tuple[float, float] | None = None


def _check_num_accepted(num_accepted: torch.Tensor, K: int) -> None:  # num_accepted: [num_blocks]
    if not isinstance(num_accepted, torch.Tensor):
        raise ValueError(f"num_accepted must be a torch.Tensor, got {type(num_accepted).__name__}")
    if num_accepted.is_floating_point() or num_accepted.is_complex() or num_accepted.dtype == torch.bool:
        raise ValueError(f"num_accepted must be an integer tensor, got dtype {num_accepted.dtype}")
    if num_accepted.dim() != 1:
        raise ValueError(f"num_accepted must have shape [num_blocks], got {tuple(num_accepted.shape)}")
    if K < 1:
        raise ValueError(f"block length K must be >= 1, got {K}")
    if num_accepted.numel() > 0:
        lo, hi = torch.stack([num_accepted.min(), num_accepted.max()]).tolist()
        if lo < 0 or hi > K:
            raise ValueError(f"num_accepted values must lie in 0..K={K}, got min {lo} and max {hi}")


def _check_num_drafted(
    num_drafted: torch.Tensor,  # [num_blocks] int, values in 1..K
    num_accepted: torch.Tensor,  # [num_blocks] int
    K: int,
) -> None:
    if not isinstance(num_drafted, torch.Tensor) or num_drafted.is_floating_point() \
            or num_drafted.dtype == torch.bool or tuple(num_drafted.shape) != tuple(num_accepted.shape):
        raise ValueError(f"num_drafted must be an integer tensor shaped like num_accepted "
                         f"{tuple(num_accepted.shape)}, got {num_drafted!r}")
    if num_drafted.numel() > 0:
        lo, hi = torch.stack([num_drafted.min(), num_drafted.max()]).tolist()
        if lo < 1 or hi > K:
            raise ValueError(f"num_drafted values must lie in 1..K={K}, got min {lo} and max {hi}")
        if bool((num_accepted > num_drafted).any()):
            raise ValueError("num_accepted exceeds num_drafted: a block accepts at most the tokens it drafted")


def _check_inputs(
    target_logits: torch.Tensor,  # [num_blocks, K, vocab]
    draft_logits: torch.Tensor,  # [num_blocks, K, vocab]
    num_accepted: torch.Tensor,  # [num_blocks] int, values in 0..K
    num_drafted: torch.Tensor | None = None,  # [num_blocks] int, values in 1..K
) -> None:
    for name, t in (("target_logits", target_logits), ("draft_logits", draft_logits)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape [num_blocks, K, vocab], got {tuple(t.shape)}")
    if target_logits.shape != draft_logits.shape:
        raise ValueError(f"shapes differ: target {tuple(target_logits.shape)} vs draft {tuple(draft_logits.shape)}")
    num_blocks, K, vocab = draft_logits.shape
    if vocab < 1:
        raise ValueError("logits must have a non-empty vocab dimension")
    _check_num_accepted(num_accepted, K)
    if num_accepted.shape[0] != num_blocks:
        raise ValueError(f"num_accepted has {num_accepted.shape[0]} entries but the logits have {num_blocks} blocks")
    if len({target_logits.device, draft_logits.device, num_accepted.device}) > 1:
        raise ValueError(f"devices differ: {target_logits.device}, {draft_logits.device}, {num_accepted.device}")
    if num_drafted is not None:
        _check_num_drafted(num_drafted, num_accepted, K)


def _check_gamma(gamma: float) -> None:
    if not (isinstance(gamma, (int, float)) and math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"gamma must be a finite number > 0, got {gamma!r}")


def _masks(
    num_accepted: torch.Tensor,  # [num_blocks] int, values in 0..K
    K: int,
    first_rejected_only: bool,
    num_drafted: torch.Tensor | None = None,  # [num_blocks] int K_m; None = K
) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(1, K + 1, device=num_accepted.device)  # [K] 1-based positions
    r = num_accepted.unsqueeze(-1)  # [num_blocks, 1]
    accepted = k <= r  # [num_blocks, K]  eq. 8
    rejected = (k == r + 1) if first_rejected_only else (k > r)  # [num_blocks, K]  eq. 9
    if num_drafted is not None:
        rejected = rejected & (k <= num_drafted.unsqueeze(-1))  # padding rows k > K_m are no position
    return accepted, rejected


def position_masks(
    num_accepted: torch.Tensor,  # [num_blocks] int, values in 0..K
    K: int,
    *,
    first_rejected_only: bool = False,
    num_drafted: torch.Tensor | None = None,  # [num_blocks] int, values in 1..K
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return bool masks ``(accepted, rejected)``, each ``[num_blocks, K]``.

    accepted[m, k-1] = k <= r_m; rejected[m, k-1] = r_m < k <= K_m, or k == r_m + 1 <= K_m only
    when ``first_rejected_only`` (then a fully accepted block has no rejected position).
    """
    _check_num_accepted(num_accepted, K)
    if num_drafted is not None:
        _check_num_drafted(num_drafted, num_accepted, K)
    return _masks(num_accepted, K, first_rejected_only, num_drafted)


def _log_probs(
    target_logits: torch.Tensor,  # [num_blocks, K, vocab]
    draft_logits: torch.Tensor,  # [num_blocks, K, vocab]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p, log q), each [num_blocks, K, vocab]; log p is detached (teacher).

    A drafter with a reduced vocabulary gives -inf logits outside it; the teacher is then
    renormalised over the draft vocabulary (its mass elsewhere is out of the drafter's reach).
    """
    dtype = torch.promote_types(torch.promote_types(target_logits.dtype, draft_logits.dtype), torch.float32)
    target_logits = target_logits.detach().to(dtype)
    # unconditionally: a full-vocabulary drafter has no -inf logits, and no `.any()` syncs a GPU per call
    target_logits = target_logits.masked_fill(torch.isneginf(draft_logits), float("-inf"))
    return torch.log_softmax(target_logits, dim=-1), torch.log_softmax(draft_logits.to(dtype), dim=-1)


def _kl(
    log_a: torch.Tensor,  # [num_blocks, K, vocab]
    log_b: torch.Tensor,  # [num_blocks, K, vocab]
) -> torch.Tensor:
    """KL(a || b) = sum_v a(v) (log a(v) - log b(v)) per position: [num_blocks, K].

    Forward KL is _kl(log_p, log_q), reverse KL is _kl(log_q, log_p). Tokens where a(v) = 0
    (outside a reduced draft vocabulary, where both are -inf) add 0.
    """
    a = log_a.exp()
    inside = a > 0
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    # -inf - -inf is nan, and where() passes nan gradients from the branch it drops: clean both inputs
    diff = torch.where(inside, log_a, zero) - torch.where(inside, log_b, zero)
    return torch.where(inside, a * diff, zero).sum(-1)


def _position_weights(K: int, gamma: float, like: torch.Tensor) -> torch.Tensor:
    """w_k = gamma^(k-1) for k = 1..K (eq. 12): [K], with like's dtype and device."""
    return gamma ** torch.arange(K, dtype=like.dtype, device=like.device)


def _masked_mean(
    values: torch.Tensor,  # [num_blocks, K]
    mask: torch.Tensor,  # [num_blocks, K] bool
    weights: torch.Tensor | None = None,  # [K], or None for uniform weights
) -> torch.Tensor:
    """sum_{mask} w * values / sum_{mask} w; a graph-connected 0 when the mask is empty."""
    w = mask.to(values.dtype) if weights is None else torch.where(mask, weights, 0.0)  # [num_blocks, K]
    total = w.sum()
    numerator = (torch.where(mask, values, 0.0) * w).sum()
    return numerator / torch.where(total > 0, total, torch.ones_like(total))


def _totals(
    acc_mask: torch.Tensor,  # [num_blocks, K] bool
    rej_mask: torch.Tensor,  # [num_blocks, K] bool
    acc_weights: torch.Tensor | None = None,  # [K], or None for uniform weights
    rej_weights: torch.Tensor | None = None,  # [K], or None for uniform weights
) -> tuple[int, int, float, float]:
    """(|acc|, |rej|, sum of acc's weights, sum of rej's weights), one device sync."""
    def weight_sum(mask: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        return mask.sum() if weights is None else torch.where(mask, weights, 0.0).sum()

    sums = [acc_mask.sum(), rej_mask.sum(), weight_sum(acc_mask, acc_weights), weight_sum(rej_mask, rej_weights)]
    n_acc, n_rej, w_acc, w_rej = torch.stack([t.double() for t in sums]).tolist()
    return int(n_acc), int(n_rej), w_acc, w_rej


def draft_opd_loss(
    target_logits: torch.Tensor,  # [num_blocks, K, vocab]
    draft_logits: torch.Tensor,  # [num_blocks, K, vocab]
    num_accepted: torch.Tensor,  # [num_blocks] int, values in 0..K
    *,
    gamma: float = 0.8,
    lambda_acc: float = 1.0,
    lambda_rej: float = 1.0,
    first_rejected_only: bool = False,
    num_drafted: torch.Tensor | None = None,  # [num_blocks] int K_m in 1..K; None = K
) -> DraftOPDLoss:
    """Draft-OPD acceptance-aware objective (eq. 10-13).

    Forward KL(p || q) on accepted positions (target-weighted: cover the target at
    verified states); gamma-weighted reverse KL(q || p) on rejected positions
    (draft-weighted: penalise the draft's own proposals the target disagrees with,
    earlier failures weigh more). Groups are pooled over the batch; an empty group
    drops out of eq. 13. ``first_rejected_only``: rejected group = {r+1} (sec. 6.1).
    """
    _check_inputs(target_logits, draft_logits, num_accepted, num_drafted)
    _check_gamma(gamma)
    if not (lambda_acc >= 0 and lambda_rej >= 0 and lambda_acc + lambda_rej > 0):
        raise ValueError(f"lambda_acc and lambda_rej must be >= 0 with a positive sum, got {lambda_acc}, {lambda_rej}")
    K = draft_logits.shape[1]
    acc, rej = _masks(num_accepted, K, first_rejected_only, num_drafted)  # [num_blocks, K] each
    log_p, log_q = _log_probs(target_logits, draft_logits)
    w = _position_weights(K, gamma, log_q)  # [K] eq. 12
    l_acc = _masked_mean(_kl(log_p, log_q), acc)  # eq. 10
    l_rej = _masked_mean(_kl(log_q, log_p), rej, w)  # eq. 11
    n_acc, n_rej, w_acc, w_rej = _totals(acc, rej, None, w)
    lam_acc = lambda_acc if n_acc else 0.0  # an empty group leaves eq. 13 entirely
    lam_rej = lambda_rej if n_rej else 0.0
    if lam_acc + lam_rej == 0:
        loss = (l_acc + l_rej) * 0.0  # nothing to learn from: graph-connected zero
    else:
        loss = (lam_acc * l_acc + lam_rej * l_rej) / (lam_acc + lam_rej)  # eq. 13
    return DraftOPDLoss(loss, l_acc, l_rej, n_acc, n_rej, w_acc, w_rej, (float(lambda_acc), float(lambda_rej)))


def all_forward_loss(
    target_logits: torch.Tensor,  # [num_blocks, K, vocab]
    draft_logits: torch.Tensor,  # [num_blocks, K, vocab]
    num_accepted: torch.Tensor,  # [num_blocks] int, values in 0..K
    *,
    num_drafted: torch.Tensor | None = None,  # [num_blocks] int K_m in 1..K; None = K
) -> DraftOPDLoss:
    """Ablation "All-forward" (Table 3): uniform mean of KL(p || q) over all drafted positions."""
    _check_inputs(target_logits, draft_logits, num_accepted, num_drafted)
    acc, rej = _masks(num_accepted, draft_logits.shape[1], False, num_drafted)
    kl = _kl(*_log_probs(target_logits, draft_logits))  # [num_blocks, K]
    loss = _masked_mean(kl, acc | rej)  # acc | rej covers every drafted position: sum KL(p || q) / sum K_m
    return DraftOPDLoss(loss, _masked_mean(kl, acc), _masked_mean(kl, rej), *_totals(acc, rej))


def all_reverse_loss(
    target_logits: torch.Tensor,  # [num_blocks, K, vocab]
    draft_logits: torch.Tensor,  # [num_blocks, K, vocab]
    num_accepted: torch.Tensor,  # [num_blocks] int, values in 0..K
    *,
    gamma: float = 0.8,
    num_drafted: torch.Tensor | None = None,  # [num_blocks] int K_m in 1..K; None = K
) -> DraftOPDLoss:
    """Ablation "All-reverse" (Table 3): sum_k w_k KL(q || p) / sum_k w_k over all drafted positions."""
    _check_inputs(target_logits, draft_logits, num_accepted, num_drafted)
    _check_gamma(gamma)
    K = draft_logits.shape[1]
    acc, rej = _masks(num_accepted, K, False, num_drafted)
    log_p, log_q = _log_probs(target_logits, draft_logits)
    kl = _kl(log_q, log_p)  # [num_blocks, K]
    w = _position_weights(K, gamma, log_q)  # [K]
    loss = _masked_mean(kl, acc | rej, w)
    return DraftOPDLoss(loss, _masked_mean(kl, acc, w), _masked_mean(kl, rej, w), *_totals(acc, rej, w, w))


def target_rollout_loss(
    target_logits: torch.Tensor,  # [num_blocks, K, vocab]
    draft_logits: torch.Tensor,  # [num_blocks, K, vocab]
    num_accepted: torch.Tensor,  # [num_blocks] int, values in 0..K
    *,
    num_drafted: torch.Tensor | None = None,  # [num_blocks] int K_m in 1..K; None = K
) -> DraftOPDLoss:
    """Naive target-assisted rollout baseline (Table 4): forward KL on the verified trajectory only.

    Speculative decoding keeps the verified continuation: the r accepted draft
    tokens, then the target's own token at position r+1 (replacing the first
    rejected draft token). Training on that rollout is forward KL(p || q) at the
    states it visits. Position k is predicted from c_m + d_{<k}, which is the
    verified prefix while d_1..d_{k-1} were all accepted, i.e. for k <= r+1: the
    state at r+1 is on the trajectory, only its token was replaced. Positions
    k > r+1 condition on a rejected draft token and are dropped: exactly the draft
    errors Draft-OPD keeps. When r == K_m the bonus token is position K_m+1, outside
    the block, so k <= K_m. ``.accepted``: mean over k <= r; ``.rejected``: mean
    over position r+1; ``.loss``: mean over both pooled.
    """
    _check_inputs(target_logits, draft_logits, num_accepted, num_drafted)
    acc, first_rej = _masks(num_accepted, draft_logits.shape[1], True, num_drafted)
    kl = _kl(*_log_probs(target_logits, draft_logits))  # [num_blocks, K]
    loss = _masked_mean(kl, acc | first_rej)  # positions k <= min(r + 1, K)
    return DraftOPDLoss(loss, _masked_mean(kl, acc), _masked_mean(kl, first_rej), *_totals(acc, first_rej))


LK_MIN_ACCEPTANCE = 1e-6  # floor of alpha in lk_loss: -log stays finite where p and q share no mass


def acceptance_rate(
    log_p: torch.Tensor,  # [num_blocks, K, vocab] target log-probabilities (teacher)
    log_q: torch.Tensor,  # [num_blocks, K, vocab] draft log-probabilities
) -> torch.Tensor:
    """alpha = sum_v min(p(v), q(v)) = 1 - TV(p, q) per position: [num_blocks, K].

    The probability that speculative sampling accepts the drafter's token at that position (Leviathan
    et al. 2023, their beta), differentiable in q almost everywhere: d alpha / d q(v) = 1 where q(v) < p(v).
    Tokens outside a reduced draft vocabulary (both -inf) add 0.
    """
    return torch.minimum(log_p, log_q).exp().sum(-1)


def lk_loss(
    target_logits: torch.Tensor,  # [num_blocks, K, vocab]
    draft_logits: torch.Tensor,  # [num_blocks, K, vocab]
    num_accepted: torch.Tensor,  # [num_blocks] int, values in 0..K
    *,
    num_drafted: torch.Tensor | None = None,  # [num_blocks] int K_m in 1..K; None = K
    temperature: float = 1.0,
) -> DraftOPDLoss:
    """LK loss -log alpha (Samarin et al. 2026, arXiv 2602.23881) on the verified trajectory.

    Acceptance rate itself instead of a KL proxy: alpha = sum_v min(p, q) (``acceptance_rate``), and
    -log alpha's gradient is TV's scaled by 1 / alpha, large where the drafter is far off (pure TV's
    vanishes there). The positions are target_rollout's, k <= min(r + 1, K_m): the states the
    verified continuation visits, where a draft token can be accepted at all. With a one-hot
    teacher -log alpha is the cross-entropy of the teacher's token; with p = q it is 0.
    ``temperature``: the teacher's, p = softmax(target_logits / temperature); 0 = greedy, p one-hot
    on the target's argmax over the draft vocabulary (ties share it), whose acceptance rate is T=0
    verification's: the loss is then the cross-entropy of the target's greedy token at each state
    the drafted prefix reaches.
    ``.accepted``: mean over k <= r; ``.rejected``: mean over position r + 1; ``.loss``: both pooled.
    """
    _check_inputs(target_logits, draft_logits, num_accepted, num_drafted)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    acc, first_rej = _masks(num_accepted, draft_logits.shape[1], True, num_drafted)
    if temperature == 0:  # one-hot on the argmax inside the draft vocabulary (-inf outside it)
        masked = target_logits.detach().masked_fill(torch.isneginf(draft_logits), float("-inf"))
        target_logits = torch.zeros_like(masked).masked_fill(masked < masked.amax(-1, keepdim=True), float("-inf"))
    elif temperature != 1:
        target_logits = target_logits / temperature
    alpha = acceptance_rate(*_log_probs(target_logits, draft_logits))  # [num_blocks, K]
    nll = -alpha.clamp_min(LK_MIN_ACCEPTANCE).log()  # [num_blocks, K]
    loss = _masked_mean(nll, acc | first_rej)
    return DraftOPDLoss(loss, _masked_mean(nll, acc), _masked_mean(nll, first_rej), *_totals(acc, first_rej))


def pool_losses(
    parts: Sequence[DraftOPDLoss],
    total_weights: tuple[float, float] | None = None,
) -> DraftOPDLoss:
    """One objective's results on several batches, pooled as if their positions were one batch.

    With S_g = sum over parts of (group g's term * its weight W_g) and W_g summed over the parts,
    group g's pooled term is S_g / W_g: for Draft-OPD, eq. 10 and 11 with I_acc and I_rej the
    union of the parts' sets. ``.loss`` is eq. 13 over the pooled terms (a group empty in every
    part drops out), or, for an objective with ``group_lambdas`` None, (S_acc + S_rej) / (W_acc +
    W_rej). ``total_weights`` = (W_acc, W_rej) over a larger batch whose other parts are held
    elsewhere (other data-parallel ranks): then every returned term is these parts' share, and the
    shares of all holders sum to the pooled value. Default: these parts' own totals.
    """
    if not parts:
        raise ValueError("pool_losses needs at least one part")
    lambdas = parts[0].group_lambdas
    if any(p.group_lambdas != lambdas for p in parts):
        raise ValueError(f"parts come from different objectives: group_lambdas {[p.group_lambdas for p in parts]}")
    own_acc = sum(p.accepted_weight for p in parts)
    own_rej = sum(p.rejected_weight for p in parts)
    w_acc, w_rej = (own_acc, own_rej) if total_weights is None else total_weights
    s_acc = torch.stack([p.accepted * p.accepted_weight for p in parts]).sum()
    s_rej = torch.stack([p.rejected * p.rejected_weight for p in parts]).sum()
    acc = s_acc / w_acc if w_acc > 0 else s_acc * 0.0
    rej = s_rej / w_rej if w_rej > 0 else s_rej * 0.0
    if lambdas is None:
        loss = (s_acc + s_rej) / (w_acc + w_rej) if w_acc + w_rej > 0 else (s_acc + s_rej) * 0.0
    else:
        lam_acc = lambdas[0] if w_acc > 0 else 0.0
        lam_rej = lambdas[1] if w_rej > 0 else 0.0
        total = lam_acc + lam_rej
        loss = (lam_acc * acc + lam_rej * rej) / total if total > 0 else (acc + rej) * 0.0  # eq. 13
    return DraftOPDLoss(loss, acc, rej, sum(p.num_accepted_positions for p in parts),
                        sum(p.num_rejected_positions for p in parts), own_acc, own_rej, lambdas)


LossFn = Callable[..., DraftOPDLoss]

LOSSES: dict[str, LossFn] = {
    "draft_opd": draft_opd_loss,
    "all_forward": all_forward_loss,
    "all_reverse": all_reverse_loss,
    "target_rollout": target_rollout_loss,
    "lk": lk_loss,
}


#: objectives that read positions k <= min(r + 1, K_m) only, the states the verified continuation visits,
#: so the target's rows along the sequence itself are their whole teacher (teacher_rows.path_block_teacher);
#: draft_opd with ``first_rejected_only`` too (``opd.objective_fn``)
PATH_ONLY = frozenset({"target_rollout", "lk"})


def get_loss(name: str) -> LossFn:
    """Look up an objective in ``LOSSES`` by name."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid names: {', '.join(sorted(LOSSES))}")
    return LOSSES[name]
