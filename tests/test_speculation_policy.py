"""The speculation policy, its cost model and acceptance estimates, on hand-computed cases."""

from __future__ import annotations

import itertools
import random

import pytest

from online_opd.speculation.acceptance import AcceptanceCounts, geometric_profile
from online_opd.speculation.costs import CostModel, StepCosts, with_prior
from online_opd.speculation.policy import (
    PRIOR_COST_PER_TOKEN,
    _step_seconds,
    break_even_taus,
    choose_k,
    clean_profile,
    compress,
    decide,
    expected_tokens,
)


def linear_costs(points, c=(0.1, 0.02, 0.01, 0.015), num_steps=20) -> StepCosts:
    """Buckets of exactly t(b, K) = c0 + c1 b + c2 K + c3 b K."""
    costs = StepCosts()
    for b, k in points:
        for _ in range(num_steps):
            costs.observe(b, k, c[0] + c[1] * b + c[2] * k + c[3] * b * k)
    return costs


# -- choose_k -------------------------------------------------------------------------------------
def test_chooses_zero_where_speculating_costs_more_than_it_yields():
    # goodput: K=0 1/1 = 1; K=1 1.3/1.5 = 0.867; K=2 1.4/2 = 0.7
    assert choose_k([1.0, 1.5, 2.0], [0.3, 0.1]) == 0


def test_chooses_the_k_with_the_highest_goodput():
    # K=0 1.0; K=1 1.8/1.2 = 1.5; K=2 2.4/1.4 = 1.714
    assert choose_k([1.0, 1.2, 1.4], [0.8, 0.6]) == 2
    # a_2 lower: K=2 2.0/1.4 = 1.429 < K=1 1.5
    assert choose_k([1.0, 1.2, 1.4], [0.8, 0.2]) == 1


def test_exact_break_even_keeps_the_serving_k():
    # tau(1) = 1.5 = t(1) / t(0): both yield exactly 1 token per second
    assert choose_k([1.0, 1.5], [0.5]) == 0
    assert choose_k([1.0, 1.5], [0.5], current_k=1) == 1
    assert choose_k([1.0, 1.5], [0.5 + 1e-9]) == 1


def test_margin_is_a_strict_relative_threshold():
    # goodput(1) = 1.5 / 1.25 = 1.2 = (1 + 0.2) goodput(0): not more than the margin
    assert choose_k([1.0, 1.25], [0.5], margin=0.2) == 0
    assert choose_k([1.0, 1.25], [0.5], margin=0.19) == 1
    # a serving K > 0 that beats plain stays inside the margin: goodput 1 (K=0), 1.3 / 1.25 = 1.04 (K=1),
    # 1.6 / 1.4 = 1.143 (K=2), 1.143 / 1.04 = 1.099
    assert choose_k([1.0, 1.25, 1.4], [0.3, 0.3], current_k=1, margin=0.2) == 1
    assert choose_k([1.0, 1.25, 1.4], [0.3, 0.3], current_k=1, margin=0.05) == 2


def test_a_serving_k_slower_than_plain_is_left_whatever_the_margin():
    # goodput(0) = 1 vs goodput(1) = 1.1 / 1.25 = 0.88: leaving K=1 needs no margin
    assert choose_k([1.0, 1.25], [0.1], current_k=1, margin=0.2) == 0
    assert choose_k([1.0, 1.25], [0.1], current_k=1, margin=0.0) == 0
    # exactly plain's goodput: K=1 stays (1.25 / 1.25 = 1)
    assert choose_k([1.0, 1.25], [0.25], current_k=1, margin=0.2) == 1
    # a forced move goes up only to a K that beats plain by the margin, else to the best K not above the
    # serving one: goodput 1, 0.962 (K=1), 1.074 (K=2), 1.179 (K=3); K=3 beats plain by 17.9% (and K=1 by
    # 22.6%): with a 20% margin K=1 goes to 0, with 15% up to 3
    steps, profile = [1.0, 1.3, 1.35, 1.4], [0.25, 0.2, 0.2]
    assert choose_k(steps, profile, current_k=1, margin=0.25) == 0
    assert choose_k(steps, profile, current_k=1, margin=0.2) == 0
    assert choose_k(steps, profile, current_k=1, margin=0.15) == 3
    # K=2 serving (1.074 > 1): above plain, K=3 within the margin: it stays
    assert choose_k(steps, profile, current_k=2, margin=0.25) == 2


