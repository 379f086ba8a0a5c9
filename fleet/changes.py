"""The change journal: how every gateway learns what changed in one store request.

Each write of a record the gateways serve from (``routes/``, ``tenants/``) is followed by one
entry in ``changes/journal.json``: a sequence number, the key, and its new ETag (None when it
was deleted). A gateway GETs the journal (conditionally: on S3 an unchanged journal is a 304
with no body) and reads only the keys named after the last sequence number it applied, once
each. The journal keeps the last ``KEEP`` entries; a reader that fell further behind, or finds
a journal it does not know (another ``epoch``: the store was wiped or restored), reads
everything again (``fleet.gateway.sync``).

Writers are serialised by the store: the journal is rewritten with If-Match on the ETag it
was read with, and a writer that lost the race reads it again. So no entry is lost and the
sequence numbers are the order the entries were committed. A record is written *before* its
entry, and a reader always reads the record as it is now, never a copy in the journal: a
reader that applies entries in sequence order ends at the store's last write of every key,
whatever order two writers' record writes and entries interleaved in.

A writer that dies between its record and its entry leaves a change no entry names; readers
find it at their periodic full comparison (``RESYNC_S``, listings only: one LIST per 1,000
keys). The entry is also published on the change bus (Redis pub/sub, ``FLEET_REDIS_URL``)
when there is one, so subscribed gateways read it at once instead of at their next poll.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from fleet.errors import Conflict, IntegrityError, NotFound, PreconditionFailed
from fleet.types import ObjectStore

log = logging.getLogger("fleet.changes")

KEY = "changes/journal.json"
WATCHED = ("routes/", "tenants/")
KEEP = 1000  # entries kept: a reader more than this many changes behind reads everything again
MAX_ATTEMPTS = 200  # a writer storm of hundreds of writers each wins within this many tries
CHANNEL = "fleet:changes"
PUBLISH_TIMEOUT_S = 0.2  # a bus that does not answer costs a writer at most this; the poll still finds it


class Change(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int
    key: str
    etag: str | None  # None: deleted


class Journal(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    epoch: str
    seq: int = 0
    changes: tuple[Change, ...] = ()

    def since(self, seq: int) -> list[Change] | None:
        """Entries after ``seq``, oldest first; None when some of them were already dropped."""
        if seq > self.seq:
            return None  # a journal older than what the reader applied: not the same history
        if seq == self.seq:
            return []
        if not self.changes or self.changes[0].seq > seq + 1:
            return None
        return [c for c in self.changes if c.seq > seq]


def watched(key: str) -> bool:
    return key.startswith(WATCHED) and key.endswith(".json")


def read(store: ObjectStore, etag: str | None = None) -> tuple[Journal | None, str | None]:
    """The journal and its ETag; ``(None, etag)`` when it is still ``etag``; an empty journal
    (epoch ``""``) when none was ever written."""
    try:
        obj = store.get_if_changed(KEY, etag)
    except NotFound:
        return Journal(epoch=""), None
    if obj is None:
        return None, etag
    try:
        return Journal.model_validate_json(obj.data), obj.etag
    except ValidationError as exc:
        raise IntegrityError(f"{KEY!r} in {store.url} is not a change journal: {exc.errors()[0]['msg']}") from None


def note(store: ObjectStore, key: str, etag: str | None) -> int | None:
    """Commit that ``key`` now has ``etag`` (None: deleted) as the journal's next entry, and
    publish it on the bus; its sequence number, or None for a key gateways do not read."""
    if not watched(key):
        return None
    for attempt in range(MAX_ATTEMPTS):
        obj, current = None, None
        try:
            obj = store.get(KEY)
            current = Journal.model_validate_json(obj.data)
        except NotFound:
            pass
        except ValidationError:
            pass  # a corrupt journal is replaced (conditionally) by a new epoch: its readers start over
        base = current or Journal(epoch=secrets.token_hex(8))
        entry = Change(seq=base.seq + 1, key=key, etag=etag)
        after = base.model_copy(update={"seq": entry.seq, "changes": (*base.changes, entry)[-KEEP:]})
        data = after.model_dump_json().encode()
        try:
            if obj is None:
                store.put(KEY, data, if_none_match=True)
            else:
                store.put(KEY, data, if_match=obj.etag)
        except PreconditionFailed:
            time.sleep(random.uniform(0, min(0.05, 0.002 * 2**attempt)))
            continue
        _here.published = bus().publish(entry)
        _here.noted = True
        return entry.seq
    raise Conflict(f"gave up recording the change of {key!r} in {store.url} after {MAX_ATTEMPTS} attempts; try again")


_here = threading.local()


def noted() -> bool:
    """Whether this thread committed a journal entry (a route or tenant changed here)."""
    return getattr(_here, "noted", False)


def published() -> bool:
    """Whether this thread's last journal entry went out on the bus: every subscribed gateway
    was told; without it, a writer that wants the change seen at once pushes it
    (``fleet.catalog.gateway_directory.tell``)."""
    return getattr(_here, "published", False)


class Bus:
    """Publishes journal entries on Redis (``FLEET_REDIS_URL``) when one is configured.

    Fire and forget: a bus that is down or slow costs a writer at most ``PUBLISH_TIMEOUT_S``
    once per ``RETRY_S`` (then it is skipped until then), and gateways still see the change
    at their next poll of the journal.
    """

    RETRY_S = 5.0

    def __init__(self, url: str | None) -> None:
        self.url = url
        self._client: Any = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    def publish(self, entry: Change) -> bool:
        if not self.url or time.monotonic() < self._down_until:
            return False
        try:
            import redis

            with self._lock:
                if self._client is None:
                    self._client = redis.Redis.from_url(
                        self.url, socket_timeout=PUBLISH_TIMEOUT_S, socket_connect_timeout=PUBLISH_TIMEOUT_S
                    )
                client = self._client
            client.publish(CHANNEL, json.dumps(entry.model_dump()))
            return True
        except Exception as exc:  # noqa: BLE001 - any failure of an optional speed-up is only logged
            log.info("change bus at %s not reached (gateways see the change at their next poll): %s", self.url, exc)
            self._down_until = time.monotonic() + self.RETRY_S
            return False


_buses: dict[str | None, Bus] = {}


def bus() -> Bus:
    """The bus for the current ``FLEET_REDIS_URL`` (one client per URL per process)."""
    url = os.environ.get("FLEET_REDIS_URL") or None
    if url not in _buses:
        _buses[url] = Bus(url)
    return _buses[url]
