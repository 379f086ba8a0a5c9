"""The admin API: versions, routes, pins, tenants, rollback and stats, behind the admin token.

The same operations as the CLI through the same code (``Registry``, ``Router``,
``Tenants``, ``fleet.catalog.routes.rollback``); store work runs in a thread so serving never waits on
it. After every change this gateway re-reads routing state at once and pushes the change
to every other live gateway (``fleet.catalog.gateway_directory.notify``).

Input is as hostile here as anywhere: a body is read only after the token checked out and
only up to ``max_body_bytes`` (413); bodies are strict pydantic models (``"false"`` is not
a boolean, ``"50"`` not a weight, unknown fields are refused) and path parameters are
checked as names and versions before anything touches the store. Failed authentications
are counted (``fleet_auth_failures_total{surface="admin"}``). ``/admin/refresh``,
``/admin/stats`` and ``/admin/top`` (what ``fleet top`` reads, every model at once) also take
a scoped credential (``fleet.catalog.gateway_directory.credential``), which the control plane
sends instead of the token itself.

Without ``FLEET_ADMIN_TOKEN`` the admin API is off: every call answers 403 saying so.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleet.catalog import gateway_directory
from fleet.catalog.registry import Registry
from fleet.catalog.routes.rollback import rollback
from fleet.catalog.routes.store import Router
from fleet.catalog.tenants import MAX_GRACE, Tenants, make_quota, parse_entitlements, public, span
from fleet.errors import Forbidden, InvalidInput, Unauthorized
from fleet.gateway import body as bodies
from fleet.gateway.inputs import MalformedBody
from fleet.gateway.protocol import parse_json
from fleet.gateway.stats import HORIZON_S
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.top import MAX_TENANTS as TOP_TENANTS
from fleet.gateway.top import MAX_WINDOW_S as TOP_WINDOW_S
from fleet.names import check_name, check_version
from fleet.runtime.base import Runtime
from fleet.types import ObjectStore
from fleet.validation import checked, explain

Handler = Callable[[Request], Awaitable[Response]]
ADMIN_BODY_BYTES = 64 * 1024
ADMIN_PREFIX = "/admin/"  # every route below; fleet.gateway.listeners keeps them off the public port
_REASON = Field(min_length=1, max_length=2000, pattern=r"\S")  # a reason, not blanks
_VERSION = Field(None, min_length=1, max_length=128)


def json_response(value: Any, status: int = 200) -> Response:  # noqa: ANN401 - any JSON value
    return Response(orjson.dumps(value, default=_default), status_code=status, media_type="application/json")


def _default(value: Any) -> Any:  # noqa: ANN401
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise TypeError(type(value).__name__)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class RouteChange(_Body):
    stable: str | None = _VERSION
    canary: str | None = _VERSION
    weight: float | None = Field(None, ge=0, le=100)
    shadow: str | None = _VERSION
    shadow_percent: float | None = Field(None, ge=0, le=100)
    clear_canary: bool = False
    clear_shadow: bool = False
    reason: str = _REASON


class PinChange(_Body):
    version: str = Field(min_length=1, max_length=128)
    reason: str = _REASON


class RollbackRequest(_Body):
    reason: str = _REASON
    to_version: str | None = _VERSION


class NewTenant(_Body):
    name: str = Field(min_length=1, max_length=63)
    models: list[str] = Field(min_length=1, max_length=1000)
    rps: float | None = Field(None, gt=0, allow_inf_nan=False)
    burst: int | None = Field(None, ge=1, le=10**9)
    concurrency: int | None = Field(None, ge=1, le=10**6)
    tokens_per_minute: int | None = Field(None, ge=1, le=10**12)
    weight: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False)


class Revoke(_Body):
    key_id: str | None = Field(None, min_length=1, max_length=64)


class NewKey(_Body):
    """No fields: the body may be empty or ``{}``; anything else is refused like elsewhere."""


_MAX_GRACE_S = int(MAX_GRACE.total_seconds())


class Rotate(_Body):
    key_id: str | None = Field(None, min_length=1, max_length=64)
    # bounded here, not only in Tenants.rotate: a huge number would overflow timedelta first
    grace_s: checked(
        float,
        f"seconds from 0 (stop the old key at once) to {_MAX_GRACE_S} ({span(MAX_GRACE)})",
        lambda v: 0 <= v <= _MAX_GRACE_S,
    ) = Field(allow_inf_nan=False)


_PATH_CHECKS = {
    "model": lambda v: check_name("model", v),
    "tenant": lambda v: check_name("tenant", v),
    "version": check_version,
}


def admin_routes(
    store: ObjectStore,
    token: str | None,
    *,
    on_change: Callable[[], None],
    stats: Callable[[str, int], dict],
    telemetry: Telemetry,
    top: Callable[[int, int, str], Awaitable[dict]] | None = None,
    gateway_id: str = "",
    runtime: Runtime | None = None,
    max_body_bytes: int = ADMIN_BODY_BYTES,
) -> list[Route]:
    registry = Registry(store)
    router, tenants = Router(store, registry), Tenants(store)

    def guarded(handler: Handler, scoped: str | None = None) -> Handler:
        async def run(request: Request) -> Response:
            if not token:
                raise Forbidden("the admin API is off; start the gateway with FLEET_ADMIN_TOKEN set")
            given = request.headers.get("authorization", "")
            scheme, _, value = given.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())
            if not ok and scoped is not None:
                ok = gateway_directory.verify(given, token, scoped, gateway_id)
            if not ok:
                telemetry.auth_failures.labels("admin").inc()
                raise Unauthorized(
                    "admin API: missing or wrong admin token; expected 'Authorization: Bearer <FLEET_ADMIN_TOKEN>'"
                )
            for name, value in request.path_params.items():
                _PATH_CHECKS[name](value)
            return await handler(request)

        return run

    async def body(request: Request, model: type[_Body]) -> Any:  # noqa: ANN401 - an instance of model
        raw = await bodies.read(request, max_body_bytes)
        data = parse_json(raw) if raw.strip() else {}
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise InvalidInput("; ".join(explain(exc, model))) from None

    def and_tell(work: Callable[[], Any]) -> Any:  # noqa: ANN401
        """``work``, then the other gateways told in the same thread (the bus, else a push)."""
        result = work()
        gateway_directory.tell(store, token)
        return result

    async def changed(work: Callable[[], Any], status: int = 200) -> Response:
        result = await asyncio.to_thread(and_tell, work)
        on_change()
        return json_response(result, status)

    async def list_models(_: Request) -> Response:
        return json_response(await asyncio.to_thread(registry.list))

    async def show_version(request: Request) -> Response:
        p = request.path_params
        return json_response(await asyncio.to_thread(registry.get, p["model"], p["version"]))

    async def show_route(request: Request) -> Response:
        return json_response(await asyncio.to_thread(router.get, request.path_params["model"]))

    async def set_route(request: Request) -> Response:
        change, model = await body(request, RouteChange), request.path_params["model"]
        fields = change.model_dump(exclude={"reason"}, exclude_unset=True)
        if not fields:
            raise InvalidInput("nothing to change; expected stable, canary, weight, shadow, shadow_percent ...")
        return await changed(lambda: router.set(model, **fields, why=change.reason))

    async def pin(request: Request) -> Response:
        change, p = await body(request, PinChange), request.path_params
        return await changed(lambda: router.pin(p["model"], p["tenant"], change.version, why=change.reason))

    async def unpin(request: Request) -> Response:
        p, why = request.path_params, request.query_params.get("reason", "")
        if not why.strip() or len(why) > 2000:
            raise InvalidInput("a change needs a reason; expected ?reason=... (at most 2000 characters)")
        return await changed(lambda: router.unpin(p["model"], p["tenant"], why=why))

    async def do_rollback(request: Request) -> Response:
        change, model = await body(request, RollbackRequest), request.path_params["model"]
        result, pushed = await asyncio.to_thread(
            lambda: (
                rollback(router, model, change.to_version, why=change.reason, runtime=runtime, start_missing=False),
                gateway_directory.tell(store, token),
            )
        )
        on_change()
        return json_response({**result.__dict__, "gateways_notified": pushed or {}, "change_bus": pushed is None})

    async def history(request: Request) -> Response:
        return json_response(await asyncio.to_thread(router.history, request.path_params["model"]))

    async def list_tenants(_: Request) -> Response:
        found = await asyncio.to_thread(tenants.list)
        return json_response([public(t) for t in found])

    async def create_tenant(request: Request) -> Response:
        new = await body(request, NewTenant)
        quota = None
        if new.rps is not None:
            quota = make_quota(new.rps, new.burst or max(1, int(new.rps)), new.concurrency, new.tokens_per_minute)
        elif new.burst is not None or new.concurrency is not None or new.tokens_per_minute is not None:
            raise InvalidInput(
                "burst, concurrency or tokens_per_minute without rps; expected rps (requests/s) with "
                "an optional burst, concurrency and tokens_per_minute"
            )
        tenant, key = await asyncio.to_thread(
            and_tell,
            functools.partial(tenants.create, new.name, parse_entitlements(new.models), quota, weight=new.weight),
        )
        on_change()
        return json_response({"tenant": tenant.name, "key_id": tenant.keys[0].id, "api_key": key}, status=201)

    async def revoke(request: Request) -> Response:
        change, name = await body(request, Revoke), request.path_params["tenant"]
        return await changed(lambda: public(tenants.revoke(name, change.key_id)))

    async def add_key(request: Request) -> Response:
        await body(request, NewKey)
        name = request.path_params["tenant"]

        def work() -> dict[str, Any]:
            tenant, key = tenants.add_key(name)
            return {"tenant": public(tenant), "key_id": tenant.keys[-1].id, "api_key": key}

        return await changed(work, status=201)

    async def rotate(request: Request) -> Response:
        change, name = await body(request, Rotate), request.path_params["tenant"]

        def work() -> dict[str, Any]:
            tenant, key = tenants.rotate(name, change.key_id, grace=timedelta(seconds=change.grace_s))
            new_id = tenant.keys[-1].id
            retired = [{"id": k.id, "stops_at": k.ends_at} for k in tenant.replaced(new_id)]
            return {"tenant": public(tenant), "key_id": new_id, "api_key": key, "retired": retired}

        return await changed(work)

    async def refresh(_: Request) -> Response:
        on_change()
        return json_response({"refreshing": True})

    async def window_stats(request: Request) -> Response:
        raw = request.query_params.get("window_s", "60")
        if not raw.isdigit() or not 1 <= int(raw) <= HORIZON_S:
            raise MalformedBody(f"window_s {raw[:20]!r} is not a whole number of seconds from 1 to {HORIZON_S}")
        return json_response(stats(request.path_params["model"], int(raw)))

    async def fleet_top(request: Request) -> Response:
        q = request.query_params
        window, n = q.get("window_s", "10"), q.get("tenants", "10")
        if not (window.isascii() and window.isdigit() and len(window) <= 3) or not 1 <= int(window) <= TOP_WINDOW_S:
            raise MalformedBody(f"window_s {window[:20]!r} is not a whole number of seconds from 1 to {TOP_WINDOW_S}")
        if not (n.isascii() and n.isdigit() and len(n) <= 3) or not 0 <= int(n) <= TOP_TENANTS:
            raise MalformedBody(f"tenants {n[:20]!r} is not a whole number from 0 to {TOP_TENANTS}")
        match = q.get("match", "")  # only models whose name holds it
        if len(match) > 128:
            raise MalformedBody("match is longer than a model name can be (128 characters)")
        return json_response(await top(int(window), int(n), match))  # type: ignore[misc]

    table: list[tuple[str, Handler, list[str], str | None]] = [
        ("/admin/models", list_models, ["GET"], None),
        ("/admin/models/{model}/versions/{version}", show_version, ["GET"], None),
        ("/admin/routes/{model}", show_route, ["GET"], None),
        ("/admin/routes/{model}", set_route, ["POST"], None),
        ("/admin/routes/{model}/pins/{tenant}", pin, ["PUT"], None),
        ("/admin/routes/{model}/pins/{tenant}", unpin, ["DELETE"], None),
        ("/admin/routes/{model}/rollback", do_rollback, ["POST"], None),
        ("/admin/routes/{model}/history", history, ["GET"], None),
        ("/admin/tenants", list_tenants, ["GET"], None),
        ("/admin/tenants", create_tenant, ["POST"], None),
        ("/admin/tenants/{tenant}/revoke", revoke, ["POST"], None),
        ("/admin/tenants/{tenant}/keys", add_key, ["POST"], None),
        ("/admin/tenants/{tenant}/rotate", rotate, ["POST"], None),
        ("/admin/refresh", refresh, ["POST"], "refresh"),
        ("/admin/stats/{model}", window_stats, ["GET"], "stats"),
        *([("/admin/top", fleet_top, ["GET"], "stats")] if top is not None else []),  # fleet top: every model at once
    ]
    return [Route(path, guarded(handler, scoped), methods=methods) for path, handler, methods, scoped in table]
