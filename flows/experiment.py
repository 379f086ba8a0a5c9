"""``experiment(model, arms, split, metric, min_effect, ...)``: an A/B test of two versions on an
outcome, decided by an always-valid interval (``fleet.analysis.ab``).

A (the stable) and B share the traffic by the canary split, sticky by routing key. Each
tick reads every logged request's outcome since the start, per arm, and the gateways'
counters for the guardrails (``fleet.analysis.sequential.guardrails``: B's errors and p99 against
A's); the experiment ends on a winner, no difference, out of time, or stopped (a guardrail
or ``fleet experiment stop``). Traffic then goes back to A alone; with ``promote`` a winning
B is rolled out through the normal canary rollout. It holds the model's rollout lease the
whole time: an experiment and a rollout of one model never run at once.

Reports: ``experiments/<model>.json``, a markdown artifact with a table per arm and a plot
of the effect and its interval over time (updated every tick), and ``fleet.experiment.*``
events.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

import numpy as np
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, Failed, State

from fleet import audit, leases, records
from fleet.analysis import sequential
from fleet.analysis.ab import (
    ExperimentState,
    Tick,
    arm_stats,
    decide,
    duration_of,
    effect_svg,
    interval,
    split_of,
    state_key,
    thinned,
)
from fleet.analysis.drift.render import svg_data_uri
from fleet.analysis.sources import MetricsUnavailable, empty_window, sum_windows
from fleet.catalog import gateway_directory
from fleet.catalog.registry import Registry
from fleet.catalog.registry import State as VersionState
from fleet.catalog.rollouts import arm_window as _window
from fleet.catalog.rollouts import lease_key
from fleet.catalog.routes.store import Router
from fleet.control.rollout.effects import LEASE_TTL
from fleet.control.rollout.reading import READ_SLACK_S
from fleet.errors import Conflict, InvalidInput
from flows._context import emit, fleet_context, run_id

STOP_SUFFIX = ".stop"  # experiments/<model>.json.stop: `fleet experiment stop` asks the run to end


def stop_key(model: str) -> str:
    return state_key(model) + STOP_SUFFIX


@flow(name="experiment", flow_run_name="experiment {model}")
def experiment(
    model: str,
    arms: list[str],
    split: str = "50/50",
    metric: str = "accuracy",
    min_effect: float = 0.01,
    max_duration: str = "7d",
    promote: bool = False,
    alpha: float = 0.05,
    tick_s: float = 30.0,
) -> State:
    """Compare ``arms`` (the stable first) on ``metric`` until a decision; see the module."""
    logger = get_run_logger()
    ctx = fleet_context()
    store, who = ctx.store, f"flow run {run_id()}"
    shares, max_s = split_of(split), duration_of(max_duration)
    _check(ctx, model, arms, metric, min_effect, alpha)  # at once, before waiting for anything
    lease = leases.acquire(store, lease_key(model), what=f"the experiment on {model}", who=who, stale_after=LEASE_TTL)
    router = Router(store)
    try:
        a, b, span = _check(ctx, model, arms, metric, min_effect, alpha)  # again, holding the lease: still true
        with lease.kept_alive():
            store.delete(stop_key(model))  # an old stop request is not this run's
            ctx.runtime.deploy(model, b)  # ready before it gets traffic
            lease.check()
            state = ExperimentState(
                model=model,
                arms=(a, b),
                split=shares,
                metric=metric,
                min_effect=min_effect,
                span=span,
                alpha=alpha,
                max_duration_s=max_s,
                promote=promote,
                run_id=run_id(),
                started_at=audit.now(),
                ticked_at=math.ceil(time.time()),
            )
            try:
                router.set(model, canary=b, weight=shares[1], why=f"experiment {a} vs {b} on {metric}", who=who)
                gateway_directory.notify(store)
                _save(store, state)
                emit(
                    "fleet.experiment.started",
                    {"model": model, "arms": [a, b], "metric": metric, "split": list(shares)},
                )
                logger.info(
                    "experiment on %s: %s %g%% vs %s %g%% on %s, min effect %g",
                    model,
                    a,
                    shares[0],
                    b,
                    shares[1],
                    metric,
                    min_effect,
                )
                while state.status == "running":
                    time.sleep(tick_s)
                    lease.check()
                    try:
                        state = tick(ctx, state)
                    except (MetricsUnavailable, OSError) as exc:  # no data is not a decision: look again
                        logger.warning("this look is skipped: %s", exc)
                        if time.time() < state.started_at.timestamp() + state.max_duration_s:
                            continue
                        state = state.model_copy(
                            update={"status": "out_of_time", "summary": f"out of time; the last look failed: {exc}"}
                        )
                    _save(store, state)
                    _report(state)
                    logger.info("%s", state.summary)
            except BaseException as exc:  # an error (or a cancel) ends it too: recorded, and the split removed below
                state = state.model_copy(
                    update={
                        "status": "stopped",
                        "winner": None,
                        "summary": f"stopped by an error: {type(exc).__name__}: {exc}",
                    }
                )
                _save(store, state)
                raise
            finally:
                table = router.get(model)
                if table.canary is not None and table.canary.version == b and _holds(lease):  # back on A alone
                    router.set(model, clear_canary=True, why=f"experiment ended: {state.status}", who=who)
                    gateway_directory.notify(store)
                promoting = state.status == "winner" and state.winner == b and promote
                if not promoting and b not in router.get(model).referenced_versions():
                    ctx.runtime.undeploy(model, b)  # B stops serving (a rollout deploys it again)
    finally:
        lease.release()
    emit("fleet.experiment.ended", {"model": model, "status": state.status, "winner": state.winner})
    if state.status == "winner" and state.winner == b and promote:
        from flows.rollout import canary_rollout

        logger.info("%s won: rolling it out", b)
        return canary_rollout(model, b, return_state=True)
    if state.status == "stopped" and state.summary.startswith("guardrail"):
        return Failed(message=state.summary)
    return Completed(message=state.summary)


def _holds(lease: leases.Lease) -> bool:
    """Whether this run may still change the route (a run that lost its lease leaves it alone)."""
    try:
        lease.check()
    except Conflict:
        return False
    return True


def _check(
    ctx,
    model: str,
    arms: list[str],
    metric: str,
    min_effect: float,  # noqa: ANN001
    alpha: float,
) -> tuple[str, str, float]:
    """Refuse, before anything changes, what cannot be run; return (A, B, the metric's range)."""
    if len(arms) != 2 or arms[0] == arms[1]:
        raise InvalidInput(f"arms {arms}; expected two different versions: the stable first, then the one to compare")
    a, b = arms
    table = Router(ctx.store).get(model)
    if table.stable != a:
        raise InvalidInput(f"arm {a} is not {model}'s stable ({table.stable}); expected the stable first")
    if table.canary is not None:
        raise Conflict(f"{model} has a canary ({table.canary.version}); an experiment starts when no rollout runs")
    state = Registry(ctx.store).states(model).get(b)
    if state not in (VersionState.REGISTERED, VersionState.CANARY):
        raise InvalidInput(f"arm {model}:{b} is {state or 'not registered'}; expected a registered version")
    spec = ctx.policies.models.get(model)
    declared = sorted(spec.outcomes) if spec else []
    if metric == "accuracy":
        if spec is not None and spec.generative:
            raise InvalidInput(
                f"{model} is generative: accuracy needs classes; expected an outcome: {declared or 'none declared'}"
            )
        span = 1.0
    elif metric not in declared:
        raise InvalidInput(
            f"metric {metric!r} is not accuracy or an outcome of {model}; declared outcomes: "
            f"{', '.join(declared) or 'none (add them under the model outcomes: in its policy)'}"
        )
    else:
        bounds = spec.outcomes[metric]  # type: ignore[union-attr]
        if bounds.min is None or bounds.max is None or bounds.max <= bounds.min:
            raise InvalidInput(
                f"outcome {metric} of {model} has no range (min {bounds.min}, max {bounds.max}); an "
                "experiment compares bounded outcomes: declare min and max in its policy (a few "
                "tenants' extreme values must not decide it)"
            )
        span = bounds.max - bounds.min
    if not 0 < alpha < 0.5 or min_effect <= 0:
        raise InvalidInput(f"alpha {alpha} and min_effect {min_effect}; expected 0 < alpha < 0.5 and min_effect > 0")
    return a, b, span


def tick(ctx, state: ExperimentState, now: float | None = None) -> ExperimentState:  # noqa: ANN001
    """One look: outcomes per arm, the interval, the guardrails, the decision (no route change)."""
    model, (a, b) = state.model, state.arms
    now = time.time() if now is None else now
    # the counters first: the gateways' source reads only windows ending now, and reading
    # the logs below may take seconds
    harm, served, evidence, read_upto = _guardrails(ctx, state, now)
    start = state.started_at
    end = datetime.fromtimestamp(now, UTC) + timedelta(seconds=1)
    values = _outcomes(ctx.store, model, state.metric, start, end)
    stats_a = arm_stats(a, values.get(a, np.empty(0)))
    stats_b = arm_stats(b, values.get(b, np.empty(0)))
    found = interval(stats_a, stats_b, state.alpha, state.min_effect, state.span)
    out_of_time = now >= start.timestamp() + state.max_duration_s
    decision = decide(stats_a, stats_b, found, state.min_effect, out_of_time, state.metric)
    status, winner, summary = decision.status, decision.winner, decision.summary
    if harm:
        status, winner, summary = "stopped", None, "guardrail " + "; ".join(f"{g.gate}: {g.explanation}" for g in harm)
    elif records.exists(ctx.store, stop_key(model)):  # a stop asked for wins over a decision of the same look
        asked = ctx.store.get(stop_key(model)).data.decode(errors="replace")[:200]
        status, winner, summary = "stopped", None, f"stopped by {asked}: {decision.summary}"
    point = Tick(
        at=now,
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
        }
    )


