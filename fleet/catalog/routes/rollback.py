"""Rollback: put a model's traffic back on a version known to be good, now.

The same function serves ``fleet rollback``, the gateway's admin API and the rollback
flow. With a canary in flight, rolling back ends the canary (all traffic to stable) and
marks the canary ``rejected``. Without one, the stable version before the current one —
the most recent other stable in the route history — becomes stable again; given the
runtime, it is started first if it no longer runs. Every running
gateway is then told to re-read the routes (``fleet.catalog.gateway_directory.notify``), so the change is
served within milliseconds instead of at the next poll.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fleet import audit, records
from fleet.catalog.registry import State
from fleet.catalog.routes.store import Router
from fleet.catalog.routes.table import RouteTable
from fleet.errors import Conflict, FleetError, InvalidInput
from fleet.types import Deployment


class Starter(Protocol):
    """What a rollback needs of a runtime (every ``fleet.runtime.base.Runtime`` is one): what
    runs, and starting a version. Declared here because the catalog sits below the runtimes."""

    def list(self) -> list[Deployment]: ...

    def deploy(self, model: str, version: str, replicas: int = 1) -> Deployment: ...


@dataclass(frozen=True)
class RollbackResult:
    table: RouteTable
    from_version: str | None  # what was taking the traffic that moved (the canary, or the old stable)
    to_version: str
    rejected: str | None  # the canary marked rejected, if any


def previous_stable(router: Router, model: str, current: str | None) -> str | None:
    """The most recent stable version other than ``current`` in the route history."""
    for event in reversed(router.history(model)):
        if event.kind == "route" and event.after:
            stable = event.after.get("stable")
            if stable and stable != current:
                return stable
    return None


def rollback(
    router: Router,
    model: str,
    to_version: str | None = None,
    *,
    why: str,
    who: str | None = None,
    runtime: Starter | None = None,
    start_missing: bool = True,
) -> RollbackResult:
    """Move traffic to ``to_version`` (default: end the canary, else the previous stable).

    With a ``runtime``, a target that is not running (an old stable undeployed after its
    rollback window) is deployed and ready before any traffic moves to it — or, with
    ``start_missing=False`` (the gateway, which may not start services), refused.
    """
    who = who or audit.actor()
    table = router.get(model)
    if table.stable is None:
        raise Conflict(f"{model} has no stable version; there is nothing to roll back to")
    canary = table.canary.version if table.canary else None
    if to_version is None:
        if canary is not None:
            to_version = table.stable
        else:
            to_version = previous_stable(router, model, table.stable)
            if to_version is None:
                raise Conflict(f"{model} has had no stable version before {table.stable}; name one with --to")
    states = router.registry.states(model)
    if to_version not in states:
        raise InvalidInput(f"{model}:{to_version} is not registered; registered: {', '.join(states) or 'none'}")
    moved_from = canary if to_version == table.stable else table.stable
    if runtime is not None and not any(d.model == model and d.version == to_version for d in runtime.list()):
        if not start_missing:
            raise Conflict(
                f"{model}:{to_version} is not running, and traffic never goes to a version that is not; "
                "`fleet rollback` (the flow) starts it first"
            )
        runtime.deploy(model, to_version)  # routing never points at a version that is not running
    after = router.set(model, stable=to_version, clear_canary=True, why=f"rollback: {why}", who=who)
    if not router.unchanged:  # the canary this write really ended (another may have replaced it since the read)
        canary = _canary_before(router, model, after.revision, canary)
    rejected = None
    # the route write already moved the canary back to registered (states follow routes);
    # a rollback is a verdict: it ends rejected
    if (
        canary is not None
        and canary != to_version
        and router.registry.states(model).get(canary)
        in (
            State.CANARY,
            State.REGISTERED,
        )
    ):
        router.registry.transition(model, canary, State.REJECTED, why=f"rolled back: {why}", who=who)
        rejected = canary
    return RollbackResult(after, moved_from, to_version, rejected)


def _canary_before(router: Router, model: str, revision: int, read: str | None) -> str | None:
    """The canary of the table ``revision`` replaced (its audit event's ``before``)."""
    try:
        event = records.load(router.store, audit.route_event_key(model, revision), audit.AuditEvent)[0]
    except FleetError:
        return read  # the event is rebuilt later; the canary read before the write is the best guess
    before = (event.before or {}).get("canary")
    return before["version"] if isinstance(before, dict) else None
