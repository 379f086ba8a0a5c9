"""What every gateway answer shares: its settings, the errors it adds, and the middleware that
gives each request an id and each answer the fleet's headers (and counts it)."""

from __future__ import annotations

import itertools
import os
import re
import time
import uuid
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet import gateways
from fleet.errors import FleetError
from fleet.gateway.telemetry import Telemetry

MAX_BODY_BYTES = 4 * 1024 * 1024
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Request ids: a random per-process prefix and a counter, unique across gateways without
# asking the OS for randomness on every request (uuid4 did, and it showed in profiles).
_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count(1)


class BodyTooLarge(FleetError):
    status = 413


class OverQuota(FleetError):
    status = 429

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Settings:
    """How one gateway runs; every field has the default ``fleet gateway`` uses."""

    admin_token: str | None = None
    public_url: str | None = None  # announced in the store so the control plane can reach it
    gateway_id: str = ""
    max_body_bytes: int = MAX_BODY_BYTES
    log_flush_s: float = 2.0

    @classmethod
    def from_env(cls, public_url: str | None = None) -> Settings:
        return cls(admin_token=os.environ.get("FLEET_ADMIN_TOKEN") or None, public_url=public_url,
                   gateway_id=gateways.new_id())  # fmt: skip


class Headers:
    """ASGI middleware: a request id for every request, the fleet headers on every answer,
    and the request counted once it is answered."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app, self.telemetry = app, telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        state = scope.setdefault("state", {})
        state["request_id"] = given if given and _REQUEST_ID.fullmatch(given) else f"{_ID_PREFIX}{next(_ID_COUNTER):x}"
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
                    self.telemetry.finished(state["model"], state["model_version"], state.get("tenant", "unknown"),
                                            message["status"], (time.monotonic() - started) * 1e3)  # fmt: skip
            await send(message)

        await self.app(scope, receive, send_with_headers)
