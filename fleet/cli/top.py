"""``fleet top``: the command. What it reads is ``fleet.cli.top_read``, how it merges
``top_merge``, how it words ``top_text``, the live view ``top_view``; all imported when the
command runs, so that every other command starts without them (numpy, textual)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from fleet.cli._output import JsonFlag
from fleet.cli.top_text import SORTS
from fleet.errors import InvalidInput


def top_cmd(
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, max=60, help="Seconds between refreshes of the live view.")
    ] = 1.0,
    window: Annotated[
        int, typer.Option("--window", min=1, max=60, help="Seconds of traffic each refresh counts (rates over it).")
    ] = 10,
    once: Annotated[
        bool, typer.Option("--once", help="Print one table and exit (also what happens when stdout is not a terminal).")
    ] = False,
    model: Annotated[str, typer.Option("--model", "-m", help="Only models whose name holds this text.")] = "",
    sort: Annotated[str, typer.Option("--sort", help=f"Order of the versions: {', '.join(SORTS)}.")] = "model",
    tenants: Annotated[int, typer.Option("--tenants", min=1, max=25, help="Top tenants shown.")] = 10,
    json: JsonFlag = False,
) -> None:
    """A live view of the fleet from the gateways' own stats: per model and version requests/s,
    errors, p50/p99 (a generation's time to first token) and tokens/s, share of traffic, replicas,
    in flight, queued and shed; the rollout or experiment in progress; quota refusals and the top
    tenants. Keys: s sort, f filter by model, enter a version's detail, q quit."""
    if sort not in SORTS:
        raise InvalidInput(f"--sort {sort!r} is not a column to sort by; expected one of {', '.join(SORTS)}")
    import asyncio

    from fleet.cli._output import emit_json
    from fleet.cli.top_read import TIMEOUT_S, open_reader, print_plain, read_once
    from fleet.cli.top_text import matches

    reader = open_reader(window, tenants)
    reader.match = model
    if json or once or not sys.stdout.isatty():
        top = asyncio.run(read_once(reader))
        if json:
            top.rows = [r for r in top.rows if matches(r, model)]
            emit_json(top.to_json())
        else:
            print_plain(top, sort, model)
        return
    from fleet.cli.top_view import TopApp

    TopApp(reader, interval=interval, sort=sort, text=model, timeout_s=TIMEOUT_S).run()
