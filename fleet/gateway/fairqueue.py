"""Weighted fair queuing across tenants: who waits for a saturated version's next slot.

``FairQueue`` is a pure scheduler: it holds items (``Slots`` puts its waiters in it), never
sleeps and never reads a clock; the caller passes ``now`` (monotonic seconds) to the calls
that need it. Items are hashable and told apart by equality (a waiter object or a future,
by identity), and an item is queued at most once.

Between tenants: deficit round robin. Each tenant with requests waiting is in the round;
on its turn it gains its ``weight`` (the quantum; the latest weight pushed for it) and is
served while it has a whole request's credit (a request costs 1), so a tenant of weight 3
is served 3 times a round, one of weight 0.5 every other round. A tenant whose queue
empties leaves the round and loses its credit; one that joins starts at the end of the
round with none, so it gets no burst for the time it was away.

Guarantees:

* Shares. Over ``k`` turns of a tenant that stays backlogged, it is served within one
  request of ``k * weight``; so over a period in which several tenants stay backlogged,
  each gets a share of the pops proportional to its weight, within one quantum.
* Within a tenant, ``interactive`` before ``batch``, each in arrival order, except that a
  batch request that has waited ``aging_s`` or longer counts as interactive (ordered by
  arrival among them): batch waits at most about ``aging_s`` plus the tenant's interactive
  requests that arrived before it, and cannot starve.
* Bounds. A tenant holds at most ``max_per_tenant`` items: a push past it sheds the pushed
  item. All tenants together hold at most ``max_total``: a push into a full queue sheds the
  newest item of the tenant with the most items waiting, counting the pushed one (a tie
  sheds the pushed item). So a flooding tenant sheds its own requests, never another's
  while it has more waiting. ``resize()`` changes the bounds without shedding what waits.
* Blocked tenants. ``pop`` may be told tenants not to serve now (``Slots``: those holding
  their share of a version's slots); they keep their credit and place, and are served
  again once no longer named.
* Cost. ``push`` and ``pop`` are O(number of tenants waiting), amortised (a pop usually
  O(1)); ``remove`` is O(that tenant's queue); ``waiting`` and ``len`` are O(1).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Hashable
from collections.abc import Set as AbstractSet
from itertools import count
from typing import Generic, TypeVar

PRIORITIES = ("interactive", "batch")

T = TypeVar("T", bound=Hashable)
_Entry = tuple[int, float, T]  # (arrival number, arrived at, item)


class _Tenant(Generic[T]):
    __slots__ = ("batch", "deficit", "interactive", "weight")

    def __init__(self, weight: float) -> None:
        self.weight, self.deficit = weight, 0.0
        self.interactive: deque[_Entry[T]] = deque()
        self.batch: deque[_Entry[T]] = deque()

    def __len__(self) -> int:
        return len(self.interactive) + len(self.batch)

    def line(self, priority: str) -> deque[_Entry[T]]:
        return self.interactive if priority == "interactive" else self.batch

    def next_line(self, now: float, aging_s: float) -> deque[_Entry[T]]:
        """The line whose head goes next: interactive, unless batch's head has aged and arrived first."""
        i, b = self.interactive, self.batch
        if not b:
            return i
        if not i or (now - b[0][1] >= aging_s and b[0][0] < i[0][0]):
            return b
        return i

    def priority_of(self, line: deque[_Entry[T]]) -> str:
        return "interactive" if line is self.interactive else "batch"

    def newest_line(self) -> deque[_Entry[T]]:
        i, b = self.interactive, self.batch
        return b if b and (not i or b[-1][0] > i[-1][0]) else i


