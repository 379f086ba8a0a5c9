"""Canary verdicts, window by window: tick-driven steps against the metrics fake, single
windows for each gate, and seeded property checks that could fail."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import optimize, stats

from fleet.analysis.canary import Verdict, judge
from fleet.analysis.drift import psi
from fleet.analysis.histograms import histogram_quantile
from fleet.analysis.sources import MemoryMetrics
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.types import ERROR_CLASSES, LATENCY_BUCKETS_MS, PREDICTION_BINS, ArmWindow, latency_bucket

MODEL, STABLE, CANARY = "demo", "1.0.0", "1.1.0"
T0 = 1_764_590_000.0


def policy(**changes) -> RolloutPolicy:
    gates = {"max_error_rate_increase": 0.005, "confidence": 0.95, "max_p99_ratio": 1.2, "max_prediction_psi": 0.2}
    gates.update(changes.pop("gates", {}))
    raw = {
        "steps": [10, 50, 100],
        "analysis_window_s": 10.0,
        "min_samples": 50,
        "hold_deadline_s": 900.0,
        "gates": gates,
    }
    return RolloutPolicy.model_validate({**raw, **changes})


def served(
    rng: np.random.Generator,
    n: int,
    *,
    errors: float = 0.001,
    median_ms: float = 10.0,
    sigma: float = 0.4,
    scores: tuple[float, float] = (2.0, 5.0),
    slow_share: float = 0.0,
) -> dict:
    """n requests as the gateway counts them: Bernoulli errors, lognormal latency, Beta scores."""
    failed = rng.random(n) < errors
    ok = int(n - failed.sum())
    latency = np.exp(rng.normal(math.log(median_ms), sigma, ok))
    latency[rng.random(ok) < slow_share] *= 8  # a slow tail: GC pauses, a cold cache
    buckets = np.searchsorted(LATENCY_BUCKETS_MS, latency, side="left")
    bins = np.clip((rng.beta(*scores, ok) * PREDICTION_BINS).astype(int), 0, PREDICTION_BINS - 1)
    return {"requests": n, "errors": int(failed.sum()), "buckets": buckets, "bins": bins}


def window(version: str, traffic: dict, start: float = T0, end: float = T0 + 60) -> ArmWindow:
    errors = dict.fromkeys(ERROR_CLASSES, 0)
    errors["5xx"] = traffic["errors"]
    return ArmWindow(
        model=MODEL,
        version=version,
        start=start,
        end=end,
        requests=traffic["requests"],
        errors=errors,
        latency_ms=tuple(np.bincount(traffic["buckets"], minlength=len(LATENCY_BUCKETS_MS) + 1).tolist()),
        predictions=tuple(np.bincount(traffic["bins"], minlength=PREDICTION_BINS).tolist()),
    )


def record(metrics: MemoryMetrics, version: str, at: float, traffic: dict) -> None:
    """Put traffic into the fake the way the gateway records it (grouped, to stay fast)."""
    upper = (*LATENCY_BUCKETS_MS, 20000.0)  # a latency inside each bucket
    pairs, counts = np.unique(np.stack([traffic["buckets"], traffic["bins"]]), axis=1, return_counts=True)
    for (b, s), c in zip(pairs.T.tolist(), counts.tolist()):
        metrics.answered(MODEL, version, at, upper[b], scores=[(s + 0.5) / PREDICTION_BINS], count=c)
    if traffic["errors"]:
        metrics.failed(MODEL, version, at, "5xx", count=traffic["errors"])


def run_step(p: RolloutPolicy, seed: int, rps: float, weight: float, canary: dict, ticks: int = 200) -> list[Verdict]:
    """Drive one step tick by tick: traffic arrives, the step's window so far is judged,
    until a verdict other than hold (the flow's loop, against the metrics fake)."""
    rng = np.random.default_rng(seed)
    metrics, verdicts = MemoryMetrics(), []
    for k in range(1, ticks + 1):
        now = T0 + k * p.analysis_window_s
        n = int(rng.poisson(rps * p.analysis_window_s))
        to_canary = int(rng.binomial(n, weight / 100))
        record(metrics, CANARY, now - 1, served(rng, to_canary, **canary))
        record(metrics, STABLE, now - 1, served(rng, n - to_canary))
        v = judge(metrics.window(MODEL, STABLE, T0, now), metrics.window(MODEL, CANARY, T0, now), p, step_started=T0)
        verdicts.append(v)
        if v.outcome != "hold":
            break
    return verdicts


# -- tick by tick ---------------------------------------------------------------------------


def test_no_data_holds_it_is_neither_a_failure_nor_a_success() -> None:
    """flagger#1035 / argo-rollouts#1466: "no values found" must not fail or pass a step."""
    empty = window(CANARY, served(np.random.default_rng(0), 0))
    v = judge(dataclasses.replace(empty, version=STABLE), empty, policy(), step_started=T0)
    assert v.outcome == "hold" and v.breaches == ()
    # the latency gate needs the most stable data: 299 requests to pin the stable p99 at 95 %
    assert v.deadline == T0 + 900 and (v.more_canary, v.more_stable) == (50, 299)
    assert "no data yet: canary 0, stable 0 requests, min_samples 50 per arm" in v.summary
    gates = ["samples", "error_rate", "latency_p99", "predictions"]
    assert {g.gate: g.status for g in v.gates} == dict.fromkeys(gates, "pending")


def test_low_traffic_canary_holds_tick_by_tick_and_fails_only_at_the_deadline() -> None:
    p = policy(analysis_window_s=60.0, hold_deadline_s=300.0)
    verdicts = run_step(p, seed=1, rps=0.5, weight=10, canary={})  # ~3 canary requests a minute
    assert [v.outcome for v in verdicts] == ["hold"] * 4 + ["rollback"]
    more = [v.more_canary for v in verdicts[:4]]
    assert more == sorted(more, reverse=True) and more[-1] > 0  # each tick needs less
    last = verdicts[-1]
    assert [g.gate for g in last.breaches] == ["deadline"]  # not a gate: no gate ever failed
    deadline = last.breaches[0]
    assert (deadline.observed, deadline.allowed) == (300.0, 300.0)
    assert "still undecided 300 s into the step" in deadline.explanation and "samples (~" in deadline.explanation


def test_good_canary_holds_until_it_has_shown_it_is_no_worse_then_advances() -> None:
    verdicts = run_step(policy(), seed=2, rps=20, weight=10, canary={})
    outcomes = [v.outcome for v in verdicts]
    assert outcomes[-1] == "advance" and set(outcomes[:-1]) == {"hold"}
    assert 5 < len(verdicts) < 90  # more than min_samples alone, less than the deadline
    # what it waited for, after min_samples: evidence that errors are within the margin
    assert [g.gate for g in verdicts[-2].pending] == ["error_rate"]
    assert all(g.status == "pass" for g in verdicts[-1].gates)


def test_canary_with_5pct_more_errors_rolls_back_at_the_first_verdict() -> None:
    verdicts = run_step(policy(), seed=3, rps=20, weight=10, canary={"errors": 0.051})
    assert [v.outcome for v in verdicts] == ["hold"] * (len(verdicts) - 1) + ["rollback"]
    assert len(verdicts) <= 5  # 2 canary requests a second: min_samples 50 in ~25 s
    (gate,) = verdicts[-1].breaches
    assert gate.gate == "error_rate" and gate.observed > 0.01 and gate.allowed == 0.005 and gate.p_value < 0.05
    assert "above the margin at 95%" in gate.explanation


def test_3x_slower_canary_rolls_back_on_latency() -> None:
    verdicts = run_step(policy(), seed=4, rps=20, weight=10, canary={"median_ms": 30.0})
    gate = verdicts[-1].breaches[0]
    assert verdicts[-1].outcome == "rollback" and gate.gate == "latency_p99" and gate.observed > 2.5
    assert "finds it slower overall too" in gate.explanation


def test_shifted_predictions_roll_back_on_psi() -> None:
    verdicts = run_step(policy(), seed=5, rps=20, weight=50, canary={"scores": (3.0, 3.0)})
    gate = verdicts[-1].breaches[0]
    assert verdicts[-1].outcome == "rollback" and gate.gate == "predictions" and gate.observed > 0.2


# -- one window, one gate ---------------------------------------------------------------------


def test_error_rate_is_a_test_on_counts_not_a_threshold_on_small_ones() -> None:
    rng = np.random.default_rng(6)
    stable = window(STABLE, served(rng, 2000, errors=0.0))
    one_in_60 = window(CANARY, {**served(rng, 60, errors=0.0), "errors": 1})  # 1.7 %: noise
    assert judge(stable, one_in_60, policy(), step_started=T0).outcome == "hold"
    many = window(CANARY, {**served(rng, 600, errors=0.0), "errors": 30})  # 5 %: a regression
    v = judge(stable, many, policy(), step_started=T0)
    assert v.outcome == "rollback" and v.breaches[0].gate == "error_rate"


def test_error_test_is_exact_at_small_counts() -> None:
    """2 errors in 84 is 1 in 15 even for a good canary at 0.5 %; the normal approximation
    of the score test calls it p = 0.008, the exact test does not."""
    rng = np.random.default_rng(19)
    stable = window(STABLE, {**served(rng, 306, errors=0.0), "errors": 0})
    canary = window(CANARY, {**served(rng, 84, errors=0.0), "errors": 2})
    gate = next(g for g in judge(stable, canary, policy(), step_started=T0).gates if g.gate == "error_rate")
    assert gate.status == "pending" and gate.p_value > 0.05


def test_error_breaches_at_the_margin_stay_near_the_stated_confidence() -> None:
    rng = np.random.default_rng(20)
    p, breaches, runs = policy(), 0, 400
    for _ in range(runs):  # canary exactly 0.5 pp worse: a breach here is a false one
        stable = window(STABLE, served(rng, 540, errors=0.005))
        canary = window(CANARY, served(rng, 60, errors=0.010))
        gate = next(g for g in judge(stable, canary, p, step_started=T0).gates if g.gate == "error_rate")
        breaches += gate.status == "breach"
    assert breaches / runs < 0.06  # 5 % nominal; the normal approximation gives 7.3 % here


def test_error_rate_increase_within_the_margin_passes_with_enough_data() -> None:
    rng = np.random.default_rng(7)
    stable = window(STABLE, served(rng, 20000, errors=0.002))
    canary = window(CANARY, served(rng, 20000, errors=0.004))  # +0.2 pp, margin 0.5 pp
    gate = next(g for g in judge(stable, canary, policy(), step_started=T0).gates if g.gate == "error_rate")
    assert gate.status == "pass" and 0 < gate.observed < 0.005
    worse = window(CANARY, served(rng, 20000, errors=0.012))  # +1 pp
    gate = next(g for g in judge(stable, worse, policy(), step_started=T0).gates if g.gate == "error_rate")
    assert gate.status == "breach"


def test_error_gate_with_no_margin_passes_when_no_increase_is_found() -> None:
    rng = np.random.default_rng(8)
    p = policy(gates={"max_error_rate_increase": 0.0})
    stable, canary = window(STABLE, served(rng, 900)), window(CANARY, served(rng, 100))
    gate = next(g for g in judge(stable, canary, p, step_started=T0).gates if g.gate == "error_rate")
    assert gate.status == "pass" and "no increase found" in gate.explanation


def test_tail_only_slowdown_breaches_latency_though_the_rank_test_sees_little() -> None:
    rng = np.random.default_rng(29)
    stable = window(STABLE, served(rng, 9000))
    canary = window(CANARY, served(rng, 1000, slow_share=0.03))  # 3 % of requests 8x slower
    gate = next(g for g in judge(stable, canary, policy(), step_started=T0).gates if g.gate == "latency_p99")
    assert gate.status == "breach" and "finds no overall slowdown: a slower tail" in gate.explanation


def test_latency_waits_until_the_stable_p99_can_be_bounded() -> None:
    rng = np.random.default_rng(10)
    stable, canary = window(STABLE, served(rng, 200, errors=0.0)), window(CANARY, served(rng, 200, median_ms=30))
    gate = next(g for g in judge(stable, canary, policy(), step_started=T0).gates if g.gate == "latency_p99")
    # 0.99^298 > 0.05 > 0.99^299: fewer stable requests than that cannot pin the p99 at 95 %
    assert gate.status == "pending" and gate.more_stable == 99 and "299 stable" in gate.explanation


def test_stable_serving_nothing_at_100_percent_holds_and_asks_for_a_baseline() -> None:
    rng = np.random.default_rng(11)
    nothing = window(STABLE, served(rng, 0))
    v = judge(nothing, window(CANARY, served(rng, 1200)), policy(), step_started=T0)
    assert v.outcome == "hold" and v.more_stable == 299 and v.more_canary == 0
    assert "stable 0 requests" in v.summary


def test_small_samples_of_one_distribution_do_not_breach_psi_though_raw_psi_is_high() -> None:
    rng = np.random.default_rng(12)
    hits = 0
    for _ in range(50):
        stable, canary = window(STABLE, served(rng, 60)), window(CANARY, served(rng, 60))
        gate = next(g for g in judge(stable, canary, policy(), step_started=T0).gates if g.gate == "predictions")
        hits += gate.observed > 0.2
        assert gate.status != "breach"
    assert hits >= 5  # the raw PSI does cross the limit: the significance test is what holds


def test_shadow_gate_applies_in_the_shadow_phase_only() -> None:
    rng = np.random.default_rng(13)
    p = policy(gates={"min_shadow_agreement": 0.95})
    stable, shadow = window(STABLE, served(rng, 2000)), window(CANARY, served(rng, 2000))

    def gate(agreed: int, pairs: int, phase: str = "shadow"):
        v = judge(
            stable,
            dataclasses.replace(shadow, shadow_pairs=pairs, shadow_agreed=agreed),
            p,
            step_started=T0,
            phase=phase,
        )
        return next((g for g in v.gates if g.gate == "shadow_agreement"), None)

    assert gate(170, 200).status == "breach"  # 85 % < 95 %
    assert gate(500, 500).status == "pass"
    assert gate(191, 200).status == "pending"  # 95.5 %: not yet distinguishable from 95 %
    assert gate(10, 10).status == "pending" and gate(10, 10).more_canary == 40
    assert gate(170, 200, phase="canary") is None
    assert all(
        g.gate != "shadow_agreement" for g in judge(stable, shadow, policy(), step_started=T0, phase="shadow").gates
    )


def test_verdict_is_frozen_and_tabulates_observed_vs_allowed() -> None:
    def arms(seed: int) -> tuple[ArmWindow, ArmWindow]:
        rng = np.random.default_rng(seed)
        return window(STABLE, served(rng, 9000)), window(CANARY, served(rng, 1000, median_ms=30))

    v = judge(*arms(14), policy(), step_started=T0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.outcome = "advance"  # type: ignore[misc]
    rows = {row["gate"]: row for row in v.table()}
    assert set(rows) == {"samples", "error_rate", "latency_p99", "predictions"}
    assert rows["latency_p99"]["status"] == "breach" and rows["latency_p99"]["allowed"] == "<= 1.2 x"
    assert rows["samples"] == {
        "gate": "samples",
        "status": "pass",
        "observed": "1000 requests",
        "allowed": ">= 50 requests",
        "explanation": rows["samples"]["explanation"],
    }
    assert rows["error_rate"]["allowed"] == "<= +0.50 pp" and rows["error_rate"]["observed"].endswith("pp")
    # pure: time is the window's end, never the clock, so the same inputs give the same verdict
    assert judge(*arms(14), policy(), step_started=T0) == v


def test_histogram_quantile_reads_buckets_as_prometheus_does() -> None:
    counts = np.zeros(len(LATENCY_BUCKETS_MS) + 1, dtype=int)
    counts[1] = 4  # four requests in (1, 2] ms
    assert histogram_quantile(0.5, counts) == 1.5
    counts[-1] = 100  # the open bucket holds the quantile: the last finite bound
    assert histogram_quantile(0.99, counts) == LATENCY_BUCKETS_MS[-1]
    assert math.isnan(histogram_quantile(0.99, np.zeros_like(counts)))
    assert latency_bucket(10.0) == 5 and histogram_quantile(1.0, np.eye(22, dtype=int)[5]) == 10.0


def test_psi_is_zero_for_identical_histograms_and_finite_with_empty_bins() -> None:
    a = np.array([10, 20, 30, 0, 0, 0, 0, 0, 0, 40])
    assert psi(a, a) == 0.0
    assert 0 < psi(a, a[::-1]) < math.inf


def test_the_prediction_gate_reads_drift_monitorings_psi() -> None:
    rng = np.random.default_rng(14)
    stable, canary = window(STABLE, served(rng, 400)), window(CANARY, served(rng, 400, scores=(3.0, 3.0)))
    gate = next(g for g in judge(stable, canary, policy(), step_started=T0).gates if g.gate == "predictions")
    assert gate.observed == pytest.approx(float(psi(np.array(canary.predictions), np.array(stable.predictions))))


def _scores_at_psi(target: float) -> tuple[np.ndarray, np.ndarray]:
    """Bin probabilities of Beta(2, 5) scores, and of a mixture with Beta(3, 3) whose population
    PSI against them is ``target``."""
    edges = np.linspace(0, 1, PREDICTION_BINS + 1)
    p, r = np.diff(stats.beta(2, 5).cdf(edges)), np.diff(stats.beta(3, 3).cdf(edges))

    def mixed(t: float) -> np.ndarray:
        return (1 - t) * p + t * r

    t = optimize.brentq(lambda t: float(np.sum((p - mixed(t)) * np.log(p / mixed(t)))) - target, 0.0, 1.0)
    return p, mixed(t)


@pytest.mark.parametrize(("population_psi", "breaching"), [(0.2, (0.0, 0.05)), (0.6, (0.75, 1.0))])
def test_the_psi_gate_breaches_rarely_at_its_limit_and_mostly_at_three_times_it(population_psi, breaching) -> None:
    # 200 rows an arm, whose populations are as far apart as the limit 0.2 (then 3x it): at the
    # limit at most 1 - confidence of verdicts may breach, whatever the PSI's smoothing does
    rng = np.random.default_rng(int(population_psi * 10))
    stable_p, canary_p = _scores_at_psi(population_psi)

    def arm(version: str, bins: np.ndarray) -> ArmWindow:
        return window(
            version,
            {
                "requests": 200,
                "errors": 0,
                "buckets": np.full(200, 5),
                "bins": rng.choice(PREDICTION_BINS, 200, p=bins),
            },
        )

    draws = 300
    breaches = sum(
        next(
            g
            for g in judge(arm(STABLE, stable_p), arm(CANARY, canary_p), policy(), step_started=T0).gates
            if g.gate == "predictions"
        ).status
        == "breach"
        for _ in range(draws)
    )
    assert breaching[0] <= breaches / draws <= breaching[1]


# -- properties (seeded, could fail) -----------------------------------------------------------


def test_identical_arms_never_roll_back() -> None:
    rng = np.random.default_rng(15)
    for _ in range(200):
        n = int(rng.integers(0, 5000))
        scores = (float(rng.uniform(0.5, 5)), float(rng.uniform(0.5, 5)))
        traffic = served(
            rng,
            n,
            errors=float(rng.uniform(0, 0.05)),
            median_ms=float(rng.uniform(1, 500)),
            sigma=float(rng.uniform(0.1, 1.0)),
            scores=scores,
        )
        w = window(CANARY, traffic)
        v = judge(dataclasses.replace(w, version=STABLE), w, policy(), step_started=T0)
        assert v.outcome != "rollback", v.summary


def test_a_3x_slower_canary_with_enough_samples_always_rolls_back() -> None:
    rng = np.random.default_rng(16)
    for _ in range(100):
        median, sigma = float(rng.uniform(2, 300)), float(rng.uniform(0.2, 0.8))
        n = int(rng.integers(500, 3000))
        stable = window(STABLE, served(rng, 9 * n, median_ms=median, sigma=sigma))
        canary = window(CANARY, served(rng, n, median_ms=3 * median, sigma=sigma))
        v = judge(stable, canary, policy(), step_started=T0)
        assert v.outcome == "rollback" and "latency_p99" in [g.gate for g in v.breaches], v.summary


def test_independent_samples_of_one_version_rarely_breach_any_gate() -> None:
    """Each look tests at 95 %, but margins and tail tests keep the false breach rate well
    under 5 % (bench/rollout.py measures it over whole rollouts)."""
    rng = np.random.default_rng(17)
    breaches = 0
    for _ in range(300):
        n = int(rng.integers(50, 3000))
        stable, canary = window(STABLE, served(rng, 9 * n)), window(CANARY, served(rng, n))
        breaches += judge(stable, canary, policy(), step_started=T0).outcome == "rollback"
    assert breaches <= 3


def test_more_canary_errors_never_turn_a_rollback_into_an_advance() -> None:
    rng = np.random.default_rng(18)
    stable = window(STABLE, served(rng, 5000))
    base = served(rng, 1000, errors=0.0)
    outcomes = [
        judge(stable, window(CANARY, {**base, "errors": k}), policy(), step_started=T0).outcome for k in range(0, 60, 3)
    ]
    first_rollback = outcomes.index("rollback")
    assert "advance" not in outcomes[first_rollback:] and outcomes[0] == "advance"


def test_a_baseline_from_another_time_judges_errors_and_latency_but_not_predictions() -> None:
    rng = np.random.default_rng(9)
    baseline = window("1.0.0", served(rng, 2000, scores=(5.0, 2.0)))  # the traffic before looked different
    canary = window("1.1.0", served(rng, 2000, scores=(2.0, 5.0)))
    concurrent = judge(baseline, canary, policy(gates={"max_error_rate_increase": 0.02}), step_started=T0)
    assert concurrent.outcome == "rollback" and [g.gate for g in concurrent.breaches] == ["predictions"]
    at_100 = judge(baseline, canary, policy(gates={"max_error_rate_increase": 0.02}), step_started=T0, concurrent=False)
    gate = next(g for g in at_100.gates if g.gate == "predictions")
    assert at_100.outcome == "advance" and gate.status == "pass" and "inputs differ" in gate.explanation


@pytest.mark.parametrize("method", ["fixed", "sequential"])
def test_at_100_percent_a_slowdown_within_the_floor_is_not_blamed_on_the_canary(method: str) -> None:
    """At 100 % the baseline is from before: a canary 4x slower than it but under
    ``bake_latency_floor_ms`` (the model's SLO by default) is kept — the hour may be busier;
    one above the floor too is rolled back, and in the steps before, served beside the stable,
    4x is a breach whatever the floor."""
    from fleet.analysis import sequential

    rng = np.random.default_rng(12)
    baseline = window(STABLE, served(rng, 2000, median_ms=10.0, sigma=0.2))
    slower = window(CANARY, served(rng, 400, median_ms=40.0, sigma=0.2))
    slowest = window(CANARY, served(rng, 400, median_ms=400.0, sigma=0.2))
    floored = policy(method=method, gates={"max_p99_ratio": 2.0, "bake_latency_floor_ms": 250.0})

    def verdict(canary: ArmWindow, pol: RolloutPolicy, step: int = 2) -> Verdict:
        if method == "fixed":
            return judge(baseline, canary, pol, step_started=T0, concurrent=step < 2)
        stable_now = baseline if step < 2 else dataclasses.replace(window(STABLE, served(rng, 0)), requests=0)
        arms = sequential.Arms(canary, stable_now, canary, baseline, canary, stable_now)
        return sequential.judge(arms, pol, sequential.Evidence(), step=step, step_started=T0)[0]

    def latency(v: Verdict) -> str:
        return next(g for g in v.gates if g.gate == "latency_p99").status

    assert latency(verdict(slower, floored)) == "pass"
    assert (
        "bake_latency_floor_ms"
        in next(g for g in verdict(slower, floored).gates if g.gate == "latency_p99").explanation
    )
    assert latency(verdict(slower, policy(method=method, gates={"max_p99_ratio": 2.0}))) == "breach"  # no floor
    assert latency(verdict(slowest, floored)) == "breach"
    assert latency(verdict(slower, floored, step=1)) == "breach"  # beside the stable the floor plays no part


# -- generations: TTFT is the latency; time per output token and output lengths have gates of their own
def generations(
    metrics: MemoryMetrics,
    version: str,
    at: float,
    rng: np.random.Generator,
    n: int,
    *,
    ttft_ms: float = 40.0,
    tpot_ms: float = 5.0,
    tokens: tuple[int, int] = (8, 24),
) -> None:
    for _ in range(n):
        metrics.generated(
            MODEL,
            version,
            at,
            ttft_ms * math.exp(rng.normal(0, 0.2)),
            tpot_ms * math.exp(rng.normal(0, 0.2)),
            int(rng.integers(*tokens)),
        )


GEN = {"max_tpot_p99_ratio": 1.5, "max_output_length_psi": 0.25}


def judge_ticks(canary: dict, ticks: int = 12, seed: int = 5) -> list[Verdict]:
    """Each 10 s tick: 30 generations a second on stable, 10 on the canary; a verdict over the step so far."""
    rng, m, p, out = np.random.default_rng(seed), MemoryMetrics(), policy(gates=GEN), []
    for tick in range(ticks):
        at = T0 + 10 * tick
        generations(m, STABLE, at, rng, 300)
        generations(m, CANARY, at, rng, 100, **canary)
        end = at + 10
        out.append(judge(m.window(MODEL, STABLE, T0, end), m.window(MODEL, CANARY, T0, end), p, step_started=T0))
    return out


def test_a_good_generative_canary_advances_with_every_generation_gate_judged() -> None:
    verdicts = judge_ticks({})
    assert verdicts[-1].outcome == "advance", verdicts[-1].summary
    gates = {g.gate: g.status for g in verdicts[-1].gates}
    assert gates["tpot_p99"] == gates["output_length"] == gates["latency_p99"] == "pass"


@pytest.mark.parametrize(
    ("canary", "gate"),
    [
        ({"ttft_ms": 200.0}, "latency_p99"),  # a slow first token: the latency gate reads TTFT
        ({"tpot_ms": 20.0}, "tpot_p99"),  # slow tokens
        ({"tokens": (1, 3)}, "output_length"),
    ],  # answers cut short (or garbage that ends at once)
)
def test_a_bad_generative_canary_is_rolled_back_by_its_own_gate_within_a_few_ticks(canary: dict, gate: str) -> None:
    verdicts = judge_ticks(canary)
    first = next(i for i, v in enumerate(verdicts) if v.outcome != "hold")
    assert verdicts[first].outcome == "rollback" and first <= 2, verdicts[first].summary
    assert {g.gate for g in verdicts[first].gates if g.status == "breach"} >= {gate}


def test_tensor_policies_have_no_generation_gates_and_a_generation_waits_for_its_samples() -> None:
    m = MemoryMetrics()
    rng = np.random.default_rng(1)
    generations(m, STABLE, T0, rng, 10)
    generations(m, CANARY, T0, rng, 10)
    stable, canary = m.window(MODEL, STABLE, T0, T0 + 10), m.window(MODEL, CANARY, T0, T0 + 10)
    assert "tpot_p99" not in {g.gate for g in judge(stable, canary, policy(), step_started=T0).gates}
    held = judge(stable, dataclasses.replace(canary, tpot_ms=(), output_tokens=()), policy(gates=GEN), step_started=T0)
    assert held.outcome == "hold" and {g.gate: g.status for g in held.gates}["tpot_p99"] == "pending"


# -- exact-match feedback on generations: labels arrive when callers send them, if ever
EXACT = {**GEN, "max_exact_match_drop": 0.05, "min_labels": 30}


def labelled_ticks(stable_rate: float, canary_rate: float, labels_per_tick: int, ticks: int = 12) -> list[Verdict]:
    """Good generations on both arms; each tick ``labels_per_tick`` labels per arm, matching at these rates."""
    rng, m, p, out = np.random.default_rng(9), MemoryMetrics(), policy(gates=EXACT), []
    for tick in range(ticks):
        at = T0 + 10 * tick
        generations(m, STABLE, at, rng, 300)
        generations(m, CANARY, at, rng, 100)
        for version, rate in ((STABLE, stable_rate), (CANARY, canary_rate)):
            matched = int(rng.binomial(labels_per_tick, rate))
            if matched:
                m.labelled(MODEL, version, at, True, matched)
            if labels_per_tick - matched:
                m.labelled(MODEL, version, at, False, labels_per_tick - matched)
        end = at + 10
        out.append(judge(m.window(MODEL, STABLE, T0, end), m.window(MODEL, CANARY, T0, end), p, step_started=T0))
    return out


def test_garbage_answers_are_caught_by_exact_match_feedback_while_latency_and_lengths_look_fine() -> None:
    verdicts = labelled_ticks(stable_rate=0.9, canary_rate=0.3, labels_per_tick=20)
    first = next(i for i, v in enumerate(verdicts) if v.outcome != "hold")
    assert verdicts[first].outcome == "rollback" and first <= 2, verdicts[first].summary
    assert [g.gate for g in verdicts[first].breaches] == ["exact_match"]
    assert "exact match canary" in verdicts[first].breaches[0].explanation


def test_exact_match_never_holds_a_step_without_labels_and_passes_an_equal_canary() -> None:
    unlabelled = labelled_ticks(0.9, 0.3, labels_per_tick=0)[-1]
    gate = next(g for g in unlabelled.gates if g.gate == "exact_match")
    assert unlabelled.outcome == "advance" and gate.status == "pass" and "not judged: 0 canary" in gate.explanation
    equal = labelled_ticks(0.9, 0.9, labels_per_tick=20)[-1]
    assert equal.outcome == "advance" and {g.gate: g.status for g in equal.gates}["exact_match"] == "pass"
    assert "exact_match" not in {
        g.gate for g in judge(*(labelled_window(v) for v in (STABLE, CANARY)), policy(gates=GEN), step_started=T0).gates
    }  # no gate unless the policy sets one


def labelled_window(version: str):  # noqa: ANN201 - an ArmWindow
    m = MemoryMetrics()
    generations(m, version, T0, np.random.default_rng(3), 100)
    m.labelled(MODEL, version, T0, True, 40)
    return m.window(MODEL, version, T0, T0 + 10)
