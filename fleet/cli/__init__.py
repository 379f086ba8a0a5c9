"""The ``fleet`` command line: tables for people, ``--json`` for scripts.

Errors are one line on stderr and a non-zero exit (1 for a refused operation, 2 for bad
usage), never a traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer
from pydantic import ValidationError

from fleet import __version__
from fleet.cli import (
    doctor,
    experiments,
    flows,
    gateway,
    logs,
    models,
    plan,
    policies,
    route,
    serving,
    tenants,
    top,
    usage,
)
from fleet.cli._output import fail
from fleet.errors import FleetError
from fleet.validation import explain

try:  # typer 0.29 ships its own copy of click; the exceptions are its
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - a typer on plain click
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # type: ignore[no-redef]

app = typer.Typer(
    name="fleet",
    help="Run an ML serving fleet: registry, routing, tenants, policies, packaging, serving, canary and blue-green "
    "rollouts, a live view (fleet top), monitoring and retraining, and the production placement plan.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: no boxes, no "<bool>" type column, fits 80 columns
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(models.app, name="models")
app.add_typer(route.app, name="route")
app.add_typer(tenants.app, name="tenants")
app.add_typer(policies.app, name="policies")
app.command("up")(gateway.up_cmd)
app.command("package")(serving.package_cmd)
app.command("deploy")(serving.deploy_cmd)
app.command("undeploy")(serving.undeploy_cmd)
app.command("unload-idle")(serving.unload_idle_cmd)
app.command("gateway")(gateway.gateway_cmd)
app.command("status")(serving.status_cmd)
app.command("top")(top.top_cmd)
app.add_typer(flows.app, name="flows")
app.command("rollout")(flows.rollout_cmd)
app.command("approve")(flows.approve_cmd)
app.command("rollback")(flows.rollback_cmd)
app.add_typer(experiments.app, name="experiment")
app.command("demo")(flows.demo_cmd)
app.command("plan")(plan.plan_cmd)
app.command("doctor")(doctor.doctor_cmd)
app.command("usage")(usage.usage_cmd)
app.add_typer(logs.app, name="logs")

# Options of the root that are also taken after the subcommand (`fleet models list --store X`),
# with a value and without one.
GLOBAL_OPTIONS = ("--store",)
GLOBAL_FLAGS = ("-v", "--verbose")
# Commands that set up their own logging and keep what libraries print in their log.
SERVERS = (("up",), ("gateway",), ("flows", "serve"))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fleet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
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
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Also show what libraries print (torch's, BentoML's warnings and logs), kept off the terminal "
            "otherwise; before or after the subcommand.",
        ),
    ] = False,
) -> None:
    if store:
        os.environ["FLEET_STORE"] = store
    # Commands name each bad record they skip themselves; without a logging setup Python would
    # print the store's own warning too. Servers (`fleet gateway`, `fleet up`) turn it back on.
    logging.getLogger("fleet.store").disabled = True
    _local_fleet_defaults()
    ctx.call_on_close(_tell_gateways)


def _tell_gateways() -> None:
    """A command that changed a route or tenant tells the gateways before it exits: the change
    bus did if it is configured and up, else a push to every live gateway (which would see it
    at its next poll anyway; nothing is pushed without an admin token)."""
    from fleet import changes

    if not changes.noted():
        return
    from fleet.catalog import gateway_directory
    from fleet.errors import FleetError
    from fleet.store import open_store

    try:
        gateway_directory.tell(open_store())
    except (FleetError, OSError):
        pass


def _local_fleet_defaults() -> None:
    """Next to a running ``fleet up`` (same folder), talk to its Prefect server and gateways
    without exporting anything: PREFECT_API_URL, FLEET_ADMIN_TOKEN and (with ``--gateways N``)
    FLEET_REDIS_URL, the change bus, come from ``.fleet/`` when not set."""
    import json

    from fleet.processes import alive

    if "FLEET_ADMIN_TOKEN" not in os.environ and os.path.exists(".fleet/admin-token"):
        with open(".fleet/admin-token") as f:
            os.environ["FLEET_ADMIN_TOKEN"] = f.read().strip()
    if "FLEET_REDIS_URL" not in os.environ and os.path.exists(".fleet/run/redis.json"):
        try:
            with open(".fleet/run/redis.json") as f:
                redis = json.load(f)
        except (OSError, ValueError):
            redis = {}
        if redis.get("port") and alive(int(redis.get("pid", 0)), b"redis-server"):
            os.environ["FLEET_REDIS_URL"] = f"redis://127.0.0.1:{int(redis['port'])}/0"
    if "PREFECT_API_URL" not in os.environ and os.path.exists(".fleet/run/prefect.json"):
        try:
            with open(".fleet/run/prefect.json") as f:
                server = json.load(f)
        except (OSError, ValueError):
            return
        if alive(int(server.get("pid", 0)), b"prefect") and server.get("port"):
            os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{server['port']}/api"
            os.environ.setdefault("PREFECT_HOME", os.path.abspath(".fleet/prefect"))


def hoist_global_options(argv: list[str]) -> list[str]:
    """Move ``--store X`` / ``--store=X`` and ``-v`` from anywhere before ``--`` to the front,
    where the root command reads them: operators type global options after the subcommand too."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        name = arg.split("=", 1)[0]
        if arg in GLOBAL_FLAGS:
            front.append(arg)
        elif name in GLOBAL_OPTIONS and "=" in arg:
            front.append(arg)
        elif name in GLOBAL_OPTIONS:
            if i + 1 == len(argv) or argv[i + 1].startswith("-"):
                fail(f"option {arg} needs a value (see `fleet --help`)", code=2)
            front += argv[i : i + 2]
            i += 1
        else:
            rest.append(arg)
        i += 1
    return front + rest


