"""What every gateway answer shares: its settings and the middleware that gives each request
an id and each answer the fleet's headers (and counts it).

Request ids the gateway makes are 128 random bits: nobody can guess another request's id
(feedback is joined by it). An id a client sends in ``X-Request-Id`` is kept if it is a
plain token, and means something only within that client's tenant (``fleet.feedback``).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet import gateways
from fleet.errors import ConfigError
from fleet.gateway.telemetry import UNKNOWN, Telemetry

_REQUEST_ID = re.compile(rb"[A-Za-z0-9._-]{1,128}")
_UNSAFE = re.compile(r"[^\x21-\x7e]")  # a logged path is one printable token: a tenant cannot forge lines

access_log = logging.getLogger("fleet.gateway.access")


def new_request_id() -> str:
    """128 random bits as hex (``os.urandom``: about 0.3 µs, less than uuid4's object)."""
    return os.urandom(16).hex()


@dataclass(frozen=True)
class Settings:
    """How one gateway runs; every field has the default ``fleet gateway`` uses. Byte budgets
    are policy (the ``gateway:`` section of ``fleet.spec.Policies``)."""

    admin_token: str | None = None
    public_url: str | None = None  # announced in the store so the control plane can reach it
    gateway_id: str = ""
    log_flush_s: float = 2.0
    decode_workers: int | None = None  # processes decoding large bodies; None: one per CPU but one, 1 to 4
    access_log: bool = False  # one line per request on the fleet.gateway.access logger

    @classmethod
    def from_env(cls, public_url: str | None = None) -> Settings:
        raw = os.environ.get("FLEET_DECODE_WORKERS", "").strip()
        if raw and not (raw.isdigit() and int(raw) <= 64):
            raise ConfigError(f"FLEET_DECODE_WORKERS is {raw!r}; expected a whole number from 0 (decode on the "
                              "event loop) to 64")  # fmt: skip
        return cls(admin_token=os.environ.get("FLEET_ADMIN_TOKEN") or None, public_url=public_url,
                   gateway_id=gateways.new_id(), decode_workers=int(raw) if raw else None)  # fmt: skip


class Headers:
    """ASGI middleware: a request id for every request, the fleet headers on every answer,
    and each request that reached a model endpoint counted once it is answered, labelled
    with what was established by then (``unknown`` / ``none`` for what was not)."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry, access: bool = False) -> None:
        self.app, self.telemetry, self.access = app, telemetry, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        state = scope.setdefault("state", {})
        state["request_id"] = given.decode() if given and _REQUEST_ID.fullmatch(given) else new_request_id()
        state.setdefault("model_version", "none")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] += [
                    (b"x-request-id", state["request_id"].encode()),
                    (b"x-fleet-model-version", state["model_version"].encode()),
                ]
                if "cache" in state:
                    message["headers"].append((b"x-fleet-cache", state["cache"].encode()))
                if "model" in state:
                    self.telemetry.finished(state["model"], state["model_version"], state.get("tenant", UNKNOWN),
                                            message["status"], (time.monotonic() - started) * 1e3)  # fmt: skip
                if self.access:
                    _log_access(scope, state, message["status"], started)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _log_access(scope: Scope, state: dict, status: int, started: float) -> None:
    """``client METHOD path status ms tenant= model= version= id=``: every field one token."""
    client = scope.get("client")
    path = _UNSAFE.sub("?", scope.get("path", ""))[:200]
    access_log.info(
        "%s %s %s %d %.1fms tenant=%s model=%s version=%s id=%s",
        client[0] if client else "-", scope.get("method", "-"), path, status, (time.monotonic() - started) * 1e3,
        state.get("tenant", "-"), _UNSAFE.sub("?", str(state.get("model", "-")))[:64], state["model_version"],
        state["request_id"],
    )  # fmt: skip