def test_unknown_costs_are_never_chosen():
    assert choose_k([1.0, None, 1.2], [0.9, 0.9]) == 2
    assert choose_k([None, None], [0.9], current_k=1) == 1


@pytest.mark.parametrize("margin", [0.0, 0.05])
def test_choice_is_monotone_in_acceptance(margin):
    rng = random.Random(0)
    alphas = [i / 50 for i in range(51)]
    for _ in range(200):
        steps = sorted(rng.uniform(0.5, 3.0) for _ in range(5))  # t(K) non-decreasing in K
        for current in (0, 2, 4):
            chosen = [choose_k(steps, geometric_profile(1 + sum(a ** k for k in range(1, 5)), 4, 4),
                               current_k=current, margin=margin) for a in alphas]
            assert chosen == sorted(chosen), (steps, current, chosen)
            scaled = [choose_k(steps, [c * a for a in (0.5, 0.3, 0.2, 0.1)], current_k=current,
                               margin=margin) for c in (0.0, 0.5, 1.0, 1.5, 2.0)]
            assert scaled == sorted(scaled), (steps, current, scaled)


# -- profiles and tau -----------------------------------------------------------------------------
def test_expected_tokens_and_clean_profile():
    assert expected_tokens([0.5, 0.25, 0.125], 0) == 1.0
    assert expected_tokens([0.5, 0.25, 0.125], 2) == 1.75
    # clipped to [0, 1], made non-increasing, unknown positions count as 0
    assert clean_profile([1.2, 0.5, 0.7, None], 5) == [1.0, 0.5, 0.5, 0.0, 0.0]


def test_acceptance_counts_divide_by_blocks_that_reached_the_position():
    counts = AcceptanceCounts()
    for drafted, accepted in [(4, 2), (2, 2), (4, 0), (1, 1)]:
        counts.observe(drafted, accepted)
    assert counts.num_reaching == [4, 3, 2, 2]
    assert counts.num_accepted == [3, 2, 0, 0]
    assert counts.profile(min_blocks=1) == [0.75, 2 / 3, 0.0, 0.0]
    assert counts.profile(min_blocks=3) == [0.75, 2 / 3, None, None]
    later = AcceptanceCounts.from_dict(counts.to_dict())
    later.observe(4, 4)
    delta = later - counts
    assert (delta.num_reaching, delta.num_accepted, delta.num_drafts) == ([1, 1, 1, 1], [1, 1, 1, 1], 1)


def test_geometric_profile_inverts_tau():
    assert geometric_profile(1.75, 2, 3) == pytest.approx([0.5, 0.25, 0.125])
    assert geometric_profile(1.0, 4, 2) == [0.0, 0.0]
    assert geometric_profile(5.0, 4, 2) == [1.0, 1.0]
    with pytest.raises(ValueError, match="block_size=0"):
        geometric_profile(1.5, 0, 2)


# -- costs ----------------------------------------------------------------------------------------
def test_step_costs_mean_then_ewma():
    former = StepCosts(alpha=0.5, track_speed=False)
    costs = StepCosts(alpha=0.5, relative_alpha=0.5)
    for seconds in (1.0, 2.0, 3.0):
        former.observe(2, 0, seconds, num_tokens=2)
        costs.observe(2, 0, seconds, num_tokens=2)
    # weights max(0.5, 1/n): 1 -> 1.5 (w 1/2) -> 2.25 (w 1/2); too few steps to move the speed factor
    assert former.to_rows() == costs.to_rows() == [[2, 0, 2.25, 3, 6.0, 6, 0.0]]
    assert StepCosts.from_rows(costs.to_rows()).to_rows() == costs.to_rows()
    with pytest.raises(ValueError, match="alpha=0"):
        StepCosts(alpha=0)
    with pytest.raises(ValueError, match="relative_alpha=2"):
        StepCosts(relative_alpha=2)


def _drifting_machine(costs: StepCosts) -> StepCosts:
    """Plain steps cost 1.0 and K = 1 steps 1.2 at speed 1; the machine then slows to 1.3x (a trainer
    starts) while the schedule serves K = 1, with a burst of plain steps now and then (exploration)."""
    for _ in range(60):
        costs.observe(1, 0, 1.0)
    for _ in range(60):
        costs.observe(1, 1, 1.2)
    for i in range(600):
        costs.observe(1, 1, 1.2 * 1.3)
        if i % 150 == 149:
            costs.observe(1, 0, 1.3)
    return costs


