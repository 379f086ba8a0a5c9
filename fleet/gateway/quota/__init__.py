"""Quotas: per tenant, ``rps`` requests a second with at most ``burst`` saved up, and
optionally at most ``concurrency`` requests in flight at once (and, for generations,
``tokens_per_minute``).

Two backends answer the same question (``fleet.types.QuotaBackend``), one module each:

- ``buckets.TokenBuckets``, in-process: the embedded default. Each gateway process enforces
  its *local share*, the quota divided by the live gateways (``gateways/`` records, one per
  worker): about the quota in total if the load balancer spreads a tenant evenly — not
  exactly (a client on one keep-alive connection reaches one worker, so it gets 1/N).
- ``redis.RedisQuotas`` (``FLEET_REDIS_URL``, ``redis.from_env``): one budget for every gateway
  and worker, kept by the Lua scripts of ``scripts``; while Redis is away, the local share
  in in-process buckets.

``Quotas`` is the pipeline's step: it takes a token for an authenticated tenant (whose
quota the routing snapshot already resolved: its record's, else its policy's) before the
request's body is read, so a tenant over its quota costs the gateway no parsing. A
concurrency lease is released when the request is answered (``release``, called by
``fleet.gateway.middleware.close_request``); one a crashed gateway never released expires in
Redis ``LEASE_SLACK_S`` after the request's timeout.
"""

from __future__ import annotations

import math
import os
from typing import Any

from fleet.catalog.tenants import Tenant
from fleet.errors import FleetError
from fleet.gateway.quota.buckets import LEASE_S
from fleet.gateway.telemetry import Telemetry
from fleet.types import QuotaBackend, Refusal

__all__ = ["LEASE_SLACK_S", "OverQuota", "Quotas", "divide", "release"]

LEASE_SLACK_S = 30.0  # a lease outlives its request's timeout by this (reading a body takes time too)


class OverQuota(FleetError):
    status = 429

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Quotas:
    def __init__(self, backend: QuotaBackend, telemetry: Telemetry) -> None:
        self.backend, self.telemetry = backend, telemetry

    async def take(self, tenant: Tenant, state: dict[str, Any], timeout_s: float | None = None) -> None:
        """One request's token (and, with a concurrency quota, a lease released when it is
        answered, or else lapsing ``LEASE_SLACK_S`` after the request's ``timeout_s``), or
        ``OverQuota``: 429 with the seconds until the next token."""
        q = tenant.quota
        if q is None:
            return
        lease = os.urandom(8).hex() if q.concurrency else ""
        lease_s = LEASE_S if timeout_s is None else timeout_s + LEASE_SLACK_S
        refused = await self.backend.acquire(tenant.name, q.rps, q.burst, q.concurrency, lease, lease_s)
        if refused is None:
            if q.concurrency:
                state["quota_lease"] = (self, tenant.name, lease)
            return
        self.telemetry.quota_refused(tenant.name)
        if refused.reason == "concurrency":
            raise OverQuota(
                f"tenant {tenant.name!r} already has {q.concurrency} requests in flight (its quota); "
                "retry when one is answered",
                refused.wait_s,
            )
        raise OverQuota(
            f"tenant {tenant.name!r} is over its quota of {q.rps:g} requests/s (burst {q.burst}); "
            f"retry after {refused.wait_s:.2f} s",
            refused.wait_s,
        )

    def release(self, tenant: str, lease: str) -> None:
        self.backend.release(tenant, lease)

    async def take_feedback(self, tenant: str, rps: float, burst: int) -> None:
        """One ``POST /v1/feedback`` call of ``tenant``, from a bucket of its own (the gateway
        policy's ``feedback_rps`` / ``feedback_burst``), or ``OverQuota``."""
        refused = await self.backend.acquire(f"{tenant}/feedback", rps, burst, None, "")
        if refused is not None:
            self.telemetry.quota_refused(tenant)
            raise OverQuota(
                f"tenant {tenant!r} is over its feedback quota of {rps:g} calls/s (burst {burst}; the gateway "
                f"policy's feedback_rps, else its own quota's); retry after {refused.wait_s:.2f} s",
                refused.wait_s,
            )

    async def check_tokens(self, tenant: Tenant) -> None:
        """A generation may start while the tenant has tokens left this minute; else 429."""
        q = tenant.quota
        if q is None or q.tokens_per_minute is None:
            return
        refused = await self.backend.check_tokens(tenant.name, q.tokens_per_minute)
        if refused is not None:
            raise self._over_tokens(tenant, refused)

    async def reserve_tokens(self, tenant: Tenant, n: int) -> int:
        """A generation admitted: ``n`` tokens (its ``max_tokens``) taken from the budget at
        once, if a token is left (else 429), so concurrent generations cannot overshoot a
        budget that had one token left. Returns what was reserved (0 without a token quota):
        the generation is charged against it, and what it did not use is given back."""
        q = tenant.quota
        if q is None or q.tokens_per_minute is None:
            return 0
        refused = await self.backend.reserve_tokens(tenant.name, q.tokens_per_minute, n)
        if refused is not None:
            raise self._over_tokens(tenant, refused)
        return n

    def _over_tokens(self, tenant: Tenant, refused: Refusal) -> OverQuota:
        """The 429 of a tenant out of tokens this minute (counted)."""
        self.telemetry.quota_refused(tenant.name)
        return OverQuota(
            f"tenant {tenant.name!r} has used its {tenant.quota.tokens_per_minute} tokens a minute (its quota, "  # type: ignore[union-attr]
            f"prompt and completion); retry after {refused.wait_s:.2f} s",
            refused.wait_s,
        )

    def charge(self, tenant: Tenant, n: int) -> None:
        """``n`` more tokens spent (below 0: a reservation's unused part given back)."""
        q = tenant.quota
        if q is not None and q.tokens_per_minute is not None and n != 0:
            self.backend.charge_tokens(tenant.name, q.tokens_per_minute, n)


def release(state: dict[str, Any]) -> None:
    """Give back the request's concurrency lease, if it holds one (idempotent)."""
    held = state.pop("quota_lease", None)
    if held is not None:
        quotas, tenant, lease = held
        quotas.release(tenant, lease)


def divide(limit: int, workers: int) -> int:
    """One worker's part of a limit the whole gateway process group shares: rounded up, so
    at least 1 (a limit of 1 over 2 workers is 1 each: 2 in all, the most it can be exceeded
    by is workers − 1); 0 stays 0 (``max_queue: 0``: nobody waits)."""
    return 0 if limit <= 0 else max(1, math.ceil(limit / max(1, workers)))
