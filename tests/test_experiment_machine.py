"""The experiment's decisions look by look, on the pure machine alone: no store, no metrics
source, no logs (test_experiment runs the executor and the flow)."""

from __future__ import annotations

import numpy as np
import pytest

from fleet.analysis.ab import MAX_TICKS_KEPT
from fleet.catalog.experiments import ExperimentState, ExperimentStatus
from fleet.catalog.policies.loader import load_policies
from fleet.control.experiment.machine import Look, errored, keeps_b, reads, start, step
from fleet.control.rollout.reading import READ_SLACK_S
from tests.rollout_driver import GOOD, ROOT, Traffic, served

A, B = "1.0.0", "1.1.0"
T0 = 1_000_000.3  # not a whole second: the counters are read from the next one on
POLICY = load_policies(ROOT / "policies").rollout["default"]


def begun(**overrides: object) -> ExperimentState:
    params = {
        "model": "demo",
        "arms": (A, B),
        "split": (50.0, 50.0),
        "metric": "clicked",
        "min_effect": 0.05,
        "span": 1.0,
        "alpha": 0.05,
        "max_duration_s": 3600.0,
        "promote": True,
        "run_id": "r",
        "now": T0,
    }
    return start(**{**params, **overrides})


def look(
    state: ExperimentState,
    now: float,
    rng: np.random.Generator | None = None,
    rates: tuple[float, float] = (0.2, 0.2),
    n: int = 0,
    b: Traffic = GOOD,
    stop: str | None = None,
    rps: float = 20.0,
) -> tuple[Look, ExperimentState]:
    """What the executor would read at ``now``: the counters ``reads`` names (``rps`` per arm)
    and ``n`` outcomes per arm so far, clicked at ``rates``."""
    wanted = reads(state, now)
    ticks = [served(r.version, r.start, r.end + READ_SLACK_S, rps, GOOD if r.arm == "a" else b) for r in wanted or ()]
    rng = rng or np.random.default_rng(0)
    outcomes = {A: (rng.random(n) < rates[0]).astype(float), B: (rng.random(n) < rates[1]).astype(float)}
    seen = Look(now, *(ticks or [None, None]), outcomes=outcomes, stop=stop)
    return seen, step(state, seen, POLICY)


def test_a_new_experiment_reads_from_the_next_whole_second_and_waits_for_outcomes() -> None:
    state = begun()
    assert state.status == ExperimentStatus.RUNNING and state.ticked_at == 1_000_001
    assert reads(state, T0 + 0.5) is None  # no whole second yet
    a, b = reads(state, T0 + 5.0)
    assert (a.arm, a.version, a.start, a.end) == ("a", A, 1_000_001, 1_000_005 - READ_SLACK_S) and b.version == B
    _, after = look(state, T0 + 5.0, n=10)
    assert after.status == ExperimentStatus.RUNNING and after.summary.startswith("waiting: 30 outcomes per arm")
    assert after.ticked_at == 1_000_005 and after.served["a"]["requests"] == 80 and after.ticks[-1].n == (10, 10)
    assert after.ticks[-1].diff is None and after.evidence["looks"] == 1


def test_a_late_look_reads_no_more_than_the_source_keeps() -> None:
    """The gateways keep 15 minutes: a look 40 minutes after the last (a stalled process)
    asks for the last 900 s only, rather than failing on a window no gateway has."""
    state = begun()
    a, b = reads(state, T0 + 2400.0, max_window_s=900)
    assert (a.start, a.end) == (1_002_400 - 900, 1_002_400 - READ_SLACK_S) and (b.start, b.end) == (a.start, a.end)
    assert reads(state, T0 + 2400.0)[0].start == 1_000_001  # a source that keeps everything: since the last look
    assert reads(state, T0 + 5.0, max_window_s=900)[0].start == 1_000_001  # in time: nothing left out


