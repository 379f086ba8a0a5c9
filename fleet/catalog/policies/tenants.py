"""A tenant's policy (``tenants:``): the versions it may call, its quota and its weight."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from fleet.catalog.policies.spec import Spec, VersionOrAny


class QuotaPolicy(Spec):
    rps: float = Field(gt=0.0)  # sustained requests per second
    burst: int = Field(ge=1)  # token-bucket size; may be below rps for smooth-only traffic
    concurrency: int | None = Field(None, ge=1)  # requests in flight at once, across every gateway
    tokens_per_minute: int | None = Field(None, ge=1)  # generation: prompt + completion tokens, across every gateway


class TenantSpec(Spec):
    # no pins: a tenant's pin lives in the route table only (`fleet route pin`), where the
    # router reads it; a second copy here would drift from it
    entitlements: dict[str, Annotated[list[VersionOrAny], Field(min_length=1)]]  # model -> versions
    quota: QuotaPolicy
    weight: float = Field(1.0, gt=0.0, le=1000.0)  # share of a saturated version against other tenants
    isolation: bool = False
