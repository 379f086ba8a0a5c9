"""Every decision of an A/B experiment, as pure functions over its looks.

``step(state, look, policy)`` takes the stored ``ExperimentState``
(``fleet.catalog.experiments``) and one ``Look`` — this look's gateway counters of both arms,
the outcomes logged per arm since the start, the clock, a stop request — and returns the
new state: the guardrails (``fleet.analysis.sequential.guardrails``: B's errors and p99
against A's) on the served totals and evidence it keeps, the always-valid interval and
decision (``fleet.analysis.ab``), and the tick kept for the plot. A guardrail's harm stops
it; a stop request wins over a decision of the same look. ``reads(state, now)`` names the
counters the executor reads for the next look (``fleet.control.experiment.effects``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import numpy as np

from fleet.analysis import sequential
from fleet.analysis.ab import arm_stats, arm_stats_of_sums, decide, interval, thinned
from fleet.analysis.sources import empty_window, sum_windows
from fleet.catalog.experiments import ExperimentState, ExperimentStatus, Tick
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.catalog.rollouts import arm_window
from fleet.control.rollout.reading import READ_SLACK_S, Read
from fleet.types import ArmWindow

STOP_SHOWN = 200  # characters of a stop request kept in the summary


@dataclass(frozen=True)
class Look:
    """What the executor read for one look (the counters first: the gateways' source reads
    only windows ending now, and reading the logs may take seconds)."""

    now: float
    tick_a: ArmWindow | None = None  # the counters ``reads`` named; None: no whole second to read
    tick_b: ArmWindow | None = None
    outcomes: Mapping[str, np.ndarray] | None = None  # version → the metric of each logged request with one
    # or, kept up to date a look at a time (fleet.logs.increments): version → (n, sum, sum of
    # squares) of every outcome so far; and the settled part of those, for the state
    sums: Mapping[str, tuple[int, float, float]] | None = None
    settled: Mapping[str, tuple[int, float, float]] | None = None
    settled_until: datetime | None = None
    stop: str | None = None  # who asked to stop and why; None: nobody
    unavailable: str | None = None  # the look failed (metrics or logs unreadable): why


def start(
    *,
    model: str,
    arms: tuple[str, str],
    split: tuple[float, float],
    metric: str,
    min_effect: float,
    span: float,
    alpha: float,
    max_duration_s: float,
    promote: bool,
    run_id: str,
    now: float,
) -> ExperimentState:
    """A new experiment; its counters are read from the next whole second on."""
    return ExperimentState(
        model=model,
        arms=arms,
        split=split,
        metric=metric,
        min_effect=min_effect,
        span=span,
        alpha=alpha,
        max_duration_s=max_duration_s,
        promote=promote,
        run_id=run_id,
        started_at=datetime.fromtimestamp(now, UTC),
        ticked_at=math.ceil(now),
    )


def reads(state: ExperimentState, now: float, max_window_s: int | None = None) -> tuple[Read, Read] | None:
    """The counters of A and B over the whole seconds since the last look, as the rollout
    reads them (``fleet.control.rollout.reading.tick_span``): a per-second source would count
    a second read twice twice. None: no whole second since. Never longer than the source
    keeps (``max_window_s``): after a look that came late, the seconds before are not read
    (the guardrails miss them) rather than the look failing on a window nobody has."""
    since, upto = int(state.ticked_at), math.floor(now)
    if max_window_s is not None:
        since = max(since, upto - max_window_s)  # a window of upto - since seconds (the last one left out)
    if since >= upto:
        return None
    a, b = state.arms
    return Read("a", a, since, upto - READ_SLACK_S), Read("b", b, since, upto - READ_SLACK_S)


def step(state: ExperimentState, look: Look, policy: RolloutPolicy) -> ExperimentState:
    """One look: the guardrails, the interval, the decision (no route change: the executor
    ends the split once the status is no longer running). A look that failed changes
    nothing, unless the time is up."""
    if state.status != ExperimentStatus.RUNNING:
        return state  # decided: later looks change nothing
    out_of_time = look.now >= state.started_at.timestamp() + state.max_duration_s
    if look.unavailable is not None:
        if not out_of_time:
            return state  # no data is not a decision: look again
        summary = f"out of time; the last look failed: {look.unavailable}"
        return state.model_copy(update={"status": ExperimentStatus.OUT_OF_TIME, "summary": summary})
    (a, b), values = state.arms, look.outcomes or {}
    harm, served, evidence, read_upto = _guardrails(state, look, policy)
    if look.sums is not None:
        stats_a, stats_b = (arm_stats_of_sums(v, look.sums.get(v, (0, 0.0, 0.0))) for v in (a, b))
    else:
        stats_a = arm_stats(a, values.get(a, np.empty(0)))
        stats_b = arm_stats(b, values.get(b, np.empty(0)))
    found = interval(stats_a, stats_b, state.alpha, state.min_effect, state.span)
    decision = decide(stats_a, stats_b, found, state.min_effect, out_of_time, state.metric)
    status, winner, summary = decision.status, decision.winner, decision.summary
    if harm:
        summary = "guardrail " + "; ".join(f"{g.gate}: {g.explanation}" for g in harm)
        status, winner = ExperimentStatus.STOPPED, None
    elif look.stop is not None:  # a stop asked for wins over a decision of the same look
        summary = f"stopped by {look.stop[:STOP_SHOWN]}: {decision.summary}"
        status, winner = ExperimentStatus.STOPPED, None
    point = Tick(
        at=look.now,
        n=(stats_a.n, stats_b.n),
        mean=(_finite(stats_a.mean), _finite(stats_b.mean)),
        diff=found.diff if found else None,
        lo=found.lo if found else None,
        hi=found.hi if found else None,
    )
    return state.model_copy(
        update={
            "status": status,
            "winner": winner,
            "summary": summary,
            "ticked_at": read_upto,
            "served": served,
            "evidence": evidence,
            "ticks": thinned([*state.ticks, point]),
            "settled": dict(look.settled) if look.settled is not None else state.settled,
            "settled_until": look.settled_until or state.settled_until,
        }
    )


def errored(state: ExperimentState, error: BaseException) -> ExperimentState:
    """An error (or a cancel) ends it too: recorded as stopped."""
    summary = f"stopped by an error: {type(error).__name__}: {error}"
    return state.model_copy(update={"status": ExperimentStatus.STOPPED, "winner": None, "summary": summary})


def keeps_b(state: ExperimentState) -> bool:
    """Whether B stays deployed when the experiment ends: it won and is to be rolled out."""
    return state.status == ExperimentStatus.WINNER and state.winner == state.arms[1] and state.promote


def _finite(x: float) -> float:
    return x if np.isfinite(x) else 0.0


def _guardrails(state: ExperimentState, look: Look, policy: RolloutPolicy) -> tuple[list, dict, dict, int]:
    """B's errors and p99 against A's, on the gateways' counters (fleet.analysis.sequential's
    harm tests): (breaches, the served totals, the evidence, the second read up to)."""
    model, (a, b), now = state.model, state.arms, look.now
    since, upto = int(state.ticked_at), math.floor(now)
    if since >= upto or look.tick_a is None or look.tick_b is None:
        tick_a, tick_b = empty_window(model, a, since, since), empty_window(model, b, since, since)
    else:
        tick_a, tick_b = look.tick_a, look.tick_b

    def total(arm: str, version: str, window: ArmWindow) -> ArmWindow:
        before = [arm_window(state.served[arm])] if arm in state.served else []
        return sum_windows([*before, window], model, version, since, now)

    totals = {"a": total("a", a, tick_a), "b": total("b", b, tick_b)}
    arms = sequential.Arms(tick_b, tick_a, totals["b"], totals["a"], totals["b"], totals["a"])
    results, evidence = sequential.guardrails(arms, policy, sequential.Evidence.from_dict(state.evidence))
    breaches = [g for g in results if g.status == "breach"]
    return breaches, {k: asdict(w) for k, w in totals.items()}, evidence.to_dict(), max(upto, since)
