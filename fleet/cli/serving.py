"""``fleet package|deploy|undeploy|gateway|status``: from a registered version to traffic."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from fleet.cli._output import JsonFlag, console, emit_json, err_console, registry, table

PoliciesOpt = Annotated[
    Path, typer.Option("--policies", envvar="FLEET_POLICIES", help="Policy folder or file.", show_envvar=True)
]
DEFAULT_POLICIES = Path("policies")


def _runtime(policies_path: Path):  # noqa: ANN202
    from fleet.runtime.packaged import packaged_runtime

    return packaged_runtime(policies_path, log=lambda line: err_console.print(f"[dim]{line}[/]"))


def _package(model: str, version: str, policies_path: Path, quantize: bool = False, force: bool = False):  # noqa: ANN202
    from fleet.runtime.packaged import package_version

    return package_version(
        model,
        version,
        policies=policies_path,
        quantize=quantize,
        force=force,
        log=lambda line: err_console.print(f"[dim]{line}[/]"),
    )


def _digest_option(value: str | None) -> str | None:
    from fleet.errors import InvalidInput
    from fleet.runtime.images import check_digest

    try:
        return None if value is None else check_digest(value)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc)) from None


def _repository_option(value: str | None) -> str | None:
    from fleet.errors import InvalidInput
    from fleet.runtime.images import check_repository

    try:
        return None if value is None else check_repository(value)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc)) from None


def package_cmd(
    model: str,
    version: str,
    quantize: Annotated[bool, typer.Option("--int8", help="Build the int8 dynamic-quantized CPU variant.")] = False,
    force: Annotated[
        bool,
        typer.Option(
            help="Rebuild even if the Bento exists; model files in BentoML's store that differ from the manifest are "
            "imported again."
        ),
    ] = False,
    image_digest: Annotated[
        str | None,
        typer.Option(
            help="Record the digest (sha256:<64 hex>) of the image pushed from this Bento: Kubernetes deploys the version "
            "by it.",
            callback=_digest_option,
        ),
    ] = None,
    repository: Annotated[
        str | None,
        typer.Option(
            help="With --image-digest: the repository the image was pushed to (recorded for reference).",
            callback=_repository_option,
        ),
    ] = None,
    policies: PoliciesOpt = DEFAULT_POLICIES,
    json: JsonFlag = False,
) -> None:
    """Build the Bento of a registered version (checksums verified first); --image-digest records its pushed image.

    Kubernetes deploys a version only by the image digest recorded for it.
    """
    if repository and not image_digest:
        raise typer.BadParameter(
            "--repository is recorded with an image digest; expected --image-digest too", param_hint="'--repository'"
        )
    result = _package(model, version, policies, quantize, force)
    recorded = None
    if image_digest:
        from fleet.runtime.packaged import record_image

        before, recorded = record_image(model, version, image_digest, bento=result.bento, repository=repository)
        if before and before.digest != recorded.digest:
            err_console.print(f"[dim]replaced the image recorded for {model}:{version}, {before.digest}[/]")
    if json:
        emit_json({**result.__dict__, "image": recorded.model_dump(mode="json") if recorded else None})
        return
    console.print(
        f"{'built' if result.built else 'found'} Bento [bold]{result.bento}[/] (artifact {result.artifact_sha256[:12]})"
    )
    if recorded:
        console.print(
            f"recorded image [bold]{recorded.digest}[/] for {model}:{version}: Kubernetes deploys it by this digest"
        )


def deploy_cmd(
    model: str,
    version: str,
    replicas: Annotated[int, typer.Option(min=1, help="Replicas to run.")] = 1,
    policies: PoliciesOpt = DEFAULT_POLICIES,
    json: JsonFlag = False,
) -> None:
    """Run a version's service (packaging it if needed) and wait until it is ready."""
    registry().get(model, version)
    with err_console.status(f"starting {model}:{version} ..."):
        deployment = _runtime(policies).deploy(model, version, replicas)
    if json:
        emit_json({"model": model, "version": version, "endpoints": list(deployment.endpoints)})
    else:
        console.print(f"{model}:{version} ready at " + ", ".join(deployment.endpoints))


