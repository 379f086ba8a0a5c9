"""In-process quotas: token buckets (and in-flight counts) per tenant, for one gateway
process or its local share of a quota (``fleet.gateway.quota``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fleet.types import Refusal

LEASE_S = 300.0  # a concurrency lease's life when the model's timeout is not known
TOKEN_WINDOW_S = 60.0  # a token quota is per minute: a minute's worth may be saved up


class TokenBuckets:
    """In-process buckets (and in-flight counts), for one gateway or a local share.

    With ``divisor`` (the live gateways), as the ``QuotaBackend`` it grants each quota
    divided by it: N gateways without Redis then admit about the quota in total, if the
    load balancer spreads a tenant's requests evenly, instead of N times it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, divisor: Callable[[], int] | None = None) -> None:
        self._clock = clock
        self.divisor = divisor
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant → (tokens, at)
        self._in_flight: dict[str, int] = {}
        self._tokens: dict[str, float] = {}  # tenant → when its token budget is whole again (GCRA, as in Redis)

    def take(self, tenant: str, rps: float, burst: int, concurrency: int | None = None) -> Refusal | None:
        now = self._clock()
        tokens, at = self._buckets.get(tenant, (float(burst), now))
        tokens = min(float(burst), tokens + (now - at) * rps)
        if tokens < 1.0:
            self._buckets[tenant] = (tokens, now)
            return Refusal("rate", (1.0 - tokens) / rps)
        if concurrency is not None:
            if self._in_flight.get(tenant, 0) >= concurrency:
                self._buckets[tenant] = (tokens, now)  # a refused request spends no token
                return Refusal("concurrency", 1.0)
            self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
        self._buckets[tenant] = (tokens - 1.0, now)
        return None

    def put_back(self, tenant: str) -> None:
        n = self._in_flight.get(tenant, 0) - 1
        if n > 0:
            self._in_flight[tenant] = n
        else:
            self._in_flight.pop(tenant, None)

    # -- QuotaBackend ------------------------------------------------------------------------
    def take_share(self, tenant: str, rps: float, burst: int, concurrency: int | None, n: int) -> Refusal | None:
        """The quota divided by ``n`` gateways (each part at least one request)."""
        if n <= 1:
            return self.take(tenant, rps, burst, concurrency)
        return self.take(tenant, rps / n, max(1, burst // n), None if concurrency is None else max(1, concurrency // n))

    async def acquire(
        self, tenant: str, rps: float, burst: int, concurrency: int | None, lease: str, lease_s: float = LEASE_S
    ) -> Refusal | None:
        return self.take_share(tenant, rps, burst, concurrency, self.divisor() if self.divisor else 1)

    def release(self, tenant: str, lease: str) -> None:
        self.put_back(tenant)

    def tokens_wait(self, tenant: str, per_minute: float) -> float:
        """Seconds until ``tenant`` has a token of ``per_minute`` left; 0 when it has one now."""
        now = self._clock()
        tat = max(self._tokens.get(tenant, now), now)
        if tat <= now:
            self._tokens.pop(tenant, None)  # whole again: nothing to keep
        interval = TOKEN_WINDOW_S / per_minute
        return max(0.0, tat - now - (TOKEN_WINDOW_S - interval))

    def spend_tokens(self, tenant: str, per_minute: float, n: int) -> None:
        """``n`` tokens spent (below 0: a reservation's unused part given back, never more
        than a whole budget saved up)."""
        now = self._clock()
        tat = max(self._tokens.get(tenant, now), now) + n * TOKEN_WINDOW_S / per_minute
        if tat > now:
            self._tokens[tenant] = tat
        else:
            self._tokens.pop(tenant, None)  # whole again: nothing to keep

    async def check_tokens(self, tenant: str, per_minute: int) -> Refusal | None:
        wait = self.tokens_wait(tenant, per_minute / self._share())
        return Refusal("tokens", wait) if wait > 0 else None

    def charge_tokens(self, tenant: str, per_minute: int, n: int) -> None:
        self.spend_tokens(tenant, per_minute / self._share(), n)

    async def reserve_tokens(self, tenant: str, per_minute: int, n: int) -> Refusal | None:
        refused = await self.check_tokens(tenant, per_minute)  # one step on the loop: nothing runs between
        if refused is None:
            self.charge_tokens(tenant, per_minute, n)
        return refused

    def _share(self) -> int:
        return max(1, self.divisor()) if self.divisor else 1

    @property
    def degraded(self) -> bool:
        """Never: an in-process budget is never shared, so it cannot lose its sharing."""
        return False

    async def close(self) -> None:
        """Nothing is owed and nothing connected."""

    def health(self) -> dict[str, Any]:
        n = max(1, self.divisor()) if self.divisor else 1
        return {
            "backend": "in-process",
            "shared": False,
            "share_divisor": n,
            "note": f"this gateway process enforces 1/{n} of every quota on its own traffic (the live gateways "
            "divide it); set FLEET_REDIS_URL to share one exact budget",
        }
