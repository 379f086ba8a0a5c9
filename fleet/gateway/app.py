"""The gateway's ASGI app: wiring only. Routes go to the REST adapters (``rest``), which run
the request pipeline (``pipeline``: authenticate → entitle → admit → decode → choose →
answer → record); admin routes to ``admin``; health and metrics are answered here. With
``Settings.grpc_port`` the same pipeline also answers OIP over gRPC (``grpc_server``), on
its own port but in this process and on this event loop, started and stopped with the app.

Every answer carries ``X-Request-Id`` and ``X-Fleet-Model-Version`` (``none`` before a
version was chosen); every error is ``{"error": "..."}`` with the contract's status —
including one nobody planned for, which is a JSON 500 naming the request id, logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import os
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet import __version__, audit
from fleet.catalog import gateway_directory
from fleet.catalog.policies.budgets import GatewaySpec
from fleet.catalog.policies.loader import Policies
from fleet.catalog.policies.models import ModelSpec
from fleet.catalog.tenants import Quota
from fleet.errors import FleetError
from fleet.gateway import workers
from fleet.gateway.activate import Activator
from fleet.gateway.admin import admin_routes, json_response
from fleet.gateway.body import BodyBudget, Decoder
from fleet.gateway.dispatch import Dispatcher
from fleet.gateway.generation.routes import GenerationRoutes
from fleet.gateway.middleware import Headers, Settings, internal_error, retry_after
from fleet.gateway.pipeline import DEFAULT_SPEC, Pipeline
from fleet.gateway.quota import buckets as quotas_
from fleet.gateway.quota.buckets import Quotas, TokenBuckets
from fleet.gateway.rest import Rest
from fleet.gateway.shadow import Generated, GenShadowJob, ShadowJob, ShadowMirror
from fleet.gateway.sinks import Recorder
from fleet.gateway.slots import PRIORITIES
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import Upstreams
from fleet.gateway.view import FleetView, Snapshot
from fleet.logs import activity
from fleet.logs.feedback import LoggedRequests
from fleet.logs.inference import InferenceLog
from fleet.records import BadRecord
from fleet.types import LATENCY_BUCKETS_MS, PREDICTION_BINS, QuotaBackend
from fleet.usage.meter import UsageMeter
from fleet.usage.prices import Price

activity_log = logging.getLogger("fleet.gateway")
GC_YOUNG_THRESHOLD = 20_000  # allocations between young-generation collections (default 700)

SIBLING_SCRAPE_S = 2.0  # how long /metrics waits for a sibling worker's own metrics
REPLICA_SAMPLE_S = 1.0  # how often each version's replica count is sampled (replica-seconds)
PEER_COUNT_EVERY = 5  # heartbeats between counts of the live gateways (the local share of a quota)

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
    """The gateway. ``prices``: model → its price per replica-hour (``fleet.usage.prices``), for the
    cost of what it serves; a model without one is metered with its cost unknown."""
    settings = settings or Settings(gateway_id=gateway_directory.new_id())
    limits = policies.gateway if policies else GatewaySpec()
    decoder = decoder or Decoder(settings.decode_workers)
    upstreams = Upstreams(decoder.answer)

    def buffers() -> Iterator[tuple[tuple[str, ...], float]]:
        yield ("shadow_queue",), mirror.bytes
        yield ("inference_log",), inference_log.buffered_bytes
        yield ("feedback_index",), logged.bytes
        yield ("prediction_cache",), sum(c.bytes for c in pipeline.caches.values())  # read at scrape time: all built
        yield ("request_bodies",), in_flight.held

    # how many gateway processes share each quota now (this one's workers until the store says)
    peers = {"live": max(1, settings.workers)}
    backend = quota or quotas_.from_env(lambda: peers["live"]) or TokenBuckets(divisor=lambda: peers["live"])

    def quota_state() -> Iterator[tuple[tuple[str, ...], float]]:
        health = backend.health()
        yield ("shared",), 1.0 if health["shared"] else 0.0
        yield ("share_divisor",), float(health["share_divisor"])

    telemetry = Telemetry(
        lambda: _queue_depths(upstreams),
        buffers,
        lambda: (((m, v), p.slots.in_use) for (m, v), p in list(upstreams.pools().items())),
        quota_state,
    )
    inference_log = InferenceLog(
        view.store,
        settings.gateway_id,
        flush_s=settings.log_flush_s,
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

    def on_snapshot(snap: Snapshot) -> None:
        # with workers, each process holds its part of a replica's slots and of the wait queue
        n = settings.workers
        limits_ = {
            m: (quotas_.divide(s.concurrency, n), quotas_.divide(s.max_queue, n), s.batch_aging_ms / 1000)
            for m, s in (policies.models.items() if policies else [])
        }
        upstreams.sync(snap.endpoints, limits_)
        activator.synced()

    def spec_for(model: str) -> ModelSpec:
        return policies.models.get(model, DEFAULT_SPEC) if policies else DEFAULT_SPEC

    make_room = None
    if policies is not None and policies.runtime.memory_budget_mib is not None and view.runtime.budgets_memory:
        from fleet.control.lazy import LoadController  # the local runtime's memory budget, kept by whoever starts

        make_room = LoadController(view.store, policies, view.runtime).make_room
    activator = upstreams.activator = Activator(
        view.runtime, upstreams, spec_for, telemetry, view.read_runtime, make_room
    )

    async def write_activity() -> None:
        """When this gateway last asked each version (fleet.logs.activity, lazy loading's idle
        clock), at start (so the controller knows this gateway keeps one) and with each heartbeat
        after a change."""
        written: dict[tuple[str, str], float] | None = None
        failing = False
        while True:
            if upstreams.last_used != written:
                now = dict(upstreams.last_used)
                try:
                    await asyncio.to_thread(activity.write_activity, view.store, settings.gateway_id, now)
                    written, failing = now, False
                except (FleetError, OSError) as exc:
                    if not failing:  # said once per outage: idle unloads wait for this gateway meanwhile
                        activity_log.warning(
                            "cannot write %s (lazy versions are not unloaded while it is missing): %s",
                            activity.activity_key(settings.gateway_id),
                            exc,
                        )
                    failing = True
            await asyncio.sleep(gateway_directory.HEARTBEAT_S)

    def on_shadow(
        job: ShadowJob | GenShadowJob,
        outcome: str,
        shadow_ms: float | None,
        result: Any,  # noqa: ANN401
        kind: str | None,
    ) -> None:
        if isinstance(result, Generated):  # the shadow's time to first token beside the caller's
            telemetry.shadow_result(job.model, job.version, outcome, result.ttft_ms, job.served_ms)
            telemetry.generated(
                job.model,
                job.version,
                ttft_ms=result.ttft_ms,
                tpot_ms=result.tpot_ms,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
            )
            return
        telemetry.shadow_result(job.model, job.version, outcome, shadow_ms, job.served_ms)
        if result is not None and shadow_ms is not None:
            telemetry.answered(job.model, job.version, shadow_ms, result)
        elif outcome == "error" and kind is not None:  # a refused input (no kind) is not the shadow's failure
            telemetry.failed(job.model, job.version, kind)

    mirror = ShadowMirror(upstreams.predict, on_shadow, max_bytes=limits.mib(limits.shadow_queue_mib))
    usage = UsageMeter(view.store, settings.gateway_id, dict(prices or {}).get)
    telemetry.registry.register(usage.collector())

    async def sample_replicas() -> None:
        while True:  # replica-seconds: each routed version's replicas, about once a second
            usage.replicas({k: len(urls) for k, urls in view.snapshot.endpoints.items()})
            await asyncio.sleep(REPLICA_SAMPLE_S)

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
    rest = Rest(pipeline, view.store, settings.gateway_id, limits.mib(limits.max_body_mib), logged, in_flight)
    generation = GenerationRoutes(pipeline, upstreams, telemetry, usage, in_flight, limits.mib(limits.max_body_mib))
    mirror.generate = generation.shadow
    server_info = {"name": "serving-fleet", "version": __version__, "extensions": ["generate"]}
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

    async def heartbeat(record: gateway_directory.GatewayRecord) -> None:
        beats = 0
        while True:
            await asyncio.sleep(gateway_directory.HEARTBEAT_S)
            with contextlib.suppress(FleetError, OSError):
                await asyncio.to_thread(gateway_directory.announce, view.store, record)
            beats += 1
            # how many share a quota locally: every beat while Redis is away, else now and then
            if beats % PEER_COUNT_EVERY == 1 or (isinstance(backend, quotas_.RedisQuotas) and not backend.shared):
                with contextlib.suppress(FleetError, OSError):
                    peers["live"] = max(1, len(await asyncio.to_thread(gateway_directory.live, view.store)))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(view.refresh, True)  # serve nothing until routing state is loaded
        on_snapshot(view.snapshot)
        tasks = [
            asyncio.create_task(view.run(on_snapshot)),
            asyncio.create_task(telemetry.watch_loop()),
            asyncio.create_task(sample_replicas()),
            asyncio.create_task(write_activity()),
        ]
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
            tasks.append(asyncio.create_task(heartbeat(record)))
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
                    await asyncio.to_thread(
                        activity.write_activity, view.store, settings.gateway_id, dict(upstreams.last_used)
                    )
            await upstreams.close()
            await generation.close()
            activator.close()
            if isinstance(backend, quotas_.RedisQuotas):
                await backend.close()
            await asyncio.to_thread(decoder.close)

    async def live(_: Request) -> Response:
        return json_response({"live": True})

    def observe_store() -> list[BadRecord]:
        telemetry.stale.set(1 if view.stale else 0)
        bad = view.bad_records
        for kind in ("RouteTable", "Tenant", "ModelVersion"):
            telemetry.bad_records.labels(kind).set(sum(b.kind == kind for b in bad))
        return bad

    def admin(request: Request) -> bool:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        token = settings.admin_token
        return (
            bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())
        )  # type: ignore[union-attr]

    async def ready(request: Request) -> Response:
        # Ready once a snapshot is loaded: bad records are reported, not a reason to refuse
        # traffic for every good model. Their keys and reasons name tenants, versions and the
        # store: shown with the admin token only; anyone sees how many of each kind.
        ok = view.snapshot.loaded_at > 0
        bad = observe_store()
        shown: object = {kind: sum(b.kind == kind for b in bad) for kind in sorted({b.kind for b in bad})}
        if admin(request):
            shown = [{"key": b.key, "kind": b.kind, "reason": b.reason} for b in bad]
        return json_response(
            {
                "ready": ok,
                "routing_state": "stale" if view.stale else "current",
                "store_reachable": view.healthy,
                "last_refresh_age_s": round(time.time() - view.last_success, 3),
                "store_error": view.last_error or None,
                "bad_records": shown,
                "gateway": settings.gateway_id,
                "quotas": backend.health(),
                "workers": settings.workers,
            },
            200 if ok else 503,
        )

    async def server_metadata(_: Request) -> Response:
        return json_response(server_info)

    me = workers.my_index()
    others = [(i, u) for i, u in workers.siblings() if i != me]

    async def metrics(request: Request) -> Response:
        observe_store()
        own = telemetry.exposition()
        if not others or request.query_params.get("worker"):
            return Response(own, media_type="text/plain; version=0.0.4")
        # the whole gateway, whichever worker the scrape reached (fleet.gateway.workers)
        try:
            async with httpx.AsyncClient(timeout=SIBLING_SCRAPE_S) as client:
                answers = await asyncio.gather(*(client.get(f"{u}/metrics", params={"worker": "1"}) for _, u in others))
            for a in answers:
                a.raise_for_status()
        except httpx.HTTPError as exc:
            return json_response(
                {
                    "error": f"a sibling worker did not answer its metrics ({exc}); the sum would "
                    "read as a counter reset, so none is given"
                },
                503,
            )
        merged = await asyncio.to_thread(
            workers.merge_expositions,
            [(me or 0, own.decode()), *((i, a.text) for (i, _), a in zip(others, answers, strict=True))],
        )
        return Response(merged, media_type="text/plain; version=0.0.4")

    def stats(model: str, window_s: int) -> dict[str, Any]:
        start, end, versions = telemetry.stats.window(model, window_s)
        return {
            "model": model,
            "gateway": settings.gateway_id,
            "start": start,
            "end": end,
            "latency_buckets_ms": list(LATENCY_BUCKETS_MS),
            "prediction_bins": PREDICTION_BINS,
            "versions": versions,
        }

    async def fleet_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, FleetError)
        response = json_response({"error": str(exc)}, exc.status)
        wait = retry_after(telemetry, exc)
        if wait is not None:
            response.headers["Retry-After"] = str(wait)
        return response

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return json_response({"error": f"{exc.detail}: {request.method} {request.url.path[:200]}"}, exc.status_code)

    async def unexpected(request: Request, exc: Exception) -> Response:
        return json_response({"error": internal_error(request.scope.get("state", {}).get("request_id", "?"), exc)}, 500)

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
            Route("/v2", server_metadata),
            Route("/v2/health/live", live),
            Route("/v2/health/ready", ready),
            Route("/v2/models/{model}", rest.model_metadata),
            Route("/v2/models/{model}/ready", rest.model_ready),
            Route("/v2/models/{model}/versions/{version}", rest.model_metadata),
            Route("/v2/models/{model}/versions/{version}/ready", rest.model_ready),
            Route("/metrics", metrics),
            *admin_routes(
                view.store,
                settings.admin_token,
                on_change=view.wake,
                stats=stats,
                telemetry=telemetry,
                gateway_id=settings.gateway_id,
                runtime=view.runtime,
                max_body_bytes=int(limits.admin_max_body_kib * 1024),
            ),
        ],
        exception_handlers={FleetError: fleet_error, HTTPException: http_error, Exception: unexpected},
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
        fleet_error,
        unexpected,
    )
    return Headers(fast, telemetry, access=settings.access_log)


# The POST routes answered before Starlette's router: OIP infer and generate, OpenAI's completions.
_INFER = re.compile(
    r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/(?P<route>infer|generate|generate_stream)"
    r"|/v1/(?P<openai>completions|chat/completions)"
)


class InferRoutes:
    """The inference routes (OIP infer and generate, OpenAI completions and chat), answered
    before Starlette's router and its middlewares.

    Nearly every request is one of these; the router tries each route's pattern in turn and
    two middlewares wrap every call, about a tenth of the gateway's CPU per request. This
    matches the same paths Starlette's ``Route`` does (``[^/]+`` per parameter, on the
    decoded path), calls the same handler and answers errors with the same handlers, so
    a request gets the same answer either way; everything else goes on to ``app``.
    ``handlers``: the last part of the path (``infer``, ``generate``, ``generate_stream``,
    ``completions``, ``chat/completions``) → its handler; a route without one goes to ``app``.
    """

    def __init__(
        self,
        app: ASGIApp,
        handlers: Mapping[str, Callable[[Request], Awaitable[Response]]],
        on_error: Callable[[Request, Exception], Awaitable[Response]],
        on_unexpected: Callable[[Request, Exception], Awaitable[Response]],
    ) -> None:
        self.app, self.handlers, self.on_error, self.on_unexpected = app, dict(handlers), on_error, on_unexpected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = _INFER.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        handler = self.handlers.get(found["route"] or found["openai"]) if found is not None else None
        if handler is None:
            return await self.app(scope, receive, send)
        scope["app"] = self.app  # what Starlette's Request expects to find
        model, version = found["model"], found["version"]  # type: ignore[index]
        scope["path_params"] = (
            {} if model is None else {"model": model} if version is None else {"model": model, "version": version}
        )
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except FleetError as exc:
            response = await self.on_error(request, exc)
        except Exception as exc:  # noqa: BLE001 - answered 500 and logged, as Starlette's handler would
            response = await self.on_unexpected(request, exc)
        try:
            await response(scope, receive, send)
        except Exception as exc:  # a stream that broke after its head: logged as Starlette's outer middleware does
            await self.on_unexpected(request, exc)
            raise


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
