"""An experiment's outcomes, kept up to date one look at a time: ``OutcomeJoin``.

What a look needs is, per version, the count, sum and sum of squares of one number per
logged request that has an outcome: the named outcome, or for ``accuracy`` whether the
prediction equalled the label. That is a join of two tables that both grow: a request's
outcome may come up to a day after it, may be sent again (the last one counts), and may
even be committed before the request (the gateway knew the request before it was staged).

So the join is kept, not recomputed: the requests and outcomes of the *open* window (since
``settled_until``) sit in an in-process DuckDB database, and each look adds only the rows
committed since the last look (the data files the table's new ``commit`` snapshots added:
``added_files``), updating the sums by what each new row changes:

1. a new outcome of a known request adds its value, less the value it replaces;
2. a new request (the first with its tenant, id and row) adds the value of its outcome, if
   one came already.

Requests logged more than ``SETTLE`` ago can get no new outcome (a label points at most a
day back; an hour more for the commit). They leave the database; their part of the sums is
``settled``, which the experiment's state keeps, so a flow that restarts reads the open
window once and goes on. A look whose last snapshot was expired meanwhile reads the open
window again too. Compaction and retention snapshots add no rows and are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from fleet.logs import tables
from fleet.logs.feedback import LOOKBACK_H
from fleet.types import ObjectStore

SETTLE = timedelta(hours=LOOKBACK_H + 1)
# A restart reads this much before the open window too: an id logged again just after the
# boundary then still counts once (its first row settled). Ids repeated further apart count
# as two requests (nothing but a caller reusing its X-Request-Id does that).
BLOCK = timedelta(hours=1)
Sums = tuple[int, float, float]  # (n, sum, sum of squares)
_KEY = ("tenant", "request_id", "row")


def added_files(table: Any, since: int | None, model: str) -> list[str] | None:
    """The data files of ``model`` that the ``commit`` snapshots after ``since`` added (oldest
    first); None if ``since`` is no longer in the table's history (expired)."""
    from pyiceberg.manifest import ManifestEntryStatus

    chain, snapshot = [], table.current_snapshot()
    while snapshot is not None and snapshot.snapshot_id != since:
        chain.append(snapshot)
        parent = snapshot.parent_snapshot_id
        snapshot = table.metadata.snapshot_by_id(parent) if parent is not None else None
    if since is not None and snapshot is None:
        return None
    found = []
    for snap in reversed(chain):
        if (snap.summary.additional_properties if snap.summary else {}).get("fleet.op") != "commit":
            continue  # compaction, retention: no new rows
        for manifest in snap.manifests(table.io):
            if manifest.added_snapshot_id != snap.snapshot_id:
                continue
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                if (
                    entry.status == ManifestEntryStatus.ADDED
                    and entry.snapshot_id == snap.snapshot_id
                    and entry.data_file.partition[0] == model
                ):
                    found.append(entry.data_file.file_path)
    return found


def _snapshot_id(table: Any) -> int | None:
    snapshot = table.current_snapshot() if table is not None else None
    return snapshot.snapshot_id if snapshot is not None else None


@dataclass
class Looked:
    """What one look gives the experiment: every version's sums so far, the settled part of
    them and where it ends (both for the state), and what the look read."""

    sums: dict[str, Sums]
    settled: dict[str, Sums]
    settled_until: datetime
    files: int = 0
    rows: int = 0
    full: bool = False  # the open window was read whole (first look, a restart, an expired snapshot)
    unreadable: list[str] = field(default_factory=list)


