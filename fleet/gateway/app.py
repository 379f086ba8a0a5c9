"""The gateway's ASGI app: wiring only. Routes go to the REST adapters (``rest``), which run
the request pipeline (``pipeline``: authenticate → entitle → admit → decode → choose →
answer → record); generation to ``generation.routes``; admin routes to ``admin``; health,
readiness and metrics to ``health``; the loops beside the requests are ``background``'s.
With ``Settings.grpc_port`` the same pipeline also answers OIP over gRPC (``grpc_server``),
on its own port but in this process and on this event loop, started and stopped with the app.

Every answer carries ``X-Request-Id`` and ``X-Fleet-Model-Version`` (``none`` before a
version was chosen); every error is ``{"error": "..."}`` with the contract's status —
including one nobody planned for, which is a JSON 500 naming the request id, logged
(``middleware.ErrorAnswers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import socket
from collections.abc import AsyncIterator, Iterator, Mapping

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import ASGIApp

from fleet import __version__, audit
from fleet.catalog import gateway_directory
from fleet.catalog.policies.budgets import GatewaySpec
from fleet.catalog.policies.loader import Policies
from fleet.catalog.tenants import Quota
from fleet.errors import FleetError
from fleet.gateway import background, bus, shadow
from fleet.gateway.activate import Activator
from fleet.gateway.admin import admin_routes
from fleet.gateway.body import BodyBudget, Decoder
from fleet.gateway.dispatch import Dispatcher
from fleet.gateway.fairqueue import PRIORITIES
from fleet.gateway.generation.routes import GenerationRoutes
from fleet.gateway.health import Health, quota_state
from fleet.gateway.infer_routes import InferRoutes
from fleet.gateway.middleware import ErrorAnswers, Headers, Settings
from fleet.gateway.pipeline import Pipeline
from fleet.gateway.quota import Quotas, divide
from fleet.gateway.quota.buckets import TokenBuckets
from fleet.gateway.quota.redis import from_env as redis_quotas
from fleet.gateway.rest import Rest
from fleet.gateway.shadow import ShadowMirror
from fleet.gateway.sinks import Recorder
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.top import TopStats
from fleet.gateway.upstream import Upstreams
from fleet.gateway.view import FleetView, Snapshot
from fleet.logs import activity
from fleet.logs.inference import InferenceLog
from fleet.logs.logged import LoggedRequests
from fleet.types import QuotaBackend
from fleet.usage.meter import UsageMeter
from fleet.usage.prices import Price

GC_YOUNG_THRESHOLD = 20_000  # allocations between young-generation collections (default 700)
GRPC_GRACE_S = 5.0  # how long gRPC calls in flight may finish once the gateway stops


def create_app(
    view: FleetView,
    policies: Policies | None = None,
    settings: Settings | None = None,
    *,
    quota: QuotaBackend | None = None,
    decoder: Decoder | None = None,
    prices: Mapping[str, Price] | None = None,
) -> ASGIApp:
    """The gateway. ``prices``: model → its price per replica-hour (``fleet.usage.meter``), for the
    cost of what it serves; a model without one is metered with its cost unknown."""
    settings = settings or Settings(gateway_id=gateway_directory.new_id())
    limits = policies.gateway if policies else GatewaySpec()
    decoder = decoder or Decoder(settings.decode_workers)
    upstreams = Upstreams(decoder.answer)
    peers = background.Peers(settings.workers)
    backend = quota or redis_quotas(peers) or TokenBuckets(divisor=peers)

    def buffers() -> Iterator[tuple[tuple[str, ...], float]]:  # read at scrape time: all built by then
        yield ("shadow_queue",), mirror.bytes
        yield ("inference_log",), inference_log.buffered_bytes
        yield ("feedback_index",), logged.bytes
        yield ("prediction_cache",), sum(c.bytes for c in pipeline.caches.values())
        yield ("request_bodies",), in_flight.held

    telemetry = Telemetry(
        lambda: _queue_depths(upstreams),
        buffers,
        lambda: (((m, v), p.slots.in_use) for (m, v), p in list(upstreams.pools().items())),
        functools.partial(quota_state, backend),
    )
    inference_log = InferenceLog(
        view.store,
        settings.gateway_id,
        flush_s=settings.log_flush_s if settings.log_flush_s is not None else limits.inference_log_flush_s,
        flush_bytes=limits.mib(limits.inference_log_flush_mib),
        max_bytes=limits.mib(limits.inference_log_buffer_mib),
        on_written=lambda m, n: telemetry.log_rows.labels(m, "written").inc(n),
        on_dropped=lambda m, n: telemetry.log_rows.labels(m, "dropped").inc(n),
    )
    logged = LoggedRequests(view.store, limits.mib(limits.feedback_index_mib))
    if policies:
        view.use_policies(
            {
                name: Quota(
                    rps=t.quota.rps,
                    burst=t.quota.burst,
                    concurrency=t.quota.concurrency,
                    tokens_per_minute=t.quota.tokens_per_minute,
                )
                for name, t in policies.tenants.items()
            },
            {name: t.weight for name, t in policies.tenants.items()},
        )
    mirror = ShadowMirror(
        upstreams.predict, functools.partial(shadow.record, telemetry), max_bytes=limits.mib(limits.shadow_queue_mib)
    )
    usage = UsageMeter(view.store, settings.gateway_id, dict(prices or {}).get)
    telemetry.registry.register(usage.collector())
    pipeline = Pipeline(
        view,
        policies,
        telemetry,
        Quotas(backend, telemetry),
        decoder,
        Dispatcher(upstreams, telemetry),
        Recorder(mirror, inference_log, logged, usage),
    )
    in_flight = BodyBudget(limits.mib(limits.inflight_body_mib))
    rest = Rest(
        pipeline,
        view.store,
        settings.gateway_id,
        limits.mib(limits.max_body_mib),
        logged,
        in_flight,
        (limits.feedback_rps, limits.feedback_burst),
        limits.body_read_s,
    )
    generation = GenerationRoutes(
        pipeline,
        upstreams,
        telemetry,
        usage,
        in_flight,
        limits.mib(limits.max_body_mib),
        limits.body_read_s,
        limits.stream_write_s,
    )
    mirror.generate = generation.shadow
    make_room = None
    if policies is not None and policies.runtime.memory_budget_mib is not None and view.runtime.budgets_memory:
        from fleet.control.lazy import LoadController  # the local runtime's memory budget, kept by whoever starts

        make_room = LoadController(view.store, policies, view.runtime).make_room
    activator = upstreams.activator = Activator(
        view.runtime, upstreams, pipeline.spec, telemetry, view.read_runtime, make_room
    )

    def on_snapshot(snap: Snapshot) -> None:
        # with workers, each process holds its part of a replica's slots and of the wait queue
        n = settings.workers
        limits_ = {
            m: (divide(s.concurrency, n), divide(s.max_queue, n), s.batch_aging_ms / 1000, s.tenant_share)
            for m, s in (policies.models.items() if policies else [])
        }
        upstreams.sync(snap.endpoints, limits_)
        activator.synced()
        telemetry.routed({(m, v) for m, table in snap.routes.items() for v in table.referenced_versions()})

    server_info = {"name": "serving-fleet", "version": __version__, "extensions": ["generate"]}
    health = Health(view, telemetry, settings, backend, server_info)
    grpc = None
    if settings.grpc_port is not None:  # imported only when asked for: grpcio and the OIP protos load in ~70 ms
        from fleet.gateway.grpc_server import GrpcEndpoint, InferenceService

        service = InferenceService(
            pipeline, lambda: view.snapshot.loaded_at > 0, server_info, in_flight, access=settings.access_log
        )
        grpc = GrpcEndpoint(
            service,
            settings.grpc_host,
            settings.grpc_port,
            limits.mib(limits.max_body_mib),
            reuse_port=settings.workers > 1,
        )

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(view.refresh, True)  # serve nothing until routing state is loaded
        on_snapshot(view.snapshot)
        record_activity = functools.partial(activity.write_activity, view.store, settings.gateway_id)
        tasks = [
            asyncio.create_task(view.run(on_snapshot)),
            asyncio.create_task(telemetry.watch_loop()),
            asyncio.create_task(background.sample_replicas(view, usage)),
            asyncio.create_task(
                background.write_activity(upstreams, record_activity, activity.activity_key(settings.gateway_id))
            ),
        ]
        if bus_url := os.environ.get("FLEET_REDIS_URL"):
            tasks.append(asyncio.create_task(bus.subscribe(bus_url, view.nudge, view.on_bus)))
        usage.start()
        record = None
        if settings.public_url:
            now = audit.now()
            record = gateway_directory.GatewayRecord(
                id=settings.gateway_id,
                url=settings.public_url,
                host=socket.gethostname(),
                pid=os.getpid(),
                started_at=now,
                heartbeat_at=now,
            )
            await asyncio.to_thread(gateway_directory.announce, view.store, record)
            tasks.append(asyncio.create_task(background.heartbeat(view.store, record, peers, backend)))
        decoder.start()
        mirror.start()
        inference_log.start()
        try:
            if grpc is not None:  # on this loop: its calls share every step's state with HTTP's
                await grpc.start()  # inside try: a port it cannot bind still stops what started above
            # everything imported and built so far lives as long as the process: keep it out of
            # the garbage collector's full passes, which otherwise pause the loop for tens of ms
            gc.freeze()
            # A request allocates a few hundred objects, nearly all freed when it ends; at the
            # default threshold (700) a young-generation pass ran every couple of requests.
            _, older, oldest = gc.get_threshold()
            gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
            yield
        finally:
            if grpc is not None:
                await grpc.stop(GRPC_GRACE_S)  # first: its calls in flight still need everything below
            for task in tasks:
                task.cancel()
            await mirror.close()
            await asyncio.to_thread(inference_log.close)
            await asyncio.to_thread(usage.close)
            if record is not None:
                with contextlib.suppress(FleetError, OSError):
                    await asyncio.to_thread(gateway_directory.withdraw, view.store, record.id)
            if upstreams.last_used:  # the last word on what it served, for the idle clock
                with contextlib.suppress(FleetError, OSError):
                    await asyncio.to_thread(record_activity, dict(upstreams.last_used))
            await upstreams.close()
            await generation.close()
            activator.close()
            await backend.close()
            await asyncio.to_thread(decoder.close)

    errors = ErrorAnswers(telemetry)
    app = Starlette(
        routes=[  # inference first: the router tries routes in order
            Route("/v2/models/{model}/infer", rest.infer_v2, methods=["POST"]),
            Route("/v2/models/{model}/versions/{version}/infer", rest.infer_v2, methods=["POST"]),
            Route("/v1/models/{target}", rest.predict_v1, methods=["POST"]),
            Route("/v1/completions", generation.completions, methods=["POST"]),
            Route("/v1/chat/completions", generation.chat, methods=["POST"]),
            Route("/v2/models/{model}/generate", generation.oip_generate, methods=["POST"]),
            Route("/v2/models/{model}/generate_stream", generation.oip_generate_stream, methods=["POST"]),
            Route("/v2/models/{model}/versions/{version}/generate", generation.oip_generate, methods=["POST"]),
            Route(
                "/v2/models/{model}/versions/{version}/generate_stream",
                generation.oip_generate_stream,
                methods=["POST"],
            ),
            Route("/v1/feedback", rest.feedback, methods=["POST"]),
            Route("/v2", health.server_metadata),
            Route("/v2/health/live", health.live),
            Route("/v2/health/ready", health.ready),
            Route("/v2/models/{model}", rest.model_metadata),
            Route("/v2/models/{model}/ready", rest.model_ready),
            Route("/v2/models/{model}/versions/{version}", rest.model_metadata),
            Route("/v2/models/{model}/versions/{version}/ready", rest.model_ready),
            Route("/metrics", health.metrics),
            *admin_routes(
                view.store,
                settings.admin_token,
                on_change=view.wake,
                stats=health.stats,
                telemetry=telemetry,
                top=TopStats(view, telemetry, upstreams, settings.gateway_id).answer,  # fleet top
                gateway_id=settings.gateway_id,
                runtime=view.runtime,
                max_body_bytes=int(limits.admin_max_body_kib * 1024),
            ),
        ],
        exception_handlers={
            FleetError: errors.fleet_error,
            HTTPException: errors.http_error,
            Exception: errors.unexpected,
        },
        lifespan=lifespan,
    )
    app.state.inference_log = inference_log
    app.state.telemetry = telemetry
    app.state.pipeline = pipeline
    app.state.grpc = grpc
    fast = InferRoutes(
        app,
        {
            "infer": rest.infer_v2,
            "generate": generation.oip_generate,
            "generate_stream": generation.oip_generate_stream,
            "completions": generation.completions,
            "chat/completions": generation.chat,
        },
        errors.fleet_error,
        errors.unexpected,
    )
    return Headers(fast, telemetry, access=settings.access_log, write_s=limits.stream_write_s)


def grpc_address(gateway: ASGIApp) -> str | None:
    """``host:port`` the gateway's gRPC endpoint listens on (the port it bound, when asked
    for 0), once the app has started; None when gRPC is off."""
    inner = gateway
    while not isinstance(inner, Starlette):  # create_app's wrappers (Headers, InferRoutes) around its Starlette
        inner = inner.app  # type: ignore[attr-defined]
    grpc = inner.state.grpc
    return grpc.address if grpc is not None else None


def _queue_depths(upstreams: Upstreams) -> Iterator[tuple[str, str, str, int]]:
    for (model, version), pool in list(upstreams.pools().items()):
        for priority in PRIORITIES:
            yield model, version, priority, pool.slots.waiting(priority)
