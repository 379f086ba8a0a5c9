"""Typed JSON records in the object store, and the conditional read-modify-write loop.

Every piece of shared state (routes, tenants, version state) is changed through
``update``: read with its ETag, apply a pure change, write only if the ETag still matches,
and on a lost race start again from a fresh read. Another writer is never overwritten.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from fleet import changes
from fleet.errors import Conflict, IntegrityError, InvalidInput, NotFound, PreconditionFailed
from fleet.types import ObjectStore

T = TypeVar("T", bound=BaseModel)

MAX_ATTEMPTS = 50

log = logging.getLogger("fleet.store")


def dump(record: BaseModel) -> bytes:
    """The record's stored bytes, refused unless they read back as the same record.

    JSON has no inf or NaN: pydantic writes them as ``null``, which the record's own model
    then refuses on every read. Checking the round trip here keeps any value that cannot
    survive storage (from a model that forgot to forbid it) out of the store.
    """
    data = record.model_dump_json(indent=2).encode() + b"\n"
    try:
        type(record).model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the record"
        raise InvalidInput(
            f"{type(record).__name__} record refused: it would not read back ({where}: {first['msg']}); "
            "expected finite numbers and JSON values"
        ) from None
    return data


def parse(store: ObjectStore, key: str, data: bytes, cls: type[T]) -> T:
    """Validate a record's bytes; ``IntegrityError`` naming the key and the first problem."""
    try:
        return cls.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the record"
        raise IntegrityError(
            f"{key!r} in {store.url} is not a valid {cls.__name__} record "
            f"({exc.error_count()} problem(s), first: {where}: {first['msg']})"
        ) from None


def load(store: ObjectStore, key: str, cls: type[T]) -> tuple[T, str]:
    """Read and validate one record; return it with its ETag."""
    obj = store.get(key)
    return parse(store, key, obj.data, cls), obj.etag


# -- many records: one bad record is skipped and reported, never fatal ----------------------


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A stored record that cannot be read: skipped by every reader that lists many."""

    key: str
    reason: str
    kind: str  # the record's type, e.g. "Tenant"

    @property
    def advice(self) -> str:
        return (
            f"fix or restore {self.key} (its history is under events/ for routes and versions), "
            f"or remove it with `fleet doctor --remove {self.key}`"
        )


_reported: dict[str, str] = {}
_reported_lock = threading.Lock()


def report(bad: BadRecord) -> None:
    """Log a bad record once per key and reason (readers list often; the log stays readable)."""
    with _reported_lock:
        if _reported.get(bad.key) == bad.reason:
            return
        _reported[bad.key] = bad.reason
    log.warning("skipping a bad record: %s", bad.reason)


def load_all(
    store: ObjectStore, prefix: str, cls: type[T], *, keep: Callable[[str], bool] | None = None
) -> tuple[dict[str, T], list[BadRecord]]:
    """Every ``.json`` record under ``prefix`` that ``keep`` accepts: (key → record, bad ones).

    A record that does not parse is left out and reported (``report``); records deleted
    between the listing and the read are simply absent.
    """
    good: dict[str, T] = {}
    bad: list[BadRecord] = []
    for key in store.list(prefix):
        if not key.endswith(".json") or (keep is not None and not keep(key)):
            continue
        try:
            good[key] = load(store, key, cls)[0]
        except NotFound:
            continue
        except IntegrityError as exc:
            found = BadRecord(key, str(exc), cls.__name__)
            report(found)
            bad.append(found)
    return good, bad


def load_or_none(store: ObjectStore, key: str, cls: type[T]) -> tuple[T | None, str | None]:
    try:
        return load(store, key, cls)
    except NotFound:
        return None, None


def exists(store: ObjectStore, key: str) -> bool:
    try:
        store.get(key)
        return True
    except NotFound:
        return False


def create(store: ObjectStore, key: str, record: BaseModel) -> str:
    """Write a record that must not exist yet (``PreconditionFailed`` if it does)."""
    etag = store.put(key, dump(record), if_none_match=True)
    changes.note(store, key, etag)  # gateways read routes and tenants from the change journal
    return etag


def update(
    store: ObjectStore,
    key: str,
    cls: type[T],
    change: Callable[[T | None], T],
    *,
    attempts: int = MAX_ATTEMPTS,
) -> tuple[T | None, T]:
    """Apply ``change`` to the record at ``key`` (``None`` when missing) until a write wins.

    ``change`` must be pure: it may run several times. Errors it raises propagate unchanged
    and nothing is written. Returns ``(before, after)``.
    """
    for attempt in range(attempts):
        before, etag = load_or_none(store, key, cls)
        after = change(before)
        try:
            if etag is None:
                written = store.put(key, dump(after), if_none_match=True)
            else:
                written = store.put(key, dump(after), if_match=etag)
            changes.note(store, key, written)
            return before, after
        except PreconditionFailed:
            # Jittered backoff so racing writers stop colliding in lock-step.
            time.sleep(random.uniform(0, min(0.2, 0.005 * 2**attempt)))
    raise Conflict(
        f"gave up writing {key!r} in {store.url} after {attempts} attempts: too many concurrent writers; try again"
    )
