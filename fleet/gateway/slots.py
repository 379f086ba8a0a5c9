"""Admission to an upstream: a concurrency limit with a bounded, two-class wait queue.

When every slot is taken, a request waits; a freed slot goes to the longest-waiting
``interactive`` request first, and to a ``batch`` one only when no interactive request
waits. The queue is bounded: past ``max_waiting`` a request is shed at once (503) rather
than letting latency grow without end.
"""

from __future__ import annotations

import asyncio
from collections import deque

from fleet.errors import FleetError

PRIORITIES = ("interactive", "batch")


class QueueFull(FleetError):
    status = 503


class Slots:
    def __init__(self, limit: int, max_waiting: int) -> None:
        self.limit, self.max_waiting = limit, max_waiting
        self.in_use = 0
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {p: deque() for p in PRIORITIES}

    def waiting(self, priority: str | None = None) -> int:
        if priority is not None:
            return len(self._waiting[priority])
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, priority: str, what: str) -> None:
        """Take a slot, waiting in ``priority``'s line; cancellation (a deadline) leaves the line."""
        if self.in_use < self.limit and not self.waiting():
            self.in_use += 1
            return
        if self.waiting() >= self.max_waiting:
            raise QueueFull(
                f"{what} is saturated: {self.in_use} requests in flight and {self.waiting()} waiting "
                f"(the limit); retry later or send less at once"
            )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line = self._waiting[priority]
        line.append(future)
        try:
            await future  # resolved by release(), which hands its slot over
        except BaseException:
            if future.done() and not future.cancelled():
                self.release()  # the slot was handed over just as we gave up: pass it on
            else:
                line.remove(future)
            raise

    def release(self) -> None:
        if self.in_use > self.limit:  # over a cap lowered by resize(): the slot is gone, not handed on
            self.in_use -= 1
            return
        if not self._hand_over():
            self.in_use -= 1

    def resize(self, limit: int, max_waiting: int) -> None:
        """A new limit (a policy change, a replica more or less): under a larger one, requests
        in line take the new slots now; over a smaller one, slots end as they are released."""
        self.limit, self.max_waiting = limit, max_waiting
        while self.in_use < self.limit and self.waiting():
            self.in_use += 1
            if not self._hand_over():
                self.in_use -= 1
                break

    def _hand_over(self) -> bool:
        """Give a held slot to the first waiter in priority order; False if nobody waits."""
        for priority in PRIORITIES:
            line = self._waiting[priority]
            while line:
                future = line.popleft()
                if not future.done():
                    future.set_result(None)  # the slot moves to the waiter; in_use unchanged
                    return True
        return False
