"""Reading a log table's window: the committed files a scan plans, then what is still staged.

The committed part is an Iceberg scan: its planning prunes files by partition (the model, the
window's hours) and by column bounds, and reads only the columns asked for. The staged part
is one listing of ``logs/staging/<table>/`` (it holds only what the committer has not taken
yet) and the files whose rows' times overlap the window.

The order makes each row counted at most once: the staging listing first, then the table's
snapshot (loaded after it), then the commit intents. A listed file already committed in
that snapshot is either gone when read (the committer deletes staged files before their
intent) or named by an intent whose snapshot is in it: not read twice. A file committed
after the snapshot is read from staging if it is still there; if it was deleted in
between, this read misses its rows (the next read has them). ``Reading`` says what a read
cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fleet.logs import staging, tables
from fleet.types import ObjectStore


@dataclass
class Reading:
    """What one read cost: committed files opened and their bytes, staged files read."""

    files: int = 0
    bytes: int = 0
    staged: int = 0
    snapshot_id: int | None = None
    paths: list[str] = field(default_factory=list)
    features: dict[str, list[str]] = field(default_factory=dict)  # feature names the staged files carried


def read(
    store: ObjectStore,
    name: str,
    model: str,
    start: datetime,
    end: datetime,
    columns: tuple[str, ...] | None = None,
    unreadable: list[str] | None = None,
    reading: Reading | None = None,
    *,
    committed: bool = True,
    staged: bool = True,
    extra: Any = None,
):  # noqa: ANN201 - a pyarrow Table in the table's columns (or ``columns``)
    """Rows of ``model`` with ``start <= ts < end`` from table ``name``, committed and staged."""
    import pyarrow as pa

    if start.tzinfo is None or end.tzinfo is None:
        raise ValueError("reading a log window needs timezone-aware datetimes")
    reading = reading if reading is not None else Reading()
    schema = tables.arrow_schema(name)
    wanted = columns or tuple(schema.names)
    parts = []
    listed_at = time.monotonic()
    candidates = [s for s in staging.listed(store, name) if s.overlaps(start, end)] if staged else []
    logs = tables.tables_for(store) if committed or candidates else None
    table = logs.table(name, fresh_since=listed_at) if logs is not None else None
    if committed and table is not None and table.current_snapshot() is not None:
        planned = tables.scan(table, tables.window_filter(model, start, end, extra), wanted)
        _, tasks = planned
        reading.files += len(tasks)
        reading.bytes += sum(t.file.file_size_in_bytes for t in tasks)
        reading.paths += [t.file.file_path for t in tasks]
        reading.snapshot_id = table.current_snapshot().snapshot_id
        if tasks:
            parts.append(tables.read(planned).select(list(wanted)))
    if candidates:
        done = committed_keys(store, name, table) if table is not None else set()
        for item in candidates:
            if item.key in done:
                continue
            found = staging.read(store, item.key, unreadable)
            if found is None:
                continue
            reading.staged += 1
            reading.features.update(staging.features_of(found))
            parts.append(_window(found, model, start, end, wanted))
    if not parts:
        return pa.Table.from_batches([], schema=pa.schema([schema.field(c) for c in wanted]))
    return pa.concat_tables([p.cast(pa.schema([schema.field(c) for c in wanted])) for p in parts])


def _window(found, model: str, start: datetime, end: datetime, wanted: tuple[str, ...]):  # noqa: ANN001, ANN202
    import pyarrow as pa
    import pyarrow.compute as pc

    ts = found.column("ts")
    keep = pc.and_(
        pc.equal(found.column("model"), pa.scalar(model)),
        pc.and_(pc.greater_equal(ts, pa.scalar(start, ts.type)), pc.less(ts, pa.scalar(end, ts.type))),
    )
    return found.filter(keep).select(list(wanted))


def committed_keys(store: ObjectStore, name: str, table: Any) -> set[str]:
    """Staged keys whose rows the table already holds though they are still staged: those of a
    commit intent whose snapshot is in the table (the committer died before deleting them)."""
    found: set[str] = set()
    pending = staging.intents(store, name)
    if not pending:
        return found
    done = {s.summary.additional_properties.get("fleet.intent") for s in table.metadata.snapshots if s.summary}
    for intent_id, keys in pending.items():
        if intent_id in done:
            found.update(keys)
    return found


def features(store: ObjectStore, model: str, width: int, reading: Reading | None = None) -> tuple[str, ...]:
    """A model's feature names: the inference table's property, else what staged files said,
    else f0, f1, ..."""
    import json

    logs = tables.tables_for(store)
    table = logs.table("inference") if logs is not None else None
    if table is not None:
        raw = table.properties.get(tables.FEATURES_PROPERTY.format(model))
        if raw:
            names = tuple(json.loads(raw))
            if len(names) == width:
                return names
    names = tuple((reading.features if reading is not None else {}).get(model, ()))
    if len(names) == width:
        return names
    return tuple(f"f{i}" for i in range(width))
