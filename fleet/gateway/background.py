"""The gateway's chores beside answering requests, each a loop the app runs while it lives:
its heartbeat in the store's gateway directory (and the count of live gateways, which
divides a quota's local share), when it last asked each version (``fleet.logs.activity``, lazy loading's
idle clock), and each version's replicas sampled for replica-seconds (usage)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from fleet.catalog import gateway_directory
from fleet.errors import FleetError
from fleet.gateway.upstream import Upstreams
from fleet.gateway.view import FleetView
from fleet.types import ObjectStore, QuotaBackend
from fleet.usage.meter import UsageMeter

log = logging.getLogger("fleet.gateway")

REPLICA_SAMPLE_S = 1.0  # how often each version's replica count is sampled (replica-seconds)
PEER_COUNT_EVERY = 2  # heartbeats between counts of the live gateways (the local share of a quota): 10 s


class Peers:
    """How many gateway processes share each quota now (the divisor of a local share): this
    process's workers until the store's gateway directory says."""

    def __init__(self, workers: int) -> None:
        self.live = max(1, workers)

    def __call__(self) -> int:
        return self.live


async def heartbeat(
    store: ObjectStore, record: gateway_directory.GatewayRecord, peers: Peers, quotas: QuotaBackend
) -> None:
    """Announce ``record`` every ``HEARTBEAT_S``; count the live gateways every
    ``PEER_COUNT_EVERY`` beats, and every beat while a shared quota budget is away (the local
    share then decides, so its divisor must be current)."""
    beats = 0
    while True:
        await asyncio.sleep(gateway_directory.HEARTBEAT_S)
        with contextlib.suppress(FleetError, OSError):
            await asyncio.to_thread(gateway_directory.announce, store, record)
        beats += 1
        if beats % PEER_COUNT_EVERY == 1 or quotas.degraded:
            with contextlib.suppress(FleetError, OSError):
                peers.live = await asyncio.to_thread(gateway_directory.count_live, store, record.id)


async def write_activity(
    upstreams: Upstreams, write: Callable[[dict[tuple[str, str], float]], object], key: str
) -> None:
    """When this gateway last asked each version (``Upstreams.last_used``), written with
    ``write`` (``fleet.logs.activity.write_activity``, to ``key``) at start — so the controller
    knows this gateway keeps one — and with each heartbeat after a change."""
    written: dict[tuple[str, str], float] | None = None
    failing = False
    while True:
        if upstreams.last_used != written:
            now = dict(upstreams.last_used)
            try:
                await asyncio.to_thread(write, now)
                written, failing = now, False
            except (FleetError, OSError) as exc:
                if not failing:  # said once per outage: idle unloads wait for this gateway meanwhile
                    log.warning("cannot write %s (lazy versions are not unloaded while it is missing): %s", key, exc)
                failing = True
        await asyncio.sleep(gateway_directory.HEARTBEAT_S)


async def sample_replicas(view: FleetView, usage: UsageMeter) -> None:
    """Replica-seconds: each routed version's replicas, about once a second."""
    while True:
        usage.replicas({k: len(urls) for k, urls in view.snapshot.endpoints.items()})
        await asyncio.sleep(REPLICA_SAMPLE_S)
