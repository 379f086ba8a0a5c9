"""``fleet tenants``: create tenants with API keys, list and revoke them."""

from __future__ import annotations

from typing import Annotated

import typer

from fleet.cli._output import JsonFlag, console, emit_json, err_console, table, tenants, when
from fleet.errors import InvalidInput
from fleet.tenants import Quota, parse_entitlements

app = typer.Typer(help="Manage tenants and their API keys.", no_args_is_help=True)


@app.command()
def create(
    name: str,
    model: Annotated[
        list[str],
        typer.Option("--model", help="Entitlement: MODEL (every version) or MODEL:1.0.0,1.1.0. Repeatable."),
    ],
    rps: Annotated[float | None, typer.Option(help="Quota: sustained requests per second.")] = None,
    burst: Annotated[int | None, typer.Option(help="Quota: burst size (requests).")] = None,
    json: JsonFlag = False,
) -> None:
    """Create a tenant and print its API key once (only its SHA-256 is stored)."""
    if (rps is None) != (burst is None):
        raise InvalidInput("a quota needs both --rps and --burst")
    quota = Quota(rps=rps, burst=burst) if rps is not None and burst is not None else None
    tenant, key = tenants().create(name, parse_entitlements(model), quota)
    if json:
        emit_json({"tenant": tenant.model_dump(mode="json"), "api_key": key})
        return
    console.print(f"created tenant [bold]{tenant.name}[/]")
    console.print("API key (shown once, store it now):")
    console.print(key, soft_wrap=True, markup=False, highlight=False)
    err_console.print("only the key's SHA-256 is kept; a lost key cannot be recovered, only revoked")


@app.command("list")
def list_(json: JsonFlag = False) -> None:
    """List tenants, their entitlements, quotas and keys."""
    found = tenants().list()
    if json:
        emit_json(found)
        return
    rows = []
    for t in found:
        ents = "; ".join(f"{m}:{','.join(v)}" for m, v in sorted(t.entitlements.items()))
        quota = f"{t.quota.rps:g} rps / {t.quota.burst}" if t.quota else "-"
        keys = ", ".join(k.id + (" (revoked)" if k.revoked_at else "") for k in t.keys)
        rows.append([t.name, ents, quota, keys, when(t.created_at)])
    table(None, ["tenant", "entitlements", "quota", "keys", "created"], rows)


@app.command()
def revoke(
    name: str,
    key_id: Annotated[str | None, typer.Option("--key-id", help="Revoke only this key.")] = None,
    json: JsonFlag = False,
) -> None:
    """Revoke a tenant's keys (all of them unless --key-id names one)."""
    t = tenants().revoke(name, key_id)
    if json:
        emit_json(t)
        return
    console.print(f"revoked {'key ' + key_id if key_id else 'every key'} of {name}")
