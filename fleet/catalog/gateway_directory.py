"""Running gateways announce themselves in the store, so the control plane can reach them all.

Each gateway writes ``gateways/<id>.json`` when it starts and again every
``HEARTBEAT_S`` seconds; a record whose heartbeat is older than ``STALE_AFTER_S`` belongs
to a gateway that is gone, and one older than ``EXPIRE_AFTER_S`` is deleted by the next
gateway that counts its peers. Rollbacks push to every live gateway's admin API, and canary
analysis sums the windowed stats of every live gateway.

Counting the live gateways (the divisor of a quota's local share) is one listing, whatever
their number: a listing carries each record's write time, and a record is live when it was
written within ``STALE_AFTER_S`` of the counting gateway's own last heartbeat — both times
on the store's clock, so gateways' clocks need not agree.

Trust model. A record is only as trustworthy as whoever can write ``gateways/`` in the
store, so a URL read from it is not trusted on its say-so:

- the admin token never leaves this process: a push carries a *scoped credential*, an
  HMAC of the token over (purpose, gateway id, time), good for one purpose (``refresh`` or
  ``stats``) on one gateway for ``CREDENTIAL_TTL_S`` seconds; whoever receives it can at
  most make that gateway re-read routes or show its counters for a minute;
- a push or a stats read goes only to a gateway whose URL host is an IP address on
  loopback or in ``FLEET_GATEWAY_NETWORKS`` (comma-separated CIDRs, e.g. the VPC's); a
  host name is not trusted (DNS can point anywhere). Over plain HTTP the credential is
  readable on that network, which is why the networks are named, not assumed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import time
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

from fleet import audit, changes, records
from fleet.errors import ConfigError, IntegrityError
from fleet.types import ObjectStore

log = logging.getLogger("fleet.catalog.gateway_directory")

PREFIX = "gateways/"
HEARTBEAT_S = 5.0  # a PUT per process each beat: 2 s cost 2.5x as much for a staleness 5 s sooner
STALE_AFTER_S = 20.0
EXPIRE_AFTER_S = 300.0  # a record this much older than the counter's own is deleted
EXPIRE_SLACK_S = 5.0  # listing times and heartbeats differ by a write's duration and the listing's grain
EXPIRE_AT_ONCE = 100  # records deleted by one count at most (the rest at the next)
SCOPED = "Fleet-Scoped"
CREDENTIAL_TTL_S = 60
PURPOSES = ("refresh", "stats")


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


def count_live(store: ObjectStore, gateway_id: str) -> int:
    """How many gateways are live, by one listing (this one included); records of gateways
    dead for ``EXPIRE_AFTER_S`` are deleted on the way."""
    listed = [i for i in store.scan(PREFIX) if i.key.endswith(".json")]
    mine = next((i.modified for i in listed if i.key == key(gateway_id)), None)
    now = max((i.modified for i in listed), default=0.0) if mine is None else mine
    dead = [i.key for i in listed if now - i.modified > EXPIRE_AFTER_S]
    for k in dead[:EXPIRE_AT_ONCE]:
        log.info("deleting %s: its gateway has not written it for %.0f s", k, EXPIRE_AFTER_S)
        store.delete(k)
    return max(1, sum(1 for i in listed if now - i.modified < STALE_AFTER_S))


def live(store: ObjectStore) -> list[GatewayRecord]:
    """Every gateway whose heartbeat is recent, oldest first: one listing, then only the
    records written recently are read (in parallel); those left by dead ones are not."""
    import concurrent.futures

    listed = [i for i in store.scan(PREFIX) if i.key.endswith(".json")]
    newest = max((i.modified for i in listed), default=0.0)
    fresh = [i.key for i in listed if newest - i.modified < STALE_AFTER_S + EXPIRE_SLACK_S]
    now = audit.now()

    def read(k: str) -> GatewayRecord | None:
        try:
            return records.load_or_none(store, k, GatewayRecord)[0]
        except IntegrityError:
            return None  # a half-written or foreign file is not a gateway

    if not fresh:
        return []
    with concurrent.futures.ThreadPoolExecutor(min(16, len(fresh))) as pool:
        found = [r for r in pool.map(read, fresh) if r is not None and r.live(now)]
    return sorted(found, key=lambda r: r.started_at)


def credential(token: str, purpose: str, gateway_id: str, at: int | None = None) -> str:
    """An ``Authorization`` value good for ``purpose`` on ``gateway_id`` for a minute."""
    at = int(time.time()) if at is None else at
    mac = hmac.new(token.encode(), f"{purpose}\n{gateway_id}\n{at}".encode(), hashlib.sha256).hexdigest()
    return f"{SCOPED} {purpose}:{gateway_id}:{at}:{mac}"


def verify(authorization: str, token: str, purpose: str, gateway_id: str, now: float | None = None) -> bool:
    """Whether ``authorization`` is a live scoped credential for ``purpose`` on this gateway."""
    scheme, _, value = authorization.partition(" ")
    parts = value.strip().split(":")
    if scheme != SCOPED or len(parts) != 4 or not parts[2].isdigit() or len(parts[2]) > 12:
        return False
    given_purpose, given_id, at, mac = parts
    if given_purpose != purpose or given_id != gateway_id:
        return False
    if abs((time.time() if now is None else now) - int(at)) > CREDENTIAL_TTL_S:
        return False
    expected = credential(token, purpose, gateway_id, int(at)).rsplit(":", 1)[1]
    return hmac.compare_digest(mac.encode(), expected.encode())


def trusted_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Loopback, plus ``FLEET_GATEWAY_NETWORKS`` (comma-separated CIDRs)."""
    nets = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]
    raw = os.environ.get("FLEET_GATEWAY_NETWORKS", "")
    for item in filter(None, (x.strip() for x in raw.split(","))):
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ConfigError(
                f"FLEET_GATEWAY_NETWORKS has {item!r}; expected comma-separated CIDRs such as 10.0.0.0/16"
            ) from None
    return nets


