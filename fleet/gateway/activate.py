"""Activation: a request for a lazy version that runs no replica is held while it starts.

The role of Knative's activator (or KEDA's HTTP add-on), in the gateway. A model whose
policy says ``loading: lazy`` may have versions routed that run nothing (never started,
or stopped after ``idle_unload_s`` by ``fleet.control.lazy``). A request the router sends to
such a version is held here:

- **One start per version.** The first held request starts the version through the
  runtime's ``activate`` in a thread (the local runtime takes the version's ``flock``, so
  other gateways and workers asking at once find the replica it started); every other
  request for it waits on the same start. The start first makes room under the runtime's
  memory budget (``fleet.control.lazy.LoadController.make_room``), off the event loop.
- **The hold is bounded** by the policy's ``max_hold_ms`` and the request's own deadline,
  whichever comes first (the hold counts against the request's timeout). Past it the
  request gets 503 with ``Retry-After`` saying the version is starting; the start goes on.
  So is the number held: at most ``max_held`` requests per version in this process, and
  ``max_held_per_tenant`` of one tenant; past either, the same 503 at once (one tenant
  cannot fill the hold for everyone else, nor the gateway's memory with waiting requests).
- **A start that fails** answers every held request 503 naming the cause in a few words
  (``summary`` of the runtime's error: the Bento is not built, the replica exited while
  starting, the memory budget cannot hold it); log lines, paths and other models' names go
  to the gateway's log only. The version is not started again for
  ``FAILED_BACKOFF_S`` (doubling, at most ``MAX_BACKOFF_S``): requests meanwhile get the same
  503 at once, with ``Retry-After`` until the next try, rather than a start each.
- **Served once ready.** When the start returns, the gateway re-reads the runtime at once
  and the held requests go on through the same pools as any other.
- A runtime that cannot start anything (``static``) refuses the start (``DeployFailed``):
  the 503 says so, with the same back-off.

Metrics: ``fleet_cold_starts_total{outcome}``, ``fleet_activation_hold_seconds``,
``fleet_requests_held``. A request held is not an attempt of the version for canary analysis;
a failed start is (``unreachable``), and a canary's request falls back to stable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fleet.catalog.policies.models import ModelSpec
from fleet.errors import FleetError
from fleet.gateway.replicas import Pool
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import NoReplica, Upstreams
from fleet.runtime.base import DeployFailed, Runtime

log = logging.getLogger("fleet.gateway.activate")

FAILED_BACKOFF_S = 5.0
MAX_BACKOFF_S = 120.0
EXPECTED_START_S = 3.0  # Retry-After for a request that gave up holding, before a start was measured
START_THREADS = 4  # versions starting at once in one gateway process; more wait for a thread


class Starting(FleetError):
    """The version is starting and was not ready within the hold: retry shortly."""

    status = 503

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StartFailed(NoReplica):
    """The version could not be started; the message names why. Not retried before ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Activator:
    def __init__(
        self,
        runtime: Runtime,
        upstreams: Upstreams,
        spec_for: Callable[[str], ModelSpec],  # noqa: ANN401
        telemetry: Telemetry,
        read_runtime: Callable[[], None],
        make_room: Callable[[str, str], object] | None = None,
    ) -> None:
        """``read_runtime()``: ask the gateway's view to re-read the runtime now (from the loop);
        ``make_room(model, version)``: runs in the start's thread before a replica starts."""
        self.runtime, self.upstreams, self.spec_for, self.telemetry = runtime, upstreams, spec_for, telemetry
        self.read_runtime, self.make_room = read_runtime, make_room
        self._starts: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._failed: dict[tuple[str, str], tuple[float, str, int]] = {}  # until (monotonic), cause, failures in a row
        self._synced = asyncio.Event()
        self._started_s: dict[tuple[str, str], float] = {}  # the last start's seconds, for Retry-After
        self._began: dict[tuple[str, str], float] = {}  # when the current (or last) start began (monotonic)
        self._held: dict[tuple[str, ...], int] = {}  # (model, version) and (model, version, tenant) → held now
        # starts block a thread for as long as they take (minutes, for a pod waiting on a GPU): a
        # pool of their own, so they never hold up the threads the gateway's refresh and heartbeat use
        self._executor = ThreadPoolExecutor(max_workers=START_THREADS, thread_name_prefix="fleet-activate")

    def synced(self) -> None:
        """The gateway's pools now match a new snapshot (called by its ``on_snapshot``)."""
        self._synced.set()
        self._synced = asyncio.Event()

    async def hold(self, model: str, version: str, deadline: float, tenant: str = "") -> Pool:
        """The version's pool once it has a replica, starting it if needed; raise ``Starting``
        past the hold (or with the hold full), ``StartFailed`` if it cannot start,
        ``NoReplica`` for an eager model."""
        pool = self.upstreams.pool(model, version)
        if pool is not None and pool.replicas:
            return pool
        spec = self.spec_for(model)
        if spec.loading != "lazy":
            raise NoReplica(f"{model}:{version} has no running replica; expected it to be deployed")
        key = (model, version)
        now = time.monotonic()
        failed = self._failed.get(key)
        if failed is not None and now < failed[0]:
            raise StartFailed(failed[1], failed[0] - now)
        mine = (model, version, tenant)
        for counted, limit, whose in ((mine, spec.max_held_per_tenant, " of your tenant"), (key, spec.max_held, "")):
            if self._held.get(counted, 0) >= limit:
                raise Starting(
                    f"{model}:{version} is starting and already holds {limit} requests{whose} (its policy's "
                    f"max_held{'_per_tenant' if whose else ''}); retry after {self._retry_after(key, now):.0f} s",
                    self._retry_after(key, now),
                )
        task = self._starts.get(key)
        if task is None or task.done():
            task = self._starts[key] = asyncio.create_task(self._start(model, version))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # held requests may all have left
        until = min(deadline, now + spec.max_hold_ms / 1000)
        held = self.telemetry.held.labels(model, version)
        held.inc()
        for counted in (key, mine):
            self._held[counted] = self._held.get(counted, 0) + 1
        try:
            async with asyncio.timeout(max(0.0, until - now)):
                await asyncio.shield(task)
                return await self._pool(model, version)
        except TimeoutError:
            left = self._retry_after(key, now)
            raise Starting(
                f"{model}:{version} is starting (a cold start; this request waited {(time.monotonic() - now) * 1e3:.0f} ms, "
                f"max_hold_ms {spec.max_hold_ms} or the request's timeout); retry after {left:.0f} s",
                left,
            ) from None
        finally:
            held.dec()
            for counted in (key, mine):
                if (n := self._held[counted] - 1) > 0:
                    self._held[counted] = n
                else:
                    del self._held[counted]  # a tenant that no longer waits leaves no entry behind
            self.telemetry.hold.labels(model, version).observe(time.monotonic() - now)

    def _retry_after(self, key: tuple[str, str], now: float) -> float:
        """Seconds until the start under way is likely done: its last start's time, less what passed."""
        expected = self._started_s.get(key, EXPECTED_START_S)
        return max(1.0, expected - (time.monotonic() - self._began.get(key, now)))

    async def _pool(self, model: str, version: str) -> Pool:
        """Wait (within the caller's timeout) until the gateway's pools list the started replica."""
        while True:
            pool = self.upstreams.pool(model, version)
            if pool is not None and pool.replicas:
                return pool
            synced = self._synced
            self.read_runtime()
            await synced.wait()

    async def _start(self, model: str, version: str) -> None:
        key = (model, version)
        began = self._began[key] = time.monotonic()
        log.info("starting %s:%s for a held request (lazy)", model, version)
        make_room = self.make_room

        def start() -> bool:
            before = (lambda: make_room(model, version)) if make_room is not None else None
            return bool(self.runtime.activate(model, version, before_start=before)[1])

        try:  # in threads of its own: a start may take minutes (a pod waiting for a GPU)
            started = await asyncio.get_running_loop().run_in_executor(self._executor, start)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, held requests get a 503 and a back-off
            failures = self._failed.get(key, (0.0, "", 0))[2] + 1
            backoff = min(MAX_BACKOFF_S, FAILED_BACKOFF_S * 2 ** (failures - 1))
            # the tenant hears why in a few words (``summary``); paths, log lines and other
            # models' names stay in the gateway's log
            cause = exc.summary if isinstance(exc, DeployFailed) else None
            message = (
                f"{model}:{version} could not be started: {cause or 'the runtime failed to start it'}; "
                f"not tried again for {backoff:.0f} s"
            )
            self._failed[key] = (time.monotonic() + backoff, message, failures)
            self.telemetry.cold_starts.labels(model, version, "failed").inc()
            log.warning(
                "cold start of %s:%s failed (retried in %.0f s): %s",
                model,
                version,
                backoff,
                exc,
                exc_info=not isinstance(exc, FleetError),
            )
            raise StartFailed(message, backoff) from None
        self._failed.pop(key, None)
        if started:  # another gateway, worker or deploy may have started it: then nothing is counted
            self._started_s[key] = time.monotonic() - began
            self.telemetry.cold_starts.labels(model, version, "started").inc()
            log.info("started %s:%s in %.2f s", model, version, time.monotonic() - began)
        self.read_runtime()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
