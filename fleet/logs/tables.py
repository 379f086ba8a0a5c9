"""The logs as Apache Iceberg tables: their schemas, partitions, catalog and scans.

Four tables, each partitioned by ``model`` and ``hour(ts)`` (Iceberg's hidden partitioning:
a query's ``ts`` range prunes hours by itself), in the store under ``logs/tables/<table>/``:

- ``inference``: one row per logged input row (a generation: one row per answer); the
  features as one ``list<double>`` (their names are the table property
  ``fleet.features.<model>``), so every model shares one schema; ``status`` the HTTP status
  the caller got (a sampled request that failed is logged too, with no prediction);
- ``feedback``: one row per label (``label`` for a class, ``version``/``match``/
  ``label_digest`` for a generation's exact-match label);
- ``outcomes``: one row per (request, row, outcome name);
- ``usage``: one row per (hour, gateway, tenant, model, version) of served traffic, copied
  from the usage files (``fleet.usage.records``) once the hour is final (``flows/logs.py``);
  the files stay the source of ``fleet usage`` and its costs.

Gateways never write a table: they stage Parquet files under ``logs/staging/`` (see
``fleet.logs.staging``) and the committer (``fleet.logs.committer``, one per store) makes
them rows of the tables. Readers read the committed files a scan plans (pruned by partition
and by column bounds) and then what is still staged.

The catalog: ``FLEET_LOG_CATALOG`` = ``glue:<database>`` (AWS Glue; production) or a
SQLAlchemy URL (``sqlite:////path/catalog.db``); unset, a file store keeps a SQLite catalog
at ``<root>/.catalog/logs.db`` and an S3 store has none (its tables need the variable).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fleet.errors import ConfigError
from fleet.types import ObjectStore

NAMESPACE = "fleet_logs"  # the catalog's namespace (with Glue: the database named in FLEET_LOG_CATALOG)
TABLES = ("inference", "feedback", "outcomes", "usage")
WAREHOUSE = "logs/tables/"
FEATURES_PROPERTY = "fleet.features.{}"  # a model's feature names, as JSON, in the inference table's properties
REFRESH_S = 1.0  # a reader asks the catalog for a table's newest metadata at most this often


def _schema(name: str):  # noqa: ANN202 - a pyiceberg Schema
    from pyiceberg.schema import Schema
    from pyiceberg.types import (
        BooleanType,
        DoubleType,
        IntegerType,
        ListType,
        LongType,
        NestedField,
        StringType,
        TimestamptzType,
    )

    if name == "usage":  # ts: the hour's start
        return Schema(
            NestedField(1, "ts", TimestamptzType(), required=True),
            NestedField(2, "model", StringType(), required=True),
            NestedField(3, "tenant", StringType(), required=True),
            NestedField(4, "version", StringType(), required=True),
            NestedField(5, "gateway", StringType(), required=True),
            NestedField(6, "requests", LongType(), required=True),
            NestedField(7, "rows", LongType(), required=True),
            NestedField(8, "upstream_s", DoubleType(), required=True),
            NestedField(9, "tokens", LongType(), required=True),
        )
    head = [
        NestedField(1, "ts", TimestamptzType(), required=True),
        NestedField(2, "model", StringType(), required=True),
        NestedField(3, "request_id", StringType(), required=True),
        NestedField(4, "tenant", StringType(), required=True),
    ]
    columns: dict[str, list] = {
        "inference": [
            NestedField(5, "row", IntegerType(), required=True),
            NestedField(6, "version", StringType(), required=True),
            NestedField(7, "latency_ms", DoubleType(), required=False),
            NestedField(8, "features", ListType(9, DoubleType(), element_required=False), required=False),
            NestedField(10, "prediction", LongType(), required=False),
            NestedField(11, "score", DoubleType(), required=False),
            NestedField(12, "ttft_ms", DoubleType(), required=False),
            NestedField(13, "prompt_tokens", IntegerType(), required=False),
            NestedField(14, "completion_tokens", IntegerType(), required=False),
            NestedField(15, "finish_reason", StringType(), required=False),
            NestedField(16, "output_digest", StringType(), required=False),
            NestedField(17, "prompt", StringType(), required=False),
            NestedField(18, "output", StringType(), required=False),
            NestedField(19, "status", IntegerType(), required=False),  # the caller's HTTP status
        ],
        "feedback": [
            NestedField(5, "row", IntegerType(), required=True),
            NestedField(6, "label", LongType(), required=False),
            NestedField(7, "version", StringType(), required=False),
            NestedField(8, "match", BooleanType(), required=False),
            NestedField(9, "label_digest", StringType(), required=False),
        ],
        "outcomes": [
            NestedField(5, "row", IntegerType(), required=True),
            NestedField(6, "name", StringType(), required=True),
            NestedField(7, "value", DoubleType(), required=True),
        ],
    }
    return Schema(*head, *columns[name])


@functools.cache
def arrow_schema(name: str):  # noqa: ANN201 - a pyarrow Schema
    """The table's columns as Arrow types: what a staged file of ``name`` holds."""
    return _schema(name).as_arrow()