def trusted(record: GatewayRecord, networks: list | None = None) -> bool:
    """Whether this process may push to / read from the URL the record announces."""
    parts = urlsplit(record.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    try:
        address = ipaddress.ip_address(parts.hostname)
    except ValueError:
        return parts.hostname == "localhost"
    return any(address in net for net in (trusted_networks() if networks is None else networks))


def tell(store: ObjectStore, admin_token: str | None = None) -> dict[str, bool] | None:
    """After a route or tenant change made in this thread: nothing when the change bus took it
    (every subscribed gateway reads it now: None), else a push to every live gateway
    (``notify``; what it returns). Called by every writer of what gateways serve — the CLI,
    the admin API, rollbacks, the flows."""
    if changes.published():
        return None
    return notify(store, admin_token)


def notify(store: ObjectStore, admin_token: str | None = None, timeout_s: float = 0.5) -> dict[str, bool]:
    """Ask every live, trusted gateway to re-read routing state now; gateway id → whether it
    answered (False for one that is not trusted: it is not asked).

    A gateway that does not answer still picks the change up at its next poll; this only
    makes it faster. Needs the admin token (``FLEET_ADMIN_TOKEN``) to make the scoped
    credential from; without one, nothing is pushed.
    """
    import concurrent.futures

    import httpx

    token = admin_token or os.environ.get("FLEET_ADMIN_TOKEN")
    gateways = live(store)
    if not token or not gateways:
        return {}
    networks = trusted_networks()

    def push(record: GatewayRecord) -> bool:
        if not trusted(record, networks):
            log.warning(
                "not pushing to gateway %s at %s: not on loopback or in FLEET_GATEWAY_NETWORKS", record.id, record.url
            )
            return False
        headers = {"Authorization": credential(token, "refresh", record.id)}
        try:
            return httpx.post(f"{record.url}/admin/refresh", headers=headers, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(gateways))) as pool:
        return dict(zip((g.id for g in gateways), pool.map(push, gateways)))
