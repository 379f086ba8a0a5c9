"""``canary_rollout(model, version, **policy_overrides)``: preflight → deploy → shadow → weight
steps → approval → promote, or roll back; with ``strategy="blue-green"``: preflight → deploy
green at the stable's replica count → shadow → approval → switch → bake → promote, or switch
back. The Prefect flow composes ``fleet.control.rollout.effects``.

Every decision is in ``fleet.control.rollout.machine`` and every write in its executor
``fleet.control.rollout.effects.Rollout``; this module only orders
the calls, sleeps between ticks, holds the rollout lease, asks for approval through a
Prefect pause, and reports. The lease is kept alive by a heartbeat for the whole run —
through a deploy that packages and waits for readiness, and through the approval pause —
and is the ``Rollout``'s guard, so a run that lost it stops before its next route change
or state write. Each phase's task runs are named after it ("deploy green 1.1.0 x2 ...", "shadow tick",
"step 2 at 50% tick", "bake tick"), so the run's graph in the UI reads as its phases; the
switch itself is the event ``fleet.rollout.switched``. Reports: a table
artifact of every step's gates after each tick, a
markdown summary at the end, and ``fleet.rollout.*`` events. A rollback ends the run
Failed with a message that names the breached gate; it is never reported as a success.

    from flows.rollout import canary_rollout
    canary_rollout("demo-classifier", "1.1.0", steps=[20, 50, 100], analysis_window_s=5)
    canary_rollout("demo-classifier", "1.1.0", strategy="blue-green", bake_s=120)
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, pause_flow_run, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.input import RunInput
from prefect.states import Completed, Failed, State

from fleet import leases
from fleet.catalog.rollouts import Phase, RolloutState, lease_key
from fleet.control.rollout.effects import LEASE_TTL, Rollout, apply_overrides
from fleet.errors import Conflict
from flows._context import emit, fleet_context, run_id


class Approval(RunInput):
    """What an approver answers when a rollout pauses before 100 %."""

    approve: bool
    note: str = ""
    by: str = "someone"


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(rollout: Rollout, state: RolloutState) -> RolloutState:
    return rollout.run_preflight(state)


@task(name="prefetch canary artifact", cache_policy=NO_CACHE)
def prefetch(model: str, version: str, cache_mib: float | None) -> str:
    """The canary's artifact downloaded and verified into the artifact cache while preflight
    runs, so that packaging its Bento (the deploy step) finds it there."""
    from fleet.catalog.registry import Registry
    from fleet.runtime.packaged import artifact_cache
    from fleet.store import open_store

    _, size, took = artifact_cache(cache_mib).prefetch(Registry(open_store()), model, version)
    return f"artifact of {model}:{version} cached and verified: {size / 2**20:.1f} MiB in {took:.2f} s"


@task(name="deploy canary", cache_policy=NO_CACHE, timeout_seconds=900)
def deploy(rollout: Rollout, state: RolloutState) -> RolloutState:
    return rollout.deploy(state)


def _deploy_name(state: RolloutState) -> str:
    if state.strategy == "blue-green":
        return f"deploy green {state.version} x{state.replicas} (blue {state.champion} held)"
    return f"deploy canary {state.version}"


def _tick_name(state: RolloutState) -> str:
    """The next tick's name in the run graph: the phase it judges."""
    if state.phase == Phase.STEP:
        return f"step {state.step + 1} at {state.weight:g}% tick"
    if state.waiting:
        return f"{state.champion}'s baseline tick"
    return f"{state.phase} tick"


def _retry_unless_conflict(task: Any, task_run: Any, state: State) -> bool:  # noqa: ANN401 - Prefect's hook signature
    """A tick that lost its lease or its state to another run would lose again: fail at once."""
    try:
        state.result()
    except Conflict:
        return False
    except Exception:  # noqa: BLE001 - anything else (the store blinked) is worth the retries
        return True
    return True


@task(
    name="analysis tick",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=_retry_unless_conflict,
)
def tick(rollout: Rollout, state: RolloutState) -> RolloutState:
    new, verdict = rollout.tick(state)
    logger = get_run_logger()
    if verdict is not None:
        logger.info("%s at %g%%: %s", new.version, state.weight, verdict.summary)
        report = new.reports[-1] if new.reports else None
        if report is not None and report.gates:
            create_table_artifact(
                key=f"rollout-{new.model}",
                table=report.gates,
                description=f"{new.model}:{new.version} {report.phase} at {report.weight:g}%: {verdict.summary}",
            )
    return new


LATE_IN_SECOND = 0.9  # where in a second a look is taken


def _next_look(window_s: float) -> float:
    """Seconds to sleep so the next look falls ``window_s`` on, late in a clock second. The
    gateways' counters are per second and a look reads the second it is taken in as far as
    it got; the rest of that second is never read again (reading it twice would count it
    twice). Late in the second, little is left unread."""
    at = time.time() + window_s
    return window_s + (LATE_IN_SECOND - at % 1.0) % 1.0


