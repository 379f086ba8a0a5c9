"""What a rollout tick reads and how it judges what it read: pure.

``needs(state, policy, now)`` names the metric windows the executor must read for the next
observation; ``judge_tick`` turns them into a verdict with ``fleet.analysis.canary`` (the
"fixed" method) or ``fleet.analysis.sequential`` (the "sequential" method, with the running
totals and evidence the state keeps). ``fleet.control.rollout.machine`` acts on the verdict.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from fleet.analysis import sequential
from fleet.analysis.canary import Verdict, judge
from fleet.analysis.reference import BASELINE_S
from fleet.analysis.sources import empty_window, sum_windows
from fleet.catalog.policies.rollout import RolloutPolicy, judged
from fleet.catalog.rollouts import JUDGED, SERVING, Phase, RolloutState, arm_window
from fleet.types import ArmWindow

READ_SLACK_S = 0.001  # a tick reads [since, upto - this): whole seconds, never the second at upto


@dataclass(frozen=True)
class Read:
    """One window to read: ``arm`` (canary | stable | baseline) is ``version`` over [start, end]."""

    arm: str
    version: str
    start: float
    end: float


@dataclass(frozen=True)
class Needs:
    """The windows the next observation carries, in the order to read them (``ticks``: the
    analysis tick's; ``baseline``: the stable's before the rollout, when the next step may
    be the first)."""

    ticks: tuple[Read, ...] = ()
    baseline: Read | None = None


def needs(state: RolloutState, policy: RolloutPolicy, now: float) -> Needs:
    ticks: tuple[Read, ...] = ()
    if state.phase in SERVING and policy.method == "sequential":
        since, upto = tick_span(state, now)
        if since < upto:  # [since, upto): whole seconds, the one still running left for the next tick
            ticks = (
                Read("canary", state.version, since, upto - READ_SLACK_S),
                Read("stable", state.champion, since, upto - READ_SLACK_S),
            )
    elif state.phase in JUDGED:
        t0 = state.step_started
        ticks = (Read("stable", state.champion, t0, now), Read("canary", state.version, t0, now))
    baseline = Read("baseline", state.champion, now - BASELINE_S, now) if _may_begin_steps(state, policy, now) else None
    return Needs(ticks, baseline)


def _may_begin_steps(state: RolloutState, policy: RolloutPolicy, now: float) -> bool:
    """Whether the observation may take the rollout to its first weight step (a first step at
    100 % reads the baseline before it asks for approval: ``fleet.analysis.reference``)."""
    if state.step != -1:
        return False
    if state.phase == Phase.DEPLOY:
        return state.waiting or not (policy.shadow_percent > 0 and policy.shadow_duration_s > 0)
    if state.phase == Phase.SHADOW:
        return now - state.step_started >= policy.shadow_duration_s
    return state.phase == Phase.APPROVAL


def larger(kept: dict | None, read: ArmWindow | None) -> ArmWindow | None:
    """The stored baseline or the one just read, whichever saw more requests."""
    stored = arm_window(kept) if kept else None
    if stored is None or (read is not None and read.requests >= stored.requests):
        return read
    return stored


def tick_span(state: RolloutState, now: float) -> tuple[int, int]:
    """The whole seconds [since, upto) a sequential tick reads. A metrics source counts by
    the second: reading a second twice would count its requests twice, so each tick reads
    from where the last one ended (or the step began) to the last whole second."""
    since = max(math.ceil(state.step_started), int(state.ticked_at))
    return since, max(math.floor(now), since)


def judge_tick(
    state: RolloutState, policy: RolloutPolicy, now: float, canary: ArmWindow | None, stable: ArmWindow | None
) -> tuple[Verdict, RolloutState, ArmWindow | None]:
    """(verdict, the state with the sequential totals and evidence updated, the step's stable
    window when the fixed method judged it — a baseline candidate)."""
    policy = judged(policy, state.strategy)
    if state.phase in SERVING and policy.method == "sequential":
        verdict, state = _sequential(state, policy, now, canary, stable)
        return verdict, state, None
    t0 = state.step_started
    canary = canary or empty_window(state.model, state.version, t0, now)
    stable = stable or empty_window(state.model, state.champion, t0, now)
    reference, concurrent = stable, True
    if state.phase in SERVING and state.weight >= 100 and state.baseline:
        reference, concurrent = arm_window(state.baseline), False
    verdict = judge(
        reference,
        canary,
        policy,
        step_started=t0,
        concurrent=concurrent,
        phase="shadow" if state.phase == Phase.SHADOW else "canary",
    )
    return verdict, state, stable


def _sequential(
    state: RolloutState, policy: RolloutPolicy, now: float, tick_c: ArmWindow | None, tick_s: ArmWindow | None
) -> tuple[Verdict, RolloutState]:
    """One tick of ``fleet.analysis.sequential``: this tick's windows (over ``tick_span``) added
    to the totals since the first step and since the step began, which the state keeps, and
    fed to the tests' evidence. No window longer than a tick is read, so a step may last
    longer than a source keeps."""
    since, upto = tick_span(state, now)
    if since >= upto or tick_c is None or tick_s is None:
        tick_c = empty_window(state.model, state.version, since, since)
        tick_s = empty_window(state.model, state.champion, since, since)
        upto = since
    elif state.weight >= 100:
        # at 100 % the stable answers only the canary's failed requests again: a sample the
        # canary chose, not the stable's traffic (beside it, its own baseline stands in)
        tick_s = empty_window(state.model, state.champion, since, upto)
    kept = state.step_served if state.step_of == state.step_started else {}

    def plus(totals: dict[str, dict], arm: str, window: ArmWindow) -> ArmWindow:
        before = [arm_window(totals[arm])] if arm in totals else []
        return sum_windows([*before, window], window.model, window.version, since, upto)

    served = {"canary": plus(state.served, "canary", tick_c), "stable": plus(state.served, "stable", tick_s)}
    step = {"canary": plus(kept, "canary", tick_c), "stable": plus(kept, "stable", tick_s)}
    stable_all = served["stable"]
    if stable_all.requests == 0 and state.baseline:
        # a rollout straight to 100 %: the stable at full traffic before it is all there is
        stable_all = replace(arm_window(state.baseline), version=state.champion)
    arms = sequential.Arms(tick_c, tick_s, served["canary"], stable_all, step["canary"], step["stable"])
    verdict, evidence = sequential.judge(
        arms,
        policy,
        sequential.Evidence.from_dict(state.evidence),
        step=state.step,
        step_started=state.step_started,
    )
    state = state.model_copy(
        update={
            "served": {k: asdict(w) for k, w in served.items()},
            "step_served": {k: asdict(w) for k, w in step.items()},
            "step_of": state.step_started,
            "evidence": evidence.to_dict(),
            "ticked_at": upto,
        }
    )
    return verdict, state
