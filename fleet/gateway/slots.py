"""Admission to an upstream: a concurrency limit with a bounded wait queue shared fairly by tenants.

When every slot is taken, a request waits in a ``FairQueue`` (``fleet.gateway.fairqueue``
states its guarantees): a freed slot goes to the tenants in turn, by deficit round robin
weighted by each tenant's ``weight``, so a tenant of weight 3 gets three hand-overs for
each one of a tenant of weight 1 while both wait; within a tenant, ``interactive`` before
``batch``, except that batch waiting ``aging_s`` or longer counts as interactive, so it
cannot starve. The queue is bounded, so latency cannot grow without end: a tenant may
have ``max_per_tenant`` requests waiting, all tenants together ``max_waiting``; past the
first the request is shed (503), and past the second the newest request of the tenant
with the most waiting is, so a flooding tenant sheds its own requests, not another's.

A tenant holds at most ``share`` of the slots at once (``tenant_share`` in the model's
policy; at least one): past it, its requests wait in line while other tenants' take the
free slots, and are served as its own slots come back. A tenant whose callers stall (a
stream nobody reads, until the write deadline cuts it) so holds its share, never the
version.
"""

from __future__ import annotations

import asyncio
import math
import time

from fleet.errors import FleetError
from fleet.gateway.fairqueue import FairQueue

__all__ = ["BATCH_AGING_S", "QueueFull", "Slots"]

BATCH_AGING_S = 2.0  # a batch request waiting this long is served as if interactive


class QueueFull(FleetError):
    status = 503


class _Waiter:
    __slots__ = ("future", "tenant", "what")

    def __init__(self, future: asyncio.Future[None], tenant: str, what: str) -> None:
        self.future, self.tenant, self.what = future, tenant, what


class Slots:
    def __init__(
        self,
        limit: int,
        max_waiting: int,
        *,
        max_per_tenant: int | None = None,
        aging_s: float = BATCH_AGING_S,
        share: float = 1.0,
    ) -> None:
        self.limit, self.max_waiting, self.share = limit, max_waiting, share
        self.max_per_tenant = max_waiting if max_per_tenant is None else max_per_tenant
        self.in_use = 0
        self.held: dict[str, int] = {}  # tenant → slots it holds (only tenants holding any)
        self._full: set[str] = set()  # tenants holding their cap
        self._queue: FairQueue[_Waiter] = FairQueue(self.max_per_tenant, max_waiting, aging_s)

    @property
    def tenant_cap(self) -> int:
        """The most slots one tenant may hold at once: its ``share`` of ``limit``, at least 1."""
        return max(1, math.floor(self.limit * self.share + 1e-9))

    def waiting(self, priority: str | None = None) -> int:
        """Requests waiting, of every tenant: all, or those that asked for ``priority``."""
        return self._queue.waiting(priority=priority)

    def waiting_for(self, tenant: str) -> int:
        """Requests of ``tenant`` waiting."""
        return self._queue.waiting(tenant)

    async def acquire(self, priority: str, what: str, tenant: str = "", weight: float = 1.0) -> None:
        """Take a slot, waiting in ``tenant``'s ``priority`` line; cancellation (a deadline)
        leaves the line. ``QueueFull`` if the request is shed, now or while it waits."""
        # (a slot is free only while every waiter's tenant holds its cap: release() keeps it so)
        if self.in_use < self.limit and tenant not in self._full:
            self.in_use += 1
            self._take(tenant)
            return
        waiter = _Waiter(asyncio.get_running_loop().create_future(), tenant, what)
        shed = self._queue.push(waiter, tenant, priority, weight, time.monotonic())
        if shed is waiter:
            raise self._refusal(waiter)
        if shed is not None and not shed.future.done():
            shed.future.set_exception(
                QueueFull(
                    f"{shed.what} is saturated and tenant {shed.tenant!r} had the most requests waiting "
                    f"({self._queue.waiting(shed.tenant) + 1}), so its newest was shed for another tenant's; "
                    f"retry later or send less at once"
                )
            )
        try:
            await waiter.future  # resolved by release(), which hands its slot over
        except BaseException:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(tenant)  # the slot was handed over just as we gave up: pass it on
            else:
                self._queue.remove(waiter)
            raise

    def release(self, tenant: str = "") -> None:
        """Give back a slot ``tenant`` took: to the next waiter the fair queue names whose
        tenant is under its cap, else it is free."""
        left = self.held.get(tenant, 0) - 1
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)
        if left < self.tenant_cap:
            self._full.discard(tenant)
        if self.in_use > self.limit:  # over a cap lowered by resize(): the slot is gone, not handed on
            self.in_use -= 1
            return
        if not self._hand_over():
            self.in_use -= 1

    def resize(
        self,
        limit: int,
        max_waiting: int,
        *,
        max_per_tenant: int | None = None,
        aging_s: float | None = None,
        share: float | None = None,
    ) -> None:
        """A new limit (a policy change, a replica more or less): under a larger one, requests
        in line take the new slots now; over a smaller one, slots end as they are released.
        New queue bounds (``max_per_tenant`` None: ``max_waiting``, as in the constructor)
        hold for later requests; none already waiting is shed. A new ``share``: slots held
        past it end as they are released."""
        self.limit, self.max_waiting = limit, max_waiting
        if share is not None:
            self.share = share
        cap = self.tenant_cap
        self._full = {t for t, n in self.held.items() if n >= cap}
        self.max_per_tenant = max_waiting if max_per_tenant is None else max_per_tenant
        self._queue.resize(self.max_per_tenant, max_waiting)
        if aging_s is not None:  # the policy's batch_aging_ms
            self._queue.aging_s = aging_s
        while self.in_use < self.limit and self._queue:
            self.in_use += 1
            if not self._hand_over():
                self.in_use -= 1
                break

    def refuse_early(self, tenant: str, what: str) -> None:
        """``QueueFull`` now if a request of ``tenant`` arriving now would be shed when it
        asked for a slot — so a flooding tenant's request is refused before its body is read
        and decoded, at a fraction of the cost; otherwise nothing."""
        if (self.in_use >= self.limit or self._queue) and self._queue.would_shed(tenant):
            raise self._refusal(_Waiter(None, tenant, what))  # type: ignore[arg-type]

    def _refusal(self, waiter: _Waiter) -> QueueFull:
        mine = self._queue.waiting(waiter.tenant)
        if mine >= self.max_per_tenant:
            return QueueFull(
                f"{waiter.what} is saturated and tenant {waiter.tenant!r} already has {mine} requests waiting "
                f"(its limit); retry later or send less at once"
            )
        return QueueFull(
            f"{waiter.what} is saturated: {self.in_use} requests in flight and {len(self._queue)} waiting (the limit), "
            f"and no other tenant has more waiting than tenant {waiter.tenant!r} would with this one ({mine + 1}); "
            f"retry later or send less at once"
        )

    def _hand_over(self) -> bool:
        """Give a held slot to the next waiter the fair queue names; False if nobody waits."""
        while (waiter := self._queue.pop(time.monotonic(), self._full)) is not None:
            if not waiter.future.done():  # not one that gave up (and is about to leave the line)
                waiter.future.set_result(None)  # the slot moves to the waiter; in_use unchanged
                self._take(waiter.tenant)
                return True
        return False

    def _take(self, tenant: str) -> None:
        n = self.held[tenant] = self.held.get(tenant, 0) + 1
        if n >= self.tenant_cap:
            self._full.add(tenant)
