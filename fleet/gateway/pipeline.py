"""The request path as named steps, run in this order for every protocol:

1. ``authenticate``  the API key → a tenant (401), before any byte of the body is read
2. ``entitle``       the model is served and the tenant may use it, else it does not
                     exist (404, the same answer for both); a version named in the path
                     must be one the tenant may use (404 likewise)
3. ``admit``         503 at once when the version it will most likely reach already holds
                     as many of its requests waiting as it may (``Slots.refuse_early``),
                     then the tenant's quota (429); still before the body
4. ``decode``        the body, within its byte budget (413), decoded against the schema of
                     the version it will most likely reach (400 / 413 / 422); large bodies
                     off the event loop (``fleet.gateway.body``)
5. ``choose``        routing controls (400) and the version (``fleet.catalog.routes.table``, pure)
6. ``answer``        prediction cache, then dispatch (``fleet.gateway.dispatch``: slots,
                     retry on stable, blame) (503 / 504 / 502 / a model's 4xx)
7. ``record``        shadow offer, inference log, feedback index (``fleet.gateway.sinks``)

A ``Call`` carries what the steps established; as each fact becomes real it is written to
the request's state (the ASGI scope's, or the gRPC call's), which is what
``fleet.gateway.middleware.close_request`` labels metrics with — so a metric label is never a
name a request merely claimed.

The protocols enter here: ``rest`` (HTTP: JSON and Triton's binary bodies) and
``grpc_server`` (OIP gRPC) each only turn their request into a ``Call`` (headers or gRPC
metadata, the version asked for, the caller's deadline) and their body into a ``Decoded``;
every decision above is made once, in this module.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from fleet.catalog.policies.loader import Policies
from fleet.catalog.policies.models import ModelSpec
from fleet.catalog.registry import ModelVersion, TensorSpec
from fleet.catalog.routes.table import Choice, RouteTable, choose_version, usable_versions
from fleet.catalog.tenants import Tenant
from fleet.errors import FleetError, InvalidInput, NotFound, Unauthorized, VersionUnavailable
from fleet.gateway.body import Decoder
from fleet.gateway.cache import PredictionCache
from fleet.gateway.dispatch import Dispatcher
from fleet.gateway.fairqueue import PRIORITIES
from fleet.gateway.inputs import MalformedBody, conforms
from fleet.gateway.protocol import Decoded
from fleet.gateway.quota import Quotas
from fleet.gateway.sinks import Recorder
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.tensors import TensorExchange
from fleet.gateway.upstream import Exchange
from fleet.gateway.view import FleetView, Snapshot

R = TypeVar("R")
DEFAULT_SPEC = ModelSpec.model_validate(
    {
        "family": "unknown",
        "size_class": "small",
        "params_millions": 1.0,
        "autoscaling": {"max_replicas": 1, "target_qps_per_replica": 1.0, "target_p99_ms": 1000.0},
        "slo": {"p99_ms": 1000.0, "error_rate": 0.01},
    }
)  # a model without a policy: 5 s timeout, 32 in flight per replica, no cache, 10 % logged
MAX_CONTROL = 256  # characters of a routing key or other control value


class DeadlinePassed(FleetError):
    """The caller's own deadline (gRPC's) ran out before a model was asked: nobody's failure
    but the caller's wait, so no version is blamed for it."""

    status = 504


def _shown(name: str) -> str:
    return repr(name if len(name) <= 64 else name[:61] + "...")


@dataclass(slots=True)
class Call:
    """One request as the steps establish it."""

    model: str
    requested: str | None  # a version named in the path
    headers: Mapping[str, str]
    state: dict[str, Any]  # the ASGI scope's state (request id in; tenant, model, version out)
    started: float = field(default_factory=time.monotonic)
    snapshot: Snapshot | None = None
    tenant: Tenant | None = None
    table: RouteTable | None = None
    spec: ModelSpec = DEFAULT_SPEC
    expected: ModelVersion | None = None  # the version whose schema the body is decoded against
    unreadable: str | None = None  # the expected version, when its manifest cannot be read
    routing_key: str = ""
    deadline: float | None = None  # monotonic time the caller stops waiting (a gRPC deadline), if it said

    @property
    def request_id(self) -> str:
        return self.state["request_id"]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model's metadata (OIP ``ModelMetadata``), whichever protocol asks."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


