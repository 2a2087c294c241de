"""The live check's decision (online_opd/release/live_check.py): hand-worked cases and a simulation
of its false-rollback rate and power at the configured defaults."""

from __future__ import annotations

import math

import numpy as np
import pytest

from online_opd.config import ServeConfig
from online_opd.release.live_check import (
    KEEP,
    ROLL_BACK,
    UNDECIDED,
    accepted_count_probs,
    decide_live_check,
    latest_windows,
    position_acceptance,
    simulate_rollback_rate,
    t_quantile,
    window_stats,
)

# 4 windows of 10 drafts each: tau 1.5 and 1.2, both with residuals a_i - m d_i = +-1
BASELINE = [(10, 6), (10, 4), (10, 6), (10, 4)]
WORSE = [(10, 3), (10, 1), (10, 3), (10, 1)]


def test_window_stats_ratio_estimator_and_variance():
    # D = 40, A = 12, m = 0.3; residuals 5-3, 3-3, 4-6 = 2, 0, -2; Var = 3/2 * 8 / 40^2 = 0.0075
    stats = window_stats([(10, 5), (10, 3), (20, 4), (0, 0)])
    assert stats.num_windows == 3 and stats.num_drafts == 40
    assert stats.tau == pytest.approx(1.3) and stats.variance == pytest.approx(0.0075)
    assert window_stats([]) is None and window_stats([(0, 0)]) is None


@pytest.mark.parametrize("p, df, exact, rel", [(0.99, 3, 4.5407, 5e-3), (0.99, 6, 3.1427, 1e-3),
                                              (0.99, 10, 2.7638, 1e-4), (0.95, 5, 2.0150, 1e-3),
                                              (0.99, 1e9, 2.3263, 1e-4)])
def test_t_quantile_matches_tables(p, df, exact, rel):
    assert t_quantile(p, df) == pytest.approx(exact, rel=rel)


def test_decision_by_hand():
    # each side: tau var = 4/3 * 4 / 40^2 = 1/300; g = 1.2 - 1.5 = -0.3, t = -0.3 / sqrt(2/300) = -3.674
    # Welch df = (2/300)^2 / (2 (1/300)^2 / 3) = 6; t_{0.99, 6} = 3.143 < 3.674 < t_{0.999, 6} = 5.208
    check = decide_live_check(BASELINE, WORSE, min_drafts=40, min_windows=4, tolerance=0.0, alpha=0.01)
    assert check.decision == ROLL_BACK
    assert check.statistic == pytest.approx(-0.3 / math.sqrt(2 / 300)) and check.df == pytest.approx(6.0)
    assert check.critical == pytest.approx(3.1427, rel=1e-3)
    assert check.baseline.tau == pytest.approx(1.5) and check.candidate.tau == pytest.approx(1.2)
    strict = decide_live_check(BASELINE, WORSE, min_drafts=40, min_windows=4, tolerance=0.0, alpha=0.001)
    assert strict.decision == KEEP  # same data, not significant at 0.1%
    # a 20% margin: g = 1.2 - 0.8 * 1.5 = 0, never below it
    lenient = decide_live_check(BASELINE, WORSE, min_drafts=40, min_windows=4, tolerance=0.2, alpha=0.01)
    assert lenient.decision == KEEP and lenient.statistic == pytest.approx(0.0, abs=1e-12)
    better = decide_live_check(WORSE, BASELINE, min_drafts=40, min_windows=4, tolerance=0.0, alpha=0.01)
    assert better.decision == KEEP and better.statistic > 0


def test_undecided_until_both_sides_have_enough():
    check = decide_live_check(BASELINE, WORSE[:3], min_drafts=30, min_windows=4, tolerance=0.0, alpha=0.01)
    assert check.decision == UNDECIDED and check.reason.startswith("candidate has 30 drafts in 3 windows")
    check = decide_live_check(BASELINE, WORSE, min_drafts=41, min_windows=4, tolerance=0.0, alpha=0.01)
    assert check.decision == UNDECIDED and check.reason.startswith("baseline has 40 drafts")
    check = decide_live_check([], WORSE, min_drafts=1, min_windows=4, tolerance=0.0, alpha=0.01)
    assert check.decision == UNDECIDED and "no drafts" in check.reason
    with pytest.raises(ValueError, match="min_windows=3"):
        decide_live_check(BASELINE, WORSE, min_drafts=1, min_windows=3, tolerance=0.0, alpha=0.01)


def test_identical_windows_decide_on_the_gap_alone():
    flat = [(10, 5)] * 4  # zero variance on both sides
    kw = dict(min_drafts=40, min_windows=4, tolerance=0.0, alpha=0.01)
    assert decide_live_check(flat, [(10, 0)] * 4, **kw).decision == ROLL_BACK
    assert decide_live_check(flat, flat, **kw).decision == KEEP


def test_latest_windows_take_the_newest_until_enough():
    windows = [(50, 1), (10, 2), (0, 0), (30, 3), (20, 4)]
    assert latest_windows(windows, 40, 1) == [(30, 3), (20, 4)]
    assert latest_windows(windows, 40, 3) == [(10, 2), (30, 3), (20, 4)]  # the empty poll is skipped
    assert latest_windows(windows, 1000, 1) == [(50, 1), (10, 2), (30, 3), (20, 4)]


def test_acceptance_model():
    assert position_acceptance(1.5, 1) == pytest.approx(0.5)
    assert position_acceptance(1.0 + 0.5 + 0.25, 2) == pytest.approx(0.5)  # p + p^2 = 0.75
    probs = accepted_count_probs(np.array(0.5), 2)
    np.testing.assert_allclose(probs, [0.5, 0.25, 0.25])
    p = position_acceptance(1.6, 4)
    assert float(accepted_count_probs(np.array(p), 4) @ np.arange(5)) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="tau=6.0 is outside"):
        position_acceptance(6.0, 4)


def _rate(tau_baseline: float, tau_candidate: float, *, seed: int = 0, **overrides) -> float:
    cfg = ServeConfig()
    kw = dict(num_checks=2000, min_drafts=cfg.live_check_drafts, min_windows=cfg.live_check_min_windows,
              tolerance=cfg.rollback_tolerance, alpha=cfg.live_check_alpha, drafts_per_window=200,
              block_size=4, concentration=50.0)
    kw.update(overrides)
    result = simulate_rollback_rate(np.random.default_rng(seed), tau_baseline=tau_baseline,
                                    tau_candidate=tau_candidate, **kw)
    assert result["undecided_rate"] == 0.0
    return result["rollback_rate"]


def test_defaults_rarely_roll_back_a_good_version_and_catch_a_bad_one():
    """2000 simulated checks per figure at the serve defaults (1000 drafts in 20 polls, 2% margin,
    alpha 1%), polls of ~200 drafts whose traffic varies (Beta concentration 50)."""
    assert _rate(1.15, 1.15) <= 0.01  # the case: the old check rolled back ~9%
    assert _rate(1.6, 1.6) <= 0.01
    assert _rate(1.6, 1.2) >= 0.99  # a 25% drop
    assert _rate(1.6, 1.44) >= 0.45  # a 10% drop: measured 0.54


def test_the_level_holds_at_the_boundary_of_the_null():
    # no margin: an equal version is rolled back at the test's level, not more (the variance of
    # independent drafts, blind to the spread between polls, rolls back 25% here)
    assert 0.035 <= _rate(1.6, 1.6, tolerance=0.0, alpha=0.05, min_windows=10) <= 0.065
