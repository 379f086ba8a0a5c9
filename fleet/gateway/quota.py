"""Per-tenant token buckets: ``rps`` tokens a second, at most ``burst`` saved up.

In-process, so each gateway enforces the budget on its own share of the traffic; the
``fleet.types.QuotaBackend`` protocol is where a shared backend plugs in.
"""

from __future__ import annotations

import time
from collections.abc import Callable


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
