"""fleet.analysis.sequential: always-valid tests, checked tick by tick over seeded simulations.

Each guarantee is a rate over many seeded runs under continuous monitoring (a look at every
tick, the way a rollout looks); each could fail: a test re-taken at a fixed confidence every
tick crosses far more often (the first test shows it does).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from fleet.analysis.anytime import ErrorHarm, TailHarm, bernoulli_bounds
from fleet.analysis.sequential import Evidence, spent_alpha
from fleet.analysis.simulate import SCENARIOS, Scenario, Stream, run
from fleet.catalog.policies.loader import load_policies
from fleet.catalog.policies.rollout import RolloutPolicy
from tests.test_rollout import ROOT

GOOD = SCENARIOS[0]


def test_the_error_test_crosses_under_alpha_however_often_it_is_looked_at() -> None:
    """Equal error rates (2 %), the canary's share of traffic moving from 10 to 50 %, a look
    after every tick of 40 requests, 150 ticks: the e-process ever reaching 1/alpha in at most
    alpha of 1,000 runs. A two-proportion z-test at the same alpha, taken at every tick,
    crosses in several times as many."""
    rng, alpha, runs, crossed, z_crossed = np.random.default_rng(18), 0.05, 1000, 0, 0
    for _ in range(runs):
        harm, hit, z_hit, totals = ErrorHarm(), False, False, np.zeros(4)
        for tick in range(150):
            nc = rng.binomial(40, 0.1 if tick < 50 else 0.5)
            ns = 40 - nc
            xc, xs = rng.binomial(nc, 0.02), rng.binomial(ns, 0.02)
            harm = harm.update(nc, xc, ns, xs)
            hit = hit or harm.e_value >= 1 / alpha
            totals += (xc, nc, xs, ns)
            (a, b, c, d), pooled = totals, (totals[0] + totals[2]) / (totals[1] + totals[3])
            se = np.sqrt(pooled * (1 - pooled) * (1 / b + 1 / d)) if b and d and 0 < pooled < 1 else 0
            z_hit = z_hit or (se > 0 and (a / b - c / d) / se > stats.norm.isf(alpha))
        crossed += hit
        z_crossed += z_hit
    assert crossed / runs <= alpha, crossed
    assert z_crossed / runs > 3 * alpha, z_crossed  # what looking every tick does to a fixed test


def test_a_canary_erring_more_is_caught_and_one_erring_less_never_is() -> None:
    rng = np.random.default_rng(7)
    worse, better = ErrorHarm(), ErrorHarm()
    for _ in range(60):  # 10 s ticks at 20 req/s, 50 %: 0.1 % vs 1.1 %
        worse = worse.update(100, rng.binomial(100, 0.011), 100, rng.binomial(100, 0.001))
        better = better.update(100, rng.binomial(100, 0.001), 100, rng.binomial(100, 0.011))
    assert worse.e_value >= 100 and better.e_value < 1


def test_the_tail_test_crosses_under_alpha_when_exactly_one_percent_is_slow() -> None:
    rng, alpha, runs = np.random.default_rng(3), 0.05, 1000
    crossed = 0
    for _ in range(runs):
        tail, hit = TailHarm(), False
        for _ in range(100):
            tail = tail.update(20, float(rng.binomial(20, 0.01)))
            hit = hit or tail.e_value >= 1 / alpha
        crossed += hit
    assert crossed / runs <= alpha, crossed
    slow = TailHarm()
    for _ in range(30):  # 5 % above the limit: shown within 600 answers
        slow = slow.update(20, float(rng.binomial(20, 0.05)))
    assert slow.e_value >= 1 / alpha


def test_the_confidence_sequence_holds_at_every_look_at_once() -> None:
    """A rate of 1 %, 3,000 trials looked at every 100: the bounds exclude it at some look
    in at most ``level`` of the runs, on each side."""
    rng, level, runs = np.random.default_rng(11), 0.05, 200
    low_misses = high_misses = 0
    for _ in range(runs):
        events = np.cumsum(rng.random(3000) < 0.01)
        looks = [bernoulli_bounds(float(events[n - 1]), n, level) for n in range(100, 3001, 100)]
        low_misses += any(lo > 0.01 for lo, _ in looks)
        high_misses += any(hi < 0.01 for _, hi in looks)
    assert low_misses / runs <= level and high_misses / runs <= level, (low_misses, high_misses)
    lo, hi = bernoulli_bounds(0, 40, 0.05)
    assert lo == 0.0 and 0.05 < hi < 0.2
    assert bernoulli_bounds(0, 0, 0.05) == (0.0, 1.0)


def test_alpha_spent_per_look_sums_under_alpha() -> None:
    assert sum(spent_alpha(0.01, k) for k in range(1, 100_000)) < 0.01
    assert spent_alpha(0.01, 1) == pytest.approx(0.01 * 6 / np.pi**2)


def test_evidence_round_trips_through_the_stored_state_and_refuses_another_grid() -> None:
    evidence = Evidence().looked()
    evidence = Evidence(ErrorHarm().update(10, 1, 90, 0), evidence.tails, evidence.looks)
    evidence = evidence.with_tail("latency_p99", TailHarm().update(20, 2.0))
    assert Evidence.from_dict(evidence.to_dict()) == evidence
    assert Evidence.from_dict(None) == Evidence()
    with pytest.raises(ValueError, match="expected 4"):
        ErrorHarm((0.0, 0.0)).update(10, 1, 10, 0)


# -- whole rollouts (fleet.analysis.simulate: the bench's and the dry run's streams) -------------------


def policy(**changes: object) -> RolloutPolicy:
    shipped = load_policies(ROOT / "policies").rollout["default"]
    return RolloutPolicy.model_validate({**shipped.model_dump(), "analysis_window_s": 5, **changes})


def rollouts(scenario: Scenario, p: RolloutPolicy, n: int, seed: int = 18) -> list:
    horizon = len(p.steps) * p.hold_deadline_s + 120
    return [run(Stream((seed, i), 20.0, horizon, scenario, 0.001), p) for i in range(n)]


def test_false_rollbacks_of_good_canaries_stay_under_the_stated_rate() -> None:
    """Good canaries at 20 req/s, a look every 5 s: with a budget of 5 % (large enough to be
    seen in 100 rollouts) at most 5 % are rolled back, every gate and step included."""
    results = rollouts(GOOD, policy(max_false_rollback_rate=0.05), 100)
    rolled = sum(r.outcome == "rollback" for r in results)
    assert rolled <= 5, rolled
    assert all(r.outcome == "promote" for r in results if r.outcome != "rollback")


def test_a_canary_exactly_at_the_margin_is_promoted_at_most_one_minus_power_of_the_time() -> None:
    at_margin = Scenario("at the margin", extra_errors=policy().gates.max_error_rate_increase)
    results = rollouts(at_margin, policy(), 40)
    promoted = sum(r.outcome == "promote" for r in results)
    assert promoted / len(results) <= 1 - policy().power, promoted


def test_clearly_good_canaries_are_promoted_sooner_than_by_the_fixed_method() -> None:
    sequential = rollouts(GOOD, policy(), 30)
    fixed = rollouts(GOOD, policy(method="fixed", analysis_window_s=10, min_samples=50), 30)
    assert all(r.outcome == "promote" for r in sequential)
    seq_median = np.median([r.at for r in sequential])
    fixed_median = np.median([r.at for r in fixed if r.outcome == "promote"])
    assert seq_median <= 180 and seq_median < fixed_median, (seq_median, fixed_median)


def test_scores_drifted_past_the_limit_are_never_promoted() -> None:
    """tests/rollout_env.py's FAST policy at 60 req/s: the error and latency gates let the last
    step with stable traffic advance on a few hundred requests, where the harm test at its
    small alpha saw a PSI of 0.42 (twice the limit) in about one rollout of five. That step
    holds until the PSI is shown within the limit, so the drift is caught while it holds;
    a canary exactly at the limit is promoted at most 1 - power of the time; a good one is
    promoted as soon as before."""
    shipped = policy()
    fast = policy(
        steps=[20, 50, 100],
        analysis_window_s=2,
        min_samples=40,
        hold_deadline_s=90,
        gates={**shipped.gates.model_dump(), "max_error_rate_increase": 0.03, "max_p99_ratio": 3.0},
    )
    horizon = len(fast.steps) * fast.hold_deadline_s + 120

    def rollouts_at_60(scenario: Scenario, n: int) -> list:
        return [run(Stream((18, i), 60.0, horizon, scenario, 0.001), fast) for i in range(n)]

    drifted = rollouts_at_60(Scenario("scores PSI 0.42", scores=(2.0, 3.0)), 40)
    assert all(r.outcome == "rollback" and not r.by_deadline for r in drifted), [r.outcome for r in drifted]
    at_limit = rollouts_at_60(Scenario("scores PSI 0.21", scores=(2.0, 3.5)), 40)
    assert sum(r.outcome == "promote" for r in at_limit) / len(at_limit) <= 1 - fast.power
    good = rollouts_at_60(GOOD, 40)
    assert all(r.outcome == "promote" for r in good)
    assert np.median([r.at for r in good]) <= 20, [r.at for r in good]
