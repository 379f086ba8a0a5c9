"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``): ServerLive,
ServerReady, ServerMetadata, ModelReady, ModelMetadata and ModelInfer, on their own port.

The messages and their decoding are ``fleet.gateway.grpc_codec``'s. The server is
``grpc.aio`` on the gateway's own event loop (uvloop), started and stopped by the app's
lifespan: a gRPC call runs the same ``Pipeline`` steps, with the same quotas, caches,
upstream pools, shadow queue and inference log, as an HTTP one.

A call enters the pipeline as a ``Call`` whose headers are the call's metadata
(``authorization: Bearer <key>``, ``x-fleet-routing-key``, ``x-fleet-priority``,
``x-fleet-timeout-ms``, ``x-request-id``) and whose deadline is the gRPC deadline. A
ModelInferRequest arrives as bytes (its size capped by grpc itself at the policies'
``gateway.max_body_mib``: RESOURCE_EXHAUSTED) and is decoded like an HTTP body: by a pure
function (``grpc_codec.decode_infer``), inline when small, in the decode worker when large,
its bytes counted against the bodies in flight. Errors are the pipeline's, as gRPC status
codes (``grpc_codec.grpc_code``); each call is counted and logged by
``middleware.close_request`` like an HTTP one, under the HTTP status its code stands for.

Unlike HTTP, grpc has read the whole message before the gateway sees it, so the key and the
quota are checked after the bytes arrived, but before any of them is parsed: the model and
version are read from the message's leading fields alone (``grpc_codec.leading_target``).
What unauthenticated calls can make grpc hold is bounded by the message size and
``MAX_CONCURRENT_CALLS``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from fleet.errors import ConfigError, FleetError
from fleet.gateway.body import BodyBudget
from fleet.gateway.grpc_codec import (
    SERVICE,
    decode_infer,
    grpc_code,
    infer_response,
    leading_target,
    parse_infer,
    pb,
    tensor_metadata,
)
from fleet.gateway.middleware import close_request, internal_error, open_request, retry_after
from fleet.gateway.pipeline import Call, Pipeline
from fleet.gateway.protocol import check_outputs

T = TypeVar("T")
# The gateway's own timeout ends this long before the call's deadline, so that the client
# gets the gateway's DEADLINE_EXCEEDED, which says what timed out, rather than racing its own
# cancellation; a cancellation from then on is counted as the deadline's (504), not as a
# client that went away (499).
DEADLINE_MARGIN_S = 0.005
# Calls grpc runs at once (it reads each message whole before the handler runs, so this and
# the message size bound what unauthenticated calls can make it hold), and streams per
# connection: past them grpc refuses with RESOURCE_EXHAUSTED.
MAX_CONCURRENT_CALLS = 256
MAX_STREAMS_PER_CONNECTION = 64