def _finite(x: float) -> float:
    return x if np.isfinite(x) else 0.0


def _outcomes(store, model: str, metric: str, start: datetime, end: datetime) -> dict[str, np.ndarray]:  # noqa: ANN001
    """version → the metric of each logged request (row) that has one."""
    from fleet.logs.feedback import OUTCOME_COLUMN, labelled, with_outcomes

    if metric == "accuracy":
        frame = labelled(store, model, start, end)
        if frame.empty:
            return {}
        frame = frame[frame["label"].notna()]
        column = (frame["prediction"] == frame["label"]).astype(np.float64)
    else:
        frame = with_outcomes(store, model, start, end, [metric])
        if frame.empty:
            return {}
        name = OUTCOME_COLUMN.format(metric)
        frame = frame[frame[name].notna()]
        column = frame[name].astype(np.float64)
    return {str(v): column[frame["version"] == v].to_numpy() for v in frame["version"].unique()}


def _guardrails(ctx, state: ExperimentState, now: float) -> tuple[list, dict, dict, int]:  # noqa: ANN001
    """B's errors and p99 against A's, on the gateways' counters (fleet.analysis.sequential's harm tests)."""
    model, (a, b) = state.model, state.arms
    # whole seconds since the last look, as the rollout reads them: a per-second source would
    # count a second read twice twice (fleet.control.rollout.reading.tick_span)
    since, upto = int(state.ticked_at), math.floor(now)
    if since >= upto:
        tick_a, tick_b = empty_window(model, a, since, since), empty_window(model, b, since, since)
    else:
        tick_a = ctx.metrics.window(model, a, since, upto - READ_SLACK_S)
        tick_b = ctx.metrics.window(model, b, since, upto - READ_SLACK_S)
    totals = {
        "a": sum_windows(
            [*([_window(state.served["a"])] if "a" in state.served else []), tick_a], model, a, since, now
        ),
        "b": sum_windows(
            [*([_window(state.served["b"])] if "b" in state.served else []), tick_b], model, b, since, now
        ),
    }
    arms = sequential.Arms(tick_b, tick_a, totals["b"], totals["a"], totals["b"], totals["a"])
    results, evidence = sequential.guardrails(
        arms, ctx.policies.rollout_for(model), sequential.Evidence.from_dict(state.evidence)
    )
    from dataclasses import asdict

    breaches = [g for g in results if g.status == "breach"]
    return breaches, {k: asdict(w) for k, w in totals.items()}, evidence.to_dict(), max(upto, since)


