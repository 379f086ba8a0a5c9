"""Typed JSON records in the object store, and the conditional read-modify-write loop.

Every piece of shared state (routes, tenants, version state) is changed through
``update``: read with its ETag, apply a pure change, write only if the ETag still matches,
and on a lost race start again from a fresh read. Another writer is never overwritten.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from fleet.errors import Conflict, IntegrityError, NotFound, PreconditionFailed
from fleet.types import ObjectStore

T = TypeVar("T", bound=BaseModel)

MAX_ATTEMPTS = 50


def dump(record: BaseModel) -> bytes:
    return record.model_dump_json(indent=2).encode() + b"\n"


def load(store: ObjectStore, key: str, cls: type[T]) -> tuple[T, str]:
    """Read and validate one record; return it with its ETag."""
    obj = store.get(key)
    try:
        return cls.model_validate_json(obj.data), obj.etag
    except ValidationError as exc:
        raise IntegrityError(
            f"{key!r} in {store.url} is not a valid {cls.__name__} record "
            f"({exc.error_count()} problem(s), first: {exc.errors()[0]['msg']})"
        ) from None


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
    return store.put(key, dump(record), if_none_match=True)


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
                store.put(key, dump(after), if_none_match=True)
            else:
                store.put(key, dump(after), if_match=etag)
            return before, after
        except PreconditionFailed:
            # Jittered backoff so racing writers stop colliding in lock-step.
            time.sleep(random.uniform(0, min(0.2, 0.005 * 2**attempt)))
    raise Conflict(
        f"gave up writing {key!r} in {store.url} after {attempts} attempts: "
        "too many concurrent writers; try again"
    )
