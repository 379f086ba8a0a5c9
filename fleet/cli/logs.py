"""``fleet logs``: the log tables (inference log, feedback, outcomes; see ``fleet.logs.tables``)."""

from __future__ import annotations

from typing import Annotated

import typer

from fleet.cli._output import JsonFlag, emit_json, err_console, table

app = typer.Typer(
    help="The log tables: commit what the gateways staged, and query them with SQL.", no_args_is_help=True
)


@app.command("commit")
def commit_cmd(
    retention_days: Annotated[
        int, typer.Option("--retention-days", min=1, help="Delete rows older than this many days.")
    ] = 30,
    maintain: Annotated[
        bool, typer.Option("--maintain/--no-maintain", help="Also compact settled hours and expire old snapshots.")
    ] = True,
    json: JsonFlag = False,
) -> None:
    """Commit the staged log files into the tables now (the commit-logs flow does it every 5 minutes),
    and copy the final usage hours into the usage table.

    One committer runs at a time per store: if the flow is committing, this says so and stops.
    """
    from dataclasses import asdict

    from fleet.logs.committer import run
    from fleet.store import open_store

    def shown(d) -> None:  # noqa: ANN001 - a Committed
        if not json:
            err_console.print(
                f"{d.table}: {d.files} files ({d.rows} rows) committed"
                + (f", {len(d.rejected)} rejected (moved to logs/rejected/)" if d.rejected else "")
                + (f", {d.compacted} hours compacted" if d.compacted else "")
                + (f", {d.deleted} old files deleted" if d.deleted else ""),
                markup=False,
                highlight=False,
            )

    from flows.logs import copy_usage

    store = open_store()

    def usage(logs, check) -> None:  # noqa: ANN001
        hours = copy_usage(store, logs, check)
        if hours and not json:
            err_console.print(f"usage: hours {hours[0]} to {hours[-1]} copied", markup=False, highlight=False)

    done = run(
        store, who="fleet logs commit", retention_days=retention_days, maintain=maintain, progress=shown, also=usage
    )
    if json:
        emit_json([asdict(d) for d in done])


@app.command("query")
def query_cmd(
    sql: Annotated[str, typer.Argument(help="SQL over the views inference, feedback, outcomes, usage.")],
    max_rows: Annotated[
        int, typer.Option("--max-rows", min=1, max=1_000_000, help="Print at most this many rows.")
    ] = 1000,
    json: JsonFlag = False,
) -> None:
    """Run SQL (DuckDB) over the committed log tables.

    Example: fleet logs query "SELECT version, count(*) FROM inference WHERE model = 'demo' GROUP BY 1"
    """
    from fleet.logs.query import run
    from fleet.store import open_store

    answer = run(open_store(), sql, max_rows)
    if json:
        emit_json([dict(zip(answer.columns, row, strict=True)) for row in answer.rows])
    else:
        table(None, list(answer.columns), [[_cell(v) for v in row] for row in answer.rows])
    if answer.truncated:
        err_console.print(f"(only the first {max_rows} rows shown; --max-rows for more)", markup=False)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)
