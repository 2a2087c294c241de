"""The live check: has a newly served drafter lowered acceptance? keep / roll back / undecided.

The server's reloader (vllm_patches/endpoint.py) loads the registry's new
version and then asks `decide_live_check` after every poll. What it can
measure is vLLM's own counters, read every ``stats_poll_s`` seconds: one
*window* per poll, ``(num_drafts, num_accepted)`` served by one version
(vllm_patches/metrics.py `ServedAcceptance`). The baseline is the previous
version's most recent windows, the candidate's are those since its reload.

The test. Acceptance varies from request to request, so drafts are not
independent; the window is the unit. For a set of n windows with drafts d_i
and accepted tokens a_i the ratio estimator and its between-window
(linearised) variance are

    m = sum a_i / sum d_i,        tau = 1 + m,
    Var(tau) = n / (n - 1) * sum (a_i - m d_i)^2 / (sum d_i)^2.

With g = tau_c - (1 - tolerance) tau_b the one-sided hypotheses are

    H0: g >= 0  (the candidate is at most `tolerance` worse: keep it),
    H1: g < 0,

tested with Welch's t = g / sqrt(Var_c + (1 - tolerance)^2 Var_b) on the
Welch-Satterthwaite degrees of freedom: roll back iff t < -t_{1-alpha, df}.
The test looks once, when the candidate has served ``min_drafts`` drafts in
``min_windows`` windows; before that the answer is "undecided". One look means
the false-rollback rate of a version no worse than the baseline is at most
``alpha`` (under the test's normal approximation; `simulate_rollback_rate`
measures it, and benchmarks/live_check_power.py prints it with the power).

What it cannot see: traffic that changes between the baseline's windows and the
candidate's. A shift towards harder prompts right after a reload looks like a
worse drafter; ``tolerance`` is the margin for that.

Pure numpy and stdlib: no vllm, no prometheus.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from online_opd.traces.records import acceptance_length

KEEP, ROLL_BACK, UNDECIDED = "keep", "roll_back", "undecided"


@dataclass(frozen=True)
class WindowStats:
    """A version's live acceptance over some poll windows."""

    num_windows: int
    num_drafts: float
    tau: float  # 1 + accepted / drafts (ratio estimator)
    variance: float  # of tau's estimate, between windows (module docstring)


@dataclass(frozen=True)
class LiveCheck:
    """The decision and the figures behind it (stored in the manifest's ``live_check``)."""

    decision: str  # KEEP, ROLL_BACK or UNDECIDED
    reason: str
    baseline: WindowStats | None
    candidate: WindowStats | None
    statistic: float | None = None  # Welch's t of g = tau_c - (1 - tolerance) tau_b
    critical: float | None = None  # t_{1-alpha, df}: roll back iff statistic < -critical
    df: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def window_stats(windows: Sequence[tuple[float, float]]) -> WindowStats | None:
    """Ratio estimator of tau and its between-window variance; None without drafts."""
    pairs = np.asarray([w for w in windows if w[0] > 0], dtype=np.float64).reshape(-1, 2)
    num_drafts = float(pairs[:, 0].sum())
    if num_drafts <= 0:
        return None
    num_accepted = float(pairs[:, 1].sum())
    n = len(pairs)
    residual = pairs[:, 1] - num_accepted / num_drafts * pairs[:, 0]  # a_i - m d_i
    variance = n / (n - 1) * float(residual @ residual) / num_drafts**2 if n > 1 else math.inf
    return WindowStats(num_windows=n, num_drafts=num_drafts, tau=acceptance_length(num_accepted, num_drafts),
                       variance=variance)


def t_quantile(p: float, df: float) -> float:
    """Student t quantile by the Cornish-Fisher expansion (Abramowitz & Stegun 26.7.5).

    t = z + g1/v + g2/v^2 + g3/v^3 + g4/v^4 with z the normal quantile; within 0.5% of the
    exact value at p = 0.99 for v >= 3 (so the check needs 4 windows a side: Welch's v >= 3),
    and exact as v -> inf.
    """
    z = statistics.NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def latest_windows(windows: Sequence[tuple[float, float]], min_drafts: int,
                   min_windows: int) -> list[tuple[float, float]]:
    """The newest windows that hold ``min_drafts`` drafts in at least ``min_windows`` (the baseline);
    all of them when they hold fewer."""
    taken: list[tuple[float, float]] = []
    num_drafts = 0.0
    for window in reversed(windows):
        if num_drafts >= min_drafts and len(taken) >= min_windows:
            break
        if window[0] <= 0:  # a poll without drafts says nothing
            continue
        taken.append(window)
        num_drafts += window[0]
    return taken[::-1]


def has_enough(windows: Sequence[tuple[float, float]], min_drafts: int, min_windows: int) -> bool:
    """Whether windows hold ``min_drafts`` drafts in at least ``min_windows`` polls with drafts."""
    return _is_enough(window_stats(windows), min_drafts, min_windows)


def _is_enough(stats: WindowStats | None, min_drafts: int, min_windows: int) -> bool:
    return stats is not None and stats.num_drafts >= min_drafts and stats.num_windows >= min_windows


