"""The rollout machine's invariants over every phase × observation (Hypothesis): terminal
phases absorb; weights only from the policy's steps, and only once deployed; a rollback
action exactly when the rollout enters rolled_back; promote only after the last step and
promoted only from promote; the state returned is the state last saved; route changes
expect the route as the rollout left it; refusals only where a request does not fit."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.catalog.rollouts import Phase, RolloutState, StepReport
from fleet.control.rollout.machine import (
    Answered,
    Begin,
    Checked,
    Deployed,
    Looked,
    Observation,
    Promoting,
    Route,
    RouteMoved,
    SetRoute,
    step,
)
from fleet.control.rollout.reading import needs
from fleet.errors import Conflict, InvalidInput
from tests.rollout_driver import CANARY, MODEL, PASS, STABLE, T0, Traffic, check, policy, served

POLICIES = [
    policy(),
    policy(method="sequential", steps=[20, 50, 100], analysis_window_s=2, min_samples=40),
    policy(manual_approval=True),
    policy(shadow_percent=10, shadow_duration_s=120),
    policy(steps=[100], manual_approval=True),
    policy(steps=[100], method="sequential", min_samples=20),
    policy(strategy="blue-green", bake_s=120),
    policy(strategy="blue-green", bake_s=60, method="sequential", min_samples=20, analysis_window_s=2),
    policy(strategy="blue-green", bake_s=90, shadow_percent=10, shadow_duration_s=60, manual_approval=True),
]
TRAFFIC = [Traffic(), Traffic(errors=0.2), Traffic(latency_ms=40.0), Traffic(scores=(0.95,)), None]
AT = datetime.fromtimestamp(T0, UTC)


@st.composite
def states(draw: st.DrawFn, steps: list[float], strategy: str = "canary") -> RolloutState:
    other = Phase.STEP if strategy == "blue-green" else Phase.BAKE  # each strategy's own serving phase
    phase = draw(st.sampled_from([p for p in Phase if p != other]))
    last = len(steps) - 1
    index = {
        Phase.STEP: draw(st.integers(0, last)),
        Phase.BAKE: last,
        Phase.APPROVAL: last - 1,  # waiting before the 100 % step, the last
        Phase.PROMOTE: last,
        Phase.PROMOTED: last,
        Phase.ROLLED_BACK: draw(st.integers(-1, last)),
    }.get(phase, -1)
    weight = float(steps[index]) if index >= 0 and phase not in (Phase.ROLLED_BACK, Phase.REJECTED) else 0.0
    reports = []
    if phase in (Phase.SHADOW, Phase.STEP, Phase.BAKE):
        reports = [StepReport(phase=str(phase), weight=weight, started=T0)]
    return RolloutState(
        model=MODEL,
        version=CANARY,
        champion=STABLE,
        run_id="run-1",
        strategy=strategy,
        switched_at=T0 if phase == Phase.BAKE else None,
        phase=phase,
        step=index,
        weight=weight,
        step_started=T0,
        reports=reports,
        started_at=AT,
        updated_at=AT,
    )


def route_left(state: RolloutState) -> Route:
    """The route as the rollout left it in ``state``."""
    if state.phase == Phase.SHADOW:
        return Route(STABLE, shadow=CANARY, revision=2)
    if state.step >= 0 and state.phase in (Phase.STEP, Phase.BAKE, Phase.APPROVAL, Phase.PROMOTE):
        return Route(STABLE, CANARY, state.weight, revision=2)
    if state.phase == Phase.PROMOTED:
        return Route(CANARY, revision=3)
    return Route(STABLE, revision=1)


@st.composite
def observations(draw: st.DrawFn, state: RolloutState, policy_: object) -> Observation:
    now = T0 + draw(st.floats(0.0, 2 * policy_.hold_deadline_s))  # type: ignore[attr-defined]
    mine = route_left(state)
    moved = Route(STABLE, "1.2.0", 5.0, revision=9, updated_by="ops", reason="by hand")
    route = draw(st.sampled_from([mine, mine, moved, Route(STABLE, revision=9, updated_by="ops")]))
    kind = draw(st.sampled_from(["look", "look", "deployed", "checked", "answered", "promote", "moved", "begin"]))
    if kind == "look":
        traffic = draw(st.sampled_from(TRAFFIC))
        rps = draw(st.sampled_from([1.0, 40.0, 400.0]))
        wanted = needs(state, policy_, now)  # type: ignore[arg-type]
        windows = {r.arm: served(r.version, r.start, r.end, rps, traffic or Traffic()) for r in wanted.ticks}
        unavailable = "gateway down" if traffic is None else None
        base = wanted.baseline
        baseline = served(base.version, base.start, base.end, rps, Traffic()) if base else None
        return Looked(now, route, windows.get("canary"), windows.get("stable"), unavailable, baseline)
    if kind == "deployed":
        return Deployed(now, failed=draw(st.sampled_from([None, "exited while starting"])))
    if kind == "checked":
        failed = ({"check": "schema", "status": "fail", "detail": "inputs differ"},)
        return Checked(draw(st.sampled_from([PASS, PASS + failed])), registered=draw(st.booleans()))
    if kind == "answered":
        return Answered(now, draw(st.booleans()), "ops", draw(st.sampled_from(["", "no"])))
    if kind == "promote":
        return Promoting(draw(st.sampled_from([mine, Route(STABLE, CANARY, 100.0, CANARY)])))
    if kind == "moved":
        return RouteMoved(moved)
    version = draw(st.sampled_from([CANARY, "1.2.0", STABLE]))
    running = draw(st.sampled_from([True, False, None]))
    return Begin(MODEL, version, "run-2", now, AT, route, running, policy_.strategy, 2)  # type: ignore[attr-defined]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_transition_keeps_the_invariants(data: st.DataObject) -> None:
    policy_ = data.draw(st.sampled_from(POLICIES))
    bg = policy_.strategy == "blue-green"
    state = data.draw(states([100.0] if bg else [float(w) for w in policy_.steps], policy_.strategy))
    obs = data.draw(observations(state, policy_))
    try:
        t = step(state, obs, policy_)
    except Conflict as refused:
        # refused outright: an answer while not waiting, a promote before the last step
        # passed, or a new rollout the route does not allow
        message = str(refused)
        assert (
            (isinstance(obs, Answered) and state.phase != Phase.APPROVAL)
            or (isinstance(obs, Promoting) and state.phase != Phase.PROMOTE)
            or (isinstance(obs, Begin) and ("already" in message))
        ), (state.phase, obs, message)
        return
    except InvalidInput:
        raise AssertionError("every generated route has a stable") from None
    check(state, obs, t, policy_)
    for action in t.actions:
        if isinstance(action, SetRoute):
            assert action.expect_stable == STABLE
            assert action.expect_canary == (CANARY if state.step >= 0 else None)
    if state.done and not isinstance(obs, Begin):
        assert t.state is state
    if isinstance(obs, Looked) and obs.unavailable and t.state.phase != Phase.ROLLED_BACK:
        assert t.state == state, "no data is not bad data: nothing changes but an event"
