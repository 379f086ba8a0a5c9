"""``fleet tenants``: create tenants with API keys, list them, add, rotate and revoke keys."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Annotated

import typer

from fleet import audit
from fleet.catalog.tenants import MAX_GRACE, ApiKey, Quota, check_grace, make_quota, parse_entitlements, public, span
from fleet.cli._output import JsonFlag, console, emit_json, err_console, table, tenants, when
from fleet.cli.doctor import skipped
from fleet.errors import InvalidInput

app = typer.Typer(help="Manage tenants and their API keys.", no_args_is_help=True)

_DURATION = re.compile(r"(\d{1,9})([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_grace(raw: str) -> timedelta:
    """``0``, ``90s``, ``15m``, ``1h``, ``2d`` → a grace period (0 up to ``MAX_GRACE``)."""
    text = raw.strip()
    if text == "0":
        return timedelta(0)
    found = _DURATION.fullmatch(text)
    if found is None:
        raise InvalidInput(
            f"--grace {raw!r} is not a duration; expected 0 or a whole number with a unit s, m, h or d "
            f"(90s, 15m, 1h, 2d), at most {span(MAX_GRACE)}"
        )
    return check_grace(timedelta(**{_UNITS[found[2]]: int(found[1])}))


def key_label(key: ApiKey, now: datetime) -> str:
    """``abcd1234``, ``abcd1234 (revoked)``, ``(expired)`` or ``(expires <UTC time>)``."""
    if key.revoked_at is not None:
        return f"{key.id} (revoked)"
    if key.expires_at is not None:
        return f"{key.id} (expired)" if key.expires_at <= now else f"{key.id} (expires {when(key.expires_at)})"
    return key.id


def _show_key(api_key: str) -> None:
    console.print("API key (shown once, store it now):")
    console.print(api_key, soft_wrap=True, markup=False, highlight=False)
    err_console.print("only the key's SHA-256 is kept; a lost key cannot be recovered, only revoked")


@app.command()
def create(
    name: str,
    model: Annotated[
        list[str],
        typer.Option("--model", help="Entitlement: MODEL (every version) or MODEL:1.0.0,1.1.0. Repeatable."),
    ],
    rps: Annotated[float | None, typer.Option(help="Quota: sustained requests per second.")] = None,
    burst: Annotated[int | None, typer.Option(help="Quota: burst size (requests).")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Quota: requests in flight at once (with --rps).")] = None,
    tokens_per_minute: Annotated[
        int | None, typer.Option(help="Quota: generated and prompt tokens a minute (with --rps).")
    ] = None,
    weight: Annotated[
        float | None,
        typer.Option(help="Share of a saturated version against other waiting tenants (fair queuing); default 1."),
    ] = None,
    json: JsonFlag = False,
) -> None:
    """Create a tenant and print its API key once (only its SHA-256 is stored)."""
    quota = _quota(rps, burst, concurrency, tokens_per_minute)
    tenant, key = tenants().create(name, parse_entitlements(model), quota, weight=weight)
    if json:
        emit_json({"tenant": public(tenant), "api_key": key})
        return
    console.print(f"created tenant [bold]{tenant.name}[/]")
    _show_key(key)


def _quota(
    rps: float | None, burst: int | None, concurrency: int | None, tokens_per_minute: int | None = None
) -> Quota | None:
    if (rps is None) != (burst is None):
        raise InvalidInput("a quota needs both --rps and --burst")
    for flag, value in (("--concurrency", concurrency), ("--tokens-per-minute", tokens_per_minute)):
        if value is not None and rps is None:
            raise InvalidInput(f"{flag} is part of a quota; expected it with --rps and --burst")
    return make_quota(rps, burst, concurrency, tokens_per_minute) if rps is not None and burst is not None else None


@app.command()
def limits(
    name: str,
    rps: Annotated[float | None, typer.Option(help="Quota: sustained requests per second.")] = None,
    burst: Annotated[int | None, typer.Option(help="Quota: burst size (requests).")] = None,
    concurrency: Annotated[int | None, typer.Option(help="Quota: requests in flight at once (with --rps).")] = None,
    tokens_per_minute: Annotated[
        int | None, typer.Option(help="Quota: generated and prompt tokens a minute (with --rps).")
    ] = None,
    no_quota: Annotated[
        bool, typer.Option("--no-quota", help="Remove the quota (the policy's applies, if any).")
    ] = False,
    weight: Annotated[float | None, typer.Option(help="Fair-queuing share against other tenants (default 1).")] = None,
    json: JsonFlag = False,
) -> None:
    """Change a tenant's quota or fair-queuing weight; gateways apply it within about a second."""
    quota = _quota(rps, burst, concurrency, tokens_per_minute)
    if quota is not None and no_quota:
        raise InvalidInput("--no-quota and --rps/--burst contradict each other; expected one of them")
    tenant = tenants().set_limits(name, quota=quota, clear_quota=no_quota, weight=weight)
    if json:
        emit_json(public(tenant))
        return
    console.print(f"tenant [bold]{tenant.name}[/]: quota {_shown_quota(tenant.quota)}, weight {tenant.weight or 1:g}")


