"""Leases: one holder at a time for a long operation on shared state (a registration, a rollout).

A lease is an object created with must-not-exist. Its holder renews it (a conditional write
on its own ETag); a lease not renewed for ``stale_after`` is taken to belong to a crashed
holder and may be taken over, and so is one whose holder ran on this host in a process
that no longer exists. A holder whose renewal fails has been taken over and must stop
before it commits anything.

Renewing as progress is made (after each file of a registration) only holds while every
step is shorter than ``stale_after``. A holder with steps of unknown length (a deploy that
waits for readiness, a pause for approval) renews from a thread of its own instead,
``with lease.kept_alive():``, every third of ``stale_after``, and asks ``lease.check()``
before each write that only the holder may make. ``check`` refuses once a renewal lost, and
also when the last one that won is so old that a takeover could come before the write does
(renewals failing while the store is unreachable, say): the holder then stops rather than
write beside a new one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict

from fleet import audit, records
from fleet.errors import Conflict, PreconditionFailed
from fleet.types import ObjectStore

log = logging.getLogger(__name__)

# check() refuses once this share of stale_after has passed since the last renewal that won:
# two heartbeats missed, with a third of the lease left for the write that follows the check
USABLE_SHARE = 2 / 3


class LeaseRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    who: str
    acquired_at: datetime
    renewed_at: datetime
    host: str | None = None  # where the holder runs, so a dead holder on this host is seen at once
    pid: int | None = None

    def holder_gone(self) -> bool:
        """True when the holder ran on this host and its process no longer exists."""
        if self.host != socket.gethostname() or self.pid is None:
            return False  # elsewhere: only time can tell
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class Lease:
    def __init__(
        self,
        store: ObjectStore,
        key: str,
        what: str,
        record: LeaseRecord,
        etag: str,
        taken_over: bool,
        stale_after: timedelta,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.key, self.what = store, key, what
        self.record, self._etag = record, etag
        self.taken_over = taken_over  # True: a crashed holder's leftovers may exist
        self.stale_after, self._clock = stale_after, clock
        self._renewed = clock()  # when the last renewal that won was sent, by this process's clock
        self._lost: str | None = None  # why the lease is gone, once a renewal lost
        self._lock = threading.Lock()  # renewals from the heartbeat and the holder, one at a time

    def renew(self) -> None:
        """Extend the lease; ``Conflict`` if another holder took it over meanwhile."""
        with self._lock:
            if self._lost is not None:
                raise Conflict(self._lost)
            sent = self._clock()
            record = self.record.model_copy(update={"renewed_at": audit.now()})
            try:
                self._etag = self.store.put(self.key, records.dump(record), if_match=self._etag)
            except PreconditionFailed:
                self._lost = (
                    f"{self.what}: lost the lease (not renewed for too long, taken over by another "
                    "run); stopped before committing anything"
                )
                raise Conflict(self._lost) from None
            self.record, self._renewed = record, sent

    def check(self) -> None:
        """Return if this holder may still act; ``Conflict`` saying why not otherwise.

        Not when a renewal lost, nor when the last one that won is older than
        ``USABLE_SHARE`` of ``stale_after`` (another run may take the lease over soon).
        """
        if self._lost is not None:
            raise Conflict(self._lost)
        age = self._clock() - self._renewed
        usable = self.stale_after.total_seconds() * USABLE_SHARE
        if age > usable:
            raise Conflict(
                f"{self.what}: the lease was last renewed {age:.1f} s ago, and a holder may act only "
                f"within {usable:.1f} s of a renewal (another run may take it over after "
                f"{self.stale_after.total_seconds():g} s); stopped before changing anything"
            )

    @contextlib.contextmanager
    def kept_alive(self, every: float | None = None) -> Iterator[Lease]:
        """Renew every ``every`` seconds (default a third of ``stale_after``) from a thread
        of its own while the block runs, however long its steps take.

        A renewal that loses marks the lease lost and ends the heartbeat; ``check`` then
        refuses. A renewal that fails otherwise (the store unreachable) is retried at the
        next beat; ``check`` refuses once the last good one is too old.
        """
        interval = every if every is not None else self.stale_after.total_seconds() / 3
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(stop, interval), name=f"lease {self.key}", daemon=True)
        beat.start()
        try:
            yield self
        finally:
            stop.set()
            beat.join()

    def _beat(self, stop: threading.Event, interval: float) -> None:
        while not stop.wait(interval):
            try:
                self.renew()
            except Conflict:
                log.warning("%s", self._lost)
                return
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried; check() bounds how long
                log.warning("%s: renewing the lease failed, retrying in %.1f s: %s", self.what, interval, exc)

    def release(self) -> None:
        held, _ = records.load_or_none(self.store, self.key, LeaseRecord)
        if held is not None and held.id == self.record.id:
            self.store.delete(self.key)


def acquire(
    store: ObjectStore,
    key: str,
    *,
    what: str,
    who: str,
    stale_after: timedelta,
    clock: Callable[[], float] = time.monotonic,
) -> Lease:
    """Take the lease at ``key`` or raise ``Conflict`` naming its live holder.

    ``clock`` (monotonic seconds) times the holder's own renewals, for ``Lease.check``.
    """
    now = audit.now()
    record = LeaseRecord(
        id=uuid.uuid4().hex, who=who, acquired_at=now, renewed_at=now, host=socket.gethostname(), pid=os.getpid()
    )

    def lease(etag: str, taken_over: bool) -> Lease:
        return Lease(store, key, what, record, etag, taken_over, stale_after, clock)

    try:
        return lease(records.create(store, key, record), taken_over=False)
    except PreconditionFailed:
        pass
    held, etag = records.load_or_none(store, key, LeaseRecord)
    if held is not None and now - held.renewed_at < stale_after and not held.holder_gone():
        raise Conflict(
            f"{what} is in progress by {held.who} since {held.acquired_at:%Y-%m-%d %H:%M:%S} UTC "
            f"(last renewed {held.renewed_at:%H:%M:%S}); wait for it to finish"
        )
    try:  # the holder stopped renewing: it crashed; take over
        kwargs = {"if_match": etag} if etag else {"if_none_match": True}
        return lease(store.put(key, records.dump(record), **kwargs), taken_over=True)
    except PreconditionFailed:
        raise Conflict(f"{what} was just started by someone else; wait for it to finish") from None
