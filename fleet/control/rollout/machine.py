"""Every decision of a rollout, canary or blue-green, as one pure function: ``step(state, observation, policy)``.

``step`` takes the stored ``RolloutState`` (``fleet.catalog.rollouts``), one observation of
the world that the executor (``fleet.control.rollout.effects.Rollout``) gathered — the route
table, the metric windows it read, how a deploy or the preflight went, an approver's
answer — and returns a ``Transition``: the new state and the actions that get there, in
the order they must be performed (traffic first, state writes where today's rollout
checkpoints, events last). It reads no store, runtime, metrics source or clock; what the
executor must read for the next observation is ``needs(state, policy, now)``
(``fleet.control.rollout.reading``, with how a tick's windows are judged).

Phases (``fleet.catalog.rollouts.Phase``): ``preflight`` → ``deploy`` → ``shadow`` (optional)
→ ``step`` (one per weight of the policy) → ``approval`` (optional, before 100 %) →
``promote`` → ``promoted``; or ``rolled_back`` or ``rejected``. Blue-green (``strategy``) has
one step instead of the weights, ``bake``: entered by switching 100 % to green at once (as
the route's canary, so a request green fails is still answered by blue, the stable), left by
promotion once green passed its gates for ``bake_s``, or by switching back. A first step at
100 % (the switch, or ``steps: [100]``) is judged against the stable's traffic before it
alone, so it is taken only once that baseline can judge it: until then the version waits in
``deploy``, ready and unrouted (``RolloutState.waiting``), to ``hold_deadline_s`` at most. A finished rollout takes only
``Begin`` (a new rollout replaces it); an approver's answer or a promotion for it is refused
with ``Conflict``, and every other observation leaves it as it is.

Route changes are conditional (``SetRoute.expect_*``: the route as the rollout left it).
When one finds the route moved, the executor performs nothing more of that transition and
steps again with ``RouteMoved``: the rollout then ends as changed elsewhere, rolled back
without overwriting anyone's route.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fleet.analysis import reference
from fleet.analysis.canary import Verdict
from fleet.analysis.reference import BASELINE_S
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.catalog.rollouts import JUDGED, Phase, RolloutState, StepReport
from fleet.catalog.routes.table import Canary, Shadow
from fleet.control.rollout.protocol import (
    Action,
    Answered,
    Begin,
    Checked,
    Deployed,
    Emit,
    Looked,
    Observation,
    Promoting,
    Reject,
    RollBack,
    Route,
    RouteMoved,
    Save,
    SetRoute,
    Transition,
)
from fleet.control.rollout.reading import judge_tick, larger
from fleet.errors import Conflict, InvalidInput
from fleet.types import ArmWindow

# what the machine takes and gives, importable from here as before
__all__ = [
    "Action",
    "Answered",
    "Begin",
    "Checked",
    "Deployed",
    "Emit",
    "Looked",
    "Observation",
    "Promoting",
    "Reject",
    "RollBack",
    "Route",
    "RouteMoved",
    "Save",
    "SetRoute",
    "Transition",
    "schedule",
    "step",
]

# -- the transitions ------------------------------------------------------------------------


def step(state: RolloutState | None, obs: Observation, policy: RolloutPolicy) -> Transition:
    """The rollout's next state and the actions that get there. Raises ``InvalidInput`` or
    ``Conflict`` for a request refused outright (nothing to do, nothing written)."""
    acts: list[Action] = []
    if isinstance(obs, Begin):
        return _begin(state, obs, acts)
    if state is None:
        raise InvalidInput(f"no rollout to step with {type(obs).__name__}; expected one begun first")
    if isinstance(obs, Answered):
        return _answered(state, obs, policy, acts)
    if isinstance(obs, Promoting):
        return _promote(state, obs, acts)
    if state.done:
        return Transition(state)  # terminal phases absorb
    if isinstance(obs, RouteMoved):
        return _ended_elsewhere(state, obs.route, acts)
    if isinstance(obs, Checked):
        return _preflight(state, obs, acts)
    if isinstance(obs, Deployed):
        return _deployed(state, obs, policy, acts)
    return _tick(state, obs, policy, acts)


def _begin(stored: RolloutState | None, obs: Begin, acts: list[Action]) -> Transition:
    """Start, resume (the stored rollout of this version), or end an abandoned one first:
    the transition's state is then that rollout, rolled back, and the executor begins again."""
    route = obs.route
    if stored is not None and stored.phase == Phase.PROMOTED and stored.version == obs.version:
        if route.stable == obs.version:
            return Transition(stored)  # run again after it finished: nothing left to do
    if stored is not None and not stored.done:
        if stored.version == obs.version:
            state = _save(acts, stored, run_id=obs.run_id)
            acts.append(_event("resumed", state))
            return _recover(state, obs, acts)
        reason = f"abandoned: a rollout of {obs.version} started after this one's run stopped"
        return _rollback(stored, reason, [], acts)
    if route.stable is None:
        raise InvalidInput(
            f"{obs.model} has no stable version to canary against; set one with `fleet route set --stable`"
        )
    if route.stable == obs.version:
        raise Conflict(f"{obs.model}:{obs.version} is already the stable version")
    if route.canary is not None:
        raise Conflict(
            f"{obs.model} already has canary {route.canary} at {route.weight:g}% that no rollout owns; remove it "
            "(fleet route set --no-canary) or roll it back first"
        )
    state = RolloutState(
        model=obs.model,
        version=obs.version,
        champion=route.stable,
        run_id=obs.run_id,
        strategy=obs.strategy,
        replicas=obs.replicas,
        started_at=obs.at,
        updated_at=obs.at,
    )
    acts.append(Save(state))
    acts.append(_event("started", state, champion=route.stable, replicas=obs.replicas))
    return Transition(state, tuple(acts))


