"""What each of the gateway's listening sockets serves, and how long an idle connection stays.

Two kinds of port. The *public* port (``--port``) answers inference, health and ``/metrics``;
a load balancer or the internet may reach it. With ``--admin-port`` the admin API
(``/admin/...``, fleet/gateway/admin.py) is taken off it: there it answers 404, as for a path
that does not exist, and it answers on the admin port (and on a worker's private port, which
the control plane reaches it at) instead, which the deployment exposes only inside the
cluster. The check is on the path the router matches (uvicorn's percent-decoded
``scope["path"]``), so no spelling of ``/admin/`` slips past it to the route; it keys on the
port the connection arrived at (``scope["server"]``), which a caller cannot choose.

Keep-alive (``FLEET_GATEWAY_KEEPALIVE_S``): how long the server keeps an idle HTTP/1.1
connection open between requests. Behind a load balancer it must outlast the balancer's own
idle timeout, or the gateway closes a connection just as the balancer sends a request on it
and the caller gets a 502 (infra/edge.py sets both).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.errors import ConfigError
from fleet.gateway.admin import ADMIN_PREFIX

KEEP_ALIVE_ENV = "FLEET_GATEWAY_KEEPALIVE_S"
DEFAULT_KEEP_ALIVE_S = 75.0  # above ALB's default idle timeout (60 s); infra sets it from the stack's
ADMIN_PORT_ENV = "FLEET_ADMIN_PORT"
_NOT_FOUND = b'{"error": "not found"}'


def keep_alive_s(env: dict[str, str] | None = None) -> float:
    """``FLEET_GATEWAY_KEEPALIVE_S`` in seconds (default ``DEFAULT_KEEP_ALIVE_S``)."""
    raw = (os.environ if env is None else env).get(KEEP_ALIVE_ENV, "").strip()
    if not raw:
        return DEFAULT_KEEP_ALIVE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 4000):
        raise ConfigError(
            f"{KEEP_ALIVE_ENV} is {raw!r}; expected seconds above 0 and at most 4000 (ALB's longest idle "
            "timeout), more than the load balancer's idle timeout in front of the gateway"
        )
    return value


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX.rstrip("/") or path.startswith(ADMIN_PREFIX)


class AdminOffPublicPorts:
    """ASGI middleware: ``/admin/...`` on a connection to one of ``public_ports`` answers 404
    without reaching the app; everything else, and every other port, passes through."""

    def __init__(self, app: ASGIApp, public_ports: Iterable[int]) -> None:
        self.app, self.public_ports = app, frozenset(public_ports)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_admin_path(scope["path"]) and self._public(scope):
            await send(
                {
                    "type": "http.response.start",
                    "status": 404,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_NOT_FOUND))],
                }
            )
            await send({"type": "http.response.body", "body": _NOT_FOUND})
            return
        await self.app(scope, receive, send)

    def _public(self, scope: Scope) -> bool:
        server = scope.get("server")
        # no server address (a Unix socket, a test client): not a port the load balancer reaches
        return server is not None and server[1] in self.public_ports