def _save(store, state: ExperimentState) -> None:  # noqa: ANN001
    store.put(state_key(state.model), records.dump(state))


def _report(state: ExperimentState) -> None:
    a, b = state.arms
    last = state.ticks[-1] if state.ticks else None
    lines = [
        f"# Experiment on {state.model}: {a} vs {b} — {state.status}",
        "",
        f"**{state.summary}**",
        "",
        f"Metric {state.metric}, split {state.split[0]:g}/{state.split[1]:g}, minimum effect {state.min_effect:g}, "
        f"alpha {state.alpha:g}, started {state.started_at:%Y-%m-%d %H:%M:%S} UTC.",
        "",
    ]
    if last is not None:
        lines += [
            "| arm | outcomes | mean |",
            "|---|---|---|",
            f"| {a} (A) | {last.n[0]} | {last.mean[0]:.4g} |",
            f"| {b} (B) | {last.n[1]} | {last.mean[1]:.4g} |",
            "",
        ]
        if last.diff is not None:
            lines += [f"B - A = {last.diff:+.4g}, always-valid interval [{last.lo:+.4g}, {last.hi:+.4g}]", ""]
    svg = effect_svg(state.ticks, state.arms, state.metric, state.min_effect)
    lines.append(f"![effect over time]({svg_data_uri(svg)})")
    create_markdown_artifact(
        key=f"experiment-{state.model}",
        markdown="\n".join(lines),
        description=f"{state.model}: {a} vs {b} on {state.metric}, {state.status}",
    )


def load(store, model: str) -> ExperimentState | None:  # noqa: ANN001
    state, _ = records.load_or_none(store, state_key(model), ExperimentState)
    return state
