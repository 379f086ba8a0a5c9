"""The gateway's listeners (``fleet.gateway.listeners``), over real sockets to a real ``fleet
gateway``: an idle connection stays open for ``FLEET_GATEWAY_KEEPALIVE_S`` and is closed by
the server after it (behind a load balancer this must outlast the balancer's idle timeout);
with ``--admin-port`` the admin API answers there and 404 on the public port, also with
workers, and the control plane's pushes reach it on the port the gateway announces."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import httpx
import pytest

from fleet.catalog import gateway_directory
from fleet.errors import ConfigError
from fleet.gateway.admin import ADMIN_PREFIX, admin_routes
from fleet.gateway.listeners import DEFAULT_KEEP_ALIVE_S, keep_alive_s
from fleet.gateway.telemetry import Telemetry
from fleet.store import open_store
from tests.gateway_env import ADMIN_TOKEN, GatewayEnv, wait_for
from tests.serving_env import free_port

KEEP_ALIVE_S = 2.0  # short, so the test is quick; production's is infra/edge.py's (90 s for the example stacks)
REQUEST = b"GET /v2/health/live HTTP/1.1\r\nHost: gateway\r\n\r\n"


def _answer(sock: socket.socket) -> bytes:
    """One whole HTTP answer (headers and a Content-Length body) read from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection mid-answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:]) if k.lower() == b"content-length"
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def _closed_by_server_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (an EOF), or None if it stayed open and silent
    for ``seconds``: waits on the socket, not on a clock."""
    start = time.monotonic()
    readable, _, _ = select.select([sock], [], [], seconds)
    if not readable:
        return None
    assert sock.recv(1) == b"", "the server sent bytes nobody asked for"
    return time.monotonic() - start


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory):
    env = GatewayEnv(tmp_path_factory.mktemp("listeners"))
    try:
        env.register("1.0.0")
        env.route(stable="1.0.0")
        admin_port = free_port()
        url, _ = env.gateway("--admin-port", str(admin_port), FLEET_GATEWAY_KEEPALIVE_S=str(KEEP_ALIVE_S))
        yield env, url, admin_port
    finally:
        env.stop()


def test_an_idle_connection_is_reused_within_the_keep_alive_and_closed_by_the_server_after_it(gateway) -> None:
    _, url, _ = gateway
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(REQUEST)
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        # idle for half the keep-alive: still open (no EOF arrives while we wait on it)
        assert _closed_by_server_within(sock, KEEP_ALIVE_S / 2) is None
        sock.sendall(REQUEST)  # the same connection serves the next request
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        # idle again: the server, not us, closes it once the keep-alive is over — not before
        closed_after = _closed_by_server_within(sock, KEEP_ALIVE_S + 3)
    assert closed_after is not None, f"the connection was still open {KEEP_ALIVE_S + 3} s after its last answer"
    assert KEEP_ALIVE_S - 0.2 <= closed_after <= KEEP_ALIVE_S + 1.5, (
        f"closed after {closed_after:.2f} s idle; expected FLEET_GATEWAY_KEEPALIVE_S={KEEP_ALIVE_S}"
    )


def test_keep_alive_defaults_above_the_load_balancers_default_and_refuses_nonsense() -> None:
    assert keep_alive_s({}) == DEFAULT_KEEP_ALIVE_S > 60  # ALB's default idle timeout
    assert keep_alive_s({"FLEET_GATEWAY_KEEPALIVE_S": "90"}) == 90.0
    for bad in ("0", "-5", "soon", "nan", "inf", "5000"):
        with pytest.raises(ConfigError, match=rf"FLEET_GATEWAY_KEEPALIVE_S is '{bad}'; expected seconds above 0"):
            keep_alive_s({"FLEET_GATEWAY_KEEPALIVE_S": bad})


def test_every_admin_route_is_under_the_prefix_the_public_port_refuses(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    routes = admin_routes(store, "t", on_change=lambda: None, stats=lambda m, w: {}, telemetry=Telemetry(lambda: {}))
    outside = [r.path for r in routes if not r.path.startswith(ADMIN_PREFIX)]
    assert not outside, f"admin routes outside {ADMIN_PREFIX} would be served on the public port: {outside}"


ADMIN_PATHS = ("/admin/tenants", "/admin/models", "/admin/%74enants", "/admin/routes/stub-model")


def test_the_admin_api_answers_on_the_admin_port_and_404_on_the_public_one(gateway) -> None:
    _, url, admin_port = gateway
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for path in ADMIN_PATHS:
        # %74 is "t": the guard sees the decoded path the router matches
        public = httpx.get(f"{url}{path}", headers=auth, timeout=10)
        assert public.status_code == 404, f"{path} on the public port answered {public.status_code}: {public.text}"
        assert public.json() == {"error": "not found"}
        internal = httpx.get(f"http://127.0.0.1:{admin_port}{path}", headers=auth, timeout=10)
        assert internal.status_code == 200, f"{path} on the admin port answered {internal.status_code}: {internal.text}"
    # the rest of the API is where it was, and only there
    assert httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200
    assert httpx.post(f"{url}/admin/refresh", headers=auth, timeout=10).status_code == 404


def test_the_gateway_announces_its_admin_port_so_pushes_reach_it(gateway) -> None:
    env, _, admin_port = gateway
    (record,) = gateway_directory.live(env.store)
    assert record.url == f"http://127.0.0.1:{admin_port}"
    assert gateway_directory.notify(env.store, ADMIN_TOKEN) == {record.id: True}


def test_with_workers_the_admin_port_is_shared_and_the_public_port_refuses_admin(tmp_path: Path) -> None:
    env = GatewayEnv(tmp_path)
    try:
        admin_port = free_port()
        url, _ = env.gateway("--workers", "2", "--admin-port", str(admin_port))
        log = tmp_path / f"gateway-{url.rsplit(':', 1)[1]}.log"
        wait_for(lambda: "Ctrl-C stops" in log.read_text(), timeout=60, what="the supervisor's ready report")
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        # several connections: the kernel spreads them over both workers' sockets
        for _ in range(6):
            with httpx.Client(timeout=10, headers=auth) as client:
                assert client.get(f"{url}/admin/tenants").status_code == 404
                assert client.get(f"http://127.0.0.1:{admin_port}/admin/tenants").status_code == 200
        records = gateway_directory.live(env.store)
        assert len(records) == 2  # each worker announces its private port, where admin answers
        assert all(v for v in gateway_directory.notify(env.store, ADMIN_TOKEN).values())
    finally:
        env.stop()
