"""``fleet flows serve``, ``fleet rollout``, ``fleet approve``, ``fleet rollback``: the Prefect flows
from the terminal. Runs go through the deployments, so they show in the Prefect UI."""

from __future__ import annotations

import asyncio
import json as jsonlib
import os
import time
from typing import Annotated, Any

import typer

from fleet.cli._output import JsonFlag, console, emit_json, err_console
from fleet.errors import ConfigError, FleetError, InvalidInput, NotFound

app = typer.Typer(help="Prefect deployments of the fleet's flows.", no_args_is_help=True)

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class FlowFailed(FleetError):
    status = 409


@app.command("serve")
def serve_cmd() -> None:
    """Register the rollout, rollback (and monitoring) deployments and run their flow runs.

    Needs PREFECT_API_URL (fleet up starts a server and sets it). Ctrl-C stops.
    """
    from flows.serve import serve

    _api_url()
    serve()


@app.command("deploy")
def deploy_cmd(
    image: Annotated[
        str, typer.Option("--image", help="The flows image, <repository>:<tag> (Dockerfile.flows), pushed to ECR.")
    ],
    work_pool: Annotated[str, typer.Option("--work-pool", help="The Kubernetes work pool.")] = "fleet-kubernetes",
    json: JsonFlag = False,
) -> None:
    """Register every deployment `fleet flows serve` serves, schedules included, on the cluster's
    Kubernetes work pool: the Prefect worker there runs each flow run as a Job of IMAGE.

    Needs PREFECT_API_URL (and PREFECT_API_AUTH_STRING: the server has basic auth) pointed at the
    cluster's Prefect server, and FLEET_STORE at its store (the per-model monitors are scheduled
    for the models registered there).
    """
    from flows.serve import deploy, schedules

    _api_url()
    repository, _, tag = image.rpartition(":")
    if not repository or not tag or "/" in tag:
        raise InvalidInput(f"--image {image!r}; expected <repository>:<tag>, e.g. <account>.dkr.ecr.../flows:0.1.0")
    pool = _work_pool(work_pool)
    if pool.type != "kubernetes":
        raise ConfigError(
            f"work pool {work_pool!r} is of type {pool.type!r}; expected 'kubernetes' (the one the cluster's "
            "Prefect worker polls; `fleet flows serve` runs the local fleet's flows)"
        )
    made = deploy(image, work_pool)
    rows = [{"deployment": f"{d.flow_name}/{d.name}", "schedules": list(schedules(d))} for d in made]
    if json:
        emit_json({"work_pool": work_pool, "image": image, "deployments": rows})
        return
    for row in rows:
        console.print(f"{row['deployment']:<40} {', '.join(row['schedules']) or 'on demand'}")
    err_console.print(f"{len(rows)} deployments on work pool {work_pool} with image {image}")


def _work_pool(name: str) -> Any:  # noqa: ANN401 - a prefect WorkPool
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    async def read() -> Any:  # noqa: ANN401
        async with get_client() as client:
            return await client.read_work_pool(name)

    try:
        return asyncio.run(read())
    except ObjectNotFound:
        raise NotFound(
            f"work pool {name!r} does not exist on {_api_url()}; the cluster's Prefect worker creates it when it "
            "starts (infra/charts.py)"
        ) from None


def _api_url() -> str:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise ConfigError("PREFECT_API_URL is not set; start the fleet with `fleet up` or point it at a Prefect server")
    return url


def _ui_link(flow_run_id: str) -> str:
    ui = os.environ.get("PREFECT_UI_URL") or _api_url().removesuffix("/api")
    return f"{ui}/runs/flow-run/{flow_run_id}"


def _start(deployment: str, parameters: dict[str, Any]) -> Any:  # noqa: ANN401 - a FlowRun
    from prefect.deployments import run_deployment

    _api_url()
    try:
        return run_deployment(deployment, parameters=parameters, timeout=0, as_subflow=False)
    except Exception as exc:  # the Prefect client raises many kinds: say which call failed
        name = type(exc).__name__
        hint = "; is `fleet flows serve` (or `fleet up`) running?" if "NotFound" in name or "404" in str(exc) else ""
        raise FlowFailed(f"could not start deployment {deployment}: {name}: {exc}{hint}") from None


def _run_state(flow_run_id: Any) -> tuple[str, str]:  # noqa: ANN401
    from prefect.client.orchestration import get_client

    async def read() -> tuple[str, str]:
        async with get_client() as client:
            run = await client.read_flow_run(flow_run_id)
            return (run.state.type.value if run.state else "PENDING", (run.state.message or "") if run.state else "")

    return asyncio.run(read())