def test_step_costs_keep_ratios_when_the_machine_drifts():
    costs = _drifting_machine(StepCosts())
    (b0, k0, plain, *_), (b1, k1, spec, *_) = costs.to_rows()
    assert (b0, k0, b1, k1) == (1, 0, 1, 1)
    assert spec == pytest.approx(1.56, rel=0.01)  # today's cost of the serving K
    # the slowdown, seen through K = 1 steps alone, is split between the speed factor (to 1.24) and the
    # serving bucket (1.2 -> 1.27 at speed 1): the ratio the policy compares is 5% high, not 30%
    assert costs.speed == pytest.approx(1.3, rel=0.06)
    assert plain == pytest.approx(1.3, rel=0.06)  # plain steps at today's speed, seen in 4 steps since
    assert 1.2 <= spec / plain < 1.27
    # the former per-bucket means compare 1.56 now with 1.0 measured before the slowdown
    former = _drifting_machine(StepCosts(track_speed=False)).to_rows()
    assert former[1][2] / former[0][2] > 1.45
    # CostModel and with_prior read the rows at today's speed
    model = CostModel(costs, min_steps=1, prior_steps=0)
    assert model.measured[(1, 1)] / model.measured[(1, 0)] == pytest.approx(spec / plain)
    merged = with_prior(costs, StepCosts(), max_prior_steps=16)
    assert [row[2] for row in merged.to_rows()] == pytest.approx([plain, spec])


def test_one_slow_step_moves_the_speed_factor_by_a_bounded_amount():
    costs = StepCosts(alpha=0.05)
    for _ in range(40):
        costs.observe(4, 0, 0.05)
    assert costs.speed == pytest.approx(1.0)
    costs.observe(4, 0, 0.5)  # a 10x pause (preemption, a collection): winsorised at 1.5x the prediction
    assert costs.speed == pytest.approx(1.0 + 0.05 * 0.5)
    assert costs.to_rows()[0][4] == pytest.approx(40 * 0.05 + 0.5)  # the totals stay the raw seconds


def test_cost_model_fits_the_bilinear_model_and_uses_measured_buckets():
    costs = linear_costs([(1, 0), (2, 0), (4, 0), (8, 0), (1, 4), (8, 4)])
    model = CostModel(costs)
    assert model.knows_speculation
    assert model.describe() == pytest.approx({"1": 0.1, "b": 0.02, "k": 0.01, "bk": 0.015})
    assert model.seconds(4, 2) == pytest.approx(0.1 + 0.08 + 0.02 + 0.12)
    costs.observe(16, 0, 5.0)  # one step: not enough to be used as measured, but in the fit
    assert CostModel(costs, min_steps=2).seconds(16, 0) != 5.0
    assert CostModel(costs, min_steps=1, prior_steps=0).seconds(16, 0) == 5.0
    shrunk = CostModel(costs, min_steps=1)  # one step against 32 pseudo-steps of the fit
    assert shrunk.seconds(16, 0) == pytest.approx((5.0 + 32 * shrunk._fitted(16, 0)) / 33)


def test_the_fit_never_makes_a_part_of_a_step_cost_less_than_nothing():
    # a fresh c=8 server's first buckets: warm-up steps at small b cost more than later steps at b=7-8
    # (2026-12-05): the plain fit's c1 < 0 predicted t(31, 0) = 0 and scheduled K = 1 at b = 31-32 alone
    costs = StepCosts.from_rows([[1, 0, 0.115, 40, 4.6, 40], [2, 0, 0.108, 12, 1.3, 24],
                                 [3, 0, 0.101, 10, 1.0, 30], [7, 0, 0.0726, 30, 2.2, 210],
                                 [8, 0, 0.0645, 60, 3.9, 480], [1, 1, 0.118, 12, 1.4, 16],
                                 [8, 1, 0.084, 9, 0.76, 95]])
    model = CostModel(costs)
    assert model.knows_speculation and min(model.describe().values()) >= 0.0, model.describe()
    assert model.seconds(31, 0) >= model.seconds(8, 0) > 0.05
    decision = decide(model, [0.358, 0.083, 0.014, 0.001], max_k=4, max_batch_size=32)
    assert decision.lookup[8:] == [0] * 25, decision.schedule  # break-even at b=8: 0.084 / 0.0645 = 1.30


