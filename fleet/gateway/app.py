"""The gateway's ASGI app: OIP v2 and KServe v1 inference for many tenants, plus admin.

A request: body (size-limited) → tenant by API key → quota → version choice
(``fleet.routing``) → input checked against the version's schema → prediction cache →
the upstream call (priority, deadline, retry on the other arm) → metrics, shadow mirror
and inference-log sample, none of which the caller waits for.

Every answer carries ``X-Request-Id`` and ``X-Fleet-Model-Version`` (``none`` before a
version was chosen); every error is ``{"error": "..."}`` with the contract's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from fleet import __version__, audit, gateways
from fleet.errors import FleetError, Forbidden, NotFound, Unauthorized
from fleet.gateway import protocol
from fleet.gateway.admin import admin_routes, json_response
from fleet.gateway.http import BodyTooLarge, Headers, OverQuota, Settings
from fleet.gateway.cache import PredictionCache
from fleet.gateway.quota import TokenBuckets
from fleet.gateway.shadow import ShadowJob, ShadowMirror
from fleet.gateway.slots import PRIORITIES
from fleet.gateway.state import FleetView, Snapshot
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import NoReplica, Upstreams, UpstreamError, UpstreamTimeout
from fleet.feedback import LoggedRequests
from fleet.feedback import parse as parse_feedback
from fleet.feedback import write as write_feedback
from fleet.inference_log import InferenceLog, Sample, feature_names
from fleet.registry import ModelVersion
from fleet.routing import Choice, RouteTable, choose_version, should_shadow
from fleet.spec import ModelSpec, Policies
from fleet.tenants import Tenant
from fleet.types import LATENCY_BUCKETS_MS, PREDICTION_BINS, QuotaBackend

DEFAULT_SPEC = ModelSpec.model_validate({
    "family": "unknown", "size_class": "small", "params_millions": 1.0,
    "autoscaling": {"max_replicas": 1, "target_qps_per_replica": 1.0, "target_p99_ms": 1000.0},
    "slo": {"p99_ms": 1000.0, "error_rate": 0.01},
})  # fmt: skip  (a model without a policy: 5 s timeout, 32 in flight per replica, no cache, 10 % logged)

def _policy(policies: Policies | None, model: str) -> ModelSpec:
    return policies.models.get(model, DEFAULT_SPEC) if policies else DEFAULT_SPEC


def create_app(
    view: FleetView,
    policies: Policies | None = None,
    settings: Settings | None = None,
    *,
    quota: QuotaBackend | None = None,
) -> ASGIApp:
    settings = settings or Settings(gateway_id=gateways.new_id())
    upstreams = Upstreams()
    telemetry = Telemetry(lambda: _queue_depths(upstreams))
    buckets: QuotaBackend = quota or TokenBuckets()
    caches: dict[str, PredictionCache] = {}
    inference_log = InferenceLog(
        view.store, settings.gateway_id, flush_s=settings.log_flush_s,
        on_written=lambda m, n: telemetry.log_rows.labels(m, "written").inc(n),
        on_dropped=lambda m, n: telemetry.log_rows.labels(m, "dropped").inc(n),
    )  # fmt: skip
    policy_quotas = {name: t.quota for name, t in (policies.tenants.items() if policies else [])}
    logged = LoggedRequests(view.store)

    def on_snapshot(snap: Snapshot) -> None:
        limits = {m: (s.concurrency, s.max_queue) for m, s in (policies.models.items() if policies else [])}
        upstreams.sync(snap.endpoints, limits)

    def on_shadow(job: ShadowJob, outcome: str, shadow_ms: float | None, result: np.ndarray | None, kind: str | None) -> None:
        telemetry.shadow_result(job.model, job.version, outcome, shadow_ms, job.served_ms)
        if result is not None and shadow_ms is not None:
            telemetry.answered(job.model, job.version, shadow_ms, result)
        elif outcome == "error":
            telemetry.failed(job.model, job.version, kind or "unreachable")

    mirror = ShadowMirror(upstreams.predict, on_shadow)

    async def heartbeat(record: gateways.GatewayRecord) -> None:
        while True:
            await asyncio.sleep(gateways.HEARTBEAT_S)
            with contextlib.suppress(FleetError, OSError):
                await asyncio.to_thread(gateways.announce, view.store, record)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(view.refresh, True)  # serve nothing until routing state is loaded
        on_snapshot(view.snapshot)
        tasks = [asyncio.create_task(view.run(on_snapshot))]
        record = None
        if settings.public_url:
            now = audit.now()
            record = gateways.GatewayRecord(id=settings.gateway_id, url=settings.public_url, host=socket.gethostname(),
                                            pid=os.getpid(), started_at=now, heartbeat_at=now)  # fmt: skip
            await asyncio.to_thread(gateways.announce, view.store, record)
            tasks.append(asyncio.create_task(heartbeat(record)))
        mirror.start()
        inference_log.start()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await mirror.close()
            await asyncio.to_thread(inference_log.close)
            if record is not None:
                with contextlib.suppress(FleetError, OSError):
                    await asyncio.to_thread(gateways.withdraw, view.store, record.id)
            await upstreams.close()

    # -- the request pipeline -----------------------------------------------------------
    async def read_body(request: Request) -> dict[str, Any]:
        limit = settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
        return protocol.parse_json(b"".join(chunks))

    def tenant(request: Request, snap: Snapshot) -> Tenant:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        found = snap.tenant_for(key.strip()) if scheme.lower() == "bearer" else None
        if found is None:
            raise Unauthorized("missing, unknown or revoked API key; expected 'Authorization: Bearer <key>'")
        request.state.tenant = found.name
        return found

    def control(request: Request, parameters: dict[str, Any], name: str) -> str | None:
        value = request.headers.get(f"x-fleet-{name.replace('_', '-')}")
        if value is None and parameters.get(name) is not None:
            value = str(parameters[name])
        return value

    def check_quota(who: Tenant) -> None:
        q = who.quota or policy_quotas.get(who.name)
        if q is None:
            return
        wait = buckets.acquire(who.name, q.rps, q.burst)
        if wait is not None:
            telemetry.quota.labels(who.name).inc()
            raise OverQuota(f"tenant {who.name!r} is over its quota of {q.rps:g} requests/s (burst {q.burst}); "
                            f"retry after {wait:.2f} s", wait)  # fmt: skip

    def choose(request: Request, model: str, requested: str | None,
               parameters: dict[str, Any]) -> tuple[Snapshot, Tenant, RouteTable, Choice]:  # fmt: skip
        """Tenant, route and version; the snapshot they came from is the one the request uses
        throughout (a refresh may swap in a new one meanwhile)."""
        snap = view.snapshot
        request.state.model = model
        who = tenant(request, snap)
        table = snap.routes.get(model)
        if table is None:
            raise NotFound(f"model {model!r} is not served here")
        if not who.allows(model):
            raise Forbidden(f"tenant {who.name!r} may not use model {model!r}")
        key = control(request, parameters, "routing_key") or request.state.request_id
        choice = choose_version(table, who, key, requested)
        request.state.model_version = choice.version
        request.state.routing_key = key
        return snap, who, table, choice

    async def dispatch(model: str, table: RouteTable, choice: Choice, features: np.ndarray, timeout_ms: float,
                       priority: str) -> tuple[str, np.ndarray, float]:  # fmt: skip
        """Ask the chosen version; if it fails (not a timeout), ask the split's other arm once."""
        deadline = time.monotonic() + timeout_ms / 1000
        order = [choice.version]
        if choice.reason in ("canary", "stable") and table.canary is not None and table.stable is not None:
            order.append(table.stable if choice.version == table.canary.version else table.canary.version)
        failure: FleetError | None = None
        for i, version in enumerate(order):
            started = time.monotonic()
            try:
                result = await upstreams.predict(model, version, features, deadline, priority, i == len(order) - 1)
            except UpstreamTimeout:
                telemetry.failed(model, version, "timeout")
                raise UpstreamTimeout(f"{model}:{version} did not answer within {timeout_ms:.0f} ms "
                                      "(X-Fleet-Timeout-Ms, capped by the model's timeout_ms)") from None  # fmt: skip
            except UpstreamError as exc:
                telemetry.failed(model, version, exc.kind)
                failure = exc
                continue
            except NoReplica as exc:
                telemetry.failed(model, version, "unreachable")
                failure = exc
                continue
            upstream_ms = (time.monotonic() - started) * 1e3
            telemetry.answered(model, version, upstream_ms, result)
            return version, result, upstream_ms
        assert failure is not None
        raise failure

    async def serve(request: Request, model: str, requested: str | None, data: dict[str, Any],
                    parse: Callable[[dict[str, Any], ModelVersion], np.ndarray]) -> tuple[str, np.ndarray, ModelVersion]:  # fmt: skip
        started = time.monotonic()
        raw = data.get("parameters")
        parameters = raw if isinstance(raw, dict) else {}
        snap, who, table, choice = choose(request, model, requested, parameters)
        check_quota(who)
        spec = _policy(policies, model)
        priority = control(request, parameters, "priority") or "interactive"
        if priority not in PRIORITIES:
            raise protocol.MalformedBody(f"priority {priority!r} is not known; expected one of {', '.join(PRIORITIES)}")
        timeout_ms = timeout(request, parameters, spec)
        manifest = snap.manifests[model, choice.version]
        features = parse(data, manifest)

        cache = caches.get(model) if spec.cache.enabled else None
        if spec.cache.enabled and cache is None:
            cache = caches[model] = PredictionCache(spec.cache.max_entries, spec.cache.ttl_s)
        cache_key = PredictionCache.key(model, choice.version, features) if cache is not None else None
        result = cache.get(cache_key) if cache is not None else None
        if cache is not None:
            request.state.cache = "hit" if result is not None else "miss"
            telemetry.cache.labels(model, request.state.cache).inc()
        version = choice.version
        if result is None:
            version, result, _ = await dispatch(model, table, choice, features, timeout_ms, priority)
            if cache is not None and version == choice.version:
                cache.put(cache_key, result)
        request.state.model_version = version
        total_ms = (time.monotonic() - started) * 1e3

        if table.shadow is not None and table.shadow.version != version and should_shadow(table, request.state.routing_key):
            mirror.offer(ShadowJob(model, table.shadow.version, version, features, result, total_ms,
                                   spec.timeout_ms / 1000))  # fmt: skip
        if random.random() < spec.inference_log.sample_rate:
            served = snap.manifests.get((model, version), manifest)
            names = feature_names(served.baseline_profile, features.shape[-1] if features.ndim == 2 else 1)
            inference_log.record(Sample(time.time(), request.state.request_id, model, version, who.name, total_ms,
                                        features.reshape(len(features), -1), result.reshape(len(result), -1), names))  # fmt: skip
            logged.remember(model, request.state.request_id, len(features), who.name)
        return version, result, snap.manifests.get((model, version), manifest)

    def timeout(request: Request, parameters: dict[str, Any], spec: ModelSpec) -> float:
        asked = control(request, parameters, "timeout_ms")
        if asked is None:
            return float(spec.timeout_ms)
        try:
            value = float(asked)
        except ValueError:
            raise protocol.MalformedBody(f"X-Fleet-Timeout-Ms {asked!r} is not a number of milliseconds") from None
        if not math.isfinite(value) or value <= 0:
            raise protocol.MalformedBody(f"X-Fleet-Timeout-Ms {asked!r}; expected a positive number of milliseconds")
        return min(value, float(spec.timeout_ms))

    # -- endpoints ------------------------------------------------------------------------
    async def infer_v2(request: Request) -> Response:
        model, requested = request.path_params["model"], request.path_params.get("version")
        data = await read_body(request)
        version, result, manifest = await serve(request, model, requested, data, lambda d, m: protocol.v2_inputs(d, m.inputs))
        rid = str(data.get("id") or request.state.request_id)
        return json_response(protocol.v2_response(model, version, rid, manifest.outputs, result))

    async def predict_v1(request: Request) -> Response:
        model, sep, verb = request.path_params["target"].rpartition(":")
        if not sep or verb != "predict":
            raise NotFound(f"no route {request.url.path}; expected /v1/models/<model>:predict")
        data = await read_body(request)
        _, result, _ = await serve(request, model, None, data, lambda d, m: protocol.v1_instances(d, m.inputs))
        return json_response(protocol.v1_response(result))

    async def feedback(request: Request) -> Response:
        """Labels for earlier (sampled) requests of this tenant; unknown ones are reported."""
        data = await read_body(request)
        model, labels = parse_feedback(data)
        request.state.model = model
        who = tenant(request, view.snapshot)
        if not who.allows(model):
            raise Forbidden(f"tenant {who.name!r} may not use model {model!r}")
        wanted = {(x.request_id, x.row) for x in labels}
        owners = await asyncio.to_thread(logged.tenants, model, wanted)
        accepted = [x for x in labels if owners.get((x.request_id, x.row)) == who.name]
        unknown = [{"request_id": x.request_id, "row": x.row} for x in labels if owners.get((x.request_id, x.row)) != who.name]
        if accepted:
            await asyncio.to_thread(write_feedback, view.store, model, who.name, accepted, settings.gateway_id)
        body = {"model": model, "accepted": len(accepted), "unknown": unknown,
                "note": "labels join requests the inference log sampled, of your tenant, from the last 24 h"}  # fmt: skip
        return json_response(body, 200 if accepted else 404)

    async def model_metadata(request: Request) -> Response:
        model, requested = request.path_params["model"], request.path_params.get("version")
        snap, _, table, choice = choose(request, model, requested, {})
        manifest = snap.manifests[model, choice.version]
        return json_response({
            "name": model,
            "versions": sorted(table.served_versions()),
            "platform": f"bentoml_{manifest.framework}",
            "inputs": [s.model_dump() for s in manifest.inputs],
            "outputs": [s.model_dump() for s in manifest.outputs],
        })  # fmt: skip

    async def model_ready(request: Request) -> Response:
        model, requested = request.path_params["model"], request.path_params.get("version")
        snap, _, _, choice = choose(request, model, requested, {})
        ready = bool(snap.endpoints.get((model, choice.version)))
        return json_response({"name": model, "version": choice.version, "ready": ready}, 200 if ready else 503)

    async def live(_: Request) -> Response:
        return json_response({"live": True})

    async def ready(_: Request) -> Response:
        ok = view.snapshot.loaded_at > 0
        telemetry.stale.set(1 if view.stale else 0)
        return json_response({
            "ready": ok, "routing_state": "stale" if view.stale else "current",
            "store_reachable": view.healthy, "last_refresh_age_s": round(time.time() - view.last_success, 3),
            "store_error": view.last_error or None, "gateway": settings.gateway_id,
        }, 200 if ok else 503)  # fmt: skip

    async def server_metadata(_: Request) -> Response:
        return json_response({"name": "serving-fleet", "version": __version__, "extensions": []})

    async def metrics(_: Request) -> Response:
        telemetry.stale.set(1 if view.stale else 0)
        return Response(telemetry.exposition(), media_type="text/plain; version=0.0.4")

    def stats(model: str, window_s: int) -> dict[str, Any]:
        start, end, versions = telemetry.stats.window(model, window_s)
        return {"model": model, "gateway": settings.gateway_id, "start": start, "end": end,
                "latency_buckets_ms": list(LATENCY_BUCKETS_MS), "prediction_bins": PREDICTION_BINS,
                "versions": versions}  # fmt: skip

    async def fleet_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, FleetError)
        response = json_response({"error": str(exc)}, exc.status)
        if isinstance(exc, OverQuota):
            response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        return response

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return json_response({"error": f"{exc.detail}: {request.method} {request.url.path}"}, exc.status_code)

    app = Starlette(
        routes=[  # inference first: the router tries routes in order
            Route("/v2/models/{model}/infer", infer_v2, methods=["POST"]),
            Route("/v2/models/{model}/versions/{version}/infer", infer_v2, methods=["POST"]),
            Route("/v1/models/{target}", predict_v1, methods=["POST"]),
            Route("/v1/feedback", feedback, methods=["POST"]),
            Route("/v2", server_metadata),
            Route("/v2/health/live", live),
            Route("/v2/health/ready", ready),
            Route("/v2/models/{model}", model_metadata),
            Route("/v2/models/{model}/ready", model_ready),
            Route("/v2/models/{model}/versions/{version}", model_metadata),
            Route("/v2/models/{model}/versions/{version}/ready", model_ready),
            Route("/metrics", metrics),
            *admin_routes(view.store, settings.admin_token, on_change=view.wake, stats=stats, runtime=view.runtime),
        ],
        exception_handlers={FleetError: fleet_error, HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.inference_log = inference_log
    app.state.telemetry = telemetry
    return Headers(app, telemetry)


def _queue_depths(upstreams: Upstreams) -> Iterator[tuple[str, str, str, int]]:
    for (model, version), pool in list(upstreams.pools().items()):
        for priority in PRIORITIES:
            yield model, version, priority, pool.slots.waiting(priority)

