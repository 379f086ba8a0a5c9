"""Route tables: which versions of a model serve whom, and the pure choice of a version.

``routes/<model>.json`` holds the stable version, an optional canary {version, weight} and
shadow {version, percent}, tenant pins and a revision. Changes go through ``Router.update``:
a conditional write plus an audit event per revision, so ``history`` and ``at`` can say
what served at any past moment.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet import audit, records
from fleet.errors import Forbidden, InvalidInput, NotFound
from fleet.names import check_name, check_version
from fleet.registry import SERVABLE, TRANSITIONS, Registry, State
from fleet.tenants import Tenant, Tenants
from fleet.types import ObjectStore

BUCKETS = 10_000  # weights resolve to 0.01 %


class Canary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str
    weight: float = Field(ge=0, le=100, description="percent of unpinned traffic")


class Shadow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str
    percent: float = Field(ge=0, le=100, description="percent of requests mirrored")


class RouteTable(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    stable: str | None = None
    canary: Canary | None = None
    shadow: Shadow | None = None
    pins: dict[str, str] = {}  # tenant → version
    revision: int = 0
    updated_at: datetime | None = None
    updated_by: str | None = None
    reason: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> RouteTable:
        if self.canary and not self.stable:
            raise ValueError("a canary needs a stable version to split traffic with")
        if self.canary and self.canary.version == self.stable:
            raise ValueError(f"canary {self.canary.version} is already the stable version")
        if self.shadow and not self.stable:
            raise ValueError("a shadow needs a stable version whose traffic it mirrors")
        return self

    def served_versions(self) -> set[str]:
        """Versions that live traffic can reach (shadow excluded)."""
        found = set(self.pins.values())
        if self.stable:
            found.add(self.stable)
        if self.canary:
            found.add(self.canary.version)
        return found

    def referenced_versions(self) -> set[str]:
        return self.served_versions() | ({self.shadow.version} if self.shadow else set())

    def summary(self) -> dict[str, object]:
        """The routing content, without bookkeeping: what audit events record."""
        return self.model_dump(mode="json", exclude={"updated_at", "updated_by", "reason"})


# -- pure version choice --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Choice:
    version: str
    reason: Literal["requested", "pinned", "stable", "canary"]


def bucket(table: RouteTable, routing_key: str) -> int:
    """Stable hash of the routing key into [0, BUCKETS).

    Salted with the model and the canary version: each rollout samples a fresh set of
    keys, while within one rollout a key keeps its bucket as the weight changes.
    """
    salt = f"{table.model}\x00{table.canary.version if table.canary else ''}\x00{routing_key}"
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "big") % BUCKETS


def choose_version(
    table: RouteTable, tenant: Tenant | None, routing_key: str, requested_version: str | None = None
) -> Choice:
    """Pick the version for one request.

    requested version (if the tenant may use it and it is served) → tenant pin → sticky
    weighted split: a key goes to the canary when its bucket is below weight × 100, so
    raising the weight only ever moves keys from stable to canary.
    """
    if requested_version is not None:
        if tenant is not None and not tenant.allows(table.model, requested_version):
            raise _forbidden(table.model, requested_version, tenant)
        if requested_version not in table.served_versions():
            served = ", ".join(sorted(table.served_versions())) or "none"
            raise NotFound(f"version {requested_version} of {table.model} is not served; served: {served}")
        return Choice(requested_version, "requested")
    if tenant is not None and tenant.name in table.pins:
        return Choice(table.pins[tenant.name], "pinned")
    if table.stable is None:
        raise NotFound(f"model {table.model} has no stable version to serve")
    if table.canary and bucket(table, routing_key) < round(table.canary.weight * BUCKETS / 100):
        return Choice(table.canary.version, "canary")
    return Choice(table.stable, "stable")


def should_shadow(table: RouteTable, routing_key: str) -> bool:
    """Whether this request is mirrored to the shadow version (independent of the split)."""
    if table.shadow is None or table.shadow.percent <= 0:
        return False
    digest = hashlib.sha256(f"shadow\x00{table.model}\x00{routing_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS < round(table.shadow.percent * BUCKETS / 100)


def _forbidden(model: str, version: str, tenant: Tenant) -> Forbidden:
    allowed = ", ".join(tenant.entitlements.get(model, [])) or f"no version of {model}"
    return Forbidden(f"tenant {tenant.name!r} may not use {model}:{version}; allowed: {allowed}")


# States a version may be in to take each role; routing never asks the registry for a
# transition it would refuse.
_ROLE_STATES = {
    "stable": frozenset({State.STABLE, State.CANARY, State.RETIRED}),
    "canary": frozenset({State.REGISTERED, State.CANARY}),
}


def validate_states(table: RouteTable, states: Mapping[str, State], current_stable: str | None) -> None:
    """Refuse a table that points at missing or unservable versions, or skips the canary.

    ``states`` maps each registered version to its state; ``current_stable`` is the stable
    version before this change. A registered version may become stable directly only when
    the model has no stable version yet (its first rollout).
    """
    problems: list[str] = []
    for role, version in _roles(table):
        state = states.get(version)
        allowed = _ROLE_STATES.get(role, SERVABLE)
        if role == "stable" and current_stable in (None, version):
            allowed = allowed | {State.REGISTERED}
        if state is None:
            problems.append(f"{role} {version} is not registered")
        elif state not in allowed:
            hint = " (roll it out as a canary first)" if state == State.REGISTERED else ""
            problems.append(f"{role} {version} is {state}, expected {' or '.join(sorted(allowed))}{hint}")
    if problems:
        raise InvalidInput(f"route for {table.model} refused: {'; '.join(problems)}")


def _roles(table: RouteTable) -> list[tuple[str, str]]:
    roles = [(f"pin of {t}", v) for t, v in sorted(table.pins.items())]
    if table.stable:
        roles.append(("stable", table.stable))
    if table.canary:
        roles.append(("canary", table.canary.version))
    if table.shadow:
        roles.append(("shadow", table.shadow.version))
    return roles


# -- stored route tables --------------------------------------------------------------------


class Router:
    def __init__(self, store: ObjectStore, registry: Registry | None = None) -> None:
        self.store = store
        self.registry = registry or Registry(store)

    @staticmethod
    def _key(model: str) -> str:
        return f"routes/{check_name('model', model)}.json"

    def get(self, model: str) -> RouteTable:
        table, _ = records.load_or_none(self.store, self._key(model), RouteTable)
        if table is not None:
            return table
        if not self.registry.versions(model):
            raise NotFound(f"model {model!r} has no registered versions")
        return RouteTable(model=model)

    def update(
        self,
        model: str,
        change: Callable[[RouteTable], RouteTable],
        *,
        why: str,
        who: str | None = None,
    ) -> RouteTable:
        """Apply ``change`` as one audited revision; retried from a fresh read on a lost race."""
        who = who or audit.actor()
        if not why.strip():
            raise InvalidInput("a route change needs a reason; expected a non-empty --reason")

        def apply(before: RouteTable | None) -> RouteTable:
            before = before or RouteTable(model=model)
            after = change(before)
            validate_states(after, self.registry.states(model), before.stable)
            return after.model_copy(update={
                "model": model, "revision": before.revision + 1,
                "updated_at": audit.now(), "updated_by": who, "reason": why,
            })  # fmt: skip

        self.get(model)  # NotFound for a model that was never registered
        self._repair_audit(model)
        before, after = records.update(self.store, self._key(model), RouteTable, apply)
        self._log(before, after)
        self._apply_states(before, after, who, why)
        return after

    def set(
        self,
        model: str,
        *,
        stable: str | None = None,
        canary: str | None = None,
        weight: float | None = None,
        shadow: str | None = None,
        shadow_percent: float | None = None,
        clear_canary: bool = False,
        clear_shadow: bool = False,
        why: str,
        who: str | None = None,
    ) -> RouteTable:
        """Change some fields of the route; unnamed fields keep their value."""
        for v in (stable, canary, shadow):
            if v is not None:
                check_version(v)

        def change(t: RouteTable) -> RouteTable:
            data = t.model_dump()
            if stable is not None:
                data["stable"] = stable
                if t.canary and t.canary.version == stable:
                    data["canary"] = None  # promoting the canary ends the split
            if clear_canary:
                data["canary"] = None
            elif canary is not None or weight is not None:
                data["canary"] = _arm(model, "canary", t.canary, canary, "weight", weight, default=0.0)
            if clear_shadow:
                data["shadow"] = None
            elif shadow is not None or shadow_percent is not None:
                data["shadow"] = _arm(model, "shadow", t.shadow, shadow, "percent", shadow_percent, default=100.0)
            return _table(data)

        return self.update(model, change, why=why, who=who)

    def pin(self, model: str, tenant: str, version: str, *, why: str, who: str | None = None) -> RouteTable:
        check_version(version)
        record = Tenants(self.store).get(tenant)
        if not record.allows(model, version):
            raise _forbidden(model, version, record)
        return self.update(
            model, lambda t: _table({**t.model_dump(), "pins": {**t.pins, tenant: version}}), why=why, who=who
        )

    def unpin(self, model: str, tenant: str, *, why: str, who: str | None = None) -> RouteTable:
        def change(t: RouteTable) -> RouteTable:
            if tenant not in t.pins:
                raise NotFound(f"tenant {tenant!r} has no pin on {model}")
            return _table({**t.model_dump(), "pins": {k: v for k, v in t.pins.items() if k != tenant}})

        return self.update(model, change, why=why, who=who)

    # -- history ------------------------------------------------------------------------
    def history(self, model: str) -> list[audit.AuditEvent]:
        """Every route and state change of ``model``, oldest first."""
        self.get(model)
        self._repair_audit(model)
        return audit.events(self.store, model)

    def at(self, model: str, when: datetime) -> RouteTable | None:
        """The route table in force at ``when`` (None: the model had no route yet)."""
        if when.tzinfo is None:
            raise InvalidInput(f"time {when.isoformat()} has no timezone; expected e.g. 2026-12-01T14:02:00Z")
        in_force = None
        for event in self.history(model):
            if event.kind == "route" and event.at <= when:
                in_force = event.after
        return RouteTable.model_validate(in_force) if in_force is not None else None

    # -- internals ----------------------------------------------------------------------
    def _log(self, before: RouteTable | None, after: RouteTable) -> None:
        audit.append(self.store, audit.AuditEvent(
            model=after.model, kind="route", at=after.updated_at or audit.now(),
            who=after.updated_by or "", why=after.reason or "", revision=after.revision,
            before=before.summary() if before else None, after=after.summary(),
        ))  # fmt: skip

    def _repair_audit(self, model: str) -> None:
        """Log the current revision if a writer died between its route write and its event.

        The route table carries who/why/when of its last change and the previous event holds
        the table before it, so the lost event can be rebuilt exactly.
        """
        table, _ = records.load_or_none(self.store, self._key(model), RouteTable)
        if table is None or table.revision == 0:
            return
        if records.exists(self.store, audit.route_event_key(model, table.revision)):
            return
        before = None
        if table.revision > 1:
            try:
                prev = records.load(self.store, audit.route_event_key(model, table.revision - 1), audit.AuditEvent)[0]
                before = RouteTable.model_validate(prev.after)
            except NotFound:
                before = None
        self._log(before, table)

    def _apply_states(self, before: RouteTable | None, after: RouteTable, who: str, why: str) -> None:
        """Bring version states in line with the new table (after the route write won)."""
        states = self.registry.states(after.model)
        wanted: dict[str, State] = {}
        if after.stable:
            wanted[after.stable] = State.STABLE
        if after.canary:
            wanted[after.canary.version] = State.CANARY
        old_stable = before.stable if before else None
        if old_stable and old_stable not in after.referenced_versions():
            wanted[old_stable] = State.RETIRED
        for version, state in wanted.items():
            current = states.get(version)
            if current is not None and current != state and state in TRANSITIONS[current]:
                self.registry.transition(after.model, version, state, why=f"route r{after.revision}: {why}", who=who)


def _arm(
    model: str,
    role: str,
    current: Canary | Shadow | None,
    version: str | None,
    field: str,
    amount: float | None,
    *,
    default: float,
) -> dict[str, object]:
    """The canary or shadow after a change of version, amount, or both.

    A new version starts at ``default`` unless an amount is given; naming only an amount
    changes the current arm's.
    """
    version = version or (current.version if current else None)
    if version is None:
        raise InvalidInput(f"{model} has no {role} to change; expected --{role} VERSION")
    kept = getattr(current, field) if current is not None and current.version == version else default
    return {"version": version, field: kept if amount is None else amount}


def _table(data: dict[str, object]) -> RouteTable:
    try:
        return RouteTable.model_validate(data)
    except ValueError as exc:
        raise InvalidInput(f"route refused: {_first_error(exc)}") from None


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'route'}: {e['msg'].removeprefix('Value error, ')}"
            for e in errors()
        )
    return str(exc)