def test_cost_model_with_partial_measurements():
    assert CostModel(StepCosts()).seconds(1, 0) is None
    only_plain = CostModel(linear_costs([(1, 0), (4, 0)]))
    assert not only_plain.knows_speculation
    assert only_plain.seconds(2, 0) == pytest.approx(0.1 + 0.04)
    assert only_plain.seconds(2, 1) is None
    one_size = CostModel(linear_costs([(1, 0)]), min_steps=1000)
    assert one_size.describe() == pytest.approx({"1": 0.12})
    # K > 0 at one batch size only: c2 and c3 cannot both be told apart, the b K term is kept
    partial = CostModel(linear_costs([(1, 0), (4, 0), (1, 4)]), min_steps=1000)
    assert partial.terms == ("1", "b", "bk")
    assert partial.seconds(1, 4) == pytest.approx(0.12 + 0.04 + 0.06)


def test_break_even_taus():
    model = CostModel(linear_costs([(1, 0), (2, 0), (4, 0), (8, 0), (1, 4), (8, 4)]))
    # b = 2: t(2, 0) = 0.14, t(2, K) = 0.14 + 0.04 K
    assert break_even_taus(model, 2, 2) == pytest.approx([0.18 / 0.14, 0.22 / 0.14])
    assert break_even_taus(CostModel(linear_costs([(1, 0), (4, 0)])), 2, 1) == [None]


# -- decide ---------------------------------------------------------------------------------------
def test_compress_to_vllm_ranges():
    assert compress([0, 4, 4, 0, 0, 2]) == [(1, 2, 4), (3, 4, 0), (5, 5, 2)]
    assert compress([0, 0]) == [(1, 1, 0)]


def test_decide_without_measurements_is_conservative():
    useless = decide(None, [], max_k=4, max_batch_size=8)
    assert useless.schedule == [(1, 8, 0)] and useless.is_conservative
    # prior at b = 1: tau = 1, 1.9, 2.7, 3.4, 4.0 over 1 + 0.125 K -> 1, 1.69, 2.16, 2.47, 2.67: K = 4
    good = decide(None, [0.9, 0.8, 0.7, 0.6], max_k=4, max_batch_size=8)
    assert good.schedule == [(1, 1, 4), (2, 8, 0)]
    # weak acceptance does not pass the prior: tau(1) = 1.1 < 1.125
    assert decide(None, [0.1], max_k=4, max_batch_size=8).schedule == [(1, 8, 0)]


def test_decide_per_batch_size_from_the_cost_model():
    # t(b, K) = 0.1 + 0.02 b + 0.01 K + 0.015 b K; a_k = 0.5^k
    model = CostModel(linear_costs([(1, 0), (2, 0), (4, 0), (8, 0), (1, 4), (8, 4)]))
    profile = [0.5, 0.25, 0.125, 0.0625]
    decision = decide(model, profile, max_k=4, max_batch_size=8, margin=0.0)
    for b in range(1, 9):
        seconds = [0.1 + 0.02 * b + 0.01 * k + 0.015 * b * k for k in range(5)]
        goodput = [expected_tokens(profile, k) / t for k, t in enumerate(seconds)]
        best = max(range(5), key=lambda k: (goodput[k], -k))
        assert decision.lookup[b] == best, b
        assert decision.predicted_goodput[b] == pytest.approx(b * goodput[best])
    assert decision.lookup[1] > 0 and decision.lookup[8] == 0  # pays at b = 1 only
    assert not decision.is_conservative
    assert compress(decision.lookup) == decision.schedule


def test_decide_keeps_the_serving_schedule_inside_the_margin():
    model = CostModel(linear_costs(list(itertools.product([1, 2, 4, 8], [0, 4]))))
    first = decide(model, [0.5, 0.25, 0.125, 0.0625], max_k=4, max_batch_size=8, margin=0.0)
    nudged = decide(model, [0.51, 0.26, 0.13, 0.07], max_k=4, max_batch_size=8, margin=0.2,
                    current=first.lookup)
    assert nudged.lookup == first.lookup


