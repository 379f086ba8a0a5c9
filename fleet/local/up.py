"""``fleet up``: the whole fleet on one machine, on the embedded defaults.

Store ``./.fleet/store``, the Prefect server (SQLite, UI) on 127.0.0.1:4200 with the
fleet's deployments served by ``fleet flows serve``, the demo model trained and registered
on first run, its stable (and canary) version served by ``bentoml serve`` processes, and
the gateway on 127.0.0.1:8000 (OIP over gRPC on 127.0.0.1:8001) with its admin API on (token in
``.fleet/admin-token``) — with ``--gateways N``, N gateway processes on that port and a
Redis on 127.0.0.1:6390 sharing quotas between them. Ctrl-C stops every child;
a run after a crash first stops what the crashed one left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleet.catalog.policies.loader import Policies
from fleet.catalog.registry import Registry
from fleet.catalog.routes.store import Router
from fleet.catalog.tenants import Tenants
from fleet.errors import ConfigError, FleetError
from fleet.processes import alive, stop_group, tail
from fleet.runtime.local import LocalRuntime
from fleet.types import ObjectStore

DEMO_TENANT = "demo"
PREFECT_READY_TIMEOUT_S = 120.0


class StartFailed(FleetError):
    status = 503


@dataclass(frozen=True)
class Settings:
    home: Path  # .fleet
    port: int
    prefect_port: int
    model: str
    with_prefect: bool = True
    grpc_port: int = 8001  # the gateway's gRPC port; 0: any free one
    gateways: int = 1  # gateway processes on the port; 2 or more share quotas through a local Redis
    redis_port: int = 6390


def check_port_free(port: int, what: str, flag: str, host: str = "127.0.0.1") -> None:
    """A clear error before anything starts, rather than a server's traceback once it binds."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # as the servers themselves bind: a port whose old connections linger in TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise ConfigError(f"port {port} for the {what} is in use on {host}; free it or pass {flag}") from None