def _spec():  # noqa: ANN202 - a pyiceberg PartitionSpec
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.transforms import HourTransform, IdentityTransform

    # source ids: 2 is model, 1 is ts, in every table's schema
    return PartitionSpec(
        PartitionField(source_id=2, field_id=1000, transform=IdentityTransform(), name="model"),
        PartitionField(source_id=1, field_id=1001, transform=HourTransform(), name="ts_hour"),
    )


# Table properties: the writer's target file size (a compacted hour is one file up to this),
# zstd Parquet, and manifests merged as commits pile up, so planning reads a few small
# manifests, not one per commit.
PROPERTIES = {
    "write.parquet.compression-codec": "zstd",
    "write.target-file-size-bytes": str(128 * 1024 * 1024),
    "commit.manifest-merge.enabled": "true",
    "commit.manifest.min-count-to-merge": "50",
    # merged manifests stay small, so each covers a stretch of time and planning skips the
    # ones outside a window by their partition summaries (one 8 MB manifest of a month's
    # files was decoded whole by every plan)
    "commit.manifest.target-size-bytes": str(256 * 1024),
    "format-version": "2",
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "20",
    # small row groups: a file is sorted by request_id (fleet.logs.committer), so a label's
    # lookup reads the id columns of the one row group whose statistics hold its id
    "write.parquet.row-group-limit": "65536",
    # no silent rebase of a commit onto another writer's: a committer that lost its lease and
    # wakes up fails its append instead of doubling rows the new one committed
    "commit.retry.num-retries": "0",
}


def catalog_spec(store: ObjectStore) -> str | None:
    """What ``FLEET_LOG_CATALOG`` says, or the file store's default; None: no catalog."""
    given = os.environ.get("FLEET_LOG_CATALOG", "").strip()
    if given:
        return given
    root = getattr(store, "root", None)
    if isinstance(root, Path):
        return f"sqlite:///{root / '.catalog' / 'logs.db'}"
    return None


def _io_properties(store: ObjectStore) -> dict[str, str]:
    """How pyiceberg's FileIO reaches the store's bucket: its endpoint and region. Credentials
    are left to the AWS default chain (environment, IRSA, instance profile) so that they
    refresh; a copy frozen here would expire under a long-running gateway or committer."""
    client = getattr(store, "_s3", None)
    if client is None:
        return {}
    props = {"s3.region": client.meta.region_name or "us-east-1"}
    if client.meta.endpoint_url and "amazonaws.com" not in client.meta.endpoint_url:
        props["s3.endpoint"] = client.meta.endpoint_url
    return props


class NoCatalog(ConfigError):
    pass


@dataclass
class _Loaded:
    table: Any  # a pyiceberg Table
    at: float  # monotonic time it was loaded


