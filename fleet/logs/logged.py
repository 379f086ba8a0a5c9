"""Which requests the inference log holds, for feedback joins at the gateway: ``LoggedRequests``.

A label (``POST /v1/feedback``) is accepted only for a request the log sampled, of the same
tenant, in the last ``LOOKBACK_H`` hours; the gateway answers that from this index, not by
reading the log per label. For generations it also keeps which version answered and the
output's digest (exact-match feedback), and which answers a label was already counted for.

An id it has not seen costs no scan of the log: each hour's listing of files is remembered
and asked of the store again at most once a ``LIST_EVERY_S`` while the hour may still get
files (until ``SETTLE_S`` after its end: a late flush, a retried write), and once a
``SETTLED_LIST_EVERY_S`` after that; each file is read once. So a flood of made-up ids costs
the store at most a listing a second per model, however many calls carry them, and a label
for a request another gateway logged is found at most ``LIST_EVERY_S`` after that gateway
flushed it. (A per-id lookup that needs no listing at all is the logs' own work to come.)
"""

from __future__ import annotations

import io
import threading
import time
from collections import OrderedDict
from datetime import UTC, datetime, timedelta

from fleet.logs.feedback import LOOKBACK_H
from fleet.logs.inference import hour_prefix as log_hour_prefix
from fleet.types import ObjectStore

INDEX_BYTES = 16 * 1024 * 1024
_ENTRY_BYTES = 160  # one remembered request beyond its strings: key tuple, dict slot, int
_ANSWER_BYTES = 140  # a generation's answer beside it: a tuple and a 32-character digest
_KEY_BYTES = 60  # one listed key beyond its characters
LIST_EVERY_S = 1.0  # an hour that may still get files is listed again at most this often
SETTLE_S = 600.0  # after its end, an hour may still get files this long (a late flush, a retried write)
SETTLED_LIST_EVERY_S = 300.0  # and is listed again this often after that, for a write later still


Answer = tuple[str, str]  # a logged generation's (version, output digest)


class LoggedRequests:
    """Which requests the inference log holds, by (tenant, request id) → rows, for the last
    ``LOOKBACK_H`` hours; for generations also which version answered and its output's digest.

    Log files never change once written, so each is read once (its id columns only) and
    remembered; the gateway's own recent samples are known before they are flushed; each
    hour's listing is remembered (see the module). All are bounded in bytes, together within
    ``max_bytes``: an eighth for the answers a label was counted for, a sixteenth for the
    listings, the rest halved between the other two; the least recently used go first, in O(1).
    """

    def __init__(self, store: ObjectStore, max_bytes: int = INDEX_BYTES) -> None:
        self.store, self.max_bytes = store, max_bytes
        self._labelled_max = max_bytes // 8
        self._listed_max = max_bytes // 16
        self._half = (max_bytes - self._labelled_max - self._listed_max) // 2  # the recent samples' and the files' each
        # an hour's prefix → (when listed, monotonic; its keys; bytes)
        self._listed: OrderedDict[str, tuple[float, tuple[str, ...], int]] = OrderedDict()
        self._listed_bytes = 0
        self.listings = 0  # listings asked of the store (what a flood of unknown ids would drive)
        # (model, tenant, id) → (rows, answer or None)
        self._recent: OrderedDict[tuple[str, str, str], tuple[int, Answer | None]] = OrderedDict()
        self._recent_bytes = 0
        # key → (index (tenant, id) → rows, answers (tenant, id) → answer, bytes)
        self._files: OrderedDict[str, tuple[dict[tuple[str, str], int], dict[tuple[str, str], Answer], int]] = (
            OrderedDict()
        )
        self._files_bytes = 0
        # (model, tenant, id) of generations an exact-match label was counted for, most recent
        # last: a label sent again is not counted again (bounded: the oldest are forgotten)
        self._labelled: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._labelled_bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        return self._recent_bytes + self._files_bytes + self._labelled_bytes + self._listed_bytes

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
        now = now or datetime.now(UTC)
        hour = (now - timedelta(hours=LOOKBACK_H)).replace(minute=0, second=0, microsecond=0)
        while missing and hour <= now:
            for key in self._keys(model, hour, now):
                index, answers = self._index(key)
                for rid, row in list(missing):
                    if row < index.get((tenant, rid), 0):
                        found[rid, row] = answers.get((tenant, rid))
                        missing.discard((rid, row))
            hour += timedelta(hours=1)
        return found

    def _keys(self, model: str, hour: datetime, now: datetime) -> tuple[str, ...]:
        """The log files of ``model``'s ``hour``: remembered, listed again only as the module says."""
        prefix = log_hour_prefix(model, hour)
        settling = (now - hour - timedelta(hours=1)).total_seconds() < SETTLE_S
        every = LIST_EVERY_S if settling else SETTLED_LIST_EVERY_S
        at = time.monotonic()
        with self._lock:
            cached = self._listed.get(prefix)
            if cached is not None and at - cached[0] < every:
                self._listed.move_to_end(prefix)
                return cached[1]
        keys = tuple(self.store.list(prefix))
        size = _ENTRY_BYTES + len(prefix) + sum(_KEY_BYTES + len(k) for k in keys)
        with self._lock:
            self.listings += 1
            old = self._listed.pop(prefix, None)
            if old is not None:
                self._listed_bytes -= old[2]
            if size <= self._listed_max:
                self._listed[prefix] = (at, keys, size)
                self._listed_bytes += size
            while self._listed_bytes > self._listed_max:
                _, (_, _, evicted) = self._listed.popitem(last=False)
                self._listed_bytes -= evicted
        return keys

    def _index(self, key: str) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], Answer]]:
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
                index, answers, _ = self._files[key]
                return index, answers
        import pyarrow.parquet as pq

        data = io.BytesIO(self.store.get(key).data)
        generations = "output_digest" in pq.read_schema(data).names
        columns = ["request_id", "row", "tenant"] + (["version", "output_digest"] if generations else [])
        table = pq.read_table(data, columns=columns)
        answers: dict[tuple[str, str], Answer] = {}
        if generations:  # one row per generation
            tenants, rids, versions, digests = (
                table.column(c).to_pylist() for c in ("tenant", "request_id", "version", "output_digest")
            )
            answers = {(t, r): (v, d) for t, r, v, d in zip(tenants, rids, versions, digests, strict=True)}
            index = dict.fromkeys(answers, 1)
        else:
            # grouped by Arrow: one Python object per request, not three per row (a 10,000-row
            # request would otherwise hold the GIL, and the gateway's loop, for tens of ms)
            grouped = table.group_by(["tenant", "request_id"]).aggregate([("row", "max")])
            index = {
                (t, r): int(m) + 1
                for t, r, m in zip(*(grouped.column(c).to_pylist() for c in ("tenant", "request_id", "row_max")))
            }
        size = sum(_ENTRY_BYTES + len(t) + len(r) for t, r in index) + len(key)
        size += sum(_ANSWER_BYTES + len(v) for v, _ in answers.values())
        with self._lock:
            if size <= self._half:
                self._files[key] = (index, answers, size)
                self._files_bytes += size
            while self._files_bytes > self._half:
                _, (_, _, evicted) = self._files.popitem(last=False)
                self._files_bytes -= evicted
        return index, answers
