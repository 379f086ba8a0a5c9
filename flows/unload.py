"""``idle-unload``: stop lazy versions idle past their ``idle_unload_s`` (``fleet.control.lazy``).

Scheduled every ``EVERY_S`` by ``fleet flows serve`` (and so by ``fleet up``); each run
logs what it stopped and why. Only lazy versions are stopped, never one a rollout or a
rollback window needs; a version's next request starts it again (``fleet.gateway.activate``).
"""

from __future__ import annotations

from prefect import flow, get_run_logger

EVERY_S = 30  # an idle version runs at most this much past its idle_unload_s


@flow(name="idle-unload", flow_run_name="idle unload")
def idle_unload() -> list[dict]:
    from fleet.control.lazy import LoadController
    from flows._context import fleet_context

    ctx = fleet_context()
    stopped = LoadController(ctx.store, ctx.policies, ctx.runtime).unload_idle()
    logger = get_run_logger()
    for u in stopped:
        logger.info("stopped %s:%s: %s (%.0f MiB)", u.model, u.version, u.reason, u.memory_mib)
    if not stopped:
        logger.info("nothing idle to stop")
    return [{"model": u.model, "version": u.version, "reason": u.reason, "memory_mib": u.memory_mib} for u in stopped]