class Pipeline:
    def __init__(
        self,
        view: FleetView,
        policies: Policies | None,
        telemetry: Telemetry,
        quotas: Quotas,
        decoder: Decoder,
        dispatcher: Dispatcher,
        recorder: Recorder,
    ) -> None:
        self.view, self.policies, self.telemetry = view, policies, telemetry
        self.quotas, self.decoder, self.dispatch, self.recorder = quotas, decoder, dispatcher, recorder
        self.caches: dict[str, PredictionCache] = {}

    def spec(self, model: str) -> ModelSpec:
        return self.policies.models.get(model, DEFAULT_SPEC) if self.policies else DEFAULT_SPEC

    # -- 1-3: before the body -------------------------------------------------------------
    def begin(self, call: Call) -> Call:
        """Authenticate and entitle; nothing of the body is read yet."""
        call.state["model"] = "unknown"  # counted from here on, under names that are real only
        self.authenticate(call)
        self.entitle(call)
        return call

    async def admit(self, call: Call) -> Call:
        """An inference call ``begin``-ed: the tenant's quota (429), still before the body.
        A concurrency lease it takes is given back by ``http.close_request``."""
        if call.expected is not None:  # the version it will most likely reach: shed a flood before its body
            pool = self.dispatch.upstreams.pool(call.model, call.expected.version)  # and before its quota
            if pool is not None:
                pool.slots.refuse_early(call.tenant.name, pool.ref)  # type: ignore[union-attr]
        await self.quotas.take(call.tenant, call.state, call.spec.timeout_ms / 1000)  # type: ignore[arg-type]
        return call

    def authenticate(self, call: Call, surface: str = "inference") -> Tenant:
        call.snapshot = snap = self.view.snapshot  # the one snapshot this request uses throughout
        scheme, _, key = call.headers.get("authorization", "").partition(" ")
        found = snap.tenant_for(key.strip()) if scheme.lower() == "bearer" else None
        if found is None:
            self.telemetry.auth_failures.labels(surface).inc()
            raise Unauthorized("missing, unknown, revoked or expired API key; expected 'Authorization: Bearer <key>'")
        call.tenant = found
        call.state["tenant"] = found.name
        return found

    def entitle(self, call: Call) -> None:
        snap, tenant = call.snapshot, call.tenant
        assert snap is not None and tenant is not None
        table = snap.routes.get(call.model)
        if table is None or not tenant.allows(call.model):
            raise NotFound(f"model {_shown(call.model)} is not served here")
        call.table, call.spec = table, self.spec(call.model)
        call.state["model"] = call.model
        if call.requested is not None:
            usable = usable_versions(table, tenant)
            if call.requested not in usable:
                raise NotFound(
                    f"version {_shown(call.requested)} of {call.model} is not served; "
                    f"versions you may use: {', '.join(sorted(usable)) or 'none'}"
                )
            expected = call.requested
        else:
            pin = table.pins.get(tenant.name)
            expected = pin if pin and tenant.allows(call.model, pin) else table.stable
        if expected is not None:
            call.expected = snap.manifests.get((call.model, expected))
            call.unreadable = expected if call.expected is None else None

    # -- 4: the body ------------------------------------------------------------------------
    def expected(self, call: Call) -> ModelVersion:
        """The manifest whose schema the body is decoded against (``entitle`` found it)."""
        if call.expected is None and call.unreadable is not None:
            raise _unreadable(call.model, call.unreadable)
        if call.expected is None:
            raise NotFound(f"model {call.model} has no stable version to serve")
        return call.expected

    async def decode(self, call: Call, body: bytes, decode: Callable[..., Decoded]) -> Decoded:
        inputs = self.expected(call).inputs
        return await self.decoder.run(call.tenant.name, decode, body, inputs, call.spec.max_rows)  # type: ignore[union-attr]

    # -- 5: controls and the version --------------------------------------------------------
    def control(self, call: Call, parameters: dict[str, Any], name: str) -> str | None:
        value = call.headers.get(f"x-fleet-{name.replace('_', '-')}")
        if value is None and parameters.get(name) is not None:
            raw = parameters[name]
            if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
                raise MalformedBody(f"parameters.{name} is a JSON {type(raw).__name__}; expected a string or number")
            value = str(raw)
        if value is not None and len(value) > MAX_CONTROL:
            raise MalformedBody(f"{name} is {len(value)} characters long; expected at most {MAX_CONTROL}")
        return value

    def choose(self, call: Call, decoded: Decoded) -> tuple[Choice, str, float, ModelVersion]:
        """(the version, priority, timeout in ms, the version's manifest) for this request."""
        key = self.control(call, decoded.parameters, "routing_key") or call.request_id
        priority = self.control(call, decoded.parameters, "priority") or "interactive"
        if priority not in PRIORITIES:
            raise MalformedBody(f"priority {priority!r} is not known; expected one of {', '.join(PRIORITIES)}")
        timeout_ms = self.timeout(call, decoded.parameters)
        call.routing_key = key
        choice = choose_version(call.table, call.tenant, key, call.requested)  # type: ignore[arg-type]
        call.state["model_version"] = choice.version
        manifest = call.snapshot.manifests.get((call.model, choice.version))  # type: ignore[union-attr]
        if manifest is None:
            raise _unreadable(call.model, choice.version)
        if manifest is not call.expected and not conforms(decoded.features, manifest.inputs):
            spec = manifest.inputs[0]
            raise InvalidInput(
                f"{call.model}:{choice.version} takes {spec.name}: {spec.datatype} {spec.shape}; "
                f"got {decoded.features.dtype} {list(decoded.features.shape)}"
            )
        return choice, priority, timeout_ms, manifest

    def timeout(self, call: Call, parameters: dict[str, Any]) -> float:
        """Milliseconds the model may take: what the request asks (``timeout_ms``), capped by
        the time left before the caller's deadline, capped by the model's policy. A timeout
        asked (or a deadline leaving less) below the policy's ``min_timeout_ms`` is refused:
        400. One shorter than the policy's ``timeout_ms`` is the caller's: its running out is
        not the version's failure (``fleet.gateway.dispatch``)."""
        spec = call.spec
        limit, least = float(spec.timeout_ms), spec.min_timeout_ms  # type: ignore[union-attr]
        if call.deadline is not None:
            left = (call.deadline - time.monotonic()) * 1e3
            if left <= 0:
                raise DeadlinePassed(
                    f"the call's deadline passed {-left:.0f} ms before {call.model} was asked; "
                    "expected a deadline that leaves the model time to answer"
                )
            if left < least:
                raise MalformedBody(
                    f"the call's deadline leaves {left:.0f} ms, below {call.model}'s min_timeout_ms "
                    f"{least}; expected a deadline at least {least} ms away"
                )
            limit = min(limit, left)
        asked = self.control(call, parameters, "timeout_ms")
        if asked is None:
            return limit
        try:
            value = float(asked)
        except ValueError:
            raise MalformedBody(f"X-Fleet-Timeout-Ms {asked[:40]!r} is not a number of milliseconds") from None
        if not math.isfinite(value) or value <= 0:
            raise MalformedBody(f"X-Fleet-Timeout-Ms {asked[:40]!r}; expected a positive number of milliseconds")
        if value < least:
            raise MalformedBody(
                f"X-Fleet-Timeout-Ms {asked[:40]!r} is below {call.model}'s min_timeout_ms {least}; "
                f"expected at least {least} ms"
            )
        return min(value, limit)

    # -- what a tenant may learn of a model: metadata and readiness ---------------------------
    def metadata(self, call: Call) -> ModelInfo:
        """A ``begin``-ed call's model as the tenant may see it, in every protocol: only the
        versions it may use, the schema of the one its requests are decoded against."""
        manifest = self.expected(call)
        return ModelInfo(
            call.model,
            sorted(usable_versions(call.table, call.tenant)),  # type: ignore[arg-type]
            f"bentoml_{manifest.framework}",
            manifest.inputs,
            manifest.outputs,
        )

    def readiness(self, call: Call) -> tuple[str, bool]:
        """(the version this tenant's request would reach now, whether it has a replica)."""
        choice = choose_version(call.table, call.tenant, call.request_id, call.requested)  # type: ignore[arg-type]
        return choice.version, bool(call.snapshot.endpoints.get((call.model, choice.version)))  # type: ignore[union-attr]

    # -- 6-7: the answer and what is kept of it --------------------------------------------
    async def answer(self, call: Call, decoded: Decoded) -> tuple[str, np.ndarray, ModelVersion]:
        """(the version that answered, its answer, that version's manifest)."""
        choice, priority, timeout_ms, manifest = self.choose(call, decoded)
        model, features, spec = call.model, decoded.features, call.spec
        cache = self._cache(model, spec)
        key = b""
        if cache is not None:
            key = PredictionCache.key(choice.version, features, None if spec.cache.shared else call.tenant.name)  # type: ignore[union-attr]
        result = cache.get(key) if cache is not None else None
        if cache is not None:
            call.state["cache"] = "hit" if result is not None else "miss"
            self.telemetry.cache.labels(model, call.state["cache"]).inc()
        version, upstream_s = choice.version, 0.0
        if result is None:
            exchange = TensorExchange(features, self.dispatch.upstreams.parse)
            try:
                version, result = await self.ask(call, choice, exchange, timeout_ms, priority)
            except Exception as exc:
                self.recorder.failed(
                    model=model,
                    version=choice.version,
                    tenant=call.tenant.name,  # type: ignore[union-attr]
                    request_id=call.request_id,
                    spec=spec,
                    manifest=manifest,
                    features=features,
                    status=getattr(exc, "status", 500),
                    total_ms=(time.monotonic() - call.started) * 1e3,
                )
                raise
            upstream_s = exchange.took
            if cache is not None and version == choice.version:
                cache.put(key, result)
        call.state["model_version"] = version
        served = call.snapshot.manifests.get((model, version), manifest)  # type: ignore[union-attr]
        self.recorder.served(
            model=model,
            version=version,
            tenant=call.tenant.name,
            request_id=call.request_id,  # type: ignore[union-attr]
            routing_key=call.routing_key,
            table=call.table,
            spec=spec,
            manifest=served,  # type: ignore[arg-type]
            features=features,
            result=result,
            total_ms=(time.monotonic() - call.started) * 1e3,
            upstream_s=upstream_s,
        )
        return version, result, served

    async def ask(
        self,
        call: Call,
        choice: Choice,
        exchange: Exchange[R],
        timeout_ms: float,
        priority: str,
        first_ms: float | None = None,
    ) -> tuple[str, R]:
        """``call``'s request through the dispatch (``fleet.gateway.dispatch``), for every
        protocol: its model, route table and tenant (whose turn it is, and its weight), the
        model's own timeout beside the request's; ``first_ms``: a generation's first-token deadline."""
        tenant = call.tenant
        return await self.dispatch(
            call.model,
            call.table,  # type: ignore[arg-type]
            choice,
            exchange,
            timeout_ms,
            priority,
            tenant.name,  # type: ignore[union-attr]
            tenant.weight or 1.0,  # type: ignore[union-attr]
            first_ms,
            float(call.spec.timeout_ms),  # type: ignore[union-attr]
        )

    def _cache(self, model: str, spec: ModelSpec) -> PredictionCache | None:
        if not spec.cache.enabled:
            return None
        cache = self.caches.get(model)
        if cache is None:
            cache = self.caches[model] = PredictionCache(int(spec.cache.max_mib * 1024 * 1024), spec.cache.ttl_s)
        return cache


def _unreadable(model: str, version: str) -> VersionUnavailable:
    return VersionUnavailable(
        f"{model}:{version} cannot be served now: the gateway cannot read its manifest "
        "(the operator is told; try again later)"
    )