def unload_idle_cmd(policies: PoliciesOpt = DEFAULT_POLICIES, json: JsonFlag = False) -> None:
    """Stop lazy versions idle past their idle_unload_s (what the idle-unload flow runs on its schedule).

    Never an eager model's version, a route's canary or shadow, a version in a running rollout
    or the previous stable within its rollback window. Replicas leave the gateways' list first.
    """
    from fleet.catalog.policies.loader import load_policies
    from fleet.control.lazy import LoadController

    stopped = LoadController(registry().store, load_policies(policies), _runtime(policies)).unload_idle()
    rows = [
        {"model": u.model, "version": u.version, "reason": u.reason, "memory_mib": round(u.memory_mib, 1)}
        for u in stopped
    ]
    if json:
        emit_json(rows)
        return
    for r in rows:
        console.print(f"stopped {r['model']}:{r['version']}: {r['reason']} ({r['memory_mib']:.0f} MiB)")
    if not rows:
        console.print("nothing idle to stop")


def undeploy_cmd(model: str, version: str, policies: PoliciesOpt = DEFAULT_POLICIES, json: JsonFlag = False) -> None:
    """Stop every replica of a version."""
    _runtime(policies).undeploy(model, version)
    if json:
        emit_json({"model": model, "version": version, "stopped": True})
    else:
        console.print(f"stopped {model}:{version}")


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
    worker_fds: Annotated[
        str | None,
        typer.Option(
            "--worker-fds",
            hidden=True,
            help="Internal: SHARED,PRIVATE listening socket descriptors a --workers supervisor hands a worker.",
        ),
    ] = None,
) -> None:
    """Run the gateway alone, in front of the runtime's deployments.

    FLEET_ADMIN_TOKEN turns on the admin API (/admin/...); without it the admin API is off.
    FLEET_REDIS_URL (redis://HOST:PORT/DB, rediss:// for TLS) shares every tenant's quota
    between all gateways and workers; without it each gateway process enforces quotas alone.

    Byte budgets come from the policies' gateway: section. FLEET_DECODE_WORKERS: processes that decode large bodies (0: on the event loop).
    """
    import dataclasses

    from fleet.catalog.policies.loader import load_policies
    from fleet.gateway import FleetView, Settings, create_app
    from fleet.gateway import workers as gw_workers
    from fleet.local.up import check_port_free, serve_gateway
    from fleet.store import open_store
    from fleet.usage.prices import gateway_prices

    _gateway_logging(access_log)
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
        _supervise(workers, host, port, sys.argv[1:], _workers_banner(workers, host, shown, grpc_port))
        return
    if grpc_port and worker_fds is None:
        check_port_free(grpc_port, "gateway's gRPC endpoint", "--grpc-port", host)
    sockets = None
    if worker_fds is not None:  # a worker: its sockets come from the supervisor
        shared_fd, private_fd = (int(x) for x in worker_fds.split(","))
        sockets = [gw_workers.from_fd(shared_fd), gw_workers.from_fd(private_fd)]
        # announced (and reached by the control plane) at its own port
        public_url = gw_workers.with_port(public_url or f"http://{shown}:{port}", sockets[1].getsockname()[1])
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
    app = create_app(FleetView(store, _runtime(policies)), load_policies(policies), settings, prices=prices)
    url = f"http://{shown}:{port}"

    def ready() -> None:
        if worker_fds is not None:
            return  # the supervisor reports for all of them
        admin = "on (FLEET_ADMIN_TOKEN)" if settings.admin_token else "off (set FLEET_ADMIN_TOKEN to turn it on)"
        console.print(
            f"gateway {settings.gateway_id} listening on http://{f'[{host}]' if ':' in host else host}:{port} "
            f"(store {store.url})\n"
            f"  inference  {url}/v2/models/MODEL/infer\n  gRPC       {_grpc_line(app, shown)}\n"
            f"  health     {url}/v2/health/ready\n"
            f"  metrics    {url}/metrics\n  admin API  {admin}\n"
            f"  access log {'on' if access_log else 'off (--access-log)'}; Ctrl-C stops",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )

    serve_gateway(app, port, ready, host=host, sockets=sockets)