def decide_live_check(baseline: Sequence[tuple[float, float]], candidate: Sequence[tuple[float, float]], *,
                      min_drafts: int, min_windows: int, tolerance: float, alpha: float) -> LiveCheck:
    """Keep, roll back or wait, from per-poll ``(num_drafts, num_accepted)`` windows (module docstring)."""
    if min_windows < 4:
        raise ValueError(f"min_windows={min_windows}: the t quantile needs at least 4 windows a side")
    base, cand = window_stats(baseline), window_stats(candidate)
    for who, stats in (("baseline", base), ("candidate", cand)):
        if not _is_enough(stats, min_drafts, min_windows):
            have = "no drafts" if stats is None else f"{stats.num_drafts:.0f} drafts in {stats.num_windows} windows"
            return LiveCheck(UNDECIDED, f"{who} has {have}, needs {min_drafts} in {min_windows}", base, cand)
    scale = 1.0 - tolerance
    gap = cand.tau - scale * base.tau
    var_c, var_b = cand.variance, scale**2 * base.variance
    variance = var_c + var_b
    if variance <= 0:  # every window identical on both sides: the gap is exact
        decision = ROLL_BACK if gap < 0 else KEEP
        return LiveCheck(decision, f"live tau {cand.tau:.3f} vs {base.tau:.3f}, identical in every window",
                         base, cand)
    df = variance**2 / (var_c**2 / (cand.num_windows - 1) + var_b**2 / (base.num_windows - 1))
    statistic, critical = gap / math.sqrt(variance), t_quantile(1.0 - alpha, df)
    decision = ROLL_BACK if statistic < -critical else KEEP
    relation = "<" if decision == ROLL_BACK else ">="
    reason = (f"live tau {cand.tau:.3f} vs {base.tau:.3f}: t = {statistic:.2f} {relation} -{critical:.2f} "
              f"(H0: at most {tolerance:.0%} worse, alpha {alpha}, df {df:.1f})")
    return LiveCheck(decision, reason, base, cand, statistic, critical, df)


# ---- simulation: the test's false-rollback rate and power under a model of served traffic ---------


def position_acceptance(tau: float, block_size: int) -> float:
    """The per-position acceptance p of a draft whose positions are each accepted with the same p.

    r, the accepted count, is the number of leading accepted positions: P(r = j) = p^j (1 - p)
    for j < K and P(r = K) = p^K, so tau = 1 + E[r] = 1 + sum_{j=1..K} p^j, which rises with p;
    p is found by bisection.
    """
    if not 1.0 <= tau <= 1.0 + block_size:
        raise ValueError(f"tau={tau} is outside [1, 1 + block_size] = [1, {1 + block_size}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if sum(p**j for j in range(1, block_size + 1)) < tau - 1.0 else (lo, p)
    return (lo + hi) / 2


def accepted_count_probs(p: np.ndarray, block_size: int) -> np.ndarray:
    """P(r = j) for j = 0..K at per-position acceptance ``p`` [...] -> [..., K + 1]."""
    p = np.asarray(p, dtype=np.float64)[..., None]
    j = np.arange(block_size + 1)
    probs = p**j * np.where(j < block_size, 1 - p, 1.0)
    return probs / probs.sum(-1, keepdims=True)


def simulate_windows(rng: np.random.Generator, *, tau: float, num_checks: int, num_windows: int,
                     drafts_per_window: float, block_size: int, concentration: float) -> np.ndarray:
    """Poll windows [num_checks, num_windows, 2] of (drafts, accepted) served at acceptance ``tau``.

    Drafts per window are Poisson(drafts_per_window); each window's traffic has its own per-position
    acceptance p_w ~ Beta(c p, c (1 - p)) around the p of ``tau`` (c = ``concentration``; inf = none),
    so windows vary more than independent drafts would, as prompts of different difficulty do.
    """
    p = position_acceptance(tau, block_size)
    shape = (num_checks, num_windows)
    if math.isinf(concentration) or p in (0.0, 1.0):
        p_window = np.full(shape, p)
    else:
        p_window = rng.beta(concentration * p, concentration * (1 - p), size=shape)
    drafts = rng.poisson(drafts_per_window, size=shape)
    counts = rng.multinomial(drafts, accepted_count_probs(p_window, block_size))
    return np.stack([drafts, counts @ np.arange(block_size + 1)], axis=-1).astype(np.float64)


def simulate_rollback_rate(rng: np.random.Generator, *, tau_baseline: float, tau_candidate: float,
                           num_checks: int, min_drafts: int, min_windows: int, tolerance: float,
                           alpha: float, drafts_per_window: float, block_size: int = 4,
                           concentration: float = 50.0) -> dict:
    """Run ``num_checks`` live checks as the reloader does; the share that rolled back.

    Each check takes the baseline's `latest_windows` and the candidate's windows up to the poll
    at which they reach ``min_drafts`` in ``min_windows`` (windows are exchangeable here: the
    two rules pick alike), then decides once.
    """
    need = int(math.ceil(2 * min_drafts / max(drafts_per_window, 1e-9))) + min_windows + 2
    common = dict(num_checks=num_checks, num_windows=need, drafts_per_window=drafts_per_window,
                  block_size=block_size, concentration=concentration)
    base = simulate_windows(rng, tau=tau_baseline, **common)
    cand = simulate_windows(rng, tau=tau_candidate, **common)
    decisions = [decide_live_check(latest_windows(b.tolist(), min_drafts, min_windows),
                                   latest_windows(c.tolist(), min_drafts, min_windows), min_drafts=min_drafts, min_windows=min_windows, tolerance=tolerance,
                                   alpha=alpha).decision for b, c in zip(base, cand)]
    return {"rollback_rate": decisions.count(ROLL_BACK) / num_checks,
            "undecided_rate": decisions.count(UNDECIDED) / num_checks}
