"""Ground-truth labels for earlier requests, joined to the inference log by request id.

``logs/feedback/<model>/<yyyy>/<mm>/<dd>/<hh>/<unix ms>-<writer>-<seq>.parquet``: one row per
label — ``ts``, ``request_id``, ``row``, ``tenant``, ``label``. Labels are accepted only for
requests the inference log holds, of the same tenant (nobody labels another tenant's
traffic); the others come back as unknown, never silently dropped.

``labelled(store, model, start, end)`` is the inference log of a window with a ``label``
column where feedback exists: what concept-drift monitoring and retraining read.
"""

from __future__ import annotations

import io
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from fleet.errors import InvalidInput
from fleet.inference_log import hour_prefix as log_hour_prefix
from fleet.inference_log import read_window
from fleet.names import check_name
from fleet.types import ObjectStore

LOOKBACK_H = 24  # how far back a label may point
_FILES_CACHED = 2048


@dataclass(frozen=True, slots=True)
class Label:
    request_id: str
    row: int
    label: int


def parse(body: dict) -> tuple[str, list[Label]]:
    """``{"model": m, "feedback": [{"request_id", "label", "row"?: 0}, ...]}`` → (model, labels)."""
    model = body.get("model")
    items = body.get("feedback")
    expected = 'expected {"model": "<model>", "feedback": [{"request_id": "...", "label": <int>, "row": <int, default 0>}]}'
    if not isinstance(model, str) or not isinstance(items, list) or not items:
        raise InvalidInput(f"feedback body has no model or no feedback list; {expected}")
    check_name("model", model)
    labels = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidInput(f"feedback[{i}] is {type(item).__name__}; {expected}")
        rid, label, row = item.get("request_id"), item.get("label"), item.get("row", 0)
        if not isinstance(rid, str) or not rid:
            raise InvalidInput(f"feedback[{i}].request_id is {rid!r}; expected the X-Request-Id of an earlier answer")
        if isinstance(label, bool) or not isinstance(label, int):
            raise InvalidInput(f"feedback[{i}].label is {label!r}; expected the true class as an integer")
        if isinstance(row, bool) or not isinstance(row, int) or row < 0:
            raise InvalidInput(f"feedback[{i}].row is {row!r}; expected the row's index in the request (0 for one row)")
        labels.append(Label(rid, row, label))
    return model, labels


class LoggedRequests:
    """Which (request id, row) → tenant the inference log holds, for the last ``LOOKBACK_H`` hours.

    Log files never change once written, so each is read once (its id columns only) and
    remembered; the gateway's own recent samples are known before they are flushed.
    """

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._files: OrderedDict[str, dict[tuple[str, int], str]] = OrderedDict()
        self._recent: dict[tuple[str, str, int], str] = {}  # (model, id, row) → tenant, not yet flushed
        self._lock = threading.Lock()

    def remember(self, model: str, request_id: str, rows: int, tenant: str) -> None:
        with self._lock:
            for row in range(rows):
                self._recent[model, request_id, row] = tenant
            while len(self._recent) > 200_000:
                self._recent.pop(next(iter(self._recent)))

    def tenants(self, model: str, wanted: set[tuple[str, int]], now: datetime | None = None) -> dict[tuple[str, int], str]:
        """The tenant of each wanted (id, row) the log holds; missing ones are absent."""
        with self._lock:
            found = {k: self._recent[(model, *k)] for k in wanted if (model, *k) in self._recent}
        missing = wanted - set(found)
        now = now or datetime.now(UTC)
        hour = (now - timedelta(hours=LOOKBACK_H)).replace(minute=0, second=0, microsecond=0)
        while missing and hour <= now:
            for key in self.store.list(log_hour_prefix(model, hour)):
                ids = self._ids(key)
                for k in list(missing):
                    if k in ids:
                        found[k] = ids[k]
                        missing.discard(k)
            hour += timedelta(hours=1)
        return found

    def _ids(self, key: str) -> dict[tuple[str, int], str]:
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
                return self._files[key]
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(self.store.get(key).data), columns=["request_id", "row", "tenant"])
        ids = {(r, int(n)): t for r, n, t in zip(*(table.column(c).to_pylist() for c in ("request_id", "row", "tenant")))}
        with self._lock:
            self._files[key] = ids
            while len(self._files) > _FILES_CACHED:
                self._files.popitem(last=False)
        return ids


_seq = itertools.count(1)


def write(store: ObjectStore, model: str, tenant: str, labels: Sequence[Label], writer: str) -> str:
    """Store accepted labels as one Parquet file; return its key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    now = time.time()
    table = pa.table({
        "ts": pa.array([int(now * 1000)] * len(labels), pa.timestamp("ms", tz="UTC")),
        "request_id": [x.request_id for x in labels], "row": pa.array([x.row for x in labels], pa.int32()),
        "tenant": [tenant] * len(labels), "label": pa.array([x.label for x in labels], pa.int64()),
    })  # fmt: skip
    out = io.BytesIO()
    pq.write_table(table, out, compression="zstd")
    hour = datetime.fromtimestamp(now, UTC)
    key = f"logs/feedback/{check_name('model', model)}/{hour:%Y/%m/%d/%H}/{int(now * 1000)}-{writer}-{next(_seq):06d}.parquet"
    store.put(key, out.getvalue(), if_none_match=True)
    return key


def read_feedback(store: ObjectStore, model: str, start: datetime, end: datetime):  # noqa: ANN201 - DataFrame
    """Every label given between ``start`` and ``end`` (the last one wins for a request row)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    hour = start.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    while hour < end:
        for key in store.list(f"logs/feedback/{model}/{hour:%Y/%m/%d/%H}/"):
            tables.append(pq.read_table(io.BytesIO(store.get(key).data)))
        hour += timedelta(hours=1)
    if not tables:
        return pd.DataFrame({"ts": [], "request_id": [], "row": [], "tenant": [], "label": []})
    frame = pa.concat_tables(tables, promote_options="permissive").to_pandas().sort_values("ts")
    return frame.drop_duplicates(["request_id", "row"], keep="last").reset_index(drop=True)


def labelled(store: ObjectStore, model: str, start: datetime, end: datetime):  # noqa: ANN201 - DataFrame
    """The inference log of [start, end) with a ``label`` column (NaN where no feedback came)."""
    window = read_window(store, model, start, end)
    feedback = read_feedback(store, model, start, end + timedelta(hours=LOOKBACK_H))
    if window.empty:
        return window.assign(label=[])
    joined = window.merge(feedback[["request_id", "row", "label"]], on=["request_id", "row"], how="left")
    return joined
