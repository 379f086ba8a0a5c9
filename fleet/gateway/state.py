"""What the gateway knows, as one immutable snapshot swapped in by a background refresher.

Requests read only the snapshot (no store reads on the request path). The refresher polls
the store every ``interval`` seconds and parses only the records whose ETag changed; an
admin push (``wake``) makes it poll at once, so a rollback reaches a gateway in
milliseconds, and within ``interval`` even without a push. Deployments are re-read from
the runtime whenever routes change (so a route never gets ahead of the endpoints it
needs) and every ``runtime_interval`` seconds otherwise. When the store cannot be read,
the last good snapshot keeps serving and ``stale`` says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.errors import FleetError
from fleet.registry import ModelVersion, Registry
from fleet.routing import RouteTable
from fleet.tenants import Quota, Tenant, key_index, lookup
from fleet.types import ObjectStore, Runtime

log = logging.getLogger("fleet.gateway")

POLL_S = 0.25
RUNTIME_POLL_S = 1.0


@dataclass(frozen=True)
class Snapshot:
    routes: dict[str, RouteTable] = field(default_factory=dict)
    keys: dict[str, Tenant] = field(default_factory=dict)  # key id → tenant
    endpoints: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    manifests: dict[tuple[str, str], ModelVersion] = field(default_factory=dict)
    loaded_at: float = 0.0

    def tenant_for(self, api_key: str) -> Tenant | None:
        """The tenant owning a live ``api_key`` (``fleet.tenants.lookup``, the one rule)."""
        return lookup(self.keys, api_key)


class FleetView:
    def __init__(
        self, store: ObjectStore, runtime: Runtime, interval: float = POLL_S, runtime_interval: float = RUNTIME_POLL_S
    ) -> None:
        self.store, self.runtime = store, runtime
        self.interval, self.runtime_interval = interval, runtime_interval
        self.registry = Registry(store)
        self.snapshot = Snapshot()
        self.healthy = False  # the last refresh succeeded
        self.last_success = 0.0
        self.last_error = ""
        self._etags: dict[str, str] = {}
        self._records: dict[str, RouteTable | Tenant] = {}
        self._runtime_read_at = 0.0
        self._wake: asyncio.Event | None = None
        self._default_quotas: dict[str, Quota] = {}

    def use_policies(self, quotas: dict[str, Quota]) -> None:
        """Quotas from the policies' ``tenants:`` section, for tenants whose record sets none.

        Resolved here, once per snapshot, so a tenant's facts are in one place: the ``Tenant``
        the snapshot hands out carries the quota that applies to it.
        """
        self._default_quotas = dict(quotas)

    @property
    def stale(self) -> bool:
        return not self.healthy

    def _read(self, prefix: str, cls: type) -> tuple[dict[str, object], bool]:
        """Records under ``prefix``; parse only those whose ETag changed. (records, changed)."""
        found, changed = {}, False
        for key in self.store.list(prefix):
            if not key.endswith(".json"):
                continue
            try:
                obj = self.store.get(key)
            except FleetError as exc:
                if exc.status == 404:
                    continue  # deleted between list and get
                raise
            if self._etags.get(key) != obj.etag:
                self._records[key] = cls.model_validate_json(obj.data)
                self._etags[key] = obj.etag
                changed = True
            found[key] = self._records[key]
        gone = [k for k in self._etags if k.startswith(prefix) and k not in found]
        for k in gone:
            del self._etags[k], self._records[k]
        return found, changed or bool(gone)

    def refresh(self, force_runtime: bool = False) -> bool:
        """Poll the store (and maybe the runtime); swap in a new snapshot if anything changed."""
        route_records, routes_changed = self._read("routes/", RouteTable)
        tenant_records, tenants_changed = self._read("tenants/", Tenant)
        now = time.monotonic()
        endpoints = self.snapshot.endpoints
        if routes_changed or force_runtime or now - self._runtime_read_at >= self.runtime_interval:
            endpoints = {(d.model, d.version): d.endpoints for d in self.runtime.list()}
            self._runtime_read_at = now
        self.healthy, self.last_success, self.last_error = True, time.time(), ""
        if not (routes_changed or tenants_changed or endpoints != self.snapshot.endpoints or not self.snapshot.loaded_at):
            return False
        routes = {t.model: t for t in route_records.values()}  # type: ignore[union-attr]
        manifests = {}
        for model, table in routes.items():
            for version in table.referenced_versions():
                cached = self.snapshot.manifests.get((model, version))
                manifests[model, version] = cached or self.registry.get(model, version)
        tenants = [t if t.quota is not None or t.name not in self._default_quotas  # type: ignore[union-attr]
                   else t.model_copy(update={"quota": self._default_quotas[t.name]})  # type: ignore[union-attr]
                   for t in tenant_records.values()]  # fmt: skip
        keys = key_index(tenants)  # type: ignore[arg-type]
        self.snapshot = Snapshot(routes, keys, endpoints, manifests, time.time())
        return True

    def wake(self) -> None:
        """Poll now (an admin push): safe to call from the event loop only."""
        if self._wake is not None:
            self._wake.set()

    async def run(self, on_change: Callable[[Snapshot], None]) -> None:
        """Refresh forever; a failed refresh keeps the last good snapshot."""
        self._wake = asyncio.Event()
        while True:
            try:
                if await asyncio.to_thread(self.refresh):
                    on_change(self.snapshot)
            except (FleetError, OSError, ValueError) as exc:
                if self.healthy:
                    log.warning("cannot refresh routing state, serving the last good one: %s", exc)
                self.healthy, self.last_error = False, str(exc)
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except TimeoutError:
                pass
            self._wake.clear()