def _parse_overrides(values: list[str]) -> dict[str, Any]:
    """``["steps=[10,50,100]", "gates.max_p99_ratio=1.5"]`` → ``{"steps": [...], "gates": {...}}``."""
    out: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise InvalidInput(f"--set {item!r}; expected KEY=VALUE, e.g. --set analysis_window_s=30")
        try:
            value = jsonlib.loads(raw)
        except ValueError:
            value = raw
        head, _, rest = key.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = value
        else:
            out[key] = value
    return out


def rollout_cmd(
    model: str,
    version: str,
    set_: Annotated[
        list[str], typer.Option("--set", help="Override a rollout-policy key, e.g. --set steps=[10,100].")
    ] = [],  # noqa: B006
    strategy: Annotated[
        str | None,
        typer.Option(
            "--strategy",
            help="canary (weight steps beside the stable) or blue-green (green at the stable's replica count, "
            "one switch of 100%, a bake with switch-back on a breach). Default: the rollout policy's.",
        ),
    ] = None,
    follow: Annotated[bool, typer.Option(help="Follow progress until the run ends.")] = True,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Start nothing: print how long the policy would take to "
            "promote a good canary and to catch bad ones, from simulated rollouts at "
            "the model's traffic.",
        ),
    ] = False,
    rps: Annotated[
        float | None,
        typer.Option(
            "--rps",
            min=0.001,
            help="With --dry-run: the traffic to simulate, in "
            "requests/s (default: the stable's last 5 minutes, else the policy's "
            "expected_rps).",
        ),
    ] = None,
    json: JsonFlag = False,
) -> None:
    """Start a rollout of VERSION (canary or blue-green) and follow it: phases, weights, verdicts, the run in the UI.

    Exits 0 when the version was promoted (the run goes on to retire the previous stable
    after the rollback window), 1 when it was rolled back or refused. `fleet rollback MODEL`
    ends it at once: a blue-green rollout switches back to blue.
    """
    from fleet.catalog.policies.loader import load_policies
    from fleet.control.rollout.effects import apply_overrides

    overrides = _parse_overrides(set_)
    if strategy is not None:
        if strategy not in ("canary", "blue-green"):
            raise InvalidInput(f"--strategy {strategy!r}; expected canary or blue-green")
        overrides["strategy"] = strategy
    # refuse a bad override here, in a second, rather than in a flow run that fails later
    policy = apply_overrides(load_policies(os.environ.get("FLEET_POLICIES", "policies")).rollout_for(model), overrides)
    if dry_run:
        from fleet.cli.dry_run import dry_run as simulate_rollouts

        simulate_rollouts(model, version, policy, rps, json)
        return
    from flows.serve import ROLLOUT

    run = _start(ROLLOUT, {"model": model, "version": version, "policy_overrides": overrides})
    link = _ui_link(str(run.id))
    if not json:
        err_console.print(f"rollout of {model}:{version} started: {link}")
    if not follow:
        if json:
            emit_json({"flow_run_id": str(run.id), "url": link})
        return
    final, message = _follow(model, version, run.id, policy.rollback_window_s, quiet=json)
    if json:
        emit_json({"flow_run_id": str(run.id), "url": link, "state": final, "message": message})
    if final != "COMPLETED":
        raise FlowFailed(f"rollout of {model}:{version} ended {final.lower()}: {message} ({link})")
    if not json:
        console.print(f"[green]{message}[/]", soft_wrap=True)  # one line, for whoever greps it


def _follow(model: str, version: str, flow_run_id: Any, warm_s: float, *, quiet: bool) -> tuple[str, str]:  # noqa: ANN401
    """Print each change of the stored rollout state until the flow run is final, or until it
    promoted the version: the run then only keeps the previous stable warm for ``warm_s``
    (the rollback window) before retiring it, and nobody need wait for that."""
    from fleet import records
    from fleet.catalog.rollouts import RolloutState, state_key
    from fleet.store import open_store

    store = open_store()
    seen: tuple = ()
    while True:
        state, message = _run_state(flow_run_id)
        stored, _ = records.load_or_none(store, state_key(model), RolloutState)
        if stored is not None and stored.version == version and stored.run_id == str(flow_run_id):
            last = stored.reports[-1] if stored.reports else None
            now = (stored.shown, stored.weight, last.ticks if last else 0)
            if now != seen and not quiet:
                verdict = f" — {last.summary}" if last and last.summary else ""
                err_console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {stored.shown} {stored.weight:g}%{verdict}")
            seen = now
            if stored.phase == "promoted" and state not in FINAL:
                warm = (
                    f"{stored.champion} stays ready for an instant rollback for {warm_s:g} s" if stored.champion else ""
                )
                return "COMPLETED", f"promoted {model}:{version}" + (f"; {warm}" if warm else "")
        if state in FINAL:
            return state, message
        time.sleep(1.0)


