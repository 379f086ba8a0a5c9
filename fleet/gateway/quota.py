"""Quotas: per-tenant token buckets, ``rps`` tokens a second, at most ``burst`` saved up.

``TokenBuckets`` is in-process, so each gateway enforces the budget on its own share of the
traffic; the ``fleet.types.QuotaBackend`` protocol is where a shared backend plugs in.
``Quotas`` is the pipeline's step: it takes a token for an authenticated tenant (whose
quota the routing snapshot already resolved: its record's, else its policy's) before the
request's body is read, so a tenant over its quota costs the gateway no parsing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fleet.errors import FleetError
from fleet.gateway.telemetry import Telemetry
from fleet.tenants import Tenant
from fleet.types import QuotaBackend


class OverQuota(FleetError):
    status = 429

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TokenBuckets:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant → (tokens, at)

    def acquire(self, tenant: str, rps: float, burst: int) -> float | None:
        now = self._clock()
        tokens, at = self._buckets.get(tenant, (float(burst), now))
        tokens = min(float(burst), tokens + (now - at) * rps)
        if tokens >= 1.0:
            self._buckets[tenant] = (tokens - 1.0, now)
            return None
        self._buckets[tenant] = (tokens, now)
        return (1.0 - tokens) / rps


class Quotas:
    def __init__(self, backend: QuotaBackend, telemetry: Telemetry) -> None:
        self.backend, self.telemetry = backend, telemetry

    def take(self, tenant: Tenant) -> None:
        """One request's token, or ``OverQuota`` (429 with the seconds until the next token)."""
        q = tenant.quota
        if q is None:
            return
        wait = self.backend.acquire(tenant.name, q.rps, q.burst)
        if wait is not None:
            self.telemetry.quota.labels(tenant.name).inc()
            raise OverQuota(f"tenant {tenant.name!r} is over its quota of {q.rps:g} requests/s (burst {q.burst}); "
                            f"retry after {wait:.2f} s", wait)  # fmt: skip
