"""What every gateway answer shares, over HTTP and gRPC alike: its settings, a request id for
each request, how each answered request is counted and logged (``open_request`` /
``close_request``), the wait an over-budget refusal names, how an error is answered
(``ErrorAnswers``), and the middleware that does all of it for HTTP and gives each answer
the fleet's headers. ``fleet.gateway.grpc_server`` calls the same two functions, so a
request is counted the same whichever way it came.

Request ids the gateway makes are 128 random bits: nobody can guess another request's id
(feedback is joined by it). An id a client sends in ``X-Request-Id`` is kept if it is a
plain token, and means something only within that client's tenant (``fleet.logs.feedback``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.catalog import gateway_directory
from fleet.errors import ConfigError, FleetError
from fleet.gateway import quota
from fleet.gateway.admin import json_response
from fleet.gateway.body import DecodeBusy
from fleet.gateway.generation.sse import CallerStalled
from fleet.gateway.telemetry import UNKNOWN, Telemetry
from fleet.logs import ids

_REQUEST_ID = re.compile(rb"[A-Za-z0-9._-]{1,128}")
_UNSAFE = re.compile(r"[^\x21-\x7e]")  # a logged path is one printable token: a tenant cannot forge lines

access_log = logging.getLogger("fleet.gateway.access")
log = logging.getLogger("fleet.gateway")


def new_request_id() -> str:
    """A UUIDv7 (``fleet.logs.ids``): its time tells a feedback label which hour of the log to look in."""
    return ids.new()


def open_request(state: dict[str, Any], given: bytes) -> None:
    """A request's state as every protocol starts it: the client's id if it is a plain token
    (``X-Request-Id`` header or metadata), else a new one; no version chosen yet."""
    state["request_id"] = given.decode() if given and _REQUEST_ID.fullmatch(given) else new_request_id()
    state.setdefault("model_version", "none")


def close_request(
    telemetry: Telemetry, state: dict[str, Any], status: int, started: float, access: tuple[str, str, str] | None = None
) -> None:
    """One answered request counted (if it reached a model endpoint) under what was
    established by then, and, with ``access`` = (client, method, path), logged.

    ``status`` is the HTTP status — for gRPC the one its status code stands for — so one
    ``fleet_requests_total`` query counts errors of both protocols."""
    if not state.get("streaming"):  # a stream keeps its lease until it ends (Headers' finally)
        quota.release(state)  # a concurrency lease: the request is answered
    if "model" in state:
        telemetry.finished(
            state["model"],
            state["model_version"],
            state.get("tenant", UNKNOWN),
            status,
            (time.monotonic() - started) * 1e3,
        )
    if access is not None:
        _log_access(*access, state, status, started)


def retry_after(telemetry: Telemetry, exc: FleetError) -> int | None:
    """Whole seconds a refused client should wait (a quota's or a decode budget's refusal, a cold version),
    counting decode refusals as it goes; None for an error that retrying soon will not fix."""
    if isinstance(exc, DecodeBusy):
        telemetry.busy.labels("tenant" if exc.status == 429 else "gateway").inc()
    wait = getattr(exc, "retry_after_s", None)  # quotas, decode budgets, a version starting (fleet.gateway.activate)
    return None if wait is None else max(1, math.ceil(wait))


def internal_error(request_id: str, exc: BaseException) -> str:
    """Log an error nobody planned for; the one-line answer a client gets instead of it."""
    log.error("unexpected error in request %s: %s", request_id, exc, exc_info=exc)
    return f"internal error in the gateway (request id {request_id}); its log has the details"


class ErrorAnswers:
    """How an error is answered, the same from Starlette's exception handlers and from the
    inference routes answered before them (``fleet.gateway.infer_routes``): ``{"error": ...}``
    with the contract's status (and ``Retry-After`` where waiting helps), an HTTP error naming
    the method and path, and anything nobody planned for as a JSON 500 naming the request id,
    logged."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    async def fleet_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, FleetError)
        response = json_response({"error": str(exc)}, exc.status)
        wait = retry_after(self.telemetry, exc)
        if wait is not None:
            response.headers["Retry-After"] = str(wait)
        return response

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return json_response({"error": f"{exc.detail}: {request.method} {request.url.path[:200]}"}, exc.status_code)

    async def unexpected(self, request: Request, exc: Exception) -> Response:
        return json_response({"error": internal_error(request.scope.get("state", {}).get("request_id", "?"), exc)}, 500)


