"""Running gateways announce themselves in the store, so the control plane can reach them all.

Each gateway writes ``gateways/<id>.json`` when it starts and again every
``HEARTBEAT_S`` seconds; a record whose heartbeat is older than ``STALE_AFTER_S`` belongs
to a gateway that is gone. Rollbacks push to every live gateway's admin API, and canary
analysis sums the windowed stats of every live gateway.
"""

from __future__ import annotations

import os
import secrets
import socket
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict

from fleet import audit, records
from fleet.errors import IntegrityError
from fleet.types import ObjectStore

PREFIX = "gateways/"
HEARTBEAT_S = 2.0
STALE_AFTER_S = 15.0


class GatewayRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    url: str  # base URL of its HTTP API, e.g. http://127.0.0.1:8000
    host: str
    pid: int
    started_at: datetime
    heartbeat_at: datetime

    def live(self, now: datetime | None = None) -> bool:
        return (now or audit.now()) - self.heartbeat_at < timedelta(seconds=STALE_AFTER_S)


def new_id() -> str:
    return f"{socket.gethostname().split('.')[0].lower()[:20]}-{os.getpid()}-{secrets.token_hex(3)}"


def key(gateway_id: str) -> str:
    return f"{PREFIX}{gateway_id}.json"


def announce(store: ObjectStore, record: GatewayRecord) -> GatewayRecord:
    """Write (or refresh) the gateway's record with a new heartbeat; return what was written."""
    fresh = record.model_copy(update={"heartbeat_at": audit.now()})
    store.put(key(record.id), records.dump(fresh))  # only this gateway writes its own record
    return fresh


def withdraw(store: ObjectStore, gateway_id: str) -> None:
    store.delete(key(gateway_id))


def live(store: ObjectStore) -> list[GatewayRecord]:
    """Every gateway whose heartbeat is recent, oldest first; records left by dead ones are skipped."""
    now = audit.now()
    found = []
    for k in store.list(PREFIX):
        try:
            record, _ = records.load_or_none(store, k, GatewayRecord)
        except IntegrityError:
            continue  # a half-written or foreign file is not a gateway
        if record is not None and record.live(now):
            found.append(record)
    return sorted(found, key=lambda r: r.started_at)


def notify(store: ObjectStore, admin_token: str | None = None, timeout_s: float = 0.5) -> dict[str, bool]:
    """Ask every live gateway to re-read routing state now; gateway id → whether it answered.

    A gateway that does not answer still picks the change up at its next poll; this only
    makes it faster. Needs the admin token (``FLEET_ADMIN_TOKEN``); without one, nothing
    is pushed.
    """
    import concurrent.futures

    import httpx

    token = admin_token or os.environ.get("FLEET_ADMIN_TOKEN")
    gateways = live(store)
    if not token or not gateways:
        return {}

    def push(record: GatewayRecord) -> bool:
        try:
            r = httpx.post(f"{record.url}/admin/refresh", headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(gateways))) as pool:
        return dict(zip((g.id for g in gateways), pool.map(push, gateways)))
