"""Staged log files: what gateways write and the committer turns into table rows.

``logs/staging/<table>/<yyyy>/<mm>/<dd>/<hh>/<oldest ms>-<newest ms>-<writer>-<seq>.parquet``:
one Parquet file per flush of one writer, every model in it, in the table's own columns
(``fleet.logs.tables.arrow_schema``). The hour and the two times are those of the oldest and
newest rows, so a reader picks the files of its window from one listing, without reading any.
A file is written whole with ``if_none_match`` (never over another) and is acknowledged
logged once the store said so; the committer deletes it once its rows are committed.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from fleet.types import ObjectStore

log = logging.getLogger("fleet.logs.staging")

STAGING = "logs/staging/"
REJECTED = "logs/rejected/"
COMMITS = "logs/commits/"  # the committer's intents (fleet.logs.committer)
METADATA_KEY = b"fleet.features"  # a staged inference file's feature names per model (JSON)
_NAME = re.compile(r"(?P<oldest>\d+)-(?P<newest>\d+)-(?P<writer>[A-Za-z0-9._-]+)-(?P<seq>\d+)\.parquet")
_seq = itertools.count(1)


@dataclass(frozen=True)
class Staged:
    key: str
    oldest_ms: int
    newest_ms: int

    def overlaps(self, start: datetime, end: datetime) -> bool:
        return self.oldest_ms < end.timestamp() * 1000 and self.newest_ms >= start.timestamp() * 1000


def prefix(table: str) -> str:
    return f"{STAGING}{table}/"


def stage(store: ObjectStore, table: str, data, writer: str, features: dict[str, list[str]] | None = None) -> str:  # noqa: ANN001 - a pyarrow Table
    """Write ``data`` (the table's columns, ``ts`` in it) as one staged file; return its key."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if not re.fullmatch(r"[A-Za-z0-9._]+(-[A-Za-z0-9._]+)*", writer):
        raise ValueError(f"writer {writer!r}; expected letters, digits, '.', '_' and '-'")
    oldest = int(pc.min(data.column("ts")).cast("int64").as_py()) // 1000  # µs → ms
    newest = int(pc.max(data.column("ts")).cast("int64").as_py()) // 1000
    if features:
        data = data.replace_schema_metadata({METADATA_KEY: json.dumps(features).encode()})
    out = io.BytesIO()
    pq.write_table(data, out, compression="zstd")
    hour = datetime.fromtimestamp(oldest / 1000, UTC)
    key = f"{prefix(table)}{hour:%Y/%m/%d/%H}/{oldest}-{newest}-{writer}-{next(_seq):06d}.parquet"
    store.put(key, out.getvalue(), if_none_match=True)
    return key


def listed(store: ObjectStore, table: str) -> list[Staged]:
    """Every staged file of ``table`` (one listing: staging holds only what is not committed yet)."""
    found = []
    for key in store.list(prefix(table)):
        match = _NAME.fullmatch(key.rsplit("/", 1)[-1])
        if match is None:
            found.append(Staged(key, 0, 2**62))  # a hand-made name: read it to know
            continue
        found.append(Staged(key, int(match["oldest"]), int(match["newest"])))
    return found


def read(store: ObjectStore, key: str, unreadable: list[str] | None = None):  # noqa: ANN201 - a pyarrow Table or None
    """A staged file's table; None if it is gone (committed meanwhile) or not Parquet (named in
    the log and in ``unreadable``)."""
    import pyarrow.parquet as pq

    from fleet.errors import NotFound

    try:
        data = store.get(key).data
    except NotFound:
        return None
    try:
        return pq.read_table(io.BytesIO(data))
    except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid / ArrowIOError
        log.warning("skipping %s: not a readable Parquet file (%s)", key, exc)
        if unreadable is not None:
            unreadable.append(key)
        return None


def features_of(table) -> dict[str, list[str]]:  # noqa: ANN001 - a pyarrow Table
    meta = table.schema.metadata or {}
    raw = meta.get(METADATA_KEY)
    if not raw:
        return {}
    try:
        found = json.loads(raw)
    except ValueError:
        return {}
    return {str(m): [str(n) for n in names] for m, names in found.items() if isinstance(names, list)}


def intents(store: ObjectStore, name: str) -> dict[str, list[str]]:
    """The commit intents left in the store: id → the staged keys it covers."""
    from fleet.errors import NotFound

    found = {}
    for key in store.list(f"{COMMITS}{name}/intents/"):
        try:
            body = json.loads(store.get(key).data)
        except (NotFound, ValueError):
            continue
        found[key.rsplit("/", 1)[-1].removesuffix(".json")] = list(body.get("keys", []))
    return found
