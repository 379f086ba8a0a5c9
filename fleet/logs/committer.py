"""The committer: the one writer of the log tables. Staged files in, table rows out.

A run, per table, under the lease ``logs/committer/lease`` (one committer per store):

1. **Recover.** A commit intent (``logs/commits/<table>/intents/<id>.json``: the staged keys
   of one commit) left by a committer that died: if the table has a snapshot with
   ``fleet.intent = <id>`` the rows are in, and its staged files are deleted; if not, the
   commit never happened and its files are still staged. Either way the intent goes.
2. **Commit.** Up to ``MAX_FILES`` staged files (about ``MAX_BYTES``) are read, and commits
   follow one another until staging is empty or ``BUDGET_S`` is spent; one that is not
   Parquet, or not the table's columns, is moved to ``logs/rejected/``. The intent is
   written, then the rows are appended as one snapshot (atomic in the catalog) carrying the
   intent's id, then the staged files and the intent are deleted. A kill at any point leaves
   either no snapshot (the files are committed by the next run) or a snapshot and its intent
   (recovered by step 1): every staged row ends in the table exactly once.
3. **Compact.** An hour of a model that ended more than ``SETTLE_S`` ago and holds two files
   smaller than ``SMALL_FILE`` is rewritten, sorted by ``request_id`` (snapshots marked
   ``fleet.op = compact``: incremental readers skip them); the files it replaced are deleted
   once no kept snapshot can read them.
5. **Fencing.** The tables refuse a commit whose base is not the newest metadata (no retry,
   ``commit.retry.num-retries = 0``): a committer that lost its lease while stalled fails
   its append instead of doubling rows its successor committed.
4. **Expire.** Rows older than ``retention_days`` are deleted (whole hours: metadata only);
   snapshots older than ``SNAPSHOT_KEEP_S`` are expired, and the files only they read deleted.
"""

from __future__ import annotations

import functools
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
EVERY_S = 300.0  # the committer's schedule (flows/logs.py): readers read what is staged meanwhile
MAX_FILES = 2_000  # staged files in one commit
MAX_BYTES = 512 * 1024 * 1024  # and about this many bytes of rows (a batch of READERS files past it at most)
BUDGET_S = 45.0  # a run commits batch after batch for at most this long (a backlog is caught up)
SMALL_FILE = 8 * 1024 * 1024  # a model-hour is compacted while it has two files smaller than this
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
    store: ObjectStore,
    logs: tables.LogTables,
    name: str,
    *,
    check: Callable[[], None] = lambda: None,
    budget_s: float = BUDGET_S,
) -> Committed:
    """Steps 1 and 2 for table ``name``: commits of at most ``MAX_FILES`` files and about
    ``MAX_BYTES`` each, one after the other, until staging is drained or ``budget_s`` is
    spent (a backlog is caught up, never read into memory at once). ``check`` is asked
    before every write only the committer may make (the lease's)."""
    done = Committed(name)
    table = logs.table(name, fresh=True)
    done.recovered = recover(store, name, table)
    pending = sorted(staging.listed(store, name), key=lambda s: s.key)
    started = time.monotonic()
    while pending and time.monotonic() - started < budget_s:
        taken = _commit_once(store, table, name, pending, done, check)
        pending = pending[taken:]
    return done