@dataclass(frozen=True)
class Settings:
    """How one gateway runs; every field has the default ``fleet gateway`` uses. Byte budgets
    are policy (the ``gateway:`` section of ``fleet.catalog.policies.loader.Policies``)."""

    admin_token: str | None = None
    # GET /metrics names every tenant and version: it needs this scrape token (FLEET_METRICS_TOKEN,
    # what Prometheus is given) or the admin token
    metrics_token: str | None = None
    public_url: str | None = None  # announced in the store so the control plane can reach it
    gateway_id: str = ""
    log_flush_s: float | None = None  # None: the policy's gateway.inference_log_flush_s
    decode_workers: int | None = None  # processes decoding large bodies; None: one per CPU but one, 1 to 4
    access_log: bool = False  # one line per request on the fleet.gateway.access logger
    grpc_port: int | None = None  # OIP over gRPC on this port too (0: any free port); None: HTTP only
    grpc_host: str = "127.0.0.1"  # the address the gRPC port listens on (``fleet gateway --host``)
    workers: int = 1  # gateway processes on the same port (``fleet gateway --workers``): slots are divided by it

    @classmethod
    def from_env(cls, public_url: str | None = None) -> Settings:
        raw = os.environ.get("FLEET_DECODE_WORKERS", "").strip()
        if raw and not (raw.isdigit() and int(raw) <= 64):
            raise ConfigError(
                f"FLEET_DECODE_WORKERS is {raw!r}; expected a whole number from 0 (decode on the event loop) to 64"
            )
        return cls(
            admin_token=os.environ.get("FLEET_ADMIN_TOKEN") or None,
            metrics_token=os.environ.get("FLEET_METRICS_TOKEN") or None,
            public_url=public_url,
            gateway_id=gateway_directory.new_id(),
            decode_workers=int(raw) if raw else None,
        )


class Headers:
    """ASGI middleware: a request id for every request, the fleet headers on every answer,
    and each request that reached a model endpoint counted once it is answered, labelled
    with what was established by then (``unknown`` / ``none`` for what was not).

    And a write deadline on every answer: each message of it must be taken by the caller
    within ``write_s`` (the gateway policy's ``stream_write_s``), and once the last is
    written the server's buffer must keep draining: ``write_s`` without a byte taken ends
    it (a slow caller that reads is not cut, however large the answer). A caller that stops reading (one connection with
    pipelined requests behind an answer it never reads) otherwise held the answer's bytes
    and the request's task for as long as it kept the connection open. Past it the
    connection is aborted — not closed, which would wait for the bytes to drain — and
    counted in ``fleet_callers_stalled_total``. (A stream's own deadline per event is
    ``EventStreamResponse``'s; it marks the request ``stalled`` and this aborts.)"""

    def __init__(self, app: ASGIApp, telemetry: Telemetry, access: bool = False, write_s: float = 10.0) -> None:
        self.app, self.telemetry, self.access, self.write_s = app, telemetry, access, write_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        state = scope.setdefault("state", {})
        open_request(state, next((v for k, v in scope["headers"] if k == b"x-request-id"), b""))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] += [
                    (b"x-request-id", state["request_id"].encode()),
                    (b"x-fleet-model-version", state["model_version"].encode()),
                ]
                if "cache" in state:
                    message["headers"].append((b"x-fleet-cache", state["cache"].encode()))
                access = _http_access(scope) if self.access else None
                close_request(self.telemetry, state, message["status"], started, access)
            try:
                async with asyncio.timeout(self.write_s):
                    await send(message)
                if not message.get("more_body") and message["type"] == "http.response.body":
                    await _drained(send, self.write_s)
            except TimeoutError:
                state["stalled"] = True
                raise CallerStalled(f"the caller took no byte of the answer for {self.write_s:g} s") from None

        try:
            await self.app(scope, receive, send_with_headers)
        except CallerStalled as exc:
            log.info("answer cut: %s", exc)
        finally:
            quota.release(state)  # no answer was started (the client left): the lease goes all the same
            if state.get("stalled"):
                self.telemetry.stalled.labels("stream" if state.get("streaming") else "answer").inc()
                _abort(send)


def _connection(send: Send) -> Any:  # noqa: ANN401 - the server's own object
    """The server's connection under ``send``: uvicorn's ``send`` is a method of its request
    cycle, which holds the transport and its flow control; None under another server."""
    return getattr(send, "__self__", None)


async def _drained(send: Send, write_s: float) -> None:
    """Until the server's buffer of this connection is below its low-water mark (uvicorn
    writes a body to the transport at once and waits only before the next message);
    ``TimeoutError`` if ``write_s`` passes with no byte of it taken."""
    connection = _connection(send)
    flow, transport = getattr(connection, "flow", None), getattr(connection, "transport", None)
    if flow is None or transport is None:
        return
    left = transport.get_write_buffer_size()
    while flow.write_paused:
        try:
            async with asyncio.timeout(write_s):
                await flow.drain()
        except TimeoutError:
            if transport.get_write_buffer_size() >= left:
                raise
            left = transport.get_write_buffer_size()  # slow, but taking bytes: wait on


def _abort(send: Send) -> None:
    """Drop the connection and the bytes buffered for it (``close()`` would wait for a
    caller that does not read)."""
    transport = getattr(_connection(send), "transport", None)
    if transport is not None:
        transport.abort()


def _http_access(scope: Scope) -> tuple[str, str, str]:
    client = scope.get("client")
    return client[0] if client else "-", scope.get("method", "-"), scope.get("path", "")


def _log_access(client: str, method: str, path: str, state: dict, status: int, started: float) -> None:
    """``client METHOD path status ms tenant= model= version= id=``: every field one token."""
    path = _UNSAFE.sub("?", path)[:200]
    access_log.info(
        "%s %s %s %d %.1fms tenant=%s model=%s version=%s id=%s",
        _UNSAFE.sub("?", client)[:64],
        method,
        path,
        status,
        (time.monotonic() - started) * 1e3,
        state.get("tenant", "-"),
        _UNSAFE.sub("?", str(state.get("model", "-")))[:64],
        state["model_version"],
        state["request_id"],
    )
