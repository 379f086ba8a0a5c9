"""The ``fleet`` command line: tables for people, ``--json`` for scripts.

Errors are one line on stderr and a non-zero exit (1 for a refused operation, 2 for bad
usage), never a traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from pydantic import ValidationError

from fleet import __version__
from fleet.cli import flows, models, plan, policies, route, serving, tenants
from fleet.cli._output import fail
from fleet.errors import FleetError
from fleet.validation import explain

app = typer.Typer(
    name="fleet",
    help="Run an ML serving fleet: registry, routing, tenants, policies, packaging, serving, canary rollouts, "
    "monitoring and retraining, and the production placement plan.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(models.app, name="models")
app.add_typer(route.app, name="route")
app.add_typer(tenants.app, name="tenants")
app.add_typer(policies.app, name="policies")
app.command("up")(serving.up_cmd)
app.command("package")(serving.package_cmd)
app.command("deploy")(serving.deploy_cmd)
app.command("undeploy")(serving.undeploy_cmd)
app.command("gateway")(serving.gateway_cmd)
app.command("status")(serving.status_cmd)
app.add_typer(flows.app, name="flows")
app.command("rollout")(flows.rollout_cmd)
app.command("approve")(flows.approve_cmd)
app.command("rollback")(flows.rollback_cmd)
app.command("demo")(flows.demo_cmd)
app.command("plan")(plan.plan_cmd)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fleet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            envvar="FLEET_STORE",
            help="Object store: file://PATH or s3://BUCKET/PREFIX, prefix optional "
            "(default file://./.fleet/store). S3-compatible endpoint: AWS_ENDPOINT_URL_S3.",
            show_envvar=True,
        ),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    if store:
        os.environ["FLEET_STORE"] = store
    _local_fleet_defaults()


def _local_fleet_defaults() -> None:
    """Next to a running ``fleet up`` (same folder), talk to its Prefect server and gateways
    without exporting anything: PREFECT_API_URL and FLEET_ADMIN_TOKEN come from ``.fleet/``
    when not set."""
    import json

    from fleet.processes import alive

    if "FLEET_ADMIN_TOKEN" not in os.environ and os.path.exists(".fleet/admin-token"):
        with open(".fleet/admin-token") as f:
            os.environ["FLEET_ADMIN_TOKEN"] = f.read().strip()
    if "PREFECT_API_URL" not in os.environ and os.path.exists(".fleet/run/prefect.json"):
        try:
            with open(".fleet/run/prefect.json") as f:
                server = json.load(f)
        except (OSError, ValueError):
            return
        if alive(int(server.get("pid", 0)), b"prefect") and server.get("port"):
            os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{server['port']}/api"
            os.environ.setdefault("PREFECT_HOME", os.path.abspath(".fleet/prefect"))


def main() -> None:
    try:
        app()
    except FleetError as exc:
        fail(str(exc))
    except ValidationError as exc:  # a record or input that slipped past a friendlier check
        fail(f"invalid {exc.title}: " + "; ".join(explain(exc, None)))
    except OSError as exc:
        fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except Exception as exc:  # a bug: say so in one line; FLEET_DEBUG=1 shows the traceback
        if os.environ.get("FLEET_DEBUG"):
            raise
        fail(f"internal error {type(exc).__name__}: {exc} (set FLEET_DEBUG=1 for the traceback)")


if __name__ == "__main__":
    sys.exit(main())
