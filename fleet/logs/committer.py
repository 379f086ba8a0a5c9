"""The committer: the one writer of the log tables. Staged files in, table rows out.

A run, per table, under the lease ``logs/committer/lease`` (one committer per store):

1. **Recover.** A commit intent (``logs/commits/<table>/intents/<id>.json``: the staged keys
   of one commit) left by a committer that died: if the table has a snapshot with
   ``fleet.intent = <id>`` the rows are in, and its staged files are deleted; if not, the
   commit never happened and its files are still staged. Either way the intent goes.
2. **Commit.** Up to ``MAX_FILES`` staged files (``MAX_BYTES``) are read; one that is not
   Parquet, or not the table's columns, is moved to ``logs/rejected/``. The intent is
   written, then the rows are appended as one snapshot (atomic in the catalog) carrying the
   intent's id, then the staged files and the intent are deleted. A kill at any point leaves
   either no snapshot (the files are committed by the next run) or a snapshot and its intent
   (recovered by step 1): every staged row ends in the table exactly once.
3. **Compact.** An hour of a model that ended more than ``SETTLE_S`` ago and holds more than
   one file is rewritten as one (``fleet.op = compact``: incremental readers skip it); the
   files it replaced are deleted once no kept snapshot can read them.
4. **Expire.** Rows older than ``retention_days`` are deleted (whole hours: metadata only);
   snapshots older than ``SNAPSHOT_KEEP_S`` are expired, and the files only they read deleted.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from fleet.errors import FleetError, NotFound
from fleet.logs import staging, tables
from fleet.types import ObjectStore

log = logging.getLogger("fleet.logs.committer")

COMMITS = staging.COMMITS
LEASE_KEY = "logs/committer/lease"
EVERY_S = 60.0  # the committer's schedule (flows/logs.py)
MAX_FILES = 2_000  # staged files in one commit
MAX_BYTES = 512 * 1024 * 1024  # and their bytes
READERS = 16  # staged files read (and deleted) at once
SETTLE_S = 3600.0  # an hour is compacted once it ended this long ago (late flushes and retries are in)
COMPACT_LOOKBACK_H = 6  # settled hours looked at for compaction in one run
SNAPSHOT_KEEP_S = 6 * 3600.0  # snapshots kept (an experiment's last look older than this reads again in full)
RETENTION_DAYS = 30


@dataclass
class Committed:
    """What one run did to one table."""

    table: str
    files: int = 0  # staged files committed
    rows: int = 0
    rejected: list[str] = field(default_factory=list)
    recovered: int = 0  # intents of a committer that died, settled
    compacted: int = 0  # model-hours rewritten as one file
    expired: int = 0  # snapshots expired
    deleted: int = 0  # data files deleted (replaced by compaction or past retention)
    snapshot_id: int | None = None


def _intent_key(name: str, intent_id: str) -> str:
    return f"{COMMITS}{name}/intents/{intent_id}.json"


def _delete_all(store: ObjectStore, keys: list[str]) -> None:
    def gone(key: str) -> None:
        try:
            store.delete(key)
        except NotFound:
            pass

    with ThreadPoolExecutor(READERS) as pool:
        list(pool.map(gone, keys))


def recover(store: ObjectStore, name: str, table) -> int:  # noqa: ANN001 - a pyiceberg Table
    pending = staging.intents(store, name)
    if not pending:
        return 0
    done = {s.summary.additional_properties.get("fleet.intent") for s in table.metadata.snapshots if s.summary}
    for intent_id, keys in pending.items():
        if intent_id in done:
            _delete_all(store, keys)
        store.delete(_intent_key(name, intent_id))
        log.warning(
            "recovered commit %s of %s: %s", intent_id, name, "committed" if intent_id in done else "not committed"
        )
    return len(pending)


def commit(
    store: ObjectStore, logs: tables.LogTables, name: str, *, check: Callable[[], None] = lambda: None
) -> Committed:
    """Steps 1 and 2 for table ``name``; ``check`` is asked before every write only the
    committer may make (the lease's)."""
    import pyarrow as pa

    done = Committed(name)
    table = logs.table(name, fresh=True)
    done.recovered = recover(store, name, table)
    listed = sorted(staging.listed(store, name), key=lambda s: s.key)[:MAX_FILES]
    if not listed:
        return done
    schema = table.schema().as_arrow()  # the catalog numbered the fields: its own ids, by name
    with ThreadPoolExecutor(READERS) as pool:
        found = list(pool.map(lambda s: (s.key, staging.read(store, s.key, done.rejected)), listed))
    parts, keys, features, size = [], [], {}, 0
    for key, data in found:
        if data is None:
            continue
        try:
            part = data.select(schema.names).cast(schema)
        except (KeyError, ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            log.warning("rejecting %s: not the %s table's columns (%s)", key, name, exc)
            done.rejected.append(key)
            continue
        parts.append(part)
        keys.append(key)
        features.update(staging.features_of(data))
        size += part.nbytes
        if size >= MAX_BYTES:
            break
    for key in done.rejected:
        _reject(store, key)
    if not parts:
        return done
    if features:
        _set_features(table, features, check)
    intent_id = uuid.uuid4().hex
    check()
    store.put(_intent_key(name, intent_id), json.dumps({"keys": keys}).encode(), if_none_match=True)
    rows = pa.concat_tables(parts)
    check()
    table.append(rows, snapshot_properties={"fleet.intent": intent_id, "fleet.op": "commit"})
    _delete_all(store, keys)
    store.delete(_intent_key(name, intent_id))
    done.files, done.rows = len(keys), rows.num_rows
    done.snapshot_id = table.current_snapshot().snapshot_id
    return done


def _reject(store: ObjectStore, key: str) -> None:
    """Move a bad staged file aside: kept for a person to look at, never read again."""
    try:
        data = store.get(key).data
    except NotFound:
        return
    store.put(staging.REJECTED + key.removeprefix(staging.STAGING), data)
    store.delete(key)


def _set_features(table, features: dict[str, list[str]], check: Callable[[], None]) -> None:  # noqa: ANN001
    changed = {
        tables.FEATURES_PROPERTY.format(model): json.dumps(names)
        for model, names in features.items()
        if table.properties.get(tables.FEATURES_PROPERTY.format(model)) != json.dumps(names)
    }
    if changed:
        check()
        with table.transaction() as tx:
            tx.set_properties(changed)


def compact(table, name: str, now: datetime, check: Callable[[], None] = lambda: None) -> tuple[int, list[str]]:  # noqa: ANN001
    """Step 3: (model-hours rewritten, paths of the files they replaced)."""
    from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan

    if table.current_snapshot() is None:
        return 0, []
    end = (now - timedelta(seconds=SETTLE_S)).replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=COMPACT_LOOKBACK_H)
    _, tasks = tables.scan(
        table, And(GreaterThanOrEqual("ts", start.isoformat()), LessThan("ts", end.isoformat())), ("ts",)
    )
    groups: dict[tuple, list] = {}
    for task in tasks:
        groups.setdefault(tuple(task.file.partition), []).append(task)
    count, replaced = 0, []
    for (model, hour), group in groups.items():
        if len(group) < 2:
            continue
        at = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(hours=hour)
        where = tables.window_filter(model, at, at + timedelta(hours=1))
        rows = table.scan(row_filter=where).to_arrow()
        check()
        table.overwrite(rows, overwrite_filter=where, snapshot_properties={"fleet.op": "compact"})
        count += 1
        replaced += [t.file.file_path for t in group]
    return count, replaced


def expire(
    store: ObjectStore,
    logs: tables.LogTables,
    table,
    name: str,
    now: datetime,
    retention_days: int,
    replaced: list[str],
    check: Callable[[], None] = lambda: None,
) -> tuple[int, int]:  # noqa: ANN001, E501
    """Step 4: (snapshots expired, files deleted)."""
    from pyiceberg.expressions import LessThan

    garbage = f"{COMMITS}{name}/garbage/"
    if replaced:
        store.put(f"{garbage}{int(now.timestamp() * 1000)}-{uuid.uuid4().hex[:8]}.json", json.dumps(replaced).encode())
    if table.current_snapshot() is None:
        return 0, 0
    cutoff = (now - timedelta(days=retention_days)).replace(minute=0, second=0, microsecond=0)
    old = [t.file.file_path for t in tables.scan(table, LessThan("ts", cutoff.isoformat()), ("ts",))[1]]
    if old:
        check()
        table.delete(LessThan("ts", cutoff.isoformat()), snapshot_properties={"fleet.op": "retention"})
        store.put(f"{garbage}{int(now.timestamp() * 1000)}-{uuid.uuid4().hex[:8]}.json", json.dumps(old).encode())
    keep_from = now - timedelta(seconds=SNAPSHOT_KEEP_S)
    expired = [s.snapshot_id for s in table.metadata.snapshots if s.timestamp_ms < keep_from.timestamp() * 1000]
    current = table.current_snapshot().snapshot_id
    expired = [s for s in expired if s != current]
    if expired:
        lists = [s.manifest_list for s in table.metadata.snapshots if s.snapshot_id in set(expired)]
        store.put(f"{garbage}{int(now.timestamp() * 1000)}-{uuid.uuid4().hex[:8]}.json", json.dumps(lists).encode())
        check()
        table.maintenance.expire_snapshots().by_ids(expired).commit()
    # files set aside before every kept snapshot was taken are read by none of them
    oldest_kept = min((s.timestamp_ms for s in table.metadata.snapshots), default=0)
    deleted = 0
    for key in store.list(garbage):
        written_ms = int(key.rsplit("/", 1)[-1].split("-", 1)[0])
        if written_ms >= oldest_kept:
            continue
        paths = json.loads(store.get(key).data)
        _delete_all(store, [logs.key_of(p) for p in paths])
        store.delete(key)
        deleted += len(paths)
    return len(expired), deleted


def run(
    store: ObjectStore,
    *,
    who: str = "committer",
    retention_days: int = RETENTION_DAYS,
    now: datetime | None = None,
    maintain: bool = True,
    progress: Callable[[Committed], None] = lambda c: None,
) -> list[Committed]:
    """One committer run over every table, under the lease (``Conflict`` if another holds it)."""
    from fleet import leases

    logs = tables.tables_for(store)
    if logs is None:
        raise FleetError(
            "the log tables need a catalog: a file store has one of its own; for S3 set FLEET_LOG_CATALOG "
            "to glue:<database> or sqlite:////path/to/catalog.db"
        )
    lease = leases.acquire(store, LEASE_KEY, what="committing the logs", who=who, stale_after=timedelta(minutes=5))
    out = []
    try:
        with lease.kept_alive():
            logs.create()
            for name in tables.TABLES:
                started = time.monotonic()
                done = commit(store, logs, name, check=lease.check)
                if maintain:
                    table = logs.table(name, fresh=True)
                    at = now or datetime.now(UTC)
                    done.compacted, replaced = compact(table, name, at, lease.check)
                    done.expired, done.deleted = expire(
                        store, logs, table, name, at, retention_days, replaced, lease.check
                    )
                log.info("%s: %s in %.2f s", name, done, time.monotonic() - started)
                progress(done)
                out.append(done)
    finally:
        lease.release()
    return out
