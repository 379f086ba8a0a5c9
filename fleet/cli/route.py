"""``fleet route``: show and change how a model's traffic is split."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

import typer

from fleet.catalog.routes.table import RouteTable
from fleet.cli._output import JsonFlag, Reason, console, emit_json, err_console, router, table, when
from fleet.errors import InvalidInput

app = typer.Typer(help="Show and change routing: stable, canary weight, shadow, tenant pins.", no_args_is_help=True)


def _print(t: RouteTable) -> None:
    canary = f"{t.canary.version} at {t.canary.weight:g}%" if t.canary else "-"
    shadow = f"{t.shadow.version} mirroring {t.shadow.percent:g}%" if t.shadow else "-"
    console.print(f"[bold]{t.model}[/] revision {t.revision}")
    console.print(f"  stable  {t.stable or '-'}\n  canary  {canary}\n  shadow  {shadow}")
    for tenant, version in sorted(t.pins.items()):
        console.print(f"  pin     {tenant} → {version}")
    if t.updated_at:
        console.print(f"  last change {when(t.updated_at)} by {t.updated_by}: {t.reason}")


def _done(t: RouteTable, json: bool, unchanged: bool = False) -> None:
    if unchanged:  # on stderr: --json still prints the (current) table
        err_console.print(
            f"nothing changed: the route of {t.model} already is this (revision {t.revision} kept, nothing written)",
            markup=False,
            highlight=False,
        )
    if json:
        emit_json(t)
    else:
        _print(t)


@app.command()
def show(model: str, json: JsonFlag = False) -> None:
    """Show the current route table."""
    _done(router().get(model), json)


@app.command("set")
def set_(
    model: str,
    reason: Reason,
    stable: Annotated[str | None, typer.Option(help="Version that takes the traffic not sent to the canary.")] = None,
    canary: Annotated[
        str | None,
        typer.Option(
            help="Canary version (keeps the current one if omitted). Replacing a canary that takes "
            "traffic needs --weight too; a first canary starts at 0 % unless --weight is given."
        ),
    ] = None,
    weight: Annotated[float | None, typer.Option(min=0, max=100, help="Canary weight, percent 0-100.")] = None,
    shadow: Annotated[str | None, typer.Option(help="Version that receives mirrored traffic.")] = None,
    shadow_percent: Annotated[float | None, typer.Option(min=0, max=100, help="Percent of requests mirrored.")] = None,
    no_canary: Annotated[bool, typer.Option("--no-canary", help="Remove the canary.")] = False,
    no_shadow: Annotated[bool, typer.Option("--no-shadow", help="Remove the shadow.")] = False,
    json: JsonFlag = False,
) -> None:
    """Change stable / canary / shadow; fields not named keep their value.

    A change that leaves the route as it is writes nothing and says so.
    """
    if no_canary and (canary or weight is not None):
        raise InvalidInput("--no-canary cannot be combined with --canary or --weight")
    if no_shadow and (shadow or shadow_percent is not None):
        raise InvalidInput("--no-shadow cannot be combined with --shadow or --shadow-percent")
    if not any((stable, canary, weight is not None, shadow, shadow_percent is not None, no_canary, no_shadow)):
        raise InvalidInput("nothing to change; expected --stable, --canary, --weight, --shadow, --no-canary ...")
    r = router()
    t = r.set(
        model,
        stable=stable,
        canary=canary,
        weight=weight,
        shadow=shadow,
        shadow_percent=shadow_percent,
        clear_canary=no_canary,
        clear_shadow=no_shadow,
        why=reason,
    )
    _done(t, json, r.unchanged)


@app.command()
def pin(model: str, tenant: str, version: str, reason: Reason, json: JsonFlag = False) -> None:
    """Send every request of TENANT to VERSION."""
    r = router()
    t = r.pin(model, tenant, version, why=reason)
    _done(t, json, r.unchanged)


@app.command()
def unpin(model: str, tenant: str, reason: Reason, json: JsonFlag = False) -> None:
    """Remove TENANT's pin."""
    _done(router().unpin(model, tenant, why=reason), json)


_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")


def _parse_time(value: str) -> datetime:
    """ISO 8601 (``2026-12-01T14:02:00Z``) or ``HH:MM[:SS]`` today; times without a zone are UTC.

    A clock time without seconds means the end of that minute (what was in force at 14:02).
    """
    expected = "expected ISO 8601 like 2026-12-01T14:02:00Z, or HH:MM or HH:MM:SS today (UTC)"
    clock = _CLOCK.match(value.strip())
    try:
        if clock:
            hour, minute, second = int(clock[1]), int(clock[2]), clock[3]
            end = {"second": 59, "microsecond": 999999} if second is None else {"second": int(second), "microsecond": 0}
            return datetime.now(UTC).replace(hour=hour, minute=minute, **end)
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise InvalidInput(f"time {value!r} is not valid; {expected}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@app.command()
def history(
    model: str,
    at: Annotated[
        str | None, typer.Option(help="Show the route in force at this time (ISO 8601, or HH:MM[:SS] today, UTC).")
    ] = None,
    json: JsonFlag = False,
) -> None:
    """Every route and version-state change, oldest first; or the route at one time."""
    r = router()
    if at is not None:
        t = r.at(model, _parse_time(at))
        if t is None:
            raise InvalidInput(f"{model} had no route at {at}")
        _done(t, json)
        return
    events = r.history(model)
    if json:
        emit_json(events)
        return
    rows = []
    for e in events:
        if e.kind == "route":
            after = RouteTable.model_validate(e.after)
            canary = f" canary={after.canary.version}@{after.canary.weight:g}%" if after.canary else ""
            what = f"r{e.revision}: stable={after.stable}{canary}"
            if after.shadow:
                what += f" shadow={after.shadow.version}@{after.shadow.percent:g}%"
            if after.pins:
                what += " pins=" + ",".join(f"{k}→{v}" for k, v in sorted(after.pins.items()))
        else:
            what = f"{e.version}: {e.before or '-'} → {e.after}"
        rows.append([when(e.at), e.kind, what, e.who, e.why])
    table(f"history of {model}", ["when", "kind", "change", "who", "why"], rows)