class OutcomeJoin:
    """One experiment's join of requests and outcomes (see the module)."""

    def __init__(
        self,
        store: ObjectStore,
        model: str,
        metric: str,
        started_at: datetime,
        settled: dict[str, Sums],
        settled_until: datetime | None,
    ) -> None:
        self.store, self.model, self.metric, self.started_at = store, model, metric, started_at
        self.settled = {v: tuple(s) for v, s in settled.items()}
        self.until = max(started_at, settled_until or started_at)
        self._db = None
        self._sums: dict[str, list[float]] = {}
        self._cursor: dict[str, int | None] = {}

    @property
    def _source(self) -> str:
        return "feedback" if self.metric == "accuracy" else "outcomes"

    def look(self, end: datetime) -> Looked:
        logs = tables.tables_for(self.store)
        found = Looked({}, {}, self.until)
        if logs is None:  # a store with no tables (the memory store): every look reads everything staged
            found.sums, found.full = self._everything(end, found.unreadable), True
            return found
        settled, until = dict(self.settled), self.until
        try:
            return self._look(logs, end, found)
        except BaseException:
            # a look that failed halfway leaves no half-updated join: the next reads the open window again
            self._db, self._sums, self._cursor = None, {}, {}
            self.settled, self.until = settled, until
            raise

    def _look(self, logs: tables.LogTables, end: datetime, found: Looked) -> Looked:
        requests, outcomes = logs.table("inference", fresh=True), logs.table(self._source, fresh=True)
        new = None
        if self._db is not None:
            new = [
                added_files(t, self._cursor.get(n), self.model) if t is not None else []
                for n, t in (("inference", requests), (self._source, outcomes))
            ]
        if new is None or any(f is None for f in new):
            self._rebuild(requests, outcomes, end, found)
        else:
            found.files += sum(len(f) for f in new)
            self._add(self._read_files(new[0], "inference"), self._read_files(new[1], self._source), found)
        self._cursor = {
            "inference": _snapshot_id(requests),
            self._source: _snapshot_id(outcomes),
        }
        self._settle(max(self.until, end - SETTLE))
        found.sums = {v: self._total(v) for v in set(self._sums) | set(self.settled)}
        found.settled, found.settled_until = dict(self.settled), self.until
        return found

    def _everything(self, end: datetime, unreadable: list[str]) -> dict[str, Sums]:
        import numpy as np

        from fleet.logs.feedback import OUTCOME_COLUMN, labelled, with_outcomes

        if self.metric == "accuracy":
            frame = labelled(self.store, self.model, self.started_at, end, unreadable)
            frame = frame[frame["label"].notna()] if not frame.empty else frame
            values = (frame["prediction"] == frame["label"]).astype(np.float64) if not frame.empty else None
        else:
            name = OUTCOME_COLUMN.format(self.metric)
            frame = with_outcomes(self.store, self.model, self.started_at, end, [self.metric], unreadable)
            frame = frame[frame[name].notna()] if not frame.empty else frame
            values = frame[name].astype(np.float64) if not frame.empty else None
        if values is None:
            return {}
        out = {}
        for version in frame["version"].unique():
            picked = values[frame["version"] == version].to_numpy()
            out[str(version)] = (len(picked), float(picked.sum()), float((picked * picked).sum()))
        return out

    # -- reading ------------------------------------------------------------------------------

    def _columns(self, name: str) -> tuple[str, ...]:
        if name == "inference":
            return (*_KEY, "version", "prediction", "ts", "status")
        return (*_KEY, "label", "ts") if name == "feedback" else (*_KEY, "name", "value", "ts")

    def _read_files(self, paths: list[str], name: str):  # noqa: ANN202 - a pyarrow Table
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        logs = tables.tables_for(self.store)
        columns = list(self._columns(name))
        parts = [pq.read_table(io.BytesIO(self.store.get(logs.key_of(p)).data), columns=columns) for p in paths]
        if not parts:
            return pa.Table.from_batches([], schema=pa.schema([tables.arrow_schema(name).field(c) for c in columns]))
        return pa.concat_tables(parts)

    def _rebuild(self, requests: Any, outcomes: Any, end: datetime, found: Looked) -> None:
        """The open window read whole, at exactly the snapshots the cursor will name (no upper
        bound on a request's time: a row of that snapshot is counted now or never)."""
        import pyarrow as pa

        self._db, self._sums = self._open(), {}
        parts = []
        far = end + timedelta(days=3650)
        for table, name, start in (
            (requests, "inference", max(self.started_at, self.until - BLOCK)),
            (outcomes, self._source, self.until),
        ):
            columns = self._columns(name)
            if table is None or table.current_snapshot() is None:
                parts.append(self._read_files([], name))
                continue
            planned = tables.scan(table, tables.window_filter(self.model, start, far), columns, _snapshot_id(table))
            found.files += len(planned[1])
            got = tables.read(planned).select(list(columns)) if planned[1] else self._read_files([], name)
            parts.append(got.cast(pa.schema([tables.arrow_schema(name).field(c) for c in columns])))
        found.full = True
        self._block(parts[0])
        self._add(parts[0], parts[1], found)

    # -- the join -----------------------------------------------------------------------------

    def _block(self, requests: Any) -> None:
        """The requests logged just before the open window, in as counted already (no version):
        a second row of one of their ids is not a new request."""
        import pyarrow as pa
        import pyarrow.compute as pc

        ts = requests.column("ts")
        before = requests.filter(pc.less(ts, pa.scalar(self.until, ts.type))).drop_columns("status")
        self._db.register("blockers", before)
        self._db.execute(
            'INSERT INTO req SELECT tenant, request_id, "row", NULL, NULL, min(ts) FROM blockers GROUP BY ALL '
            "ON CONFLICT DO NOTHING"
        )
        self._db.unregister("blockers")

    @staticmethod
    def _open():  # noqa: ANN205 - a duckdb connection
        import duckdb

        db = duckdb.connect()
        db.execute(
            'CREATE TABLE req (tenant VARCHAR, request_id VARCHAR, "row" INTEGER, version VARCHAR, '
            'prediction BIGINT, ts TIMESTAMPTZ, PRIMARY KEY (tenant, request_id, "row"))'
        )
        db.execute(
            'CREATE TABLE out (tenant VARCHAR, request_id VARCHAR, "row" INTEGER, value DOUBLE, ts TIMESTAMPTZ, '
            'PRIMARY KEY (tenant, request_id, "row"))'
        )
        return db

    def _value(self, prediction: str, value: str) -> str:
        """The number a pair counts: the outcome, or for accuracy whether the prediction was the label."""
        return f"CAST({prediction} = {value} AS DOUBLE)" if self.metric == "accuracy" else value

    def _add(self, new_requests: Any, new_outcomes: Any, found: Looked) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        db = self._db
        found.rows += new_requests.num_rows + new_outcomes.num_rows
        ts, status = new_requests.column("ts"), new_requests.column("status")
        requests = new_requests
        if new_requests.num_rows:  # the open window's answered requests (a failed one has no outcome to count)
            answered = pc.or_kleene(pc.is_null(status), pc.less(status, 400))
            requests = new_requests.filter(
                pc.and_kleene(pc.greater_equal(ts, pa.scalar(self.until, ts.type)), answered)
            )
        requests = requests.drop_columns("status")
        if self.metric == "accuracy":
            outcomes = new_outcomes.filter(pc.is_valid(new_outcomes.column("label")))
            outcomes = outcomes.rename_columns([*_KEY, "value", "ts"])
        else:
            outcomes = new_outcomes.filter(pc.equal(new_outcomes.column("name"), self.metric)).drop_columns("name")
        db.register("new_out", outcomes)
        db.register("new_req", requests)
        key = 'tenant, request_id, "row"'
        # a key sent twice in these rows: its last outcome; a request logged twice: its first
        db.execute(
            f"CREATE OR REPLACE TEMP TABLE o AS SELECT * FROM new_out "
            f"QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY ts DESC) = 1"
        )
        db.execute(
            f"CREATE OR REPLACE TEMP TABLE r AS SELECT * FROM new_req "
            f"QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY ts) = 1"
        )
        # 1. new outcomes of requests already here: the new value in, the one it replaces out
        v_new, v_old = self._value("q.prediction", "o.value"), self._value("q.prediction", "old.value")
        rows = db.execute(
            f"SELECT q.version, {v_new}, CASE WHEN old.ts IS NULL THEN NULL ELSE {v_old} END FROM o "
            f"JOIN req q USING ({key}) LEFT JOIN out old USING ({key}) WHERE old.ts IS NULL OR o.ts >= old.ts"
        ).fetchall()
        for version, value, replaced in rows:
            if version is None:
                continue  # a request of the settled part: its outcome was counted there
            self._count(version, value, +1)
            if replaced is not None:
                self._count(version, replaced, -1)
        db.execute(
            f"INSERT INTO out SELECT {key}, value, ts FROM o ON CONFLICT DO UPDATE SET value = excluded.value, "
            "ts = excluded.ts WHERE excluded.ts >= out.ts"
        )
        # 2. requests not seen before: in, with the outcome that came already
        db.execute(f"CREATE OR REPLACE TEMP TABLE fresh AS SELECT r.* FROM r ANTI JOIN req USING ({key})")
        db.execute(f"INSERT INTO req SELECT {key}, version, prediction, ts FROM fresh")
        v_fresh = self._value("f.prediction", "x.value")
        for version, value in db.execute(
            f"SELECT f.version, {v_fresh} FROM fresh f JOIN out x USING ({key})"
        ).fetchall():
            self._count(version, value, +1)
        db.unregister("new_out")
        db.unregister("new_req")

    def _count(self, version: str, value: float, sign: int) -> None:
        n, s1, s2 = self._sums.setdefault(version, [0, 0.0, 0.0])
        self._sums[version] = [n + sign, s1 + sign * value, s2 + sign * value * value]

    def _settle(self, until: datetime) -> None:
        """Requests logged before ``until`` leave the open window; their sums become settled."""
        if until <= self.until:
            return
        key = 'tenant, request_id, "row"'
        value = self._value("q.prediction", "x.value")
        gone = self._db.execute(
            f"SELECT q.version, count(*), sum({value}), sum({value} * {value}) FROM req q JOIN out x USING ({key}) "
            "WHERE q.ts < ? GROUP BY q.version",
            [until],
        ).fetchall()
        for version, n, s1, s2 in gone:
            if version is None:
                continue
            open_ = self._sums[version]
            self._sums[version] = [open_[0] - n, open_[1] - s1, open_[2] - s2]
            old = self.settled.get(version, (0, 0.0, 0.0))
            self.settled[version] = (old[0] + n, old[1] + s1, old[2] + s2)
        self._db.execute(
            "DELETE FROM out USING req WHERE out.tenant = req.tenant AND out.request_id = req.request_id "
            'AND out."row" = req."row" AND req.ts < ?',
            [until],
        )
        # an outcome older than ``until`` belongs to no open request (a request comes before its outcome)
        self._db.execute("DELETE FROM out WHERE ts < ?", [until])
        self._db.execute("DELETE FROM req WHERE ts < ?", [until])
        self.until = until

    def _total(self, version: str) -> Sums:
        n, s1, s2 = self._sums.get(version, (0, 0.0, 0.0))
        a, b, c = self.settled.get(version, (0, 0.0, 0.0))
        return (int(n + a), s1 + b, s2 + c)