def test_conservative_decision_uses_costs_measured_at_batch_size_one():
    # only b = 1 measured: the fit cannot tell how K costs grow with b, so b > 1 stays at K = 0
    costs = StepCosts()
    for k, seconds in [(0, 0.1), (4, 0.3)]:
        for _ in range(10):
            costs.observe(1, k, seconds)
    model = CostModel(costs)
    assert not model.knows_speculation
    # a_k = 0.5: measured t(1, 4) / t(1, 0) = 3 = tau(4), break-even only; the prior's ratios for K = 1..3
    # (1.125, 1.25, 1.375) are below tau(K) = 1.5, 2.0, 2.5
    decision = decide(model, [0.5] * 4, max_k=4, max_batch_size=4, margin=0.0)
    assert decision.is_conservative and decision.schedule == [(1, 1, 3), (2, 4, 0)]
    # tau(3) / (1 + 0.375) = 2.5 / 1.375 = 1.818 > tau(2) / 1.25 = 1.6, tau(1) / 1.125 = 1.333


def test_conservative_prices_an_unmeasured_k_at_least_at_a_smaller_measured_ks_ratio():
    """A fresh c=1 server (float32 CPU, 08:43:47): t(1, 1) measured at 1.32 t(1, 0) with tau(1) 1.279 (no
    pay), and K = 2 unmeasured, priced by the prior at 1.25: goodput 1.357 / 1.25 beat plain by 8.5% and
    K = 2 served 711 steps, as slow per token as plain (it also beat the serving K = 1 by 6%). Priced at
    K = 1's 1.32 it gains 2.8% over plain: inside the margin, so the server goes from K = 1 (below plain)
    to 0."""
    costs = StepCosts()
    for k, seconds in [(0, 0.0446), (1, 0.0589)]:
        for _ in range(20):
            costs.observe(1, k, seconds)
    model = CostModel(costs)
    assert not model.knows_speculation
    profile = [0.279, 0.078, 0.022, 0.006]
    seconds = _step_seconds(model, 1, 4, True, PRIOR_COST_PER_TOKEN)
    assert seconds[1] == pytest.approx(0.0589)
    assert [t / 0.0446 for t in seconds[2:]] == pytest.approx([0.0589 / 0.0446, 1.375, 1.5])  # then the prior
    decision = decide(model, profile, max_k=4, max_batch_size=4, margin=0.05, current=[0, 1, 0, 0, 0])
    assert decision.is_conservative and decision.lookup == [0, 0, 0, 0, 0]
    # the prior alone (K = 1 measured cheap, 1.05) still lets the unmeasured K = 2 be tried at 1.25
    cheap = StepCosts()
    for k, seconds in [(0, 0.0446), (1, 0.0446 * 1.05)]:
        for _ in range(20):
            cheap.observe(1, k, seconds)
    assert _step_seconds(CostModel(cheap), 1, 4, True, PRIOR_COST_PER_TOKEN)[2] == pytest.approx(0.0446 * 1.25)


def test_a_rare_batch_sizes_noisy_bucket_is_shrunk_toward_the_fit():
    """The step costs the bootstrapped-drafter benchmark ended with (benchmarks/results/
    speculation_policy_bootstrapped.json, second round): t(7, 0) from 12 steps is 43% above t(8, 0)
    from 523. Taken as measured against the fitted t(7, K), it made K = 1 and 2 cost 2% and 4% more
    than plain (served: K = 2 at b = 7 alone); shrunk by 32 pseudo-steps toward the fit, t(7, 0) is
    (12 * 0.04291 + 32 * fit) / 44, and b = 7 keeps K <= 1 like its neighbours."""
    costs = StepCosts()
    for b, k, seconds, n in [(1, 0, 0.02563, 3039), (1, 1, 0.0289, 5), (1, 2, 0.02959, 5), (1, 3, 0.03063, 4),
                             (1, 4, 0.03033, 6), (2, 1, 0.03335, 1), (5, 1, 0.03746, 1), (7, 0, 0.04291, 12),
                             (8, 0, 0.03009, 523), (8, 2, 0.0509, 2), (8, 3, 0.0483, 2), (28, 0, 0.06204, 5),
                             (31, 0, 0.05068, 3), (32, 0, 0.04314, 439), (32, 4, 0.18174, 2)]:
        for _ in range(n):
            costs.observe(b, k, seconds)
    acceptance = [0.329, 0.098, 0.022, 0.0]
    unshrunk = CostModel(costs, prior_steps=0)
    # (the fit's c2 comes out < 0 here and is held at 0: non-negative least squares; it was 1.05 at K = 2)
    assert unshrunk.seconds(7, 0) == 0.04291 and break_even_taus(unshrunk, 7, 2) == pytest.approx([1.02, 1.06], abs=0.005)
    assert decide(unshrunk, acceptance, max_k=4, max_batch_size=32).lookup[7] == 2
    model = CostModel(costs)
    fit = model._fitted(7, 0)
    assert model.seconds(7, 0) == pytest.approx((12 * 0.04291 + 32 * fit) / 44)
    assert model.seconds(1, 0) == pytest.approx(0.02563, rel=1e-3)  # 3039 steps: as measured
    assert break_even_taus(model, 7, 2)[0] > 1.1
    decision = decide(model, acceptance, max_k=4, max_batch_size=32)
    assert decision.lookup[7] <= 1 and decision.lookup[1] > 0 and decision.lookup[32] == 0