def _recover(state: RolloutState, obs: Begin, acts: list[Action]) -> Transition:
    """After an interruption: go on only if routing still matches what was stored and the
    canary still runs; otherwise roll back (the safe way out)."""
    if state.phase in (Phase.PREFLIGHT, Phase.DEPLOY):
        return Transition(state, tuple(acts))
    route, version = obs.route, state.version
    routed = version in (route.canary, route.shadow, route.stable)
    if not obs.running and state.phase != Phase.PROMOTED:
        return _rollback(state, "the canary was not running when the interrupted rollout resumed", [], acts)
    if state.phase in JUDGED and not routed:
        return _ended_elsewhere(state, route, acts)
    if state.phase in JUDGED:  # the step (or bake) starts over: its window before the crash is not trusted
        state = _save(acts, state, step_started=obs.now)
    return Transition(state, tuple(acts))


def _preflight(state: RolloutState, obs: Checked, acts: list[Action]) -> Transition:
    if state.phase != Phase.PREFLIGHT:
        return Transition(state)  # checked already
    checks = [dict(c) for c in obs.checks]
    failed = [c for c in checks if c["status"] == "fail"]
    if not failed:
        return Transition(_save(acts, state, phase=Phase.DEPLOY, preflight=checks), tuple(acts))
    reason = "preflight failed: " + "; ".join(f"{c['check']}: {c['detail']}" for c in failed)
    if obs.registered:
        acts.append(Reject(reason))
    breached = [c["check"] for c in failed]
    state = _save(acts, state, phase=Phase.REJECTED, preflight=checks, reason=reason, breached=breached)
    acts.append(_event("rejected", state, reason=reason))
    return Transition(state, tuple(acts))


