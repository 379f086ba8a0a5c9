"""The gateway's ASGI app: OIP v2 and KServe v1 inference for many tenants.

Every answer carries ``X-Request-Id`` and ``X-Fleet-Model-Version`` (``none`` before a
version was chosen); every error is ``{"error": "..."}`` with the contract's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet import __version__
from fleet.errors import FleetError, Forbidden, NotFound, Unauthorized
from fleet.gateway import protocol
from fleet.gateway.state import FleetView, Snapshot
from fleet.gateway.upstream import Upstreams
from fleet.registry import ModelVersion
from fleet.routing import Choice, choose_version
from fleet.spec import Policies
from fleet.tenants import Tenant

MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_TIMEOUT_MS = 5000
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


class BodyTooLarge(FleetError):
    status = 413


class _Headers:
    """ASGI middleware: a request id for every request, and the two fleet headers on every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        state = scope.setdefault("state", {})
        state["request_id"] = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state.setdefault("model_version", "none")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] += [
                    (b"x-request-id", state["request_id"].encode()),
                    (b"x-fleet-model-version", state["model_version"].encode()),
                ]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_app(view: FleetView, policies: Policies | None = None, *, max_body_bytes: int = MAX_BODY_BYTES) -> ASGIApp:
    upstreams = Upstreams()

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(view.refresh)  # serve nothing until routing state is loaded
        task = asyncio.create_task(view.run())
        yield
        task.cancel()
        await upstreams.close()

    def timeout_ms(model: str, request: Request) -> float:
        limit = policies.models[model].timeout_ms if policies and model in policies.models else DEFAULT_TIMEOUT_MS
        asked = request.headers.get("x-fleet-timeout-ms")
        if asked is not None:
            try:
                return max(1.0, min(float(asked), limit))
            except ValueError:
                raise protocol.MalformedBody(f"X-Fleet-Timeout-Ms {asked!r} is not a number of milliseconds") from None
        return limit

    async def body(request: Request) -> dict[str, Any]:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body_bytes:
            raise BodyTooLarge(f"request body of {declared} bytes is over the limit of {max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise BodyTooLarge(f"request body is over the limit of {max_body_bytes} bytes")
            chunks.append(chunk)
        return protocol.parse_json(b"".join(chunks))

    def tenant(request: Request, snap: Snapshot) -> Tenant:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        found = snap.tenant_for(key.strip()) if scheme.lower() == "bearer" else None
        if found is None:
            raise Unauthorized("missing, unknown or revoked API key; expected 'Authorization: Bearer <key>'")
        return found

    def choose(request: Request, model: str, requested: str | None, parameters: dict[str, Any]) -> tuple[Choice, ModelVersion, tuple[str, ...]]:
        snap = view.snapshot
        who = tenant(request, snap)
        table = snap.routes.get(model)
        if table is None:
            raise NotFound(f"model {model!r} is not served here")
        if not who.allows(model):
            raise Forbidden(f"tenant {who.name!r} may not use model {model!r}")
        key = request.headers.get("x-fleet-routing-key") or str(parameters.get("routing_key") or "") or request.state.request_id
        choice = choose_version(table, who, key, requested)
        request.state.model_version = choice.version
        return choice, snap.manifests[model, choice.version], snap.endpoints.get((model, choice.version), ())

    async def infer_v2(request: Request) -> JSONResponse:
        model, requested = request.path_params["model"], request.path_params.get("version")
        data = await body(request)
        parameters = data.get("parameters") if isinstance(data.get("parameters"), dict) else {}
        choice, manifest, endpoints = choose(request, model, requested, parameters)
        features = protocol.v2_inputs(data, manifest.inputs)
        result = await upstreams.predict(manifest.ref, endpoints, features, timeout_ms(model, request) / 1000)
        rid = str(data.get("id") or request.state.request_id)
        return JSONResponse(protocol.v2_response(model, choice.version, rid, manifest.outputs, result))

    async def predict_v1(request: Request) -> JSONResponse:
        model, sep, verb = request.path_params["target"].rpartition(":")
        if not sep or verb != "predict":
            raise NotFound(f"no route {request.url.path}; expected /v1/models/<model>:predict")
        data = await body(request)
        choice, manifest, endpoints = choose(request, model, None, {})
        features = protocol.v1_instances(data, manifest.inputs)
        result = await upstreams.predict(manifest.ref, endpoints, features, timeout_ms(model, request) / 1000)
        return JSONResponse(protocol.v1_response(result))

    async def model_metadata(request: Request) -> JSONResponse:
        model, requested = request.path_params["model"], request.path_params.get("version")
        choice, manifest, _ = choose(request, model, requested, {})
        table = view.snapshot.routes[model]
        return JSONResponse({
            "name": model,
            "versions": sorted(table.served_versions()),
            "platform": f"bentoml_{manifest.framework}",
            "inputs": [s.model_dump() for s in manifest.inputs],
            "outputs": [s.model_dump() for s in manifest.outputs],
        })  # fmt: skip

    async def model_ready(request: Request) -> JSONResponse:
        model, requested = request.path_params["model"], request.path_params.get("version")
        choice, _, endpoints = choose(request, model, requested, {})
        ready = bool(endpoints)
        return JSONResponse({"name": model, "version": choice.version, "ready": ready}, status_code=200 if ready else 503)

    async def live(_: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    async def ready(_: Request) -> JSONResponse:
        ok = view.snapshot.loaded_at > 0
        return JSONResponse({"ready": ok, "store_reachable": view.healthy}, status_code=200 if ok else 503)

    async def server_metadata(_: Request) -> JSONResponse:
        return JSONResponse({"name": "serving-fleet", "version": __version__, "extensions": []})

    async def fleet_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, FleetError)
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return JSONResponse({"error": f"{exc.detail}: {request.method} {request.url.path}"}, status_code=exc.status_code)

    app = Starlette(
        routes=[
            Route("/v2", server_metadata),
            Route("/v2/health/live", live),
            Route("/v2/health/ready", ready),
            Route("/v2/models/{model}", model_metadata),
            Route("/v2/models/{model}/ready", model_ready),
            Route("/v2/models/{model}/versions/{version}", model_metadata),
            Route("/v2/models/{model}/versions/{version}/ready", model_ready),
            Route("/v2/models/{model}/infer", infer_v2, methods=["POST"]),
            Route("/v2/models/{model}/versions/{version}/infer", infer_v2, methods=["POST"]),
            Route("/v1/models/{target}", predict_v1, methods=["POST"]),
        ],
        exception_handlers={FleetError: fleet_error, HTTPException: http_error},
        lifespan=lifespan,
    )
    return _Headers(app)
