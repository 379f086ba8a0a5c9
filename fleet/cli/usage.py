"""``fleet usage``: requests, inferences, upstream time, replica time and cost per tenant, model
and version, from the hourly files the gateways write under ``usage/`` (see ``fleet.usage.records``)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

import typer

from fleet.cli._output import JsonFlag, console, emit_json, err_console, table
from fleet.errors import InvalidInput

if TYPE_CHECKING:  # the rollup is imported when the command runs, not at every command's start
    from fleet.usage.rollup import Report

_SINCE = re.compile(r"(\d{1,6})([mhd])")
_UNITS = {"m": "minutes", "h": "hours", "d": "days"}
MAX_SINCE = timedelta(days=366)
COLUMNS = [
    "tenant",
    "model",
    "version",
    "requests",
    "rows",
    "upstream s",
    "replica h",
    "USD",
    "USD/1k inferences",
    "price source",
]
ALL = "(all)"


def parse_since(raw: str) -> timedelta:
    """``90m``, ``24h``, ``7d`` → how far back ``fleet usage`` reads (at most ``MAX_SINCE``)."""
    found = _SINCE.fullmatch(raw.strip())
    window = timedelta(**{_UNITS[found[2]]: int(found[1])}) if found else None
    if window is None or not timedelta(0) < window <= MAX_SINCE:
        raise InvalidInput(
            f"--since {raw!r} is not a duration; expected like 90m, 24h, 7d (a whole number > 0 with a unit "
            f"m, h or d, at most {MAX_SINCE.days}d)"
        )
    return window


def usage_cmd(
    tenant: Annotated[
        str | None,
        typer.Option(
            "--tenant", help="Only this tenant's rows and the versions it used ((all) rows stay every tenant's totals)."
        ),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Only this model's versions.")] = None,
    since: Annotated[
        str,
        typer.Option("--since", help="How far back: 90m, 24h, 7d. Whole UTC hours, from the one that holds that time."),
    ] = "24h",
    json: JsonFlag = False,
) -> None:
    """Usage and cost per tenant, model and version, summed over every gateway.

    An inference is one input row (the first dimension of a request's input). A version's cost
    is its replica time (the max any gateway saw, idle time included) at the placement's price
    per replica-hour; a tenant's part of it is its share of the version's upstream seconds.
    USD is "-" where the price or the replica time is unknown (never 0).
    """
    from fleet import audit
    from fleet.store import open_store
    from fleet.usage.rollup import rollup

    window = parse_since(since)
    until = audit.now()
    report = rollup(open_store(), until - window, until, tenant=tenant, model=model)
    for b in report.skipped:
        err_console.print(
            f"skipped {b.key}: {b.reason}; its counts are left out", markup=False, highlight=False, soft_wrap=True
        )
    if json:
        emit_json(report.to_dict())
        return
    rows = _rows(report)
    files = f"{report.files} hour file{'' if report.files == 1 else 's'}"
    title = f"usage from {report.since:%Y-%m-%d %H:%M} to {report.until:%Y-%m-%d %H:%M} UTC ({files})"
    if not rows:
        console.print(f"{title}: nothing served", markup=False, highlight=False, soft_wrap=True)
        return
    table(title, COLUMNS + (TOKEN_COLUMNS if any(v.tokens for v in report.versions) else []), rows)
    console.print(
        f"an inference is one input row; {ALL}: the version's totals, idle replica time included; a tenant's "
        "replica h and USD are its share of the version's by upstream seconds; USD - : price or replica time unknown",
        markup=False,
        highlight=False,
    )


TOKEN_COLUMNS = ["tokens", "USD/1k tokens"]  # shown when a generative model served some


def _rows(report: Report) -> list[list[str]]:
    rows = []
    tokens = any(v.tokens for v in report.versions)
    for v in report.versions:
        source = v.price.source
        for t in report.tenants:
            if (t.model, t.version) == (v.model, v.version):
                rows.append(
                    [
                        t.tenant,
                        t.model,
                        t.version,
                        str(t.requests),
                        str(t.rows),
                        _num(t.upstream_s, 3),
                        _hours(t.replica_s),
                        _usd(t.usd),
                        _usd(t.usd_per_1k_inferences, 6),
                        source,
                    ]
                    + ([str(t.tokens), _usd(t.usd_per_1k_tokens, 6)] if tokens else [])
                )
        rows.append(
            [
                ALL,
                v.model,
                v.version,
                str(v.requests),
                str(v.rows),
                _num(v.upstream_s, 3),
                _hours(v.replica_s),
                _usd(v.usd),
                _usd(v.usd_per_1k_inferences, 6),
                source,
            ]
            + ([str(v.tokens), _usd(v.usd_per_1k_tokens, 6)] if tokens else [])
        )
    return rows


def _num(value: float, places: int) -> str:
    return f"{value:.{places}f}"


def _hours(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.3f}"


def _usd(value: float | None, places: int = 4) -> str:
    return "-" if value is None else f"{value:.{places}f}"
