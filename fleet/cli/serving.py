"""``fleet package|deploy|undeploy|unload-idle|status``: from a registered version to running replicas."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from fleet.cli._output import JsonFlag, console, emit_json, err_console, registry, table

PoliciesOpt = Annotated[
    Path, typer.Option("--policies", envvar="FLEET_POLICIES", help="Policy folder or file.", show_envvar=True)
]
DEFAULT_POLICIES = Path("policies")


def runtime_for(policies_path: Path):  # noqa: ANN202
    """The runtime these commands and ``fleet gateway|up`` act through, its progress on stderr."""
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
            help="Rebuild even if a Bento of this artifact and policy exists (the Bento holds code only; the weights "
            "are verified and cached again in the local artifact cache)."
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
        deployment = runtime_for(policies).deploy(model, version, replicas)
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

    stopped = LoadController(registry().store, load_policies(policies), runtime_for(policies)).unload_idle()
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
    runtime_for(policies).undeploy(model, version)
    if json:
        emit_json({"model": model, "version": version, "stopped": True})
    else:
        console.print(f"stopped {model}:{version}")


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def status_cmd(policies: PoliciesOpt = DEFAULT_POLICIES, json: JsonFlag = False) -> None:
    """Models, versions, weights, replicas and their health; each version's loading mode (eager or
    lazy), whether it is loaded, starting or unloaded, and when a gateway last sent it a request."""
    from fleet import records
    from fleet.catalog.policies.loader import load_policies
    from fleet.catalog.rollouts import RolloutState, state_key
    from fleet.catalog.routes.store import Router
    from fleet.catalog.routes.table import RouteTable
    from fleet.cli.doctor import skipped
    from fleet.control.doctor import scan
    from fleet.errors import IntegrityError
    from fleet.logs.activity import last_requests

    reg = registry()
    router = Router(reg.store, reg)
    runtime = runtime_for(policies)
    running = {(d.model, d.version): d for d in runtime.list()}
    specs = load_policies(policies).models
    asked = last_requests(reg.store)
    now = time.time()
    rows = []
    versions, bad_manifests = reg.scan()  # every manifest read once, for the table and the bad records
    bad = scan(reg.store, history=False, bad_manifests=bad_manifests)
    unreadable = {f.key for f in bad}
    tables: dict[str, RouteTable] = {}
    rollouts: dict[str, RolloutState | None] = {}
    for mv in versions:
        # a model whose route is unreadable is shown without traffic; doctor's list says why
        if mv.model not in tables:
            key = f"routes/{mv.model}.json"
            tables[mv.model] = RouteTable(model=mv.model) if key in unreadable else router.get(mv.model)
        t = tables[mv.model]
        if mv.model not in rollouts:
            try:
                rollouts[mv.model] = records.load_or_none(reg.store, state_key(mv.model), RolloutState)[0]
            except IntegrityError:  # a bad rollout record is fleet doctor's to name, never this table's end
                rollouts[mv.model] = None
        rolling = rollouts[mv.model]
        role = []
        if t.stable == mv.version:
            role.append(f"stable {100 - (t.canary.weight if t.canary else 0):g}%")
        if t.canary and t.canary.version == mv.version:
            role.append(f"canary {t.canary.weight:g}%")
        if t.shadow and t.shadow.version == mv.version:
            role.append(f"shadow {t.shadow.percent:g}%")
        role += [f"pin {tenant}" for tenant, v in sorted(t.pins.items()) if v == mv.version]
        if rolling is not None and not rolling.done and mv.version in (rolling.version, rolling.champion):
            name = ("green" if mv.version == rolling.version else "blue") if rolling.strategy == "blue-green" else ""
            role.append(f"{name} ({rolling.shown})" if name else f"rollout: {rolling.shown}")
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