class Child:
    """A child process group with a pid file, so a run after a crash can stop what was left."""

    def __init__(self, home: Path, name: str, marker: bytes) -> None:
        self.home, self.name, self.marker = home, name, marker
        self.pid_file = home / "run" / f"{name}.json"
        self.log = home / "run" / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def stop_leftover(self) -> None:
        try:
            pid = json.loads(self.pid_file.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return
        if alive(pid, self.marker):
            stop_group(pid)
        self.pid_file.unlink(missing_ok=True)

    def spawn(self, cmd: list[str], env: dict[str, str], **record: object) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        self.pid_file.write_text(json.dumps({"pid": self.proc.pid, **record}))

    def check_alive(self, what: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise StartFailed(f"{what} exited; last lines of {self.log}:\n{tail(self.log)}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc.pid)
            self.proc = None
        self.pid_file.unlink(missing_ok=True)


class Prefect(Child):
    """The Prefect server (SQLite) and its UI."""

    def __init__(self, home: Path, port: int) -> None:
        super().__init__(home, "prefect", b"prefect")
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PREFECT_HOME": str((self.home / "prefect").absolute()),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_URL": f"{self.url}/api",
        }

    def start(self) -> None:
        prefect = str(Path(sys.executable).with_name("prefect"))
        self.spawn(
            [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)], self.env(), port=self.port
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + PREFECT_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            self.check_alive("the Prefect server")
            try:
                if httpx.get(f"{self.url}/api/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise StartFailed(f"the Prefect server was not healthy after {PREFECT_READY_TIMEOUT_S:.0f} s; see {self.log}")


class RedisServer(Child):
    """Debian's redis-server on 127.0.0.1, nothing written to disk: the quota store that
    ``fleet up --gateways N`` shares between its gateways."""

    def __init__(self, home: Path, port: int) -> None:
        super().__init__(home, "redis", b"redis-server")
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ConfigError(
                "--gateways N needs redis-server to share quotas between the gateways; install it "
                "(Debian: apt-get install redis-server) or run one gateway"
            )
        self.spawn(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            dict(os.environ),
            port=self.port,
        )

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive("redis-server")
            try:
                client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise StartFailed(f"redis-server did not answer within {timeout_s:.0f} s; see {self.log}") from None
                time.sleep(0.05)


class FlowServer(Child):
    """``fleet flows serve``: registers the deployments and runs the rollouts started from the UI or CLI."""

    def __init__(self, home: Path) -> None:
        super().__init__(home, "flows", b"flows")

    def start(self, prefect: Prefect) -> None:
        self.spawn([str(Path(sys.executable).with_name("fleet")), "flows", "serve"], prefect.env())


def ensure_admin_token(home: Path) -> str:
    """The local fleet's admin token (``.fleet/admin-token``, 0600), made on first run; it
    turns on the gateway's admin API and lets flows and the CLI push to the gateway."""
    path = home / "admin-token"
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    import secrets

    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    token = secrets.token_urlsafe(32)
    path.write_text(token + "\n")
    return token


def ensure_demo_model(store: ObjectStore, model: str, policies: Policies, step: Callable[[str], None]) -> str:
    """Train and register the first version if the model has none; make sure it has a stable."""
    registry = Registry(store)
    if not registry.versions(model):
        from fleet.runtime.bento import family_module

        step(f"training {model} 1.0.0 (first run only)")
        family = family_module(policies.model(model).family)
        trainer = __import__(f"{family.__name__}.train", fromlist=["train_and_register"])
        trainer.train_and_register(store, model, "1.0.0")
    router = Router(store, registry)
    table = router.get(model)
    if table.stable is None:
        first = registry.versions(model)[0]
        router.set(model, stable=first, why="fleet up: first version of the model")
        table = router.get(model)
    return table.stable or ""


def ensure_demo_key(store: ObjectStore, model: str, key_file: Path) -> str:
    """The demo tenant's key, kept in ``key_file`` (0600) so every ``fleet up`` can print it."""
    tenants = Tenants(store)
    if key_file.exists():
        key = key_file.read_text().strip()
        with contextlib.suppress(FleetError):
            if tenants.get(DEMO_TENANT).matches(key):
                return key
    try:
        tenants.get(DEMO_TENANT)
        _, key = tenants.add_key(DEMO_TENANT)
    except FleetError:
        _, key = tenants.create(DEMO_TENANT, {model: ["*"]})
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.touch(mode=0o600)
    key_file.write_text(key + "\n")
    return key


@contextlib.contextmanager
def running_fleet(
    settings: Settings,
    store: ObjectStore,
    policies: Policies,
    runtime: LocalRuntime,
    step: Callable[[str], None],
) -> Iterator[dict[str, str]]:
    """Start everything but the gateway; stop all of it on the way out, however it ends."""
    check_port_free(settings.port, "gateway", "--port")
    if settings.grpc_port:
        check_port_free(settings.grpc_port, "gateway's gRPC endpoint", "--grpc-port")
    prefect = Prefect(settings.home, settings.prefect_port)
    flows = FlowServer(settings.home)
    redis = RedisServer(settings.home, settings.redis_port)
    step("stopping what an earlier run left behind")
    flows.stop_leftover()
    prefect.stop_leftover()
    redis.stop_leftover()
    runtime.stop_all()
    os.environ.setdefault("FLEET_ADMIN_TOKEN", ensure_admin_token(settings.home))
    try:
        if settings.gateways > 1:
            check_port_free(settings.redis_port, "Redis the gateways share quotas through", "--redis-port")
            step(f"starting Redis on 127.0.0.1:{settings.redis_port} (the gateways' shared quotas)")
            redis.start()
            redis.wait_ready()
            os.environ["FLEET_REDIS_URL"] = redis.url
        if settings.with_prefect:
            check_port_free(settings.prefect_port, "Prefect server", "--prefect-port")
            step("starting the Prefect server (SQLite)")
            prefect.start()
        stable = ensure_demo_model(store, settings.model, policies, step)
        key = ensure_demo_key(store, settings.model, settings.home / "demo-tenant.key")
        table = Router(store).get(settings.model)
        for version in [stable] + ([table.canary.version] if table.canary else []):
            step(f"packaging and starting {settings.model}:{version}")
            runtime.deploy(settings.model, version)
        if settings.with_prefect:
            step("waiting for the Prefect server")
            prefect.wait_ready()
            step("registering the rollout and rollback deployments (fleet flows serve)")
            flows.start(prefect)
        yield {
            "key": key,
            "prefect": prefect.url if settings.with_prefect else "",
            "redis": redis.url if settings.gateways > 1 else "",
        }
    finally:
        flows.stop()
        runtime.stop_all()
        prefect.stop()
        redis.stop()


def serve_gateway(
    app: object,
    port: int,
    on_ready: Callable[[], None],
    host: str = "127.0.0.1",
    sockets: list[socket.socket] | None = None,
    admin_sockets: list[socket.socket] | None = None,
) -> None:
    """Run the gateway until Ctrl-C / SIGTERM; ``on_ready`` once it accepts requests.

    ``sockets``: listen on these (a worker's, handed over by ``fleet.gateway.workers``)
    instead of binding ``host:port``; the worker then also stops when its parent is gone.
    ``admin_sockets``: listen on these too (the admin port, ``fleet.gateway.listeners``).
    An idle connection stays open ``FLEET_GATEWAY_KEEPALIVE_S`` (``listeners.keep_alive_s``)."""
    import uvicorn
    import uvloop

    from fleet.gateway.listeners import keep_alive_s
    from fleet.gateway.workers import listening_socket

    listen = sockets
    if admin_sockets:
        listen = [*(sockets or [listening_socket(host, port, reuse_port=False)]), *admin_sockets]

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            loop="none",
            http="httptools",
            timeout_graceful_shutdown=10,
            # longer than the idle timeout of a load balancer in front (infra/edge.py), else 502s
            timeout_keep_alive=keep_alive_s(),  # type: ignore[arg-type] - uvicorn takes any number of seconds
            # X-Forwarded-For from 127.0.0.1 only (uvicorn's default trust):
            # no proxy the gateway runs behind is that, so it only cost CPU
            proxy_headers=False,
        )
    )

    async def orphaned(parent: int) -> None:
        while not server.should_exit:
            await asyncio.sleep(0.5)
            if os.getppid() != parent:  # the supervisor died without stopping us
                server.should_exit = True

    async def serve() -> None:
        try:
            if sockets is not None:
                asyncio.get_running_loop().create_task(orphaned(os.getppid()))
            await server.serve(sockets=listen)
        except SystemExit:  # uvicorn's way of failing to start (a port in use, a lifespan error); it logged why
            raise StartFailed("the gateway did not start; the lines above say why") from None

    async def main() -> None:
        task = asyncio.create_task(serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            try:
                on_ready()
            except BaseException:  # a broken start-up report must not leave a half-started gateway serving
                server.should_exit = True
                await task
                raise
        await task

    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
