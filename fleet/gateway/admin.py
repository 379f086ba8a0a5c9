"""The admin API: versions, routes, pins, tenants, rollback and stats, behind the admin token.

The same operations as the CLI through the same code (``Registry``, ``Router``,
``Tenants``, ``fleet.rollback``); store work runs in a thread so serving never waits on
it. After every change this gateway re-reads routing state at once and pushes the change
to every other live gateway.

Without ``FLEET_ADMIN_TOKEN`` the admin API is off: every call answers 403 saying so.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleet import gateways
from fleet.errors import Forbidden, InvalidInput, Unauthorized
from fleet.gateway.protocol import MalformedBody, parse_json
from fleet.registry import Registry
from fleet.rollback import rollback
from fleet.router import Router
from fleet.tenants import Quota, Tenants, parse_entitlements
from fleet.types import ObjectStore, Runtime

Handler = Callable[[Request], Awaitable[Response]]


def json_response(value: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(value, default=_default), status_code=status, media_type="application/json")


def _default(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise TypeError(type(value).__name__)


def admin_routes(
    store: ObjectStore,
    token: str | None,
    *,
    on_change: Callable[[], None],
    stats: Callable[[str, int], dict],
    runtime: Runtime | None = None,
) -> list[Route]:
    registry, router, tenants = Registry(store), Router(store), Tenants(store)

    def guarded(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            if not token:
                raise Forbidden("the admin API is off; start the gateway with FLEET_ADMIN_TOKEN set")
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
                raise Unauthorized("admin API: missing or wrong admin token; expected 'Authorization: Bearer <FLEET_ADMIN_TOKEN>'")
            return await handler(request)

        return run

    async def body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return parse_json(raw) if raw else {}

    def reason(data: dict[str, Any]) -> str:
        why = data.get("reason")
        if not isinstance(why, str) or not why.strip():
            raise InvalidInput('a change needs a reason; expected {"reason": "..."} in the body')
        return why

    async def changed(work: Callable[[], Any]) -> Response:
        result = await asyncio.to_thread(work)
        on_change()
        await asyncio.to_thread(gateways.notify, store, token)
        return json_response(result)

    async def list_models(_: Request) -> Response:
        return json_response(await asyncio.to_thread(registry.list))

    async def show_version(request: Request) -> Response:
        p = request.path_params
        return json_response(await asyncio.to_thread(registry.get, p["model"], p["version"]))

    async def show_route(request: Request) -> Response:
        return json_response(await asyncio.to_thread(router.get, request.path_params["model"]))

    async def set_route(request: Request) -> Response:
        data, model = await body(request), request.path_params["model"]
        allowed = {"stable", "canary", "weight", "shadow", "shadow_percent", "clear_canary", "clear_shadow", "reason"}
        unknown = set(data) - allowed
        if unknown:
            raise InvalidInput(f"unknown field(s) {sorted(unknown)}; expected some of {sorted(allowed)}")
        fields = {k: data[k] for k in allowed - {"reason"} if k in data}
        if not fields:
            raise InvalidInput("nothing to change; expected stable, canary, weight, shadow, shadow_percent ...")
        why = reason(data)
        return await changed(lambda: router.set(model, **fields, why=why))

    async def pin(request: Request) -> Response:
        data, p = await body(request), request.path_params
        version = data.get("version")
        if not isinstance(version, str):
            raise InvalidInput('a pin needs {"version": "<version>", "reason": "..."}')
        why = reason(data)
        return await changed(lambda: router.pin(p["model"], p["tenant"], version, why=why))

    async def unpin(request: Request) -> Response:
        p, why = request.path_params, reason(dict(request.query_params))
        return await changed(lambda: router.unpin(p["model"], p["tenant"], why=why))

    async def do_rollback(request: Request) -> Response:
        data, model = await body(request), request.path_params["model"]
        why = reason(data)
        result = await asyncio.to_thread(rollback, router, model, data.get("to_version"), why=why, runtime=runtime,
                                         start_missing=False)  # fmt: skip
        on_change()
        pushed = await asyncio.to_thread(gateways.notify, store, token)
        return json_response({**result.__dict__, "gateways_notified": pushed})

    async def history(request: Request) -> Response:
        return json_response(await asyncio.to_thread(router.history, request.path_params["model"]))

    async def list_tenants(_: Request) -> Response:
        found = await asyncio.to_thread(tenants.list)
        return json_response([t.model_dump(mode="json", exclude={"keys"}) | {"keys": [
            {"id": k.id, "created_at": k.created_at, "revoked_at": k.revoked_at} for k in t.keys]} for t in found])  # fmt: skip

    async def create_tenant(request: Request) -> Response:
        data = await body(request)
        name, models = data.get("name"), data.get("models")
        if not isinstance(name, str) or not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise InvalidInput('expected {"name": "<tenant>", "models": ["model" or "model:1.0.0,1.1.0", ...], "rps": n, "burst": n}')
        quota = None
        if data.get("rps") is not None:
            try:
                quota = Quota(rps=data["rps"], burst=data.get("burst") or max(1, int(data["rps"])))
            except (ValueError, TypeError) as exc:
                raise InvalidInput(f"quota: {exc}; expected rps > 0 and burst >= 1") from None
        tenant, key = await asyncio.to_thread(tenants.create, name, parse_entitlements(models), quota)
        on_change()
        return json_response({"tenant": tenant.name, "key_id": tenant.keys[0].id, "api_key": key}, status=201)

    async def revoke(request: Request) -> Response:
        data, name = await body(request), request.path_params["tenant"]
        return await changed(lambda: tenants.revoke(name, data.get("key_id")).model_dump(mode="json", exclude={"keys"}))

    async def refresh(_: Request) -> Response:
        on_change()
        return json_response({"refreshing": True})

    async def window_stats(request: Request) -> Response:
        raw = request.query_params.get("window_s", "60")
        try:
            window_s = int(raw)
        except ValueError:
            raise MalformedBody(f"window_s {raw!r} is not a whole number of seconds") from None
        return json_response(stats(request.path_params["model"], window_s))

    table: list[tuple[str, Handler, list[str]]] = [
        ("/admin/models", list_models, ["GET"]),
        ("/admin/models/{model}/versions/{version}", show_version, ["GET"]),
        ("/admin/routes/{model}", show_route, ["GET"]),
        ("/admin/routes/{model}", set_route, ["POST"]),
        ("/admin/routes/{model}/pins/{tenant}", pin, ["PUT"]),
        ("/admin/routes/{model}/pins/{tenant}", unpin, ["DELETE"]),
        ("/admin/routes/{model}/rollback", do_rollback, ["POST"]),
        ("/admin/routes/{model}/history", history, ["GET"]),
        ("/admin/tenants", list_tenants, ["GET"]),
        ("/admin/tenants", create_tenant, ["POST"]),
        ("/admin/tenants/{tenant}/revoke", revoke, ["POST"]),
        ("/admin/refresh", refresh, ["POST"]),
        ("/admin/stats/{model}", window_stats, ["GET"]),
    ]
    return [Route(path, guarded(handler), methods=methods) for path, handler, methods in table]

