"""The gateways' activity records: when each gateway last sent a request to each version.

Each gateway writes, with its heartbeat, ``activity/<gateway id>.json`` (only it writes its
own). ``last_requests`` takes the latest across gateways (a record older than a day is
ignored: its gateway is long gone). Lazy loading's idle clock (``fleet.control.lazy``) reads
them; ``silent_gateways`` names the live gateways that keep none, whose traffic would look
like idleness.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from fleet import records
from fleet.types import ObjectStore

ACTIVITY_PREFIX = "activity/"
ACTIVITY_MAX_AGE_S = 86_400.0  # an activity record not rewritten for a day belongs to a gateway long gone


class Activity(BaseModel):
    """When one gateway last sent a request to each version (unix seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    gateway: str
    written_at: float
    last_request: dict[str, dict[str, float]] = Field(default_factory=dict)  # model → version → time


def activity_key(gateway_id: str) -> str:
    return f"{ACTIVITY_PREFIX}{gateway_id}.json"


def write_activity(store: ObjectStore, gateway_id: str, last: dict[tuple[str, str], float]) -> None:
    """This gateway's record (only it writes it)."""
    nested: dict[str, dict[str, float]] = {}
    for (model, version), at in last.items():
        nested.setdefault(model, {})[version] = round(at, 3)
    store.put(
        activity_key(gateway_id),
        records.dump(Activity(gateway=gateway_id, written_at=time.time(), last_request=nested)),
    )


def silent_gateways(store: ObjectStore, now: float | None = None) -> list[str]:
    """Live gateways that keep no activity record (one that cannot write it, or of a release
    before lazy loading): what they serve is unknown, so nothing may be unloaded as idle. Old
    records of gateways long gone are removed on the way (each restart makes a new id)."""
    from fleet.catalog import gateway_directory

    now = time.time() if now is None else now
    live = {g.id for g in gateway_directory.live(store)}
    found, _ = records.load_all(store, ACTIVITY_PREFIX, Activity)
    for key, act in found.items():
        if act.gateway not in live and now - act.written_at > ACTIVITY_MAX_AGE_S:
            store.delete(key)
    return sorted(live - {act.gateway for act in found.values()})


def last_requests(store: ObjectStore, now: float | None = None) -> dict[tuple[str, str], float]:
    """(model, version) → the latest request any gateway sent it; unreadable records are skipped."""
    now = time.time() if now is None else now
    found, _ = records.load_all(store, ACTIVITY_PREFIX, Activity)
    latest: dict[tuple[str, str], float] = {}
    for act in found.values():
        if now - act.written_at > ACTIVITY_MAX_AGE_S:
            continue
        for model, versions in act.last_request.items():
            for version, at in versions.items():
                latest[model, version] = max(at, latest.get((model, version), 0.0))
    return latest
