"""Route tables and the pure decisions over them: which version serves a request.

A RouteTable holds the stable version, an optional canary {version, weight} and shadow
{version, percent}, tenant pins and a revision. Storing and changing tables is
``fleet.catalog.routes.store``'s job; everything here is pure and frozen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.catalog.registry import SERVABLE, State
from fleet.catalog.tenants import Tenant
from fleet.errors import Forbidden, InvalidInput, NotFound

BUCKETS = 10_000  # weights resolve to 0.01 %


class Canary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    version: str
    weight: float = Field(ge=0, le=100, description="percent of unpinned traffic")


class Shadow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

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


def usable_versions(table: RouteTable, tenant: Tenant | None) -> set[str]:
    """Versions a tenant's traffic may reach: stable, canary and its own pin, as far as its
    entitlements allow. Another tenant's pin and the shadow are not among them, so nothing a
    tenant is shown (metadata, error messages) tells it of other tenants' versions."""
    found = {
        v
        for v in (
            table.stable,
            table.canary.version if table.canary else None,
            table.pins.get(tenant.name) if tenant else None,
        )
        if v
    }
    return {v for v in found if tenant is None or tenant.allows(table.model, v)}


def choose_version(
    table: RouteTable, tenant: Tenant | None, routing_key: str, requested_version: str | None = None
) -> Choice:
    """Pick the version for one request.

    requested version (if it is one the tenant may use) → tenant pin → sticky weighted
    split: a key goes to the canary when its bucket is below weight × 100, so raising the
    weight only ever moves keys from stable to canary. A tenant is never given a version
    it is not entitled to: a canary it may not use leaves its traffic on stable. A version
    the tenant may not use is answered exactly like one that is not served (``NotFound``).
    """
    if requested_version is not None:
        usable = usable_versions(table, tenant)
        if requested_version not in usable:
            raise NotFound(
                f"version {requested_version} of {table.model} is not served; "
                f"versions you may use: {', '.join(sorted(usable)) or 'none'}"
            )
        return Choice(requested_version, "requested")
    if tenant is not None and tenant.name in table.pins and tenant.allows(table.model, table.pins[tenant.name]):
        return Choice(table.pins[tenant.name], "pinned")
    if table.stable is None:
        raise NotFound(f"model {table.model} has no stable version to serve")
    if (
        table.canary
        and bucket(table, routing_key) < round(table.canary.weight * BUCKETS / 100)
        and (tenant is None or tenant.allows(table.model, table.canary.version))
    ):
        return Choice(table.canary.version, "canary")
    if tenant is not None and not tenant.allows(table.model, table.stable):
        raise NotFound(
            f"no version of {table.model} that you may use is served; "
            f"you may use: {', '.join(tenant.entitlements.get(table.model, []))}"
        )
    return Choice(table.stable, "stable")


def should_shadow(table: RouteTable, routing_key: str) -> bool:
    """Whether this request is mirrored to the shadow version (independent of the split)."""
    if table.shadow is None or table.shadow.percent <= 0:
        return False
    digest = hashlib.sha256(f"shadow\x00{table.model}\x00{routing_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS < round(table.shadow.percent * BUCKETS / 100)


def forbidden(model: str, version: str, tenant: Tenant) -> Forbidden:
    allowed = ", ".join(tenant.entitlements.get(model, [])) or f"no version of {model}"
    return Forbidden(f"tenant {tenant.name!r} may not use {model}:{version}; allowed: {allowed}")


# States a version may be in to take each role; routing never asks the registry for a
# transition it would refuse.
_ROLE_STATES = {
    "stable": frozenset({State.STABLE, State.CANARY, State.RETIRED}),
    "canary": frozenset({State.REGISTERED, State.CANARY}),
}


def validate_states(
    table: RouteTable, states: Mapping[str, State], current_stable: str | None, unreadable: frozenset[str] = frozenset()
) -> None:
    """Refuse a table that points at missing or unservable versions, or skips the canary.

    ``states`` maps each registered version to its state; ``current_stable`` is the stable
    version before this change; ``unreadable`` names versions whose manifest is bad. A registered version may become stable directly only when
    the model has no stable version yet (its first rollout).
    """
    problems: list[str] = []
    # refused on write only: tables stored before this rule stay readable (and fixable)
    if table.shadow and table.shadow.version == table.stable:
        problems.append(
            f"shadow {table.shadow.version} is already the stable version; "
            "expected another version to mirror stable's traffic to"
        )
    for role, version in _roles(table):
        state = states.get(version)
        allowed = _ROLE_STATES.get(role, SERVABLE)
        if role == "stable" and current_stable in (None, version):
            allowed = allowed | {State.REGISTERED}
        if state is None and version in unreadable:
            problems.append(f"the manifest of {role} {version} cannot be read (see `fleet doctor`)")
        elif state is None:
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