def _supervise(n: int, host: str, port: int, argv: list[str], on_ready: Callable[[Any], None]) -> None:
    """N worker processes (``fleet <argv> --worker-fds ...``) on shared sockets, until stopped;
    ``on_ready(supervisor)`` once every one of them is ready."""
    import signal

    from fleet.gateway import workers as gw_workers

    supervisor = gw_workers.Supervisor(
        n,
        host,
        port,
        lambda i, a, b: gw_workers.worker_argv(argv, i, a, b),
        dict(os.environ),
        lambda line: err_console.print(line, markup=False),
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
            f"  health     {url}/v2/health/ready\n  metrics    {url}/metrics (all workers added up)\n"
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


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def status_cmd(policies: PoliciesOpt = DEFAULT_POLICIES, json: JsonFlag = False) -> None:
    """Models, versions, weights, replicas and their health; each version's loading mode (eager or
    lazy), whether it is loaded, starting or unloaded, and when a gateway last sent it a request."""
    from fleet.catalog.policies.loader import load_policies
    from fleet.catalog.routes.store import Router
    from fleet.catalog.routes.table import RouteTable
    from fleet.cli.doctor import skipped
    from fleet.control.doctor import scan
    from fleet.logs.activity import last_requests

    reg = registry()
    router = Router(reg.store, reg)
    runtime = _runtime(policies)
    running = {(d.model, d.version): d for d in runtime.list()}
    specs = load_policies(policies).models
    asked = last_requests(reg.store)
    now = time.time()
    rows = []
    versions, bad_manifests = reg.scan()  # every manifest read once, for the table and the bad records
    bad = scan(reg.store, history=False, bad_manifests=bad_manifests)
    unreadable = {f.key for f in bad}
    tables: dict[str, RouteTable] = {}
    for mv in versions:
        # a model whose route is unreadable is shown without traffic; doctor's list says why
        if mv.model not in tables:
            key = f"routes/{mv.model}.json"
            tables[mv.model] = RouteTable(model=mv.model) if key in unreadable else router.get(mv.model)
        t = tables[mv.model]
        role = []
        if t.stable == mv.version:
            role.append(f"stable {100 - (t.canary.weight if t.canary else 0):g}%")
        if t.canary and t.canary.version == mv.version:
            role.append(f"canary {t.canary.weight:g}%")
        if t.shadow and t.shadow.version == mv.version:
            role.append(f"shadow {t.shadow.percent:g}%")
        role += [f"pin {tenant}" for tenant, v in sorted(t.pins.items()) if v == mv.version]
        health = runtime.health(mv.model, mv.version) if (mv.model, mv.version) in running else {}
        spec = specs.get(mv.model)
        last = asked.get((mv.model, mv.version))
        rows.append(
            {
                "model": mv.model,
                "version": mv.version,
                "state": mv.state.value,
                "traffic": ", ".join(role),
                "replicas": len(health),
                "healthy": sum(health.values()),
                "endpoints": sorted(health),
                "loading": spec.loading if spec else None,
                # loaded: a replica answers; starting: replicas run, none ready yet; unloaded: none runs
                "load_state": "loaded" if any(health.values()) else "starting" if health else "unloaded",
                "last_request_at": last,
                "last_request_ago_s": None if last is None else round(now - last, 1),
            }
        )
    skipped(bad)  # on stderr: --json's list of versions stays what scripts expect
    if json:
        emit_json(rows)
        return
    table(
        None,
        ["model", "version", "state", "traffic", "replicas", "healthy", "loading", "loaded", "last request"],
        [
            [
                r["model"],
                r["version"],
                r["state"],
                r["traffic"] or "-",
                r["replicas"],
                r["healthy"],
                r["loading"] or "-",
                r["load_state"],
                "-" if r["last_request_ago_s"] is None else f"{_ago(r['last_request_ago_s'])} ago",
            ]
            for r in rows
        ],
    )
    from fleet import audit
    from fleet.catalog import gateway_directory

    now = audit.now()
    for g in gateway_directory.live(reg.store):
        console.print(f"gateway {g.id} at {g.url} (heartbeat {(now - g.heartbeat_at).total_seconds():.0f} s ago)")


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
    runtime = _runtime(policies)
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
        f"  fleet models train {settings.model} 1.1.0 --seed 11 && fleet rollout {settings.model} 1.1.0",
        "fleet status shows versions, weights and replicas; Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)
