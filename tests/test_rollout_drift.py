"""The recorded shifted-predictions case, on the pure machine: the end-to-end test's canaries
(``test_rollout_flow``: stable 1.0.0, shifted 2.0.3 trained with ``--label-threshold 2.5``,
good 1.1.0 with ``--seed 11``; rows 20000, epochs 15) as their measured score histograms,
at 60 req/s under the FAST policy of ``tests/rollout_env.py``, judged tick by tick.

``fixtures/drift/score_histograms.json``: each version's last-class score over 400,000
``normal(4).round(3)`` inputs (the Load's), binned as the gateway bins them (fractions per
bin 0..9). The shifted canary's scores are within the other gates' limits and its PSI
against the stable's is past 0.2; the good one's well within. The drift gate's last step
with stable traffic holds until the PSI is shown within the limit
(``fleet.analysis.sequential._psi_shown_within``), so the shifted canary never reaches 100 %.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fleet.catalog.rollouts import Phase, RolloutState
from fleet.control.rollout.machine import Checked, Deployed, Looked
from fleet.control.rollout.reading import READ_SLACK_S, needs
from fleet.types import ERROR_CLASSES, LATENCY_BUCKETS_MS, ArmWindow
from tests.rollout_driver import CANARY, MODEL, PASS, STABLE, T0, Run, policy
from tests.rollout_env import FAST

HISTOGRAMS = json.loads((Path(__file__).parent / "fixtures" / "drift" / "score_histograms.json").read_text())
RPS = 60.0
BASE_ERRORS = 0.001  # both arms
LATE_IN_SECOND = 0.9  # where the flow takes its looks (flows.rollout._next_look)


def arm(rng: np.random.Generator, version: str, n: int, scores: list[float], start: float, end: float) -> ArmWindow:
    """``n`` requests: errors Bernoulli(BASE_ERRORS), latency lognormal around 10 ms (p99 ~ 25
    ms), each answer's score bin drawn from ``scores`` (the version's histogram)."""
    failed = int(rng.binomial(n, BASE_ERRORS))
    ok = n - failed
    latency = np.exp(rng.normal(np.log(10.0), 0.4, ok))
    buckets = np.bincount(
        np.searchsorted(LATENCY_BUCKETS_MS, latency, side="left"), minlength=len(LATENCY_BUCKETS_MS) + 1
    )
    bins = rng.multinomial(ok, np.asarray(scores) / np.sum(scores))
    return ArmWindow(
        model=MODEL,
        version=version,
        start=start,
        end=end,
        requests=n,
        errors={"5xx": failed, **dict.fromkeys(ERROR_CLASSES[1:], 0)},
        latency_ms=tuple(int(c) for c in buckets),
        predictions=tuple(int(c) for c in bins),
    )


def rollout(canary: str, seed: int, ticks: int = 400) -> RolloutState:
    """One seeded rollout of ``canary`` (scores of that version) to the end: each look reads
    what ``needs`` names; requests arrive Poisson at RPS and go to the canary by its weight."""
    rng = np.random.default_rng(seed)
    run = Run(policy(**FAST, method="sequential"))
    run.now = T0 + LATE_IN_SECOND
    run.begin()
    run.do(Checked(PASS, registered=True))
    base = needs(run.state, run.policy, run.now).baseline  # the stable at full traffic before the rollout
    seconds = base.end - base.start
    baseline = arm(rng, STABLE, int(rng.poisson(RPS * seconds)), HISTOGRAMS[STABLE], base.start, base.end)
    run.do(Deployed(run.now, baseline=baseline))
    for _ in range(ticks):
        if run.state.phase == Phase.PROMOTE:
            run.promote()
        if run.state.done:
            return run.state
        run.now += run.policy.analysis_window_s
        reads = {r.arm: r for r in needs(run.state, run.policy, run.now).ticks}
        windows = {}
        if reads:
            r = reads["canary"]
            n = int(rng.poisson(RPS * (int(r.end + READ_SLACK_S) - int(r.start))))
            to_canary = int(rng.binomial(n, run.route.weight / 100))
            windows = {
                "canary": arm(rng, CANARY, to_canary, HISTOGRAMS[canary], r.start, r.end),
                "stable": arm(rng, STABLE, n - to_canary, HISTOGRAMS[STABLE], r.start, r.end),
            }
        run.do(Looked(run.now, run.route, windows.get("canary"), windows.get("stable")))
    raise AssertionError(f"{canary}: still {run.state.phase} at step {run.state.step} after {ticks} looks")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_canary_with_shifted_predictions_is_rolled_back_on_predictions_before_100(seed: int) -> None:
    state = rollout("2.0.3", seed)
    assert state.phase == Phase.ROLLED_BACK and "predictions" in state.breached, state.reason
    assert state.reports[-1].weight < 100 and all(r.weight < 100 for r in state.reports), state.reports
    assert state.reports[-1].outcome == "rollback"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_good_canary_with_the_stables_predictions_is_promoted(seed: int) -> None:
    state = rollout("1.1.0", seed)
    assert state.phase == Phase.PROMOTED, state.reason
    assert [r.weight for r in state.reports] == [20.0, 50.0, 100.0] and state.breached == []