def _usage_error(exc: UsageError) -> str:
    where = exc.ctx.command_path if exc.ctx is not None else "fleet"
    return f"{exc.format_message()} (see `{where} --help`)"


def _keep_libraries_quiet(args: list[str]) -> None:
    """Unless ``-v`` is given, what libraries print stays off the terminal (``fleet.cli.quiet``);
    servers keep their own logging. ``args`` have their global options in front (hoisted)."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        if args[i] in GLOBAL_FLAGS:
            return
        i += 2 if args[i] in GLOBAL_OPTIONS else 1
    if any(tuple(args[i : i + len(s)]) == s for s in SERVERS):
        return
    from fleet.cli import quiet

    quiet.install()


def main() -> None:
    try:
        args = hoist_global_options(sys.argv[1:])
        _keep_libraries_quiet(args)
        code = app(args=args, prog_name="fleet", standalone_mode=False)
        if code == 130:  # typer turns Ctrl-C into exit code 130
            fail("interrupted", code=130)
        if isinstance(code, int) and code:
            raise SystemExit(code)
    except NoArgsIsHelpError as exc:  # `fleet models`: the group's help, as asked
        sys.stdout.write(exc.format_message() + "\n")
        raise SystemExit(2) from None
    except UsageError as exc:  # bad usage: one line too, exit 2 (click's default is a box)
        fail(_usage_error(exc), code=2)
    except ClickException as exc:
        fail(exc.format_message(), code=exc.exit_code)
    except typer.Abort:
        fail("aborted", code=1)
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
        fail(f"internal error {type(exc).__name__}: {exc} (set FLEET_DEBUG=1 for the traceback{_library_lines()})")


def _library_lines() -> str:
    """A hint at what libraries printed before an internal error, kept off the terminal."""
    from fleet.cli import quiet

    n = len(quiet.captured())
    return f"; -v shows the {n} lines libraries printed" if n else ""


if __name__ == "__main__":
    sys.exit(main())
