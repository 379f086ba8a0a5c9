"""``rollback(model, to_version=None, reason)``: an immediate flip back to a good version.

The same ``fleet.catalog.routes.rollback.rollback`` as the CLI and the admin API, then a push to every
live gateway so the change is served within a second. If a canary rollout owns the
model, its next tick sees the route changed under it and ends as rolled back.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from fleet.catalog import gateway_directory
from fleet.catalog.routes.rollback import rollback as do_rollback
from fleet.catalog.routes.store import Router
from flows._context import emit, run_id


@flow(name="rollback", flow_run_name="rollback {model}")
def rollback(model: str, to_version: str | None = None, reason: str = "rollback requested") -> dict:
    from flows._context import fleet_context

    ctx = fleet_context()
    store = ctx.store
    result = do_rollback(Router(store), model, to_version, why=reason, who=f"flow run {run_id()}", runtime=ctx.runtime)
    pushed = gateway_directory.tell(store)
    get_run_logger().info(
        "%s: traffic from %s to %s; gateways told: %s",
        model,
        result.from_version,
        result.to_version,
        "through the change bus" if pushed is None else (pushed or "none registered"),
    )
    emit(
        "fleet.rollback.done",
        {
            "model": model,
            "from": result.from_version,
            "to": result.to_version,
            "rejected": result.rejected,
            "reason": reason,
        },
    )
    return {
        "from_version": result.from_version,
        "to_version": result.to_version,
        "rejected": result.rejected,
        "revision": result.table.revision,
        "gateways_notified": pushed or {},
        "change_bus": pushed is None,
    }