def _commit_once(
    store: ObjectStore, table, name: str, pending: list, done: Committed, check: Callable[[], None]
) -> int:  # noqa: ANN001
    """One commit of the first staged files of ``pending``; returns how many were taken."""
    import pyarrow as pa

    schema = table.schema().as_arrow()  # the catalog numbered the fields: its own ids, by name
    parts, keys, features, size, taken = [], [], {}, 0, 0
    with ThreadPoolExecutor(READERS) as pool:
        while taken < len(pending) and len(keys) < MAX_FILES and size < MAX_BYTES:
            batch = pending[taken : taken + READERS]
            taken += len(batch)
            rejected: list[str] = []
            read = functools.partial(_read_staged, store, rejected)
            for item, data in zip(batch, pool.map(read, batch), strict=True):
                if data is None:
                    continue
                try:
                    part = data.select(schema.names).cast(schema)
                except (KeyError, ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    log.warning("rejecting %s: not the %s table's columns (%s)", item.key, name, exc)
                    rejected.append(item.key)
                    continue
                parts.append(part)
                keys.append(item.key)
                features.update(staging.features_of(data))
                size += part.nbytes
            for key in rejected:
                _reject(store, key)
            done.rejected += rejected
    if not parts:
        return taken
    if features:
        _set_features(table, features, check)
    intent_id = uuid.uuid4().hex
    check()
    store.put(_intent_key(name, intent_id), json.dumps({"keys": keys}).encode(), if_none_match=True)
    # sorted by request_id within each file: a label's lookup reads one row group's ids
    rows = pa.concat_tables(parts).sort_by([("model", "ascending"), ("request_id", "ascending")])
    check()
    table.append(rows, snapshot_properties={"fleet.intent": intent_id, "fleet.op": "commit"})
    _delete_all(store, keys)
    store.delete(_intent_key(name, intent_id))
    done.files += len(keys)
    done.rows += rows.num_rows
    done.snapshot_id = table.current_snapshot().snapshot_id
    return taken


def _read_staged(store: ObjectStore, rejected: list[str], item: staging.Staged):  # noqa: ANN202 - a pyarrow Table or None
    return staging.read(store, item.key, rejected)


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
        if sum(t.file.file_size_in_bytes < SMALL_FILE for t in group) < 2:
            continue  # one file, or a big hour written as several big ones: nothing to gain
        at = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(hours=hour)
        where = tables.window_filter(model, at, at + timedelta(hours=1))
        rows = table.scan(row_filter=where).to_arrow().sort_by("request_id")
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

    def set_aside(paths: list[str]) -> None:
        """Files the current snapshot no longer reads, named by its time (the table's clock,
        the one snapshots are expired by): deleted once every older snapshot is gone."""
        stamp = table.current_snapshot().timestamp_ms
        store.put(f"{garbage}{stamp}-{uuid.uuid4().hex[:8]}.json", json.dumps(paths).encode())

    if table.current_snapshot() is None:
        return 0, 0
    if replaced:
        set_aside(replaced)
    cutoff = (now - timedelta(days=retention_days)).replace(minute=0, second=0, microsecond=0)
    old = [t.file.file_path for t in tables.scan(table, LessThan("ts", cutoff.isoformat()), ("ts",))[1]]
    if old:
        check()
        table.delete(LessThan("ts", cutoff.isoformat()), snapshot_properties={"fleet.op": "retention"})
        set_aside(old)
    # on the table's own clock (its snapshots' times), as the files set aside are named
    keep_from_ms = table.current_snapshot().timestamp_ms - SNAPSHOT_KEEP_S * 1000
    expired = [s.snapshot_id for s in table.metadata.snapshots if s.timestamp_ms < keep_from_ms]
    current = table.current_snapshot().snapshot_id
    expired = [s for s in expired if s != current]
    if expired:
        lists = [s.manifest_list for s in table.metadata.snapshots if s.snapshot_id in set(expired)]
        set_aside(lists)
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


def append_through(table, rows, key: str, value: str, check: Callable[[], None] = lambda: None) -> None:  # noqa: ANN001
    """Append ``rows`` and set the table property ``key`` to ``value`` in one commit: how a
    writer of rows derived from other records (the usage hours) says what it has done, so
    that a run killed before the commit does it again and one killed after does not."""
    check()
    with table.transaction() as tx:
        if rows.num_rows:
            data = rows.cast(table.schema().as_arrow())
            tx.append(data, snapshot_properties={"fleet.op": "commit", key: value})
        tx.set_properties({key: value})


def run(
    store: ObjectStore,
    *,
    who: str = "committer",
    retention_days: int = RETENTION_DAYS,
    now: datetime | None = None,
    maintain: bool = True,
    progress: Callable[[Committed], None] = lambda c: None,
    also: Callable[[tables.LogTables, Callable[[], None]], None] | None = None,
) -> list[Committed]:
    """One committer run over every table, under the lease (``Conflict`` if another holds it);
    ``also`` then writes more under it."""
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
            if also is not None:  # more writes of the tables, under the same lease (flows/logs.py: usage)
                also(logs, lease.check)
    finally:
        lease.release()
    return out
