"""Which requests the inference log holds, for feedback joins at the gateway: ``LoggedRequests``.

A label (``POST /v1/feedback``) is accepted only for a request the log sampled, of the same
tenant, in the last ``LOOKBACK_H`` hours; the gateway answers that from this index, not by
reading the log per label. For generations it also keeps which version answered and the
output's digest (exact-match feedback), and which answers a label was already counted for.

An id it has not seen costs a bounded lookup, never a scan of a day. The gateway's ids are
UUIDv7 (``fleet.logs.ids``): the id says when the request came, so only the files of that
hour (and the next: a long answer) can hold it. Of those, the table's scan planning keeps the
files whose ``request_id`` bounds include it (ids sort by time, so a file of a minute's
commit covers a minute of ids), and each file is read once (its id columns) and remembered.
Staged files (not committed yet) come from one listing of the staging prefix, asked again at
most once a ``LIST_EVERY_S`` however many calls come. An id a caller chose has no time: it is
looked for in the last ``UNTIMED_LOOKBACK_H`` hours only. A label for a request another
gateway logged is found once that gateway has staged it (its flush interval).
"""

from __future__ import annotations

import io
import threading
import time
from collections import OrderedDict
from datetime import UTC, datetime, timedelta

from fleet.errors import NotFound
from fleet.logs import ids
from fleet.logs.feedback import LOOKBACK_H
from fleet.logs.staging import Staged, listed
from fleet.logs.tables import scan, tables_for, window_filter
from fleet.types import ObjectStore

INDEX_BYTES = 16 * 1024 * 1024
_ENTRY_BYTES = 160  # one remembered request beyond its strings: key tuple, dict slot, int
_ANSWER_BYTES = 140  # a generation's answer beside it: a tuple and a 32-character digest
_KEY_BYTES = 60  # one listed key beyond its characters
LIST_EVERY_S = 1.0  # the staged files are listed again at most this often
MAX_ANSWER_S = 3600.0  # a request's rows are logged at most this long after its id was made
UNTIMED_LOOKBACK_H = 2  # an id a caller chose (no time in it) is looked for this far back
MAX_PLANNED_IDS = 1000  # ids of one lookup the scan's planning prunes by (more: the window's files)


ID_COLUMNS = ("model", "request_id", "row", "tenant", "version", "output_digest", "status")
Answer = tuple[str, str]  # a logged generation's (version, output digest)