# -- the service ------------------------------------------------------------------------------
class InferenceService:
    """The RPCs. Each model RPC only builds a ``Call`` and runs the pipeline's steps in
    ``_serve``, which answers errors with status codes and counts the call like HTTP's."""

    def __init__(
        self,
        pipeline: Pipeline,
        ready: Callable[[], bool],
        server_info: dict[str, Any],
        bodies_in_flight: BodyBudget,
        *,
        access: bool = False,
    ) -> None:
        self.pipeline, self.ready, self.info, self.in_flight, self.access = (
            pipeline,
            ready,
            server_info,
            bodies_in_flight,
            access,
        )

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's method handlers; ModelInfer takes its message as bytes, so that a
        large one is parsed and decoded in the decode worker rather than on the loop."""

        def unary(behavior: Callable, request: Any, response: Any) -> grpc.RpcMethodHandler:  # noqa: ANN401
            return grpc.unary_unary_rpc_method_handler(
                behavior,
                request_deserializer=request and request.FromString,
                response_serializer=response.SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "ServerLive": unary(self.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
                "ServerReady": unary(self.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
                "ServerMetadata": unary(self.server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse),
                "ModelReady": unary(self.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
                "ModelMetadata": unary(self.model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
                "ModelInfer": unary(self.model_infer, None, pb.ModelInferResponse),
            },
        )

    async def server_live(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
        self._seen(context, "ServerLive")
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
        self._seen(context, "ServerReady")
        return pb.ServerReadyResponse(ready=self.ready())

    async def server_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
        self._seen(context, "ServerMetadata")
        return pb.ServerMetadataResponse(**self.info)

    def _seen(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """A call about the server, not a model: in the access log like HTTP's health routes,
        not in the request metrics (neither is HTTP's)."""
        if self.access:
            state: dict[str, Any] = {}
            open_request(state, _headers(context).get("x-request-id", "").encode())
            close_request(self.pipeline.telemetry, state, 200, time.monotonic(), self._access(context, method))

    async def model_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
        async def ready(call: Call) -> Any:  # noqa: ANN401
            self.pipeline.begin(call)
            return pb.ModelReadyResponse(ready=self.pipeline.readiness(call)[1])

        return await self._serve(context, "ModelReady", lambda: (request.name, request.version), ready)

    async def model_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
        async def metadata(call: Call) -> Any:  # noqa: ANN401
            info = self.pipeline.metadata(self.pipeline.begin(call))
            return pb.ModelMetadataResponse(
                name=info.name,
                versions=info.versions,
                platform=info.platform,
                inputs=[tensor_metadata(s) for s in info.inputs],
                outputs=[tensor_metadata(s) for s in info.outputs],
            )

        return await self._serve(context, "ModelMetadata", lambda: (request.name, request.version), metadata)

    async def model_infer(self, body: bytes, context: grpc.aio.ServicerContext) -> Any:  # noqa: ANN401
        async def infer(call: Call) -> Any:  # noqa: ANN401
            if not call.model:  # names not at the front: parse the message, but for a known caller only
                self.pipeline.authenticate(call)
                request = parse_infer(body)
                call.model, call.requested = request.model_name, request.model_version or None
            await self.pipeline.admit(self.pipeline.begin(call))
            with self.in_flight.holding(call.tenant.name) as held:  # type: ignore[union-attr]
                held.add(len(body))
                decoded = await self.pipeline.decode(call, body, decode_infer)
            check_outputs(decoded.outputs, self.pipeline.expected(call).outputs)  # before a model is asked
            version, result, manifest = await self.pipeline.answer(call, decoded)
            return infer_response(call.model, version, decoded.id or call.request_id, manifest.outputs[0], result)

        def target() -> tuple[str, str]:
            # Only the leading fields: the key is checked before the message is parsed (in
            # infer, for a message whose names do not come first).
            return leading_target(body) or ("", "")

        return await self._serve(context, "ModelInfer", target, infer)

    async def _serve(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        target: Callable[[], tuple[str, str]],
        step: Callable[[Call], Awaitable[T]],
    ) -> T:
        """Run ``step`` on the call to ``target()`` = (model, version or ""); its error as a
        status code with the FleetError's message; the call counted and logged either way."""
        started = time.monotonic()
        headers = _headers(context)
        state: dict[str, Any] = {}
        open_request(state, headers.get("x-request-id", "").encode())
        remaining = context.time_remaining()
        deadline = started + remaining - DEADLINE_MARGIN_S if remaining is not None else None
        status = 500
        try:
            model, version = target()
            answer = await step(
                Call(model=model, requested=version or None, headers=headers, state=state, deadline=deadline)
            )
            status = 200
            context.set_trailing_metadata(_trailers(state))
            return answer
        except FleetError as exc:
            status = exc.status
            wait = retry_after(self.pipeline.telemetry, exc)
            message = str(exc) if wait is None or "retry after" in str(exc) else f"{exc}; retry after {wait} s"
            extra = (("retry-after", str(wait)),) if wait is not None else ()
            await context.abort(grpc_code(status), message, _trailers(state) + extra)
        except asyncio.CancelledError:  # the client went away, or its deadline passed first
            status = 504 if deadline is not None and time.monotonic() >= deadline else 499
            raise
        except Exception as exc:  # noqa: BLE001 - answered as INTERNAL, logged with its traceback
            await context.abort(grpc.StatusCode.INTERNAL, internal_error(state["request_id"], exc), _trailers(state))
        finally:
            close_request(self.pipeline.telemetry, state, status, started, self._access(context, method))
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def _access(self, context: grpc.aio.ServicerContext, method: str) -> tuple[str, str, str] | None:
        return (_peer(context.peer()), "gRPC", f"/{SERVICE}/{method}") if self.access else None


def _headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's text metadata as headers (the first of a repeated key, as HTTP's ``get``)."""
    headers: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            headers.setdefault(key.lower(), value)
    return headers


def _trailers(state: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The fleet's answer headers, as trailing metadata (the version is known only at the end)."""
    found = (("x-request-id", state["request_id"]), ("x-fleet-model-version", state["model_version"]))
    return found + ((("x-fleet-cache", state["cache"]),) if "cache" in state else ())


def _peer(peer: str) -> str:
    """``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` → the client's address, as HTTP logs it."""
    _, _, address = peer.partition(":")
    host, _, _ = address.rpartition(":")
    return host.strip("[]") or peer or "-"


# -- the server -------------------------------------------------------------------------------
class GrpcEndpoint:
    """A ``grpc.aio`` server for the service, on the event loop that ``start`` runs on."""

    def __init__(
        self, service: InferenceService, host: str, port: int, max_message_bytes: int, reuse_port: bool = False
    ) -> None:
        self.service, self.host, self.port, self.max_message_bytes = service, host, port, max_message_bytes
        self.reuse_port = reuse_port  # gateway workers share the port (the supervisor checked it was free)
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve. A message over ``max_message_bytes`` is refused by grpc itself
        (RESOURCE_EXHAUSTED) before the gateway reads it. Without SO_REUSEPORT (grpc's
        default is to set it) a port another process holds is an error here, not a second
        server silently sharing that port."""
        server = grpc.aio.server(
            maximum_concurrent_rpcs=MAX_CONCURRENT_CALLS,
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
                ("grpc.so_reuseport", 1 if self.reuse_port else 0),
            ],
        )
        server.add_generic_rpc_handlers((self.service.handler(),))
        try:
            self.port = server.add_insecure_port(self.address)
        except RuntimeError:
            raise ConfigError(
                f"cannot listen for gRPC on {self.address}: the port is in use or the address is not "
                "this machine's; expected a free port (--grpc-port, 0 for any)"
            ) from None
        await server.start()
        self._server = server

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls; let those in flight finish for up to ``grace_s``."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
