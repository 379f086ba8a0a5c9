"""Leases: one holder at a time for a long operation on shared state (a registration).

A lease is an object created with must-not-exist. Its holder renews it as it makes
progress (a conditional write on its own ETag); a lease not renewed for ``stale_after`` is
taken to belong to a crashed holder and may be taken over, and so is one whose holder ran
on this host in a process that no longer exists. A holder whose renewal fails
has been taken over and must stop before it commits anything.
"""

from __future__ import annotations

import os
import socket
import uuid
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict

from fleet import audit, records
from fleet.errors import Conflict, PreconditionFailed
from fleet.types import ObjectStore


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
    def __init__(self, store: ObjectStore, key: str, what: str, record: LeaseRecord, etag: str, taken_over: bool) -> None:
        self.store, self.key, self.what = store, key, what
        self.record, self._etag = record, etag
        self.taken_over = taken_over  # True: a crashed holder's leftovers may exist

    def renew(self) -> None:
        """Extend the lease; ``Conflict`` if another holder took it over meanwhile."""
        record = self.record.model_copy(update={"renewed_at": audit.now()})
        try:
            self._etag = self.store.put(self.key, records.dump(record), if_match=self._etag)
        except PreconditionFailed:
            raise Conflict(
                f"{self.what}: lost the lease (not renewed for too long, taken over by another "
                "run); stopped before committing anything"
            ) from None
        self.record = record

    def release(self) -> None:
        held, _ = records.load_or_none(self.store, self.key, LeaseRecord)
        if held is not None and held.id == self.record.id:
            self.store.delete(self.key)


def acquire(store: ObjectStore, key: str, *, what: str, who: str, stale_after: timedelta) -> Lease:
    """Take the lease at ``key`` or raise ``Conflict`` naming its live holder."""
    now = audit.now()
    record = LeaseRecord(id=uuid.uuid4().hex, who=who, acquired_at=now, renewed_at=now,
                         host=socket.gethostname(), pid=os.getpid())  # fmt: skip
    try:
        return Lease(store, key, what, record, records.create(store, key, record), taken_over=False)
    except PreconditionFailed:
        pass
    held, etag = records.load_or_none(store, key, LeaseRecord)
    if held is not None and now - held.renewed_at < stale_after and not held.holder_gone():
        raise Conflict(
            f"{what} is in progress by {held.who} since {held.acquired_at:%Y-%m-%d %H:%M:%S} UTC "
            f"(last progress {held.renewed_at:%H:%M:%S}); wait for it to finish"
        )
    try:  # the holder stopped renewing: it crashed; take over
        kwargs = {"if_match": etag} if etag else {"if_none_match": True}
        return Lease(store, key, what, record, store.put(key, records.dump(record), **kwargs), taken_over=True)
    except PreconditionFailed:
        raise Conflict(f"{what} was just started by someone else; wait for it to finish") from None