def _deployed(state: RolloutState, obs: Deployed, policy: RolloutPolicy, acts: list[Action]) -> Transition:
    if state.phase != Phase.DEPLOY:
        return Transition(state)  # deployed already
    if obs.failed is not None:
        return _rollback(state, f"the canary did not start: {obs.failed}", ["deploy"], acts)
    acts.append(_event("deployed", state))
    if state.waiting:  # deployed again on a resumed run that was waiting for the baseline
        return _next_step(state, policy, obs.now, obs.baseline, acts)
    if policy.shadow_percent > 0 and policy.shadow_duration_s > 0:
        shadow = Shadow(version=state.version, percent=policy.shadow_percent)
        acts.append(_route(state, f"shadow {policy.shadow_percent:g}%", shadow=shadow.model_dump()))
        report = StepReport(phase="shadow", weight=0.0, started=obs.now)
        state = _save(acts, state, phase=Phase.SHADOW, step_started=obs.now, reports=[*state.reports, report])
        return Transition(state, tuple(acts))
    return _next_step(state, policy, obs.now, obs.baseline, acts)


def _next_step(
    state: RolloutState, policy: RolloutPolicy, now: float, baseline: ArmWindow | None, acts: list[Action]
) -> Transition:
    index, steps = state.step + 1, schedule(state, policy)
    if index >= len(steps):
        return Transition(_save(acts, state, phase=Phase.PROMOTE), tuple(acts))
    weight = float(steps[index])
    if index == 0 and weight >= 100:
        baseline = larger(state.baseline, baseline)
        if state.phase != Phase.APPROVAL and (short := reference.short(policy, baseline)):
            return _wait_for_baseline(state, policy, now, short, acts)
        if baseline is not None:  # kept through an approval: the traffic may be gone by its answer
            state = state.model_copy(update={"baseline": asdict(baseline)})
    if weight >= 100 and policy.manual_approval and state.phase != Phase.APPROVAL:
        state = _save(acts, state, phase=Phase.APPROVAL)
        acts.append(_event("awaiting-approval", state))
        return Transition(state, tuple(acts))
    if index == 0 and baseline is not None and (baseline.requests >= policy.min_samples or weight >= 100):
        # At 100 % nothing serves on stable, so the canary is judged against the stable as it
        # was at full traffic just before the rollout: the same load, not a step's share of it.
        state = state.model_copy(update={"baseline": asdict(baseline)})
    canary = Canary(version=state.version, weight=weight)
    if state.strategy == "blue-green":  # one switch of everything; blue stays the stable behind it
        why, phase, switched = f"switch: 100% to {state.version}, {state.champion} kept ready", Phase.BAKE, now
    else:
        why, phase, switched = f"step {index + 1}/{len(steps)} at {weight:g}%", Phase.STEP, None
    acts.append(_route(state, why, canary=canary.model_dump()))
    report = StepReport(phase=str(phase), weight=weight, started=now)
    changes = {"step": index, "weight": weight, "step_started": now, "reports": [*state.reports, report]}
    state = _save(acts, state, phase=phase, switched_at=switched, **changes)
    if switched is not None:
        acts.append(_event("switched", state, blue=state.champion, green=state.version, bake_s=policy.bake_s))
    else:
        acts.append(_event("step", state, step=index + 1, steps=len(steps)))
    return Transition(state, tuple(acts))


def _wait_for_baseline(
    state: RolloutState, policy: RolloutPolicy, now: float, short: int, acts: list[Action], unreadable: str = ""
) -> Transition:
    """A first step at 100 % with too little of the stable's traffic before it to judge the
    new version against: wait ready and unrouted (the stable serves everything meanwhile)
    until there is enough, or roll back at the deadline without having moved any traffic."""
    need = reference.needed(policy)
    had = f"could not be read ({unreadable})" if unreadable else f"gave {need - short} answers in {BASELINE_S} s"
    since = state.ready_at if state.ready_at is not None else now
    if now - since >= policy.hold_deadline_s:
        reason = (
            f"no baseline: {state.champion}'s traffic {had}; {need} are needed to judge {state.version} at 100 % "
            f"(min_samples, and the stable p99 its latency gate reads); none came within hold_deadline_s "
            f"({policy.hold_deadline_s:g} s) and no traffic was moved"
        )
        return _rollback(state, reason, ["baseline"], acts)
    if state.waiting:
        return Transition(state, tuple(acts))  # waiting still: nothing new to store
    state = _save(acts, state, phase=Phase.DEPLOY, ready_at=since)
    acts.append(_event("waiting-for-baseline", state, reason=f"{state.champion}'s traffic {had}: {short} more needed"))
    return Transition(state, tuple(acts))