@task(name="promote", cache_policy=NO_CACHE)
def promote(rollout: Rollout, state: RolloutState) -> RolloutState:
    return rollout.promote(state)


@task(name="keep previous stable warm", cache_policy=NO_CACHE)
def keep_warm_then_retire(rollout: Rollout, state: RolloutState) -> bool:
    """The previous stable stays deployed for the rollback window, then goes if unused."""
    time.sleep(rollout.policy.rollback_window_s)
    return rollout.retire_previous(state)


def _summary(state: RolloutState) -> str:
    lines = [
        f"# Rollout of {state.model}:{state.version} — {state.phase}",
        "",
        f"Strategy: {state.strategy}. Champion: {state.champion}. Run: {state.run_id}.",
        "",
    ]
    if state.reason:
        lines += [f"**{state.reason}**", ""]
    if state.preflight:
        lines += ["| preflight | status | detail |", "|---|---|---|"]
        lines += [f"| {c['check']} | {c['status']} | {c['detail']} |" for c in state.preflight] + [""]
    lines += [
        "| phase | weight | outcome | canary requests | stable requests | ticks | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.phase} | {r.weight:g}% | {r.outcome} | {r.canary_requests} | {r.stable_requests} | {r.ticks} | "
        f"{r.summary.replace('|', '/')} |"
        for r in state.reports
    ]
    return "\n".join(lines)


@flow(name="canary-rollout", flow_run_name="rollout {model} {version}")
def canary_rollout(model: str, version: str, **policy_overrides: Any) -> State:
    """Roll ``version`` of ``model`` out as a canary and promote it, or roll it back."""
    logger = get_run_logger()
    ctx = fleet_context()
    policy = apply_overrides(ctx.policies.rollout_for(model), policy_overrides)
    lease = leases.acquire(
        ctx.store, lease_key(model), what=f"the rollout of {model}", who=f"flow run {run_id()}", stale_after=LEASE_TTL
    )
    rollout = Rollout(
        ctx.store, ctx.runtime, ctx.metrics, policy, emit=emit, who=f"flow run {run_id()}", guard=lease.check
    )
    try:
        with lease.kept_alive():
            state = rollout.begin(model, version, run_id())
            fetching = None
            if state.phase in (Phase.PREFLIGHT, Phase.DEPLOY) and ctx.runtime.packages_here:
                fetching = prefetch.submit(model, version, ctx.policies.runtime.artifact_cache_mib)
            if state.phase == Phase.PREFLIGHT:
                state = preflight(rollout, state)
            if fetching is not None:
                try:
                    logger.info(fetching.result())
                except Exception as exc:  # noqa: BLE001 - packaging fetches it again, and says what is wrong
                    logger.warning("prefetch of %s:%s's artifact failed: %s", model, version, exc)
            if state.phase == Phase.DEPLOY:
                state = deploy.with_options(task_run_name=_deploy_name(state))(rollout, state)
            while state.phase in (Phase.SHADOW, Phase.STEP, Phase.BAKE, Phase.APPROVAL) or state.waiting:
                if state.phase == Phase.APPROVAL:
                    before = "the switch" if state.strategy == "blue-green" else "100%"
                    logger.info("waiting for approval before %s: fleet approve %s", before, model)
                    silence = Approval(
                        approve=False, by="nobody", note=f"no answer within {policy.hold_deadline_s:g} s"
                    )
                    answer = (
                        pause_flow_run(
                            wait_for_input=Approval, timeout=int(policy.hold_deadline_s), key=f"approve-{model}"
                        )
                        or silence
                    )
                    state = rollout.approve(state, answer.approve, answer.by, answer.note)
                    continue
                time.sleep(_next_look(policy.analysis_window_s))
                state = tick.with_options(task_run_name=_tick_name(state))(rollout, state)
            if state.phase == Phase.PROMOTE:
                state = promote(rollout, state)
    finally:
        lease.release()
    create_markdown_artifact(
        key=f"rollout-{model}-summary", markdown=_summary(state), description=f"{model}:{version} {state.phase}"
    )
    if state.phase == Phase.PROMOTED:
        logger.info("promoted %s:%s; %s stays warm for %g s", model, version, state.champion, policy.rollback_window_s)
        keep_warm_then_retire(rollout, state)
        how = (
            f"after a {policy.bake_s:g} s bake"
            if state.strategy == "blue-green"
            else f"through {len(policy.steps)} steps"
        )
        return Completed(message=f"promoted {model}:{version} {how}")
    return Failed(message=f"{model}:{version} {state.phase.replace('_', ' ')}: {state.reason}")
