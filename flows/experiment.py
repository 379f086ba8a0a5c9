"""``experiment(model, arms, split, metric, min_effect, ...)``: an A/B test of two versions on an
outcome, decided by an always-valid interval (``fleet.analysis.ab``).

A (the stable) and B share the traffic by the canary split, sticky by routing key. Each
tick commits what the gateways staged (unless the committer is at it), adds the outcomes
committed since the last tick to each arm's sums (``fleet.logs.increments``: a tick reads
what is new, not everything since the start), and reads the gateways'
counters for the guardrails (``fleet.analysis.sequential.guardrails``: B's errors and p99 against
A's); the experiment ends on a winner, no difference, out of time, or stopped (a guardrail
or ``fleet experiment stop``). Traffic then goes back to A alone; with ``promote`` a winning
B is rolled out through the normal canary rollout. It holds the model's rollout lease the
whole time: an experiment and a rollout of one model never run at once.

Every decision is in ``fleet.control.experiment`` (the pure ``machine``, its executor
``effects.Experiment``); this module orders the calls, sleeps between looks, holds the
lease, deploys B and hands a winning B to the rollout.

Reports: ``experiments/<model>.json``, a markdown artifact with a table per arm and a plot
of the effect and its interval over time (updated every tick), and ``fleet.experiment.*``
events.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, Failed, State

from fleet import leases
from fleet.analysis.ab import duration_of, effect_svg, split_of
from fleet.analysis.drift.render import svg_data_uri
from fleet.catalog.experiments import ExperimentState, ExperimentStatus
from fleet.catalog.rollouts import lease_key
from fleet.control.experiment import machine
from fleet.control.experiment.effects import Experiment
from fleet.control.rollout.effects import LEASE_TTL
from flows._context import emit, fleet_context, run_id


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
    ab = Experiment(store, ctx.runtime, ctx.metrics, ctx.policies, who=who)
    ab.check(model, arms, metric, min_effect, alpha)  # at once, before waiting for anything
    lease = leases.acquire(store, lease_key(model), what=f"the experiment on {model}", who=who, stale_after=LEASE_TTL)
    ab.guard = lease.check
    try:
        a, b, span = ab.check(model, arms, metric, min_effect, alpha)  # again, holding the lease: still true
        with lease.kept_alive():
            ab.forget_stop(model)
            ctx.runtime.deploy(model, b)  # ready before it gets traffic
            lease.check()
            state = machine.start(
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
                now=time.time(),
            )
            try:
                ab.split(state)
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
                trouble: collections.deque[str] = collections.deque(maxlen=5)  # the last troubles, for the artifact
                troubled = 0  # looks with trouble so far
                while state.status == ExperimentStatus.RUNNING:
                    time.sleep(tick_s)
                    lease.check()
                    state, skipped = ab.look(state)
                    if ab.unreadable:
                        logger.warning("skipped log files that are not Parquet: %s", ", ".join(ab.unreadable))
                        trouble.append(
                            f"skipped {len(ab.unreadable)} unreadable log file(s), the first {ab.unreadable[0]}"
                        )
                    if ab.commit_failed is not None:
                        trouble.append(f"the staged logs could not be committed: {ab.commit_failed}")
                    if skipped is not None:
                        logger.warning("this look is skipped: %s", skipped)
                        trouble.append(f"a look was skipped: {skipped}")
                    troubled += bool(ab.unreadable) or skipped is not None
                    _report(state, list(trouble), troubled)
                    if skipped is not None:
                        continue
                    logger.info("%s", state.summary)
            except BaseException as exc:  # an error (or a cancel) ends it too: recorded, and the split removed below
                state = ab.stopped_by(state, exc)
                raise
            finally:
                ab.end(state)
    finally:
        lease.release()
    emit("fleet.experiment.ended", {"model": model, "status": str(state.status), "winner": state.winner})
    if machine.keeps_b(state):
        from flows.rollout import canary_rollout

        logger.info("%s won: rolling it out", b)
        return canary_rollout(model, b, return_state=True)
    if state.status == ExperimentStatus.STOPPED and state.summary.startswith("guardrail"):
        return Failed(message=state.summary)
    return Completed(message=state.summary)


def _report(state: ExperimentState, trouble: Sequence[str] = (), troubled: int = 0) -> None:
    """The run's artifact; ``trouble``: the last looks skipped and files unread, of ``troubled``."""
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
    if trouble:
        lines += [f"{troubled} look(s) had trouble; the last:", ""] + [f"- {t}" for t in trouble] + [""]
    svg = effect_svg(state.ticks, state.arms, state.metric, state.min_effect)
    lines.append(f"![effect over time]({svg_data_uri(svg)})")
    create_markdown_artifact(
        key=f"experiment-{state.model}",
        markdown="\n".join(lines),
        description=f"{state.model}: {a} vs {b} on {state.metric}, {state.status}",
    )