def schedule(state: RolloutState, policy: RolloutPolicy) -> tuple[float, ...]:
    """The weights the new version serves in turn: the policy's steps, or blue-green's one switch
    (by the strategy the rollout began with: a resumed run keeps it whatever the policy says now)."""
    return (100.0,) if state.strategy == "blue-green" else tuple(float(w) for w in policy.steps)


def _tick(state: RolloutState, obs: Looked, policy: RolloutPolicy, acts: list[Action]) -> Transition:
    """Judge the current step's traffic so far and act on the verdict."""
    if state.waiting:  # for the stable's baseline: switch (or step to 100 %) once it is enough
        route = obs.route
        if (route.stable, route.canary, route.shadow) != (state.champion, None, None):
            return _ended_elsewhere(state, route, acts)  # `fleet rollback`, a new stable: nothing to wait for
        if obs.unavailable is not None:
            return _wait_for_baseline(state, policy, obs.now, reference.needed(policy), acts, obs.unavailable)
        return _next_step(state, policy, obs.now, obs.baseline, acts)
    if state.phase not in JUDGED:
        return Transition(state)
    route, version = obs.route, state.version
    shadowing = state.phase == Phase.SHADOW and route.shadow is not None
    if (route.shadow if shadowing else route.canary) != version:
        return _ended_elsewhere(state, route, acts)
    now, t0 = obs.now, state.step_started
    if obs.unavailable is not None:
        # no data is not bad data: hold, and fail only once the step's deadline passed
        if now < t0 + policy.hold_deadline_s:
            acts.append(_event("verdict", state, outcome="hold", summary=f"metrics unavailable: {obs.unavailable}"))
            return Transition(state, tuple(acts))
        reason = f"gate metrics breached: unreadable until the step's deadline ({obs.unavailable})"
        return _rollback(state, reason, ["metrics"], acts)
    verdict, state, stable = judge_tick(state, policy, now, obs.canary, obs.stable)
    report = state.reports[-1].model_copy(
        update={
            "summary": verdict.summary,
            "gates": verdict.table(),
            "canary_requests": verdict.canary_requests,
            "stable_requests": verdict.stable_requests,
            "ticks": state.reports[-1].ticks + 1,
        }
    )
    lasts = {Phase.SHADOW: policy.shadow_duration_s, Phase.BAKE: policy.bake_s}.get(state.phase, 0.0)
    if verdict.outcome == "hold" or (verdict.outcome != "rollback" and now - t0 < lasts):
        # a hold, or gates that pass while the shadow phase (or the bake) still runs its full duration
        state = _save(acts, state, reports=[*state.reports[:-1], report])
        acts.append(_event("verdict", state, outcome=verdict.outcome, summary=verdict.summary))
        return Transition(state, tuple(acts), verdict)
    outcome = "rollback" if verdict.outcome == "rollback" else "advance"
    closed = report.model_copy(update={"outcome": outcome, "ended": now})
    if outcome == "rollback":
        state = _save(acts, state, reports=[*state.reports[:-1], closed])
        acts.append(_event("verdict", state, outcome=verdict.outcome, summary=verdict.summary))
        gates = [g.gate for g in verdict.breaches]
        summary = verdict.summary.removeprefix("roll back: ")
        at = f"{now - t0:.0f} s into the bake, switched back to {state.champion}" if state.phase == Phase.BAKE else ""
        reason = f"gate {', '.join(gates)} breached {at or f'at {state.weight:g}%'}: {summary}"
        return _with_verdict(_rollback(state, reason, gates, acts), verdict)
    # the stable at full traffic before the rollout is the better baseline, unless it saw
    # less than this step did (a rollout started right after traffic did): keep the larger.
    # (The sequential method keeps every step's stable in its totals already.)
    baseline = state.baseline
    if stable is not None and stable.requests > (baseline or {}).get("requests", 0):
        baseline = asdict(stable)
    state = _save(acts, state, reports=[*state.reports[:-1], closed], baseline=baseline)
    acts.append(_event("verdict", state, outcome=verdict.outcome, summary=verdict.summary))
    if state.phase == Phase.SHADOW:
        acts.append(_route(state, "shadow phase passed", shadow=None))
    return _with_verdict(_next_step(state, policy, now, obs.baseline, acts), verdict)


