"""What every flow needs, built once per run from the environment the flow runs in:
the store, the policies, the runtime (packaging on first deploy) and the metrics source."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from fleet.catalog.policies.loader import Policies, load_policies
from fleet.runtime.base import Runtime
from fleet.types import MetricsSource, ObjectStore


@dataclass(frozen=True)
class FleetContext:
    store: ObjectStore
    policies: Policies
    runtime: Runtime
    metrics: MetricsSource


def fleet_context() -> FleetContext:
    from fleet.analysis.sources import open_metrics
    from fleet.runtime.packaged import packaged_runtime, policies_path
    from fleet.store import open_store

    store = open_store()
    return FleetContext(
        store, load_policies(policies_path()), packaged_runtime(policies_path()), open_metrics(store=store)
    )


def run_id() -> str:
    from prefect.runtime import flow_run

    return str(flow_run.id or f"local-{os.getpid()}")


def emit(event: str, payload: dict[str, Any]) -> None:
    """A Prefect event about a model (``fleet.rollout.*``, ``fleet.monitor.*``)."""
    from prefect.events import emit_event

    resource = {
        "prefect.resource.id": f"fleet.model.{payload.get('model', 'unknown')}",
        "prefect.resource.name": str(payload.get("model", "")),
    }
    emit_event(event=event, resource=resource, payload=payload)
