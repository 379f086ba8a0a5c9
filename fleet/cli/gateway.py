"""``fleet gateway|up``: the servers: the gateway alone (one process or several workers), or
the whole local fleet with it."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.cli._output import console, err_console
from fleet.cli.serving import DEFAULT_POLICIES, PoliciesOpt, runtime_for


def gateway_cmd(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    public_url: Annotated[
        str | None, typer.Option(help="URL other fleet parts reach this gateway at (default http://HOST:PORT).")
    ] = None,
    policies: PoliciesOpt = DEFAULT_POLICIES,
    access_log: Annotated[
        bool,
        typer.Option(
            "--access-log",
            help="Print one line per request: client, method, path, status, time, tenant, model, version, request id.",
        ),
    ] = False,
    grpc_port: Annotated[
        int | None,
        typer.Option(
            "--grpc-port",
            min=0,
            max=65535,
            help="Also serve the Open Inference Protocol over gRPC (inference.GRPCInferenceService, "
            "Triton's) on this port of --host; 0 picks a free port. Off when not given.",
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            max=64,
            envvar="FLEET_GATEWAY_WORKERS",
            help="Gateway processes answering on the same port (SO_REUSEPORT), one per core: each is a "
            "gateway of its own, slots are divided between them, /metrics adds them up. Quotas "
            "are exact across them with FLEET_REDIS_URL; without it each enforces its share.",
        ),
    ] = 1,
    admin_port: Annotated[
        int | None,
        typer.Option(
            "--admin-port",
            min=1,
            max=65535,
            envvar="FLEET_ADMIN_PORT",
            help="Serve the admin API (/admin/...) on this port of --host only: --port answers it with 404. "
            "The gateway announces this port to the control plane. Off when not given (both on --port).",
        ),
    ] = None,
    worker_fds: Annotated[
        str | None,
        typer.Option(
            "--worker-fds",
            hidden=True,
            help="Internal: SHARED,PRIVATE[,ADMIN] listening socket descriptors a --workers supervisor hands a worker.",
        ),
    ] = None,
) -> None:
    """Run the gateway alone, in front of the runtime's deployments.

    FLEET_ADMIN_TOKEN turns on the admin API (/admin/...); without it the admin API is off.
    FLEET_REDIS_URL (redis://HOST:PORT/DB, rediss:// for TLS) shares every tenant's quota
    between all gateways and workers (without it each gateway process enforces quotas alone)
    and is the change bus: route and tenant changes arrive at once, the store's change journal
    is polled every 2 s (without it, every 0.25 s).

    Byte budgets come from the policies' gateway: section. FLEET_DECODE_WORKERS: processes that decode large bodies (0: on the event loop).
    FLEET_GATEWAY_KEEPALIVE_S: how long an idle connection stays open (default 75; above a load balancer's idle timeout).
    """
    import dataclasses

    from fleet.catalog.policies.loader import load_policies
    from fleet.gateway import FleetView, Settings, create_app
    from fleet.gateway import workers as gw_workers
    from fleet.gateway.listeners import AdminOffPublicPorts, keep_alive_s
    from fleet.local.up import check_port_free, serve_gateway
    from fleet.store import open_store
    from fleet.usage.prices import gateway_prices

    _gateway_logging(access_log)
    keep_alive_s()  # a bad FLEET_GATEWAY_KEEPALIVE_S is one clear error before anything starts
    if admin_port is not None and admin_port == port:
        from fleet.errors import InvalidInput

        raise InvalidInput(f"--admin-port {admin_port} is --port too; expected a port of its own for the admin API")
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    if workers > 1 and worker_fds is None:
        from fleet.errors import InvalidInput

        if grpc_port == 0:
            raise InvalidInput(
                "--grpc-port 0 with --workers: every worker would pick its own port; expected a fixed --grpc-port"
            )
        load_policies(policies)  # one clear error here, rather than one from every worker
        if grpc_port:
            check_port_free(grpc_port, "gateway's gRPC endpoint", "--grpc-port", host)
        _supervise(
            workers, host, port, sys.argv[1:], _workers_banner(workers, host, shown, grpc_port), admin_port=admin_port
        )
        return
    if grpc_port and worker_fds is None:
        check_port_free(grpc_port, "gateway's gRPC endpoint", "--grpc-port", host)
    sockets, admin_sockets = None, None
    if worker_fds is not None:  # a worker: its sockets come from the supervisor
        shared_fd, private_fd, *admin_fd = (int(x) for x in worker_fds.split(","))
        sockets = [gw_workers.from_fd(shared_fd), gw_workers.from_fd(private_fd)]
        admin_sockets = [gw_workers.from_fd(fd) for fd in admin_fd]
        # announced (and reached by the control plane) at its own port
        public_url = gw_workers.with_port(public_url or f"http://{shown}:{port}", sockets[1].getsockname()[1])
    elif admin_port is not None:
        admin_sockets = [gw_workers.listening_socket(host, admin_port, reuse_port=False)]
        # the control plane pushes to /admin/...: announce the admin port
        public_url = gw_workers.with_port(public_url or f"http://{shown}:{port}", admin_port)
    settings = dataclasses.replace(
        Settings.from_env(public_url=public_url or f"http://{shown}:{port}"),
        access_log=access_log,
        grpc_port=grpc_port,
        grpc_host=host,
        workers=workers,
    )
    if workers > 1 and settings.decode_workers is None:  # one decode process per worker, not one per core each
        settings = dataclasses.replace(settings, decode_workers=1)
    store = open_store()
    prices, _ = gateway_prices(policies)
    app = create_app(FleetView(store, runtime_for(policies)), load_policies(policies), settings, prices=prices)
    url = f"http://{shown}:{port}"

    def ready() -> None:
        if worker_fds is not None:
            return  # the supervisor reports for all of them
        admin = "on (FLEET_ADMIN_TOKEN)" if settings.admin_token else "off (set FLEET_ADMIN_TOKEN to turn it on)"
        if settings.admin_token and admin_port is not None:
            admin += f", on port {admin_port} only"
        console.print(
            f"gateway {settings.gateway_id} listening on http://{f'[{host}]' if ':' in host else host}:{port} "
            f"(store {store.url})\n"
            f"  inference  {url}/v2/models/MODEL/infer\n  gRPC       {_grpc_line(app, shown)}\n"
            f"  health     {url}/v2/health/ready\n"
            f"  metrics    {url}/metrics ({_scrape()})\n  admin API  {admin}\n"
            f"  access log {'on' if access_log else 'off (--access-log)'}; Ctrl-C stops",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )

    served = app
    if admin_port is not None:  # the admin API off the port a load balancer reaches
        served = AdminOffPublicPorts(app, {sockets[0].getsockname()[1] if sockets else port})
    serve_gateway(served, port, ready, host=host, sockets=sockets, admin_sockets=admin_sockets)


def _supervise(
    n: int, host: str, port: int, argv: list[str], on_ready: Callable[[Any], None], admin_port: int | None = None
) -> None:
    """N worker processes (``fleet <argv> --worker-fds ...``) on shared sockets, until stopped;
    ``on_ready(supervisor)`` once every one of them is ready."""
    import signal

    from fleet.gateway import workers as gw_workers

    supervisor = gw_workers.Supervisor(
        n,
        host,
        port,
        lambda i, *fds: gw_workers.worker_argv(argv, i, *fds),
        dict(os.environ),
        lambda line: err_console.print(line, markup=False),
        admin_port=admin_port,
    )

    asked = []

    def stop(*_: object) -> None:
        if not asked:  # once: a second Ctrl-C must not cut the workers' stop short
            asked.append(True)
            raise KeyboardInterrupt

    # both, explicitly: a process started in the background by a shell inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt for it (uvicorn sets its own)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        supervisor.start_all()
        supervisor.wait_ready()
        on_ready(supervisor)
        supervisor.watch()
    except KeyboardInterrupt:
        pass
    finally:
        supervisor.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _workers_banner(n: int, host: str, shown: str, grpc_port: int | None) -> Callable[[Any], None]:
    def ready(supervisor: Any) -> None:  # noqa: ANN401
        url = f"http://{shown}:{supervisor.port}"
        quotas = (
            "shared through Redis (FLEET_REDIS_URL)"
            if os.environ.get("FLEET_REDIS_URL")
            else f"each worker enforces 1/{n} of every quota (set FLEET_REDIS_URL to share one budget)"
        )
        console.print(
            f"gateway: {n} workers listening on http://{f'[{host}]' if ':' in host else host}:{supervisor.port} "
            f"(pids {', '.join(str(p.pid) for p in supervisor.procs if p)})\n"
            f"  inference  {url}/v2/models/MODEL/infer\n"
            f"  gRPC       {f'{shown}:{grpc_port}' if grpc_port else 'off (--grpc-port N)'}\n"
            f"  health     {url}/v2/health/ready\n  metrics    {url}/metrics (all workers added up; "
            f"{_scrape()})\n"
            f"  workers    {', '.join(supervisor.private_urls)}\n  quotas     {quotas}\n  Ctrl-C stops",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )

    return ready


def _grpc_line(app: object, shown_host: str) -> str:
    """Where a gRPC client connects (the port bound, when 0 was asked for), or how to turn it on."""
    from fleet.gateway.app import grpc_address

    address = grpc_address(app)  # type: ignore[arg-type]
    if address is None:
        return "off (--grpc-port N)"
    return f"{shown_host}:{address.rpartition(':')[2]}  (inference.GRPCInferenceService)"


def _gateway_logging(access: bool) -> None:
    """Warnings of the fleet (bad records, a store that cannot be read) on stderr; with
    ``access``, one line per request on stdout, stamped with the UTC time."""
    import logging
    import time

    def utc_handler(stream: object, fmt: str) -> logging.Handler:
        handler = logging.StreamHandler(stream)  # type: ignore[arg-type]
        formatter = logging.Formatter(f"%(asctime)sZ {fmt}", "%Y-%m-%dT%H:%M:%S")
        formatter.converter = time.gmtime  # type: ignore[assignment]
        handler.setFormatter(formatter)
        return handler

    logging.getLogger("fleet.store").disabled = False  # the CLI mutes it for commands that name bad records
    fleet_log = logging.getLogger("fleet")
    fleet_log.addHandler(utc_handler(sys.stderr, "%(levelname)s %(name)s: %(message)s"))
    fleet_log.setLevel(logging.WARNING)
    if access:
        log = logging.getLogger("fleet.gateway.access")
        log.addHandler(utc_handler(sys.stdout, "%(message)s"))
        log.setLevel(logging.INFO)
        log.propagate = False


def up_cmd(
    port: Annotated[int, typer.Option(help="Gateway port on 127.0.0.1.")] = 8000,
    grpc_port: Annotated[
        int,
        typer.Option(
            min=0,
            max=65535,
            help="The gateway's gRPC port on 127.0.0.1 (Open Inference Protocol, Triton's "
            "inference.GRPCInferenceService; 8001 as Triton's); 0 picks a free port.",
        ),
    ] = 8001,
    prefect_port: Annotated[int, typer.Option(help="Prefect server (UI and API) port on 127.0.0.1.")] = 4200,
    model: Annotated[str, typer.Option(help="The demo model (trained on first run).")] = "demo-classifier",
    no_prefect: Annotated[bool, typer.Option("--no-prefect", help="Do not start the Prefect server.")] = False,
    gateways: Annotated[
        int,
        typer.Option(
            "--gateways",
            min=1,
            max=16,
            help="Gateway processes on the gateway port (SO_REUSEPORT). With 2 or more, a Redis "
            "(redis-server, on --redis-port) shares every tenant's quota between them.",
        ),
    ] = 1,
    redis_port: Annotated[
        int, typer.Option(min=1, max=65535, help="Port of the Redis started for --gateways N.")
    ] = 6390,
    policies: PoliciesOpt = DEFAULT_POLICIES,
) -> None:
    """Start the local fleet: store, Prefect server and deployments, the demo model's services, the gateway.

    Ctrl-C stops every process it started.
    """
    import dataclasses

    from fleet.catalog.policies.loader import load_policies
    from fleet.gateway import FleetView, create_app
    from fleet.gateway import Settings as GatewaySettings
    from fleet.local.up import Settings, running_fleet, serve_gateway
    from fleet.store import open_store
    from fleet.usage.prices import gateway_prices

    _gateway_logging(access=False)
    if gateways > 1 and grpc_port == 0:
        from fleet.errors import InvalidInput

        raise InvalidInput("--grpc-port 0 with --gateways: every gateway would pick its own port; expected a fixed one")
    settings = Settings(
        home=Path(".fleet"),
        port=port,
        prefect_port=prefect_port,
        model=model,
        with_prefect=not no_prefect,
        grpc_port=grpc_port,
        gateways=gateways,
        redis_port=redis_port,
    )
    loaded = load_policies(policies)
    loaded.model(model)  # a clear error before anything starts
    store = open_store()
    runtime = runtime_for(policies)
    started = time.monotonic()

    def step(text: str) -> None:
        err_console.print(f"[dim]{time.monotonic() - started:5.1f}s[/]  {text}")

    try:
        with running_fleet(settings, store, loaded, runtime, step) as info:
            if gateways > 1:
                step(f"starting {gateways} gateways (quotas shared through Redis on 127.0.0.1:{redis_port})")
                argv = ["gateway", "--port", str(port), "--grpc-port", str(grpc_port), "--policies", str(policies)]
                _supervise(
                    gateways,
                    "127.0.0.1",
                    port,
                    argv,
                    lambda sup: _summary(
                        settings,
                        info,
                        time.monotonic() - started,
                        f"127.0.0.1:{grpc_port}  (inference.GRPCInferenceService)",
                        sup.private_urls,
                    ),
                )
            else:
                settings_ = dataclasses.replace(
                    GatewaySettings.from_env(public_url=f"http://127.0.0.1:{port}"), grpc_port=grpc_port
                )
                prices, _ = gateway_prices(policies)
                app = create_app(FleetView(store, runtime), loaded, settings_, prices=prices)
                serve_gateway(
                    app,
                    port,
                    lambda: _summary(settings, info, time.monotonic() - started, _grpc_line(app, "127.0.0.1")),
                )
    except KeyboardInterrupt:
        pass
    err_console.print(
        "stopped: gateway, model services, flow deployments, Prefect server" + (" and Redis" if gateways > 1 else "")
    )


def _summary(settings, info: dict[str, str], seconds: float, grpc: str, workers: list[str] | None = None) -> None:  # noqa: ANN001
    url = f"http://127.0.0.1:{settings.port}"
    body = '{"inputs":[{"name":"features","shape":[1,4],"datatype":"FP32","data":[1.0,0.0,0.0,0.0]}]}'
    lines = [
        f"serving-fleet is up ({seconds:.0f} s)",
        f"  gateway      {url}  (OIP v2 and KServe v1)"
        + (f"; {len(workers)} gateway processes, quotas shared through {info.get('redis')}" if workers else ""),
        f"  gRPC         {grpc}",
        f"  Prefect UI   {info['prefect'] or '(not started)'}",
        f"  store        {os.environ.get('FLEET_STORE', 'file://./.fleet/store')}",
        f"  tenant key   {info['key']}  (tenant demo; also in {settings.home / 'demo-tenant.key'})",
        "try it:",
        f"  curl -s -H 'Authorization: Bearer {info['key']}' -H 'Content-Type: application/json' "
        f"-d '{body}' {url}/v2/models/{settings.model}/infer",
        "  or Triton's gRPC client (tritonclient.grpc) at the gRPC address, metadata authorization: Bearer <key>",
        "roll out a new version (from this folder):",
        f"  fleet models train {settings.model} 1.1.0 --seed 12 --epochs 10 && fleet rollout {settings.model} 1.1.0",
        "fleet status shows versions, weights and replicas; Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


def _scrape() -> str:
    """Who may read /metrics (``fleet.gateway.health``), as the start-up lines say it."""
    if os.environ.get("FLEET_METRICS_TOKEN") or os.environ.get("FLEET_ADMIN_TOKEN"):
        return "with FLEET_METRICS_TOKEN or the admin token"
    return "closed: set FLEET_METRICS_TOKEN for Prometheus"