def _answered(state: RolloutState, obs: Answered, policy: RolloutPolicy, acts: list[Action]) -> Transition:
    if state.phase != Phase.APPROVAL:
        raise Conflict(f"the rollout of {state.model}:{state.version} is {state.phase}, not waiting for approval")
    if not obs.approved:
        return _rollback(state, f"not approved by {obs.by}{': ' + obs.note if obs.note else ''}", ["approval"], acts)
    acts.append(_event("approved", state, by=obs.by))
    return _next_step(state, policy, obs.now, obs.baseline, acts)


def _promote(state: RolloutState, obs: Promoting, acts: list[Action]) -> Transition:
    if state.phase != Phase.PROMOTE:
        raise Conflict(f"the rollout of {state.model}:{state.version} is {state.phase}, not ready to promote")
    shadow = {"shadow": None} if obs.route.shadow == state.version else {}
    passed = "the bake passed" if state.strategy == "blue-green" else "every step passed"
    acts.append(_route(state, f"promoted: {passed}", stable=state.version, canary=None, **shadow))
    state = _save(acts, state, phase=Phase.PROMOTED, weight=100.0, reason=passed)
    acts.append(_event("promoted", state, previous=state.champion))
    return Transition(state, tuple(acts))


def _ended_elsewhere(state: RolloutState, route: Route, acts: list[Action]) -> Transition:
    """Someone changed the route under the rollout (a manual rollback, say): stop here."""
    reason = f"the route changed outside the rollout (revision {route.revision} by {route.updated_by}: {route.reason})"
    return _rollback(state, reason, ["route"], acts)


def _rollback(state: RolloutState, reason: str, breached: list[str], acts: list[Action]) -> Transition:
    acts.append(RollBack(reason, tuple(breached)))
    state = _save(acts, state, phase=Phase.ROLLED_BACK, weight=0.0, reason=reason, breached=breached)
    acts.append(_event("rolled-back", state, reason=reason, breached=breached))
    return Transition(state, tuple(acts))


# -- helpers --------------------------------------------------------------------------------


def _save(acts: list[Action], state: RolloutState, **changes: Any) -> RolloutState:
    new = state.model_copy(update=changes)
    acts.append(Save(new))
    return new


def _route(state: RolloutState, why: str, **fields: Any) -> SetRoute:
    """A route change conditional on the route as ``state`` left it: the champion stable, no
    canary before the first step and this version's after."""
    return SetRoute(why, fields, state.champion, state.version if state.step >= 0 else None)


def _with_verdict(transition: Transition, verdict: Verdict) -> Transition:
    return Transition(transition.state, transition.actions, verdict)


def _event(name: str, state: RolloutState, **extra: Any) -> Emit:
    payload = {
        "model": state.model,
        "version": state.version,
        "phase": str(state.phase),
        "strategy": state.strategy,
        "weight": state.weight,
        "run_id": state.run_id,
        **extra,
    }
    return Emit(f"fleet.rollout.{name}", payload)