def test_the_served_totals_and_evidence_add_up_look_by_look() -> None:
    state = begun()
    for k in range(1, 6):
        _, state = look(state, T0 + 5.0 * k, n=10 * k)
    assert state.served["b"]["requests"] == 20 * (1_000_025 - 1_000_001) and state.evidence["looks"] == 5
    assert [t.at for t in state.ticks] == [T0 + 5.0 * k for k in range(1, 6)]


def test_a_planted_effect_ends_with_b_winning_and_b_is_kept_to_be_rolled_out() -> None:
    rng = np.random.default_rng(7)
    _, after = look(begun(), T0 + 10.0, rng, rates=(0.2, 0.8), n=400)
    assert (after.status, after.winner) == (ExperimentStatus.WINNER, B) and after.ticks[-1].lo > 0
    assert after.summary.startswith(f"{B} wins: clicked") and keeps_b(after)
    assert not keeps_b(after.model_copy(update={"promote": False}))
    _, worse = look(begun(), T0 + 10.0, rng, rates=(0.8, 0.2), n=400)
    assert (worse.status, worse.winner) == (ExperimentStatus.WINNER, A) and not keeps_b(worse)


def test_no_effect_ends_as_no_difference_and_undecided_runs_out_of_time() -> None:
    rng = np.random.default_rng(3)
    _, same = look(begun(min_effect=0.2), T0 + 10.0, rng, rates=(0.5, 0.5), n=2000)
    assert same.status == ExperimentStatus.NO_DIFFERENCE and same.winner is None
    _, late = look(begun(max_duration_s=60.0), T0 + 60.0, rng, n=5)
    assert late.status == ExperimentStatus.OUT_OF_TIME and "too few outcomes" in late.summary


def test_a_guardrail_stops_an_experiment_whose_b_fails_more() -> None:
    state = begun()
    for k in range(1, 13):
        _, state = look(state, T0 + 5.0 * k, b=Traffic(errors=0.2))
        if state.status != ExperimentStatus.RUNNING:
            break
    assert state.status == ExperimentStatus.STOPPED and state.summary.startswith("guardrail error_rate")
    assert state.winner is None


def test_a_stop_request_wins_over_a_decision_of_the_same_look() -> None:
    rng = np.random.default_rng(7)
    _, after = look(begun(), T0 + 10.0, rng, rates=(0.2, 0.8), n=400, stop="someone (enough)" + "x" * 300)
    assert after.status == ExperimentStatus.STOPPED and after.winner is None
    assert after.summary.startswith("stopped by someone (enough)xx") and f"{B} wins" in after.summary
    assert "x" * 184 + ":" in after.summary and "x" * 185 + ":" not in after.summary  # 200 characters of it


def test_a_failed_look_changes_nothing_until_the_time_is_up() -> None:
    state = begun(max_duration_s=60.0)
    assert step(state, Look(T0 + 30.0, unavailable="gateway down"), POLICY) is state  # look again
    over = step(state, Look(T0 + 60.0, unavailable="gateway down"), POLICY)
    assert over.status == ExperimentStatus.OUT_OF_TIME
    assert over.summary == "out of time; the last look failed: gateway down"


def test_a_decided_experiment_absorbs_later_looks_and_an_error_stops_it() -> None:
    rng = np.random.default_rng(7)
    _, won = look(begun(), T0 + 10.0, rng, rates=(0.2, 0.8), n=400)
    assert step(won, Look(T0 + 20.0, outcomes={}), POLICY) is won
    stopped = errored(begun(), KeyboardInterrupt("cancelled"))
    assert (
        stopped.status == ExperimentStatus.STOPPED
        and stopped.summary == "stopped by an error: KeyboardInterrupt: cancelled"
    )


@pytest.mark.parametrize("looks", [MAX_TICKS_KEPT + 1, MAX_TICKS_KEPT + 40])
def test_the_plotted_history_stays_bounded(looks: int) -> None:
    state = begun(max_duration_s=10**6)
    for k in range(1, looks + 1):
        state = step(state, Look(T0 + k, outcomes={}), POLICY)
    assert len(state.ticks) <= MAX_TICKS_KEPT and state.ticks[-1].at == T0 + looks
