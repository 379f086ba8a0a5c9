"""Output helpers shared by every command group."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, NoReturn

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from fleet.registry import Registry
from fleet.router import Router
from fleet.store import open_store
from fleet.tenants import Tenants

console = Console()
err_console = Console(stderr=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]
Reason = Annotated[str, typer.Option("--reason", "-r", help="Why: recorded in the audit log.")]


def fail(message: str, code: int = 1) -> NoReturn:
    # one line, so scripts and logs keep each error whole; several problems join with "; "
    sys.stderr.write("error: " + "; ".join(" ".join(line.split()) for line in message.splitlines() if line.strip()) + "\n")
    raise SystemExit(code)


def emit_json(value: Any) -> None:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")  # never cut a name or hash short with "…"
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    console.print(t)


def registry() -> Registry:
    return Registry(open_store())


def router() -> Router:
    return Router(open_store())


def tenants() -> Tenants:
    return Tenants(open_store())


def when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else ""
