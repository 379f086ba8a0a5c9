"""``monitor(model)``: data quality first, then drift and accuracy; an alert on bad data, a
retrain on drift over good data. Scheduled from the model's monitoring policy.

The window is the stable version's rows of the inference log (with feedback labels joined)
over the policy's ``window_hours``. Great Expectations checks them against the version's
schema and baseline; a failure is an alert (a ``fleet.monitor.bad-data`` event, a report
artifact, the run Failed) and blocks retraining. On good data, drift statistics and
accuracy on labelled feedback decide (``fleet.analysis.monitoring.decide``); drift starts
``retrain``. Every run stores its report under ``reports/<model>/monitor/``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed, State

from fleet.analysis.drift import concept_drift, drift_markdown, drift_report, drift_svg, svg_data_uri
from fleet.analysis.monitoring import MonitoringDecision, decide
from fleet.analysis.quality import build_expectations, quality_markdown, quality_table, validate
from fleet.catalog.registry import Registry
from fleet.catalog.routes.store import Router
from fleet.errors import NotFound
from fleet.logs.feedback import labelled
from fleet.types import ObjectStore
from flows._context import emit, fleet_context, run_id


def _state_key(model: str) -> str:
    return f"reports/{model}/monitor/state.json"


def last_retrain(store: ObjectStore, model: str) -> datetime | None:
    try:
        data = json.loads(store.get(_state_key(model)).data)
    except NotFound:
        return None  # never retrained
    return datetime.fromisoformat(data["last_retrain_at"]) if data.get("last_retrain_at") else None


def record_retrain(store: ObjectStore, model: str, at: datetime, run: str) -> None:
    store.put(_state_key(model), json.dumps({"last_retrain_at": at.isoformat(), "run": run}).encode())


@task(name="read the window", cache_policy=NO_CACHE)
def read(store: ObjectStore, model: str, version: str, hours: float) -> Any:  # noqa: ANN401 - a DataFrame
    end = datetime.now(UTC)
    frame = labelled(store, model, end - timedelta(hours=hours), end)
    return frame[frame["version"] == version].reset_index(drop=True) if len(frame) else frame


@task(name="data quality", cache_policy=NO_CACHE)
def check_quality(frame: Any, manifest: Any, policy: Any) -> Any:  # noqa: ANN401
    result = validate(
        frame,
        build_expectations(manifest.inputs, manifest.baseline_profile, policy.quality),
        name=f"{manifest.ref} inference log",
    )
    create_table_artifact(
        key=f"quality-{manifest.model}", table=quality_table(result), description=quality_markdown(result)
    )
    return result


@task(name="drift", cache_policy=NO_CACHE)
def check_drift(frame: Any, manifest: Any, policy: Any) -> tuple[Any, Any]:  # noqa: ANN401
    report = drift_report(manifest.baseline_profile, frame, policy)
    concept = None
    if "label" in frame and frame["label"].notna().any():
        rows = frame[frame["label"].notna()]
        concept = concept_drift(rows["prediction"], rows["label"], manifest.metrics, policy.retrain)
    markdown = drift_markdown(report, concept)
    if report.drifting_features:
        markdown += f"\n\n![reference vs current]({svg_data_uri(drift_svg(report))})\n"
    create_markdown_artifact(key=f"drift-{manifest.model}", markdown=markdown, description=report.reason)
    return report, concept


@flow(name="monitor", flow_run_name="monitor {model}")
def monitor(
    model: str,
    window_hours: float | None = None,
    retrain: bool = True,
    retrain_overrides: dict | None = None,
    cooldown: bool = True,
) -> State:
    """Judge the recent traffic of ``model``'s stable version; alert, retrain, or report all is well.

    ``cooldown=False`` ignores the policy's retrain cooldown (a rehearsal, ``fleet demo``).
    """
    logger = get_run_logger()
    ctx = fleet_context()
    policy = ctx.policies.monitoring_for(model)
    if ctx.policies.model(model).generative:
        # its log rows are lengths, times and digests, not features: the rollout's generation
        # gates and exact-match feedback judge it; drift of prompts is not built
        return Completed(
            message=f"{model} is generative: drift and data-quality monitoring judge tensor inputs "
            "only; its versions are judged by the rollout's generation and exact_match gates"
        )
    table = Router(ctx.store).get(model)
    if table.stable is None:
        return Completed(message=f"{model} has no stable version; nothing to monitor")
    manifest = Registry(ctx.store).get(model, table.stable)
    hours = window_hours or policy.window_hours
    frame = read(ctx.store, model, table.stable, hours)
    now = datetime.now(UTC)
    if len(frame) < policy.min_rows:
        decision = decide(None, None, None, policy, rows=len(frame), last_retrain_at=None, now=now)
        return Completed(message=decision.summary)
    quality = check_quality(frame, manifest, policy)
    report, concept = (None, None) if not quality.passed else check_drift(frame, manifest, policy)
    last = last_retrain(ctx.store, model) if cooldown else None
    decision = decide(quality, report, concept, policy, rows=len(frame), last_retrain_at=last, now=now)
    _store_report(ctx.store, model, manifest.version, hours, len(frame), quality, report, concept, decision)
    logger.info("%s:%s over %g h (%d rows): %s", model, manifest.version, hours, len(frame), decision.summary)
    event = {"alert": "bad-data", "retrain": "drift"}.get(decision.action, decision.action)
    emit(
        f"fleet.monitor.{event}",
        {"model": model, "version": manifest.version, "decision": decision.action, "reasons": list(decision.reasons)},
    )
    if decision.action == "alert":
        return Failed(message=f"{model}:{manifest.version} {decision.summary}")
    if decision.action == "retrain" and retrain:
        record_retrain(ctx.store, model, now, run_id())
        overrides = {"window_hours": hours, **(retrain_overrides or {})}  # train on the window that was judged
        state = _start_retrain(model, "; ".join(decision.reasons), overrides)
        return Completed(message=f"{decision.summary} — retrain: {state}")
    return Completed(message=decision.summary)


def _start_retrain(model: str, reason: str, overrides: dict) -> str:
    """As its own deployment run when this runs from a deployment (it takes minutes), else as a subflow."""
    from prefect.runtime import deployment

    if deployment.id:
        from prefect.deployments import run_deployment

        run = run_deployment("retrain/retrain", parameters={"model": model, "reason": reason, **overrides}, timeout=0)
        return f"started run {run.id}"
    from flows.retrain import retrain

    state = retrain(model, reason=reason, **overrides, return_state=True)
    return f"{state.type.value.lower()}: {state.message}"


def _store_report(
    store: ObjectStore,
    model: str,
    version: str,
    hours: float,
    rows: int,
    quality: Any,
    report: Any,
    concept: Any,
    decision: MonitoringDecision,
) -> None:  # noqa: ANN401
    now = datetime.now(UTC)
    body = {
        "model": model,
        "version": version,
        "at": now.isoformat(),
        "window_hours": hours,
        "rows": rows,
        "decision": {"action": decision.action, "reasons": list(decision.reasons)},
        "quality": quality.model_dump(mode="json") if quality else None,
        "drift": report.model_dump(mode="json") if report else None,
        "concept": concept.model_dump(mode="json") if concept else None,
    }
    store.put(
        f"reports/{model}/monitor/{now:%Y/%m/%d}/{now:%H%M%S}-{run_id()[:8]}.json", json.dumps(body, indent=2).encode()
    )


def deployments() -> list:
    """A scheduled monitor per model that has a registered version (cron from its policy), and retrain."""
    from fleet.catalog.policies.loader import load_policies
    from fleet.runtime.packaged import policies_path
    from fleet.store import open_store
    from flows.retrain import retrain

    policies, store = load_policies(policies_path()), open_store()
    registry = Registry(store)
    out = [retrain.to_deployment(name="retrain", description="Retrain a model and roll it out", tags=["fleet"])]
    for name in sorted(policies.models):
        if registry.versions(name):
            schedule = policies.monitoring_for(name).schedule
            out.append(
                monitor.to_deployment(
                    name=f"monitor-{name}",
                    cron=schedule,
                    parameters={"model": name},
                    description=f"Quality and drift of {name}",
                    tags=["fleet"],
                )
            )
    out.append(monitor.to_deployment(name="monitor", description="Quality and drift of a model", tags=["fleet"]))
    return out