class FairQueue(Generic[T]):
    """Items waiting per tenant, popped by weighted deficit round robin (see the module)."""

    def __init__(self, max_per_tenant: int, max_total: int, aging_s: float) -> None:
        self.max_per_tenant, self.max_total, self.aging_s = max_per_tenant, max_total, aging_s
        self._tenants: dict[str, _Tenant[T]] = {}  # only tenants with items waiting
        self._round: deque[str] = deque()  # those same tenants, the one whose turn it is first
        self._where: dict[T, str] = {}  # item → its tenant
        self._per_priority = dict.fromkeys(PRIORITIES, 0)
        self._arrivals = count()

    def __len__(self) -> int:
        return len(self._where)

    def waiting(self, tenant: str | None = None, priority: str | None = None) -> int:
        """Items waiting: all, or of one tenant, of one priority (as pushed), or both."""
        if tenant is None:
            return len(self) if priority is None else self._per_priority[priority]
        t = self._tenants.get(tenant)
        if t is None:
            return 0
        return len(t) if priority is None else len(t.line(priority))

    def push(self, item: T, tenant: str, priority: str, weight: float, now: float) -> T | None:
        """Queue ``item``; return the item shed to stay within the bounds (maybe ``item``), else None."""
        if priority not in PRIORITIES:
            raise ValueError(f"priority {priority!r} is not known; expected one of {', '.join(PRIORITIES)}")
        if not sys.float_info.min <= weight < math.inf:  # (a subnormal weight's quantum count would overflow)
            raise ValueError(f"tenant {tenant!r} has weight {weight!r}; expected a positive number")
        if item in self._where:
            raise ValueError("the item is already queued; expected each item to be pushed once")
        t = self._tenants.get(tenant)
        mine = len(t) if t is not None else 0
        if mine >= self.max_per_tenant:
            return item
        shed: T | None = None
        if len(self) >= self.max_total:
            longest = max(self._round, key=lambda name: len(self._tenants[name]), default=None)
            if longest is None or longest == tenant or len(self._tenants[longest]) <= mine + 1:
                return item  # the pusher's own queue is (one of) the longest: it sheds its own
            victim = self._tenants[longest]
            line = victim.newest_line()
            shed = line.pop()[2]
            self._forget(shed, longest, victim, victim.priority_of(line))
        if t is None:
            t = self._tenants[tenant] = _Tenant(weight)
            self._round.append(tenant)
        t.weight = weight
        t.line(priority).append((next(self._arrivals), now, item))
        self._where[item] = tenant
        self._per_priority[priority] += 1
        return shed

    def would_shed(self, tenant: str) -> bool:
        """Whether a push by ``tenant`` now would shed the pushed item itself (the same rule
        as ``push``, without pushing): the gateway asks before it reads a body."""
        t = self._tenants.get(tenant)
        mine = len(t) if t is not None else 0
        if mine >= self.max_per_tenant:
            return True
        if len(self) < self.max_total:
            return False
        longest = max(self._round, key=lambda name: len(self._tenants[name]), default=None)
        return longest is None or longest == tenant or len(self._tenants[longest]) <= mine + 1

    def pop(self, now: float, blocked: AbstractSet[str] = frozenset()) -> T | None:
        """The next item by deficit round robin, or None if nothing waits. Tenants in
        ``blocked`` (``Slots``: those holding their share of slots) are passed over, keeping
        their credit and their place in the round; None if only they wait."""
        eligible = len(self._round)
        if blocked:
            eligible -= sum(1 for name in blocked if name in self._tenants)
            if eligible <= 0:
                return None
        unserved = 0  # turns in a row that served nobody
        while self._round:
            name = self._round[0]
            if name in blocked:
                self._round.rotate(-1)
                continue
            t = self._tenants[name]
            if t.deficit < 1.0:  # at the head with less than a request's credit: a new turn
                if unserved >= eligible:
                    self._skip_idle_rounds(blocked)
                    unserved = 0
                t.deficit += t.weight
                if t.deficit < 1.0:
                    unserved += 1
                    self._round.rotate(-1)
                    continue
            line = t.next_line(now, self.aging_s)
            item = line.popleft()[2]
            t.deficit -= 1.0
            self._forget(item, name, t, t.priority_of(line))
            if name in self._tenants and t.deficit < 1.0:
                self._round.rotate(-1)  # its turn is over
            return item
        return None

    def remove(self, item: T) -> bool:
        """Take out an item that gave up waiting; False if it was not queued."""
        tenant = self._where.get(item)
        if tenant is None:
            return False
        t = self._tenants[tenant]
        for line in (t.interactive, t.batch):
            for i, entry in enumerate(line):
                if entry[2] == item:
                    del line[i]
                    self._forget(item, tenant, t, t.priority_of(line))
                    return True
        raise AssertionError("an item indexed as queued was not in its tenant's lines")  # pragma: no cover

    def resize(self, max_per_tenant: int, max_total: int) -> None:
        """New bounds for later pushes; items already queued stay, even past them."""
        self.max_per_tenant, self.max_total = max_per_tenant, max_total

    def _forget(self, item: T, name: str, t: _Tenant[T], priority: str) -> None:
        """Book-keeping once ``item`` has left ``t``'s ``priority`` line; a tenant left empty
        leaves the round (and so loses its credit)."""
        del self._where[item]
        self._per_priority[priority] -= 1
        if not t:
            del self._tenants[name]
            self._round.remove(name)

    def _skip_idle_rounds(self, blocked: AbstractSet[str]) -> None:
        """A whole round served nobody (every weight < 1): add the credit of the rounds that
        would serve nobody either, at once, so a pop costs O(tenants) whatever the weights."""
        names = [n for n in self._round if n not in blocked]
        rounds = min(math.ceil((1.0 - self._tenants[n].deficit) / self._tenants[n].weight) for n in names) - 1
        if rounds > 0:
            for name in names:
                self._tenants[name].deficit += rounds * self._tenants[name].weight