def approve_cmd(
    model: str,
    reject: Annotated[bool, typer.Option("--reject", help="Refuse instead: the rollout rolls back.")] = False,
    note: Annotated[str, typer.Option(help="Why, for the record.")] = "",
    json: JsonFlag = False,
) -> None:
    """Answer a rollout that waits for approval before 100 % (blue-green: before the switch)."""
    from prefect.flow_runs import resume_flow_run

    from fleet import audit, records
    from fleet.catalog.rollouts import RolloutState, state_key
    from fleet.store import open_store

    stored, _ = records.load_or_none(open_store(), state_key(model), RolloutState)
    if stored is None or stored.phase != "approval":
        where = f"is {stored.phase}" if stored else "has none"
        raise InvalidInput(f"{model}'s rollout {where}; only one waiting for approval can be answered")
    _api_url()
    resume_flow_run(stored.run_id, run_input={"approve": not reject, "note": note, "by": audit.actor()})
    if json:
        emit_json({"model": model, "version": stored.version, "approved": not reject, "run_id": stored.run_id})
    else:
        console.print(f"{'rejected' if reject else 'approved'} the rollout of {model}:{stored.version}")


def rollback_cmd(
    model: str,
    reason: Annotated[str, typer.Option("--reason", "-r", help="Why: recorded in the audit log.")],
    to: Annotated[
        str | None,
        typer.Option("--to", help="Version to go back to (default: end the canary, else the previous stable)."),
    ] = None,
    direct: Annotated[
        bool, typer.Option("--direct", help="Do it here, without Prefect (when its server is down).")
    ] = False,
    json: JsonFlag = False,
) -> None:
    """Put MODEL's traffic back on a good version now, through the rollback flow."""
    if direct:
        from fleet.catalog import gateway_directory
        from fleet.catalog.routes.rollback import rollback
        from fleet.cli._output import router
        from fleet.runtime.packaged import packaged_runtime

        r = router()
        result = rollback(r, model, to, why=reason, runtime=packaged_runtime())
        pushed = gateway_directory.tell(r.store)
        out = {
            "from_version": result.from_version,
            "to_version": result.to_version,
            "rejected": result.rejected,
            "revision": result.table.revision,
            "gateways_notified": pushed or {},
            "change_bus": pushed is None,
        }
    else:
        from flows.serve import ROLLBACK

        run = _start(ROLLBACK, {"model": model, "to_version": to, "reason": reason})
        deadline = time.monotonic() + 120
        state, message = _run_state(run.id)
        while state not in FINAL and time.monotonic() < deadline:
            time.sleep(0.5)
            state, message = _run_state(run.id)
        if state != "COMPLETED":
            raise FlowFailed(
                f"rollback of {model} ended {state.lower()}: {message} ({_ui_link(str(run.id))}); "
                "`fleet rollback --direct` does it without Prefect"
            )
        from fleet.cli._output import router

        table = router().get(model)
        out = {
            "flow_run_id": str(run.id),
            "url": _ui_link(str(run.id)),
            "to_version": table.stable,
            "revision": table.revision,
            "message": message,
        }
    if json:
        emit_json(out)
    else:
        console.print(
            f"{model}: traffic moved to {out.get('to_version')}"
            + (f", {out['rejected']} rejected" if out.get("rejected") else "")
        )


def demo_cmd(
    model: Annotated[str, typer.Option(help="The demo model fleet up serves.")] = "demo-classifier",
    json: JsonFlag = False,
) -> None:
    """Run the scripted scenario on the local fleet (start it first with `fleet up`, same folder).

    A good version promoted through canary steps, another blue-green, a bad one rolled back,
    drift → retrain → a new version promoted, a corrupted batch → an alert with retraining
    blocked. A few minutes; ends with a table.
    """
    from fleet.cli._output import table
    from fleet.local.demo import run, summary_table

    started = time.monotonic()
    results = run(model, lambda line: err_console.print(f"[dim]{time.monotonic() - started:6.1f}s[/] {line}"))
    if json:
        emit_json([r.__dict__ for r in results])
    else:
        table("fleet demo", *summary_table(results))
    if not all(r.ok for r in results):
        raise FlowFailed("the demo did not go as expected: " + "; ".join(r.step for r in results if not r.ok))
