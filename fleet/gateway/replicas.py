"""A version's replicas: which to ask first, and outlier ejection.

Per version a ``Pool``: its replicas, and ``Slots`` (the policy's ``concurrency`` per
replica) that queue waiting requests by priority. A call goes to the ready replica with
the fewest requests in flight; one that refuses the connection or times out connecting
is skipped for the next replica of the same version (the request never reached a model).
``EJECT_AFTER`` consecutive failures eject a replica for a while (doubling each time, up
to ``MAX_EJECTION_S``); after that one request probes it back. When every replica is
ejected the one due back soonest is tried anyway: a 503 is only said after trying.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fleet.gateway.h1client.pool import ConnectionPool
from fleet.gateway.slots import Slots

EJECT_AFTER = 3
BASE_EJECTION_S = 1.0
MAX_EJECTION_S = 30.0
CONNECT_TIMEOUT_S = 0.5  # a replica that does not accept a connection by then is skipped for the next


@dataclass
class Replica:
    url: str
    session: ConnectionPool  # shared by every pool that lists the URL
    in_flight: int = 0
    failures: int = 0  # consecutive
    ejections: int = 0  # consecutive ejections, for the back-off
    ejected_until: float = 0.0
    json_until: float = 0.0  # its /predict_tensor answered 404, 405 or 415: JSON until then (monotonic)

    @property
    def takes_tensors(self) -> bool:
        return time.monotonic() >= self.json_until

    def ejected(self, now: float) -> bool:
        return self.ejected_until > now

    def succeeded(self) -> None:
        self.failures = self.ejections = 0
        self.ejected_until = 0.0

    def failed(self, now: float) -> None:
        self.failures += 1
        if self.failures >= EJECT_AFTER:
            self.ejections += 1
            self.ejected_until = now + min(MAX_EJECTION_S, BASE_EJECTION_S * 2 ** (self.ejections - 1))
            self.failures = EJECT_AFTER - 1  # the probe after the ejection decides at once


@dataclass
class Pool:
    ref: str
    replicas: list[Replica]
    slots: Slots
    turn: int = field(default=0)

    def order(self, last_resort: bool) -> list[Replica]:
        """Replicas to try, best first: those not ejected, by fewest in flight. As the last
        resort (no other version to ask), the ejected one due back soonest too."""
        now = time.monotonic()
        if len(self.replicas) == 1:
            only = self.replicas[0]
            return [only] if not only.ejected(now) or last_resort else []
        self.turn += 1
        n = len(self.replicas)
        rotated = [self.replicas[(self.turn + i) % n] for i in range(n)]
        ready = sorted((r for r in rotated if not r.ejected(now)), key=lambda r: r.in_flight)
        ejected = sorted((r for r in rotated if r.ejected(now)), key=lambda r: r.ejected_until)
        return ready + ejected[: 1 if last_resort and not ready else 0]