def test_a_speculative_step_never_looks_cheaper_than_a_plain_one():
    """Measured in the speculation-policy benchmark: t(1, 4) from 2 steps (0.055 s) under t(1, 0) from
    500 (0.059 s), and a fit with c2 < 0, put a drafter with acceptance 0 at K = 4."""
    costs = StepCosts()
    for b, k, seconds, n in [(1, 0, 0.05928, 500), (1, 4, 0.05508, 2), (3, 0, 0.11862, 1), (8, 0, 0.2, 40),
                             (8, 4, 0.19, 40)]:
        for _ in range(n):
            costs.observe(b, k, seconds)
    model = CostModel(costs)
    assert model.seconds(1, 4) == pytest.approx(0.05928 * 1.08, rel=1e-3)  # the floor: 1 + 0.02 K
    assert model.seconds(8, 4) == pytest.approx(0.2 * 1.08, rel=0.05)  # measured below plain, floored too
    assert break_even_taus(model, 1, 4) == pytest.approx([1.02, 1.04, 1.06, 1.08])
    decision = decide(model, [0.0, 0.0, 0.0, 0.0], max_k=4, max_batch_size=8, margin=0.0)
    assert decision.lookup == [0] * 9
    # serving K = 4 now: zero acceptance still moves it to 0 (the floor is a real loss, beyond any margin < 8%)
    assert decide(model, [0.0] * 4, max_k=4, max_batch_size=8, margin=0.05, current=[0] + [4] * 8).lookup == [0] * 9


def test_an_unmeasured_bucket_costs_at_least_the_ratio_measured_below_it():
    """A fresh c=4 server (float32 CPU) early on: t(1, 0) still high from few steps, K = 1 measured at
    b = 4 at 1.34 plain steps, a few K = 2 and K = 4 steps there, nothing at b > 4. The fit's slopes
    (c1 < 0) made K = 1 look cheaper at b = 5 than at b = 4 (1.27 plain steps at b = 6), and the
    policy served K = 1 at b = 5 (and, in the server's log, K = 3 from b = 6 on)."""
    costs = StepCosts()
    for b, k, seconds, n in [(1, 0, 0.065, 20), (3, 0, 0.0556, 38), (4, 0, 0.0563, 50), (4, 1, 0.0752, 50),
                             (1, 1, 0.0722, 8), (4, 4, 0.0925, 3), (4, 2, 0.0755, 3)]:
        for _ in range(n):
            costs.observe(b, k, seconds)
    model = CostModel(costs)
    at_4, at_1 = 0.0752 / 0.0563, 0.0722 / 0.065
    assert model.ratio_floor(4, 1) == pytest.approx(at_4) and model.ratio_floor(8, 4) == pytest.approx(at_4)
    assert model.ratio_floor(3, 4) == pytest.approx(at_1)  # only b' <= 3 counts there
    assert model.ratio_floor(8, 0) == 1.0
    for b in (5, 6, 16):
        for k in (1, 2, 3, 4):
            assert model.seconds(b, k) >= at_4 * model.seconds(b, 0) * (1 - 1e-9), (b, k)
    assert model.seconds(6, 1) / model.seconds(6, 0) == pytest.approx(at_4)  # the fit alone: 1.27
    # the measured buckets themselves stay as measured (shrunk toward the fit, not floored)
    assert model.seconds(4, 1) == pytest.approx(0.0752, rel=0.05)
    # the drafter (tau(1) = 1.32) does not pay at b = 4, so it is scheduled nowhere above: K = 1 at
    # b = 1-3, where the measured b = 1 ratio (1.11) is below its tau
    decision = decide(model, [0.32, 0.103, 0.033, 0.011], max_k=4, max_batch_size=32, margin=0.05)
    assert decision.schedule == [(1, 3, 1), (4, 32, 0)]