class LoggedRequests:
    """Which requests the inference log holds, by (tenant, request id) → rows, for the last
    ``LOOKBACK_H`` hours; for generations also which version answered and its output's digest.

    Log files never change once written, so each is read once (its id columns only) and
    remembered; the gateway's own recent samples are known before they are flushed; the
    staging listing is remembered (see the module). All are bounded in bytes, together within
    ``max_bytes``: an eighth for the answers a label was counted for, a sixteenth for the
    listings, the rest halved between the other two; the least recently used go first, in O(1).
    """

    def __init__(self, store: ObjectStore, max_bytes: int = INDEX_BYTES) -> None:
        self.store, self.max_bytes = store, max_bytes
        self._labelled_max = max_bytes // 8
        self._listed_max = max_bytes // 16
        self._half = (max_bytes - self._labelled_max - self._listed_max) // 2  # the recent samples' and the files' each
        # the staged files, when listed (monotonic)
        self._listed: tuple[float, tuple[Staged, ...]] | None = None
        self.listings = 0  # listings asked of the store (what a flood of unknown ids would drive)
        self.plans = 0  # scans of the table planned
        self.files_read = 0  # committed files read (their matching row groups' id columns)
        # (model, tenant, id) → (rows, answer or None)
        self._recent: OrderedDict[tuple[str, str, str], tuple[int, Answer | None]] = OrderedDict()
        self._recent_bytes = 0
        # (model, key) → (index (tenant, id) → rows, answers (tenant, id) → answer, bytes)
        self._files: OrderedDict[
            tuple[str, str], tuple[dict[tuple[str, str], int], dict[tuple[str, str], Answer], int]
        ] = OrderedDict()
        self._files_bytes = 0
        # (model, tenant, id) of generations an exact-match label was counted for, most recent
        # last: a label sent again is not counted again (bounded: the oldest are forgotten)
        self._labelled: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._labelled_bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        listed = self._listed[1] if self._listed is not None else ()
        return (
            self._recent_bytes + self._files_bytes + self._labelled_bytes + sum(_KEY_BYTES + len(s.key) for s in listed)
        )

    def first_labels(self, model: str, tenant: str, ids: list[str]) -> list[bool]:
        """For each id (in order): whether this is the first label counted for it (then it is
        remembered). Bounded by an eighth of ``max_bytes``: past it the oldest are forgotten, and a label
        for one of those counts again."""
        out = []
        with self._lock:
            for rid in ids:
                key = (model, tenant, rid)
                if key in self._labelled:
                    self._labelled.move_to_end(key)
                    out.append(False)
                    continue
                self._labelled[key] = None
                self._labelled_bytes += _ENTRY_BYTES + len(model) + len(tenant) + len(rid)
                out.append(True)
            while self._labelled_bytes > self._labelled_max:
                (m, t, r), _ = self._labelled.popitem(last=False)
                self._labelled_bytes -= _ENTRY_BYTES + len(m) + len(t) + len(r)
        return out

    @staticmethod
    def _size(model: str, tenant: str, request_id: str, answer: Answer | None) -> int:
        return (
            _ENTRY_BYTES
            + len(model)
            + len(tenant)
            + len(request_id)
            + (_ANSWER_BYTES + len(answer[0]) if answer else 0)
        )

    def remember(self, model: str, tenant: str, request_id: str, rows: int, answer: Answer | None = None) -> None:
        """One sampled request (on the request path: O(1)); a generation with its answer."""
        key = (model, tenant, request_id)
        with self._lock:
            old = self._recent.pop(key, None)
            if old is not None:
                self._recent_bytes -= self._size(*key, old[1])
            self._recent[key] = (rows, answer)
            self._recent_bytes += self._size(*key, answer)
            while self._recent_bytes > self._half:
                evicted, (_, was) = self._recent.popitem(last=False)
                self._recent_bytes -= self._size(*evicted, was)

    def owned(
        self, model: str, tenant: str, wanted: set[tuple[str, int]], now: datetime | None = None
    ) -> set[tuple[str, int]]:
        """Which wanted (request id, row) are logged requests of ``tenant``."""
        return set(self._find(model, tenant, wanted, now))

    def answers(self, model: str, tenant: str, ids: set[str], now: datetime | None = None) -> dict[str, Answer]:
        """The logged generations among ``ids`` of ``tenant``: id → (version, output digest)."""
        found = self._find(model, tenant, {(rid, 0) for rid in ids}, now)
        return {rid: answer for (rid, _), answer in found.items() if answer is not None}

    def _find(
        self, model: str, tenant: str, wanted: set[tuple[str, int]], now: datetime | None
    ) -> dict[tuple[str, int], Answer | None]:
        found: dict[tuple[str, int], Answer | None] = {}
        with self._lock:
            for rid, row in wanted:
                entry = self._recent.get((model, tenant, rid))
                if entry is not None and row < entry[0]:
                    found[rid, row] = entry[1]
        missing = wanted - set(found)
        if not missing:
            return found
        now = now or datetime.now(UTC)
        buckets: dict[tuple[datetime, datetime], set[str]] = {}
        for rid, _ in missing:
            buckets.setdefault(self._window(rid, now), set()).add(rid)
        staged = self._staged()  # listed before the table is loaded: see _committed
        for (start, end), rids in buckets.items():
            for key in (s.key for s in staged if s.overlaps(start, end)):
                index, answers = self._index(model, key)
                self._match(model, tenant, rids, index, answers, missing, found)
            if any(rid in rids for rid, _ in missing):
                for index, answers in self._committed(model, start, end, {r for r, _ in missing if r in rids}):
                    self._match(model, tenant, rids, index, answers, missing, found)
        return found

    def _match(
        self, model: str, tenant: str, rids: set[str], index: dict, answers: dict, missing: set, found: dict
    ) -> None:
        for rid, row in list(missing):
            rows = index.get((tenant, rid), 0)
            if rid in rids and row < rows:
                found[rid, row] = answers.get((tenant, rid))
                missing.discard((rid, row))
                # remembered as a recent request: a label sent again, or its other rows, cost no read
                self.remember(model, tenant, rid, rows, answers.get((tenant, rid)))

    @staticmethod
    def _window(request_id: str, now: datetime) -> tuple[datetime, datetime]:
        """Where a request's rows can be, in whole hours (so one lookup's ids share few windows):
        the hour its id was made and the next (an answer may take up to ``MAX_ANSWER_S``) for an
        id the gateway made; the last ``UNTIMED_LOOKBACK_H`` hours for one a caller chose.
        Never before ``LOOKBACK_H`` ago."""
        floor = (now - timedelta(hours=LOOKBACK_H)).replace(minute=0, second=0, microsecond=0)
        made = ids.time_of(request_id)
        if made is None:
            start = (now - timedelta(hours=UNTIMED_LOOKBACK_H)).replace(minute=0, second=0, microsecond=0)
            return max(start, floor), now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
        hour = datetime.fromtimestamp(made, UTC).replace(minute=0, second=0, microsecond=0)
        return max(hour, floor), hour + timedelta(hours=1) + timedelta(seconds=MAX_ANSWER_S)

    def _committed(self, model: str, start: datetime, end: datetime, rids: set[str]):  # noqa: ANN202 - an iterator
        """The (index, answers) of ``rids`` in the committed files of [start, end): the table's
        scan keeps the files whose ``request_id`` bounds hold one of them, and each file is read
        for those ids only (their row groups, the id columns). The table is loaded no earlier
        than the staging listing was taken, so a file committed and unstaged before that
        listing is in it."""
        logs = tables_for(self.store)
        if logs is None:
            return
        listed_at = self._listed[0] if self._listed is not None else 0.0
        table = logs.table("inference", fresh_since=listed_at)
        if table is None or table.current_snapshot() is None:
            return
        from pyiceberg.expressions import And, GreaterThanOrEqual, LessThanOrEqual

        wanted = sorted(rids)
        for i in range(0, len(wanted), MAX_PLANNED_IDS):
            chunk = wanted[i : i + MAX_PLANNED_IDS]
            self.plans += 1
            # the chunk's id range, not an IN list (pyiceberg prunes by bounds for at most 200
            # values): ids sort by time, so a sorted chunk's range is narrow
            span = And(GreaterThanOrEqual("request_id", chunk[0]), LessThanOrEqual("request_id", chunk[-1]))
            _, tasks = scan(table, window_filter(model, start, end, span), ("request_id",))
            for task in tasks:
                self.files_read += 1
                yield self._read_ids(table, task.file.file_path, model, chunk)

    def _read_ids(self, table, path: str, model: str, chunk: list[str]):  # noqa: ANN001, ANN202
        """(index, answers) of ``chunk`` in one committed file: only the row groups whose
        ``request_id`` statistics hold one (a file is sorted by it) and only the id columns."""
        import pyarrow.parquet as pq

        columns = list(ID_COLUMNS)
        if path.startswith("s3://"):
            bucket, rest = path.removeprefix("s3://").split("/", 1)
            where, fs = f"{bucket}/{rest}", table.io.fs_by_scheme("s3", bucket)
        else:
            where, fs = path.removeprefix("file://").removeprefix("file:"), None
        found = pq.read_table(where, filesystem=fs, columns=columns, filters=[("request_id", "in", chunk)])
        return self._indexed(found, model)

    def _staged(self) -> tuple[Staged, ...]:
        """The staged inference files: listed again at most once a ``LIST_EVERY_S`` (the staging
        prefix holds only what is not committed yet, so the listing stays short)."""
        at = time.monotonic()
        with self._lock:
            if self._listed is not None and at - self._listed[0] < LIST_EVERY_S:
                return self._listed[1]
        found = tuple(listed(self.store, "inference"))
        with self._lock:
            self.listings += 1
            self._listed = (at, found)  # kept whatever its size: a backlog must not hide its requests
        return found

    def _index(self, model: str, key: str) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], Answer]]:
        """A staged file's index for ``model`` (read once, its id columns; remembered)."""
        with self._lock:
            cached = self._files.get((model, key))
            if cached is not None:
                self._files.move_to_end((model, key))
                return cached[0], cached[1]
        import pyarrow.parquet as pq

        try:
            data = io.BytesIO(self.store.get(key).data)
        except NotFound:  # committed meanwhile: the table, loaded after the listing, has it
            return {}, {}
        try:
            table = pq.read_table(data, columns=list(ID_COLUMNS))
        except (ValueError, OSError):
            return {}, {}
        index, answers = self._indexed(table, model)
        size = sum(_ENTRY_BYTES + len(t) + len(r) for t, r in index) + len(key)
        size += sum(_ANSWER_BYTES + len(v) for v, _ in answers.values())
        with self._lock:
            if size <= self._half:
                self._files[model, key] = (index, answers, size)
                self._files_bytes += size
            while self._files_bytes > self._half:
                _, (_, _, evicted) = self._files.popitem(last=False)
                self._files_bytes -= evicted
        return index, answers

    @staticmethod
    def _indexed(table, model: str) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], Answer]]:  # noqa: ANN001
        import pyarrow.compute as pc

        status = table.column("status")  # a failed request was logged too: it has no answer to label
        table = table.filter(
            pc.and_kleene(
                pc.equal(table.column("model"), model), pc.or_kleene(pc.is_null(status), pc.less(status, 400))
            )
        )
        generations = table.num_rows > 0 and table.column("output_digest").null_count < table.num_rows
        answers: dict[tuple[str, str], Answer] = {}
        if generations:  # one row per generation
            tenants, rids, versions, digests = (
                table.column(c).to_pylist() for c in ("tenant", "request_id", "version", "output_digest")
            )
            answers = {(t, r): (v, d) for t, r, v, d in zip(tenants, rids, versions, digests, strict=True)}
            return dict.fromkeys(answers, 1), answers
        # grouped by Arrow: one Python object per request, not three per row (a 10,000-row
        # request would otherwise hold the GIL, and the gateway's loop, for tens of ms)
        grouped = table.group_by(["tenant", "request_id"]).aggregate([("row", "max")])
        index = {
            (t, r): int(m) + 1
            for t, r, m in zip(*(grouped.column(c).to_pylist() for c in ("tenant", "request_id", "row_max")))
        }
        return index, answers