def _shown_quota(q: Quota | None) -> str:
    if q is None:
        return "-"
    return (
        f"{q.rps:g} rps / {q.burst}"
        + (f" / {q.concurrency} in flight" if q.concurrency else "")
        + (f" / {q.tokens_per_minute} tokens/min" if q.tokens_per_minute else "")
    )


@app.command("list")
def list_(json: JsonFlag = False) -> None:
    """List tenants, their entitlements, quotas and keys; unreadable records are skipped and named."""
    found, bad = tenants().scan()
    skipped(bad)  # stderr, so --json output stays a list a script can read
    if json:
        emit_json([public(t) for t in found])
        return
    now = audit.now()
    rows = []
    for t in found:
        ents = "; ".join(f"{m}:{','.join(v)}" for m, v in sorted(t.entitlements.items()))
        keys = ", ".join(key_label(k, now) for k in t.keys)
        rows.append([t.name, ents, _shown_quota(t.quota), f"{t.weight or 1:g}", keys, when(t.created_at)])
    table(None, ["tenant", "entitlements", "quota", "weight", "keys", "created"], rows)


@app.command("add-key")
def add_key(name: str, json: JsonFlag = False) -> None:
    """Add an API key to a tenant and print it once; its other keys keep working."""
    tenant, key = tenants().add_key(name)
    if json:
        emit_json({"tenant": public(tenant), "key_id": tenant.keys[-1].id, "api_key": key})
        return
    console.print(f"added key [bold]{tenant.keys[-1].id}[/] to tenant [bold]{tenant.name}[/]")
    _show_key(key)


@app.command()
def rotate(
    name: str,
    key_id: Annotated[
        str | None, typer.Option("--key-id", help="Retire only this key (default: every live key).")
    ] = None,
    grace: Annotated[
        str,
        typer.Option(
            help=f"How long the old key(s) keep working: 0 (revoke now), 90s, 15m, 1h, 2d; at most {span(MAX_GRACE)}."
        ),
    ] = "1h",
    json: JsonFlag = False,
) -> None:
    """Add a new API key (printed once) and retire the old one(s) after a grace period."""
    tenant, key = tenants().rotate(name, key_id, grace=parse_grace(grace))
    new_id = tenant.keys[-1].id
    retired = tenant.replaced(new_id)
    if json:
        emit_json(
            {
                "tenant": public(tenant),
                "key_id": new_id,
                "api_key": key,
                "retired": [{"id": k.id, "stops_at": k.ends_at.isoformat()} for k in retired],
            }
        )
        return
    console.print(f"rotated tenant [bold]{tenant.name}[/]: new key [bold]{new_id}[/]")
    _show_key(key)
    for old in retired:
        console.print(_retired_line(old), highlight=False)


def _retired_line(old: ApiKey) -> str:
    if old.revoked_at is not None:
        return f"old key {old.id} stopped working at {when(old.revoked_at)} (revoked, no grace)"
    return f"old key {old.id} stops working at {when(old.expires_at)} (move its callers to the new key before then)"


@app.command()
def revoke(
    name: str,
    key_id: Annotated[str | None, typer.Option("--key-id", help="Revoke only this key.")] = None,
    json: JsonFlag = False,
) -> None:
    """Revoke a tenant's keys (all of them unless --key-id names one)."""
    t = tenants().revoke(name, key_id)
    if json:
        emit_json(public(t))
        return
    console.print(f"revoked {'key ' + key_id if key_id else 'every key'} of {name}")
