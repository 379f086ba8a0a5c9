"""SQL over the log tables with DuckDB: ``fleet logs query "SELECT ..."``.

Each table is a view named after it (``inference``, ``feedback``, ``outcomes``, ``usage``)
over the data files of its current snapshot, as an Arrow dataset: DuckDB pushes the query's
column list and filters into the scan, so a query reads the columns and row groups it needs
(a ``WHERE model = ... AND ts >= ...`` also skips whole files by their statistics). Rows not
committed yet are not in the views (``fleet logs commit`` commits them). The query runs with
DuckDB's external access off: it can read these views and nothing else on the machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.errors import ConfigError, InvalidInput
from fleet.logs import tables
from fleet.types import ObjectStore

MAX_ROWS = 10_000  # rows printed at most (the query may aggregate any number)


@dataclass(frozen=True)
class Answer:
    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]
    truncated: bool


def _dataset(logs: tables.LogTables, name: str):  # noqa: ANN202 - a pyarrow Dataset, or None
    import pyarrow.dataset as ds
    from pyarrow import fs as pafs

    table = logs.table(name, fresh=True)
    schema = tables.arrow_schema(name)
    if table is None or table.current_snapshot() is None:
        return ds.dataset([], schema=schema, format="parquet")
    paths = [t.file.file_path for t in table.scan(selected_fields=("ts",)).plan_files()]
    if not paths:
        return ds.dataset([], schema=schema, format="parquet")
    if paths[0].startswith("s3://"):
        bucket = paths[0].removeprefix("s3://").split("/", 1)[0]
        filesystem = table.io.fs_by_scheme("s3", bucket)
        paths = [p.removeprefix("s3://") for p in paths]
    else:
        filesystem = pafs.LocalFileSystem()
        paths = [p.removeprefix("file://").removeprefix("file:") for p in paths]
    return ds.dataset(paths, schema=schema, format="parquet", filesystem=filesystem)


def connect(store: ObjectStore):  # noqa: ANN201 - a duckdb connection with a view per table
    import duckdb

    from fleet.logs.tables import tables_for

    logs = tables_for(store)
    if logs is None:
        raise ConfigError(
            "the log tables have no catalog here; set FLEET_LOG_CATALOG (glue:<database> or a sqlite:/// path)"
        )
    con = duckdb.connect()
    for name in tables.TABLES:
        con.register(name, _dataset(logs, name))
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def run(store: ObjectStore, sql: str, max_rows: int = MAX_ROWS) -> Answer:
    import duckdb

    con = connect(store)
    try:
        cursor = con.execute(sql)
    except duckdb.Error as exc:
        raise InvalidInput(f"the query failed: {exc}; the tables are {', '.join(tables.TABLES)}") from None
    if cursor.description is None:
        return Answer((), [], False)
    columns = tuple(d[0] for d in cursor.description)
    rows = cursor.fetchmany(max_rows + 1)
    return Answer(columns, rows[:max_rows], len(rows) > max_rows)
