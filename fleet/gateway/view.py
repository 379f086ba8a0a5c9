"""What the gateway knows, as one immutable snapshot swapped in by a background refresher.

Requests read only the snapshot (no store reads on the request path). The refresher polls
the change journal every ``interval`` seconds (one store request; ``fleet.gateway.sync``)
and reads only the records it names; an admin push (``wake``) or a message on the change bus
(``nudge``, ``fleet.gateway.bus``) makes it poll at once, so a rollback reaches a gateway in
milliseconds, and within ``interval`` even without either. While the bus is up the journal
is polled only every ``bus_interval``. Deployments are re-read from
the runtime whenever routes change (so a route never gets ahead of the endpoints it
needs) and every ``runtime_interval`` seconds otherwise. When the store cannot be read,
the last good snapshot keeps serving and ``stale`` says so.

One bad record never takes the gateway down: a route table, tenant or manifest that does not
parse is skipped (or, if it was good before, its last good copy kept) and listed in
``bad_records`` for health, metrics and ``fleet doctor``. A canary or shadow whose manifest
cannot be read is left out of the snapshot's table, so its traffic stays on stable; a stable
or pinned version without a readable manifest is answered 503 (``VersionUnavailable``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet import records
from fleet.catalog.registry import ModelVersion, Registry
from fleet.catalog.routes.table import RouteTable
from fleet.catalog.tenants import Quota, Tenant, key_index, lookup
from fleet.catalog.tenants import misplaced as wrong_key
from fleet.errors import FleetError, IntegrityError, NotFound
from fleet.gateway.sync import READERS, RESYNC_S, RecordSync
from fleet.runtime.base import Runtime
from fleet.types import ObjectStore

log = logging.getLogger("fleet.gateway")

POLL_S = 0.25
BUS_POLL_S = 2.0  # the journal's poll while the change bus is up (the bus says when to look)
RUNTIME_POLL_S = 1.0
MIN_GAP_S = 0.025  # between the starts of two polls, however often a push or the bus wakes the view


@dataclass(frozen=True)
class Snapshot:
    routes: dict[str, RouteTable] = field(default_factory=dict)
    keys: dict[str, Tenant] = field(default_factory=dict)  # key id → tenant
    endpoints: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    manifests: dict[tuple[str, str], ModelVersion] = field(default_factory=dict)
    loaded_at: float = 0.0

    def tenant_for(self, api_key: str) -> Tenant | None:
        """The tenant owning a live ``api_key`` (``fleet.catalog.tenants.lookup``, the one rule)."""
        return lookup(self.keys, api_key)


class FleetView:
    def __init__(
        self,
        store: ObjectStore,
        runtime: Runtime,
        interval: float = POLL_S,
        runtime_interval: float = RUNTIME_POLL_S,
        *,
        resync_s: float = RESYNC_S,
    ) -> None:
        self.store, self.runtime = store, runtime
        self.interval, self.runtime_interval = interval, runtime_interval
        self.bus_interval, self.bus_up = max(interval, BUS_POLL_S), False
        self.registry = Registry(store)
        self.snapshot = Snapshot()
        self.healthy = False  # the last refresh succeeded
        self.last_success = 0.0
        self.last_error = ""
        self.sync = RecordSync(store, {"routes/": RouteTable, "tenants/": Tenant}, resync_s=resync_s)
        self._misplaced: dict[str, records.BadRecord] = {}  # records at the wrong key (rebuilt with each snapshot)
        self._misplaced_tenants: dict[str, records.BadRecord] = {}
        self._bad_manifests: dict[str, records.BadRecord] = {}  # rebuilt with each snapshot
        self._runtime_read_at = 0.0
        self._read_runtime = False  # re-read the runtime at the next refresh (a push, a started version)
        self._wake: asyncio.Event | None = None
        self._default_quotas: dict[str, Quota] = {}
        self._default_weights: dict[str, float] = {}

    def use_policies(self, quotas: dict[str, Quota], weights: dict[str, float] | None = None) -> None:
        """Quotas (and fair-queuing weights) from the policies' ``tenants:`` section, for
        tenants whose record sets none.

        Resolved here, once per snapshot, so a tenant's facts are in one place: the ``Tenant``
        the snapshot hands out carries the quota that applies to it.
        """
        self._default_quotas = dict(quotas)
        self._default_weights = dict(weights or {})

    @property
    def stale(self) -> bool:
        return not self.healthy

    @property
    def bad_records(self) -> list[records.BadRecord]:
        """Stored records this gateway skips (or serves from their last good copy), by key."""
        found = {**self.sync.bad, **self._misplaced, **self._bad_manifests}
        return [found[k] for k in sorted(found)]

    def _manifests(self, routes: dict[str, RouteTable]) -> dict[tuple[str, str], ModelVersion]:
        """The manifest of every version a route names (those not held yet read in parallel);
        unreadable ones are reported."""
        wanted = [(m, v) for m, table in routes.items() for v in sorted(table.referenced_versions())]
        manifests = {mv: self.snapshot.manifests[mv] for mv in wanted if mv in self.snapshot.manifests}
        missing = [mv for mv in wanted if mv not in manifests]

        def read(mv: tuple[str, str]) -> ModelVersion | Exception:
            try:
                return self.registry.get(*mv)
            except (IntegrityError, NotFound) as exc:
                return exc

        if len(missing) > 1:
            with concurrent.futures.ThreadPoolExecutor(min(READERS, len(missing))) as pool:
                got = list(pool.map(read, missing))
        else:
            got = [read(mv) for mv in missing]
        bad: dict[str, records.BadRecord] = {}
        for (model, version), found in zip(missing, got, strict=True):
            if isinstance(found, Exception):
                key = f"models/{model}/{version}/manifest.json"
                bad[key] = records.BadRecord(key, f"route of {model} names {version}: {found}", "ModelVersion")
                records.report(bad[key])
            else:
                manifests[model, version] = found
        self._bad_manifests = bad
        return manifests

    def refresh(self, force_runtime: bool = False) -> bool:
        """Poll the store (and maybe the runtime); swap in a new snapshot if anything changed."""
        snapshot = self._poll(force_runtime)
        if snapshot is None:
            return False
        self.snapshot = snapshot
        return True

    def _poll(self, force_runtime: bool = False) -> Snapshot | None:
        """The next snapshot, or None if nothing changed. It is not published here: ``run``
        publishes it on the event loop together with the pools (``on_change``), so no request
        ever sees a route to a version whose replicas the pools do not hold yet."""
        changed = self.sync.poll()
        routes_changed, tenants_changed = "routes/" in changed, "tenants/" in changed
        now = time.monotonic()
        endpoints, periodic = self.snapshot.endpoints, False
        force_runtime, self._read_runtime = force_runtime or self._read_runtime, False
        if routes_changed or force_runtime or now - self._runtime_read_at >= self.runtime_interval:
            endpoints = {(d.model, d.version): d.endpoints for d in self.runtime.list()}
            self._runtime_read_at, periodic = now, True
        self.healthy, self.last_success, self.last_error = True, time.time(), ""
        retry = periodic and bool(self._bad_manifests)  # a fixed manifest is picked up within a second
        if not (
            routes_changed
            or tenants_changed
            or retry
            or endpoints != self.snapshot.endpoints
            or not self.snapshot.loaded_at
        ):
            return None
        routes, misplaced = {}, {}
        for key, table in self.sync.of("routes/").items():
            if key != f"routes/{table.model}.json":  # type: ignore[attr-defined]
                misplaced[key] = records.BadRecord(key, f"{key!r} holds the route of {table.model!r}", "RouteTable")  # type: ignore[attr-defined]
                records.report(misplaced[key])
                continue
            routes[table.model] = table  # type: ignore[attr-defined]
        manifests = self._manifests(routes)
        readable: dict[str, set[str]] = {}
        for model, version in manifests:
            readable.setdefault(model, set()).add(version)
        routes = {model: _servable(table, readable.get(model, set())) for model, table in routes.items()}
        keys = self.snapshot.keys
        if tenants_changed or not self.snapshot.loaded_at:  # 10,000 tenants: re-indexed only when one changed
            placed, self._misplaced_tenants = [], {}
            for key, tenant in self.sync.of("tenants/").items():
                if (wrong := wrong_key(key, tenant)) is not None:  # type: ignore[arg-type]
                    self._misplaced_tenants[key] = wrong
                    records.report(wrong)
                else:
                    placed.append(tenant)
            keys = key_index([self._with_defaults(t) for t in placed])  # type: ignore[arg-type]
        self._misplaced = {**misplaced, **self._misplaced_tenants}
        return Snapshot(routes, keys, endpoints, manifests, time.time())

    def _with_defaults(self, t: Tenant) -> Tenant:
        update: dict[str, object] = {}
        if t.quota is None and t.name in self._default_quotas:
            update["quota"] = self._default_quotas[t.name]
        if t.weight is None and t.name in self._default_weights:
            update["weight"] = self._default_weights[t.name]
        return t.model_copy(update=update) if update else t

    def wake(self) -> None:
        """Poll now, the runtime too (an admin push: a route changed, or a version was stopped or
        started): safe to call from the event loop only."""
        self._read_runtime = True
        if self._wake is not None:
            self._wake.set()

    def nudge(self) -> None:
        """Poll the journal now (the change bus said something changed): from the event loop only."""
        if self._wake is not None:
            self._wake.set()

    def on_bus(self, up: bool) -> None:
        """The change bus is up (poll slowly) or away (poll every ``interval`` again)."""
        self.bus_up = up

    def read_runtime(self) -> None:
        """Re-read the runtime's deployments now (a version was started here): from the event loop only."""
        self.wake()

    async def run(self, on_change: Callable[[Snapshot], None]) -> None:
        """Refresh forever; a failed refresh keeps the last good snapshot."""
        self._wake = asyncio.Event()
        while True:
            started = time.monotonic()
            try:
                snapshot = await asyncio.to_thread(self._poll)
                if snapshot is not None:
                    # routes and pools change in one step of the loop: a request between them
                    # would find a newly routed version (a rollback's target) with no replica
                    self.snapshot = snapshot
                    on_change(snapshot)
            except (FleetError, OSError, ValueError) as exc:
                if self.healthy:
                    log.warning("cannot refresh routing state, serving the last good one: %s", exc)
                self.healthy, self.last_error = False, str(exc)
            # polls start every interval (a poll's own round trips included), never back to back
            period = self.bus_interval if self.bus_up else self.interval
            wait = max(period / 4, period - (time.monotonic() - started))
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
                # woken (a push, the bus): a flood of nudges costs at most one poll per MIN_GAP_S
                await asyncio.sleep(max(0.0, MIN_GAP_S - (time.monotonic() - started)))
            except TimeoutError:
                pass
            self._wake.clear()


def _servable(table: RouteTable, readable: set[str]) -> RouteTable:
    """The table as this gateway serves it: a canary or shadow without a readable manifest is
    dropped (its traffic stays on stable, as after a rollback); stable and pins stay, and a
    request for them is answered 503 until the manifest is fixed."""
    update: dict[str, object] = {}
    if table.canary is not None and table.canary.version not in readable:
        update["canary"] = None
    if table.shadow is not None and (table.shadow.version not in readable or table.shadow.version == table.stable):
        update["shadow"] = None  # (a table stored before shadow = stable was refused mirrors to itself)
    return table.model_copy(update=update) if update else table
