"""What the gateway knows, as one immutable snapshot swapped in by a background refresher.

Requests read only the snapshot (no store reads on the request path). The refresher
reloads routes, tenants and the runtime's endpoints every ``interval`` seconds; when the
store cannot be read it keeps serving from the last good snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from fleet import records
from fleet.errors import FleetError
from fleet.registry import ModelVersion, Registry
from fleet.routing import RouteTable
from fleet.tenants import KEY_PREFIX, Tenant, Tenants
from fleet.types import ObjectStore, Runtime

log = logging.getLogger("fleet.gateway")


@dataclass(frozen=True)
class Snapshot:
    routes: dict[str, RouteTable] = field(default_factory=dict)
    keys: dict[str, Tenant] = field(default_factory=dict)  # key id → tenant
    endpoints: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    manifests: dict[tuple[str, str], ModelVersion] = field(default_factory=dict)
    loaded_at: float = 0.0

    def tenant_for(self, api_key: str) -> Tenant | None:
        """The tenant owning a live ``api_key`` (hash compared in constant time)."""
        if not api_key.startswith(KEY_PREFIX):
            return None
        tenant = self.keys.get(api_key[len(KEY_PREFIX):].split("_", 1)[0])
        return tenant if tenant is not None and tenant.matches(api_key) else None


class FleetView:
    def __init__(self, store: ObjectStore, runtime: Runtime, interval: float = 0.5) -> None:
        self.store, self.runtime, self.interval = store, runtime, interval
        self.registry = Registry(store)
        self.snapshot = Snapshot()
        self.healthy = False  # the last refresh succeeded

    def refresh(self) -> Snapshot:
        routes = {}
        for key in self.store.list("routes/"):
            table, _ = records.load_or_none(self.store, key, RouteTable)
            if table is not None:
                routes[table.model] = table
        keys = {k.id: t for t in Tenants(self.store).list() for k in t.keys if k.revoked_at is None}
        endpoints = {(d.model, d.version): d.endpoints for d in self.runtime.list()}
        manifests = {}
        for model, table in routes.items():
            for version in table.referenced_versions():
                cached = self.snapshot.manifests.get((model, version))
                manifests[model, version] = cached or self.registry.get(model, version)
        self.snapshot = Snapshot(routes, keys, endpoints, manifests, time.time())
        self.healthy = True
        return self.snapshot

    async def run(self) -> None:
        """Refresh forever; a failed refresh keeps the last good snapshot."""
        while True:
            try:
                await asyncio.to_thread(self.refresh)
            except (FleetError, OSError) as exc:
                if self.healthy:
                    log.warning("cannot refresh routing state, serving the last good one: %s", exc)
                self.healthy = False
            await asyncio.sleep(self.interval)
