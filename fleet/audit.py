"""Append-only audit log of every route and version-state change.

Route events are keyed by revision (``events/<model>/routes/<revision>.json``) so the event
of a revision is unique and can be found again; version-state events by time
(``events/<model>/versions/<utc>-<id>.json``). Both kinds carry who, why, when, before
and after.
"""

from __future__ import annotations

import getpass
import os
import socket
import uuid
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from fleet import records
from fleet.errors import PreconditionFailed
from fleet.types import ObjectStore


class AuditEvent(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: str
    kind: Literal["route", "state"]
    at: datetime
    who: str
    why: str
    revision: int | None = None  # route events: the revision this change produced
    version: str | None = None  # state events: the version whose state changed
    before: Any = None
    after: Any = None


def actor() -> str:
    """Who is acting: ``$FLEET_ACTOR``, else ``user@host``."""
    return os.environ.get("FLEET_ACTOR") or f"{getpass.getuser()}@{socket.gethostname()}"


def now() -> datetime:
    return datetime.now(UTC)


def route_event_key(model: str, revision: int) -> str:
    return f"events/{model}/routes/{revision:010d}.json"


def append(store: ObjectStore, event: AuditEvent) -> str:
    """Write one event; a route event whose revision is already logged is left as it is."""
    if event.kind == "route":
        key = route_event_key(event.model, event.revision or 0)
    else:
        stamp = event.at.astimezone(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        key = f"events/{event.model}/versions/{stamp}-{uuid.uuid4().hex[:8]}.json"
    try:
        records.create(store, key, event)
    except PreconditionFailed:
        pass  # the same revision was already logged (e.g. repaired by another writer)
    return key


def events(store: ObjectStore, model: str) -> list[AuditEvent]:
    """Every readable event of ``model``, oldest first (an unreadable one is reported, skipped)."""
    found = records.load_all(store, f"events/{model}/", AuditEvent)[0].values()
    return sorted(found, key=lambda e: (e.at, e.kind, e.revision or 0))