class LogTables:
    """The store's log tables through its catalog: created on first use by the committer,
    loaded (and refreshed at most every ``REFRESH_S``) by readers."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.spec = catalog_spec(store)
        if self.spec is None:
            raise NoCatalog(
                f"the logs' tables of {getattr(store, 'url', 'this store')} have no catalog; set FLEET_LOG_CATALOG "
                "to glue:<database> or sqlite:////path/to/catalog.db"
            )
        self.location = f"{store.url.rstrip('/')}/{WAREHOUSE.rstrip('/')}"  # type: ignore[attr-defined]
        self.namespace = self.spec.removeprefix("glue:") if self.spec.startswith("glue:") else NAMESPACE
        self._catalog = None
        self._created = False
        self._loaded: dict[str, _Loaded] = {}
        self._lock = threading.Lock()

    @property
    def catalog(self):  # noqa: ANN201 - a pyiceberg Catalog
        with self._lock:
            if self._catalog is None:
                self._catalog = self._open()
            return self._catalog

    def _open(self):  # noqa: ANN202
        props = _io_properties(self.store)
        if self.spec.startswith("glue:"):
            from pyiceberg.catalog.glue import GlueCatalog

            return GlueCatalog("fleet", **props)
        from pyiceberg.catalog.sql import SqlCatalog
        from sqlalchemy.exc import OperationalError

        if self.spec.startswith("sqlite:///"):
            Path(self.spec.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(5):
            try:  # several processes opening a new catalog race to create its tables
                return SqlCatalog("fleet", uri=self.spec, warehouse=self.location, **props)
            except OperationalError:
                if attempt == 4:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def create(self) -> None:
        """Make the namespace and every table that is missing (the committer's first run; once
        per process: with Glue, creating a table that exists still writes a metadata file)."""
        if self._created:
            return
        catalog = self.catalog
        if self.namespace not in {n[0] for n in catalog.list_namespaces()}:
            catalog.create_namespace_if_not_exists(self.namespace)
        for name in TABLES:
            if catalog.table_exists(f"{self.namespace}.{name}"):
                continue
            catalog.create_table_if_not_exists(
                f"{self.namespace}.{name}",
                schema=_schema(name),
                partition_spec=_spec(),
                location=f"{self.location}/{name}",
                properties=PROPERTIES,
            )
        self._created = True

    def table(self, name: str, *, fresh: bool = False, fresh_since: float = 0.0):  # noqa: ANN201 - a pyiceberg Table, or None if not made yet
        """The table as of its newest metadata, asked again at most every ``REFRESH_S`` (or now
        with ``fresh``, or if it was loaded before ``fresh_since``, a monotonic time)."""
        from pyiceberg.exceptions import NoSuchTableError

        now = time.monotonic()
        loaded = self._loaded.get(name)
        if loaded is not None and not fresh and now - loaded.at < REFRESH_S and loaded.at >= fresh_since:
            return loaded.table
        try:
            table = self.catalog.load_table(f"{self.namespace}.{name}")
        except NoSuchTableError:
            return None
        self._loaded[name] = _Loaded(table, now)
        return table

    def key_of(self, path: str) -> str:
        """The store key of a data file's path (``file:///root/logs/...`` or ``s3://bucket/prefix/logs/...``)."""
        base = self.store.url.rstrip("/") + "/"  # type: ignore[attr-defined]
        if path.startswith("file:/") and not path.startswith("file://"):
            path = "file://" + path.removeprefix("file:")
        if not path.startswith(base):
            raise ValueError(f"{path} is not in the store {base}")
        return path.removeprefix(base)


def window_filter(model: str, start: datetime, end: datetime, extra: Any = None):  # noqa: ANN201 - a BooleanExpression
    from pyiceberg.expressions import And, EqualTo, GreaterThanOrEqual, LessThan

    found = And(
        EqualTo("model", model),
        And(GreaterThanOrEqual("ts", start.isoformat()), LessThan("ts", end.isoformat())),
    )
    return found if extra is None else And(found, extra)


def scan(table: Any, row_filter: Any, columns: Iterable[str] | None = None, snapshot_id: int | None = None):  # noqa: ANN201
    """(the pyiceberg scan, its planned tasks): planning prunes files by partition and bounds."""
    scan = table.scan(
        row_filter=row_filter,
        selected_fields=tuple(columns) if columns is not None else ("*",),
        snapshot_id=snapshot_id,
    )
    return scan, list(scan.plan_files())


def read(scan_and_tasks: tuple[Any, list]):  # noqa: ANN201 - a pyarrow Table
    """The rows of a planned scan (projected and filtered row by row as planned)."""
    from pyiceberg.io.pyarrow import ArrowScan

    scan, tasks = scan_and_tasks
    return ArrowScan(scan.table_metadata, scan.io, scan.projection(), scan.row_filter, scan.case_sensitive).to_table(
        tasks
    )


_TABLES: dict[int, LogTables | None] = {}
_LOCK = threading.Lock()


def tables_for(store: ObjectStore) -> LogTables | None:
    """The store's log tables (one per store object), or None where it has no catalog."""
    with _LOCK:
        if id(store) not in _TABLES:
            try:
                _TABLES[id(store)] = LogTables(store)
            except NoCatalog:
                _TABLES[id(store)] = None
        return _TABLES[id(store)]
