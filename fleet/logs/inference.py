"""The inference log: sampled requests, written by the gateway in Parquet batches, read by monitoring.

``logs/inference/<model>/<yyyy>/<mm>/<dd>/<hh>/<unix ms>-<writer>-<seq>.parquet``, one row
per input row: ``ts``, ``request_id``, ``row``, ``model``, ``version``, ``tenant``,
``latency_ms``, one float64 column per feature, ``prediction`` (argmax class) and
``score`` (probability of the last class). A generative model's file has one row per sampled
generation (``GenSample``): ``latency_ms`` (the whole answer), ``ttft_ms``, ``prompt_tokens``,
``completion_tokens``, ``finish_reason``, ``output_digest`` (what exact-match feedback is
compared with) and, only where the policy says ``inference_log.texts: true``, ``prompt`` and
``output``.

Writing never slows a request: ``record`` appends to a buffer; a background thread turns
the buffer into Parquet and puts it in the store every ``flush_s`` seconds. A store that
is slow or down delays only that thread; what it could not write stays buffered and is
retried. The buffer is bounded in bytes (``max_bytes``, the policy's
``gateway.inference_log_buffer_mib``): past it the oldest samples are dropped, and counted,
until it is under budget again; a sample larger than the whole budget is dropped at once.
``close`` flushes what is left.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import numpy as np

from fleet.errors import FleetError
from fleet.types import ObjectStore

if TYPE_CHECKING:
    from fleet.logs.reading import Reading

log = logging.getLogger("fleet.logs.inference")

FLUSH_S = 60.0  # a gateway process stages its samples this often (the policy's gateway.inference_log_flush_s)
FLUSH_BYTES = 16 * 1024 * 1024  # or as soon as this much is buffered (gateway.inference_log_flush_mib)
RETRY_S = 2.0  # a failed flush is tried again this often (or at flush_s if shorter)
MAX_BYTES = 64 * 1024 * 1024
SAMPLE_OVERHEAD = 400  # bytes per sample beyond its arrays: ids, names, the object itself
META_COLUMNS = ("ts", "request_id", "row", "model", "version", "tenant", "latency_ms")


@dataclass(frozen=True, slots=True)
class Sample:
    ts: float  # unix seconds
    request_id: str
    model: str
    version: str
    tenant: str
    latency_ms: float
    features: np.ndarray  # [rows, features]
    outputs: np.ndarray  # [rows, classes]; [rows, 0] for a request that failed
    feature_names: tuple[str, ...]
    status: int = 200  # the HTTP status the caller got: a failed request is logged too (no outputs)

    @property
    def rows(self) -> int:
        return int(self.features.shape[0])

    @property
    def nbytes(self) -> int:
        return self.features.nbytes + self.outputs.nbytes + SAMPLE_OVERHEAD


@dataclass(frozen=True, slots=True)
class GenSample:
    """One sampled generation: its lengths, times and the digest of its output; its texts only
    where the model's policy allows (``None`` otherwise)."""

    ts: float
    request_id: str
    model: str
    version: str
    tenant: str
    latency_ms: float  # the whole answer
    ttft_ms: float
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    output_digest: str
    prompt: str | None = None
    output: str | None = None

    rows = 1
    layout = ("generation",)

    @property
    def nbytes(self) -> int:
        return SAMPLE_OVERHEAD + _text_bytes(self.prompt) + _text_bytes(self.output)


def _text_bytes(text: str | None) -> int:
    """An upper bound of a str's memory: 1 byte per character if ASCII, else 4 (``isascii`` is O(1))."""
    return 0 if text is None else len(text) * (1 if text.isascii() else 4)


def digest(text: str) -> str:
    """What a generation's output is known by in the log, and a label compared with."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _layout(sample: Sample | GenSample) -> tuple:
    return sample.layout if isinstance(sample, GenSample) else (sample.feature_names, sample.outputs.shape[-1] or 0)


def feature_names(profile: dict | None, width: int) -> tuple[str, ...]:
    """Names from a baseline profile (``features`` keys, in order), else f0, f1, ..."""
    names = tuple((profile or {}).get("features", {}))
    return names if len(names) == width else tuple(f"f{i}" for i in range(width))


def _strings(values: list, owner):  # noqa: ANN001, ANN202 - a pyarrow Array per row
    """Per-request strings repeated per row by Arrow (a dictionary cast to strings), not as
    numpy string arrays: that took 50 ms for 100k rows in the writer thread, holding the GIL and
    so the gateway's event loop."""
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(owner, pa.array(values, pa.string())).cast(pa.string())


def gen_table(samples: Sequence[GenSample]):  # noqa: ANN201 - a pyarrow.Table
    """One row per sampled generation, in the inference table's columns (no features)."""
    import pyarrow as pa

    columns = {
        "ts": pa.array([int(s.ts * 1e6) for s in samples], pa.timestamp("us", tz="UTC")),
        **{c: pa.array([getattr(s, c) for s in samples], pa.string()) for c in ("model", "request_id", "tenant")},
        "row": pa.array([0] * len(samples), pa.int32()),
        "version": pa.array([s.version for s in samples], pa.string()),
        "status": pa.array([200] * len(samples), pa.int32()),
        **{c: pa.array([getattr(s, c) for s in samples], pa.float64()) for c in ("latency_ms", "ttft_ms")},
        **{c: pa.array([getattr(s, c) for s in samples], pa.int32()) for c in ("prompt_tokens", "completion_tokens")},
        **{
            c: pa.array([getattr(s, c) for s in samples], pa.string())
            for c in ("finish_reason", "output_digest", "prompt", "output")
        },
    }
    return _conform(pa.table(columns))


def tabular_table(samples: Sequence[Sample]):  # noqa: ANN201 - a pyarrow.Table
    """One row per input row of samples sharing one layout: the features as one list each."""
    import pyarrow as pa

    rows = [s.rows for s in samples]
    width = len(samples[0].feature_names)
    features = np.concatenate([s.features.reshape(s.rows, -1) for s in samples]).astype(np.float64)
    outputs = [s.outputs.reshape(s.rows, -1) for s in samples]
    owner = pa.array(np.repeat(np.arange(len(samples), dtype=np.int32), rows))  # row → its sample
    columns = {
        "ts": pa.array(np.repeat([int(s.ts * 1e6) for s in samples], rows), pa.timestamp("us", tz="UTC")),
        **{c: _strings([getattr(s, c) for s in samples], owner) for c in ("model", "request_id", "tenant")},
        "row": pa.array(np.concatenate([np.arange(n) for n in rows]), pa.int32()),
        "version": _strings([s.version for s in samples], owner),
        "latency_ms": pa.array(np.repeat([s.latency_ms for s in samples], rows), pa.float64()),
        "features": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), width).cast(
            pa.list_(pa.float64())
        ),
        "status": pa.array(np.repeat([s.status for s in samples], rows), pa.int32()),
    }
    if outputs[0].shape[-1]:  # answered: a layout's outputs all have its width
        columns["prediction"] = pa.array(np.concatenate([o.argmax(axis=1) for o in outputs]).astype(np.int64))
        columns["score"] = pa.array(np.concatenate([o[:, -1] for o in outputs]).astype(np.float64))
    return _conform(pa.table(columns))


def _conform(table):  # noqa: ANN001, ANN202
    """``table`` with every column of the inference table, in its order and types (nulls where absent)."""
    import pyarrow as pa

    from fleet.logs.tables import arrow_schema

    schema = arrow_schema("inference")
    columns = [
        table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def to_table(samples: Sequence[Sample] | Sequence[GenSample]):  # noqa: ANN201 - a pyarrow.Table
    """The samples' rows in the inference table's columns (any mix of models and layouts)."""
    import pyarrow as pa

    groups: dict[tuple, list] = {}
    for s in samples:
        groups.setdefault(_layout(s), []).append(s)
    parts = [gen_table(group) if isinstance(group[0], GenSample) else tabular_table(group) for group in groups.values()]
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def _warm() -> None:
    """Do once, at start-up, what the first write would otherwise do in the writer thread:
    pyarrow imports pandas (about 0.2 s, holding the GIL) the first time it builds a
    timezone-aware timestamp column, which stalled the gateway's event loop at the first
    flush after every start. Called when the log is made (``create_app``, before the loop
    serves anything or its watch starts), not in ``start`` (inside the running lifespan)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fleet.logs.tables import arrow_schema

    ts = pa.array(np.zeros(1, dtype=np.int64), pa.timestamp("us", tz="UTC"))
    pq.write_table(pa.table({"ts": ts}), io.BytesIO(), compression="zstd")
    arrow_schema("inference")  # pyiceberg's import, once


class InferenceLog:
    """The gateway's writer: samples buffered in memory, staged as one Parquet file per flush
    (every model in it) every ``flush_s`` or as soon as ``flush_bytes`` are buffered, whichever
    comes first. A sample is logged once its file is staged; until then a killed process loses
    it (at most ``flush_s`` or ``flush_bytes`` of samples)."""

    def __init__(
        self,
        store: ObjectStore,
        writer_id: str,
        *,
        flush_s: float = FLUSH_S,
        flush_bytes: int = FLUSH_BYTES,
        max_bytes: int = MAX_BYTES,
        features: Callable[[str, int], tuple[str, ...]] | None = None,
        on_written: Callable[[str, int], None] = lambda model, rows: None,
        on_dropped: Callable[[str, int], None] = lambda model, rows: None,
    ) -> None:
        self.store, self.writer_id, self.flush_s, self.max_bytes = store, writer_id, flush_s, max_bytes
        self.flush_bytes = min(flush_bytes, max_bytes // 2)
        self._on_written, self._on_dropped = on_written, on_dropped
        self._buffer: deque[Sample | GenSample] = deque()  # dropping the oldest must not cost O(n) on the request path
        self._buffered_rows = 0
        self._buffered_bytes = 0
        self._writing_bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._full = threading.Event()  # flush_bytes are buffered: write now
        self._thread: threading.Thread | None = None
        self.files = 0  # staged files written
        _warm()
        self.failing = False  # the last write failed

    def record(self, sample: Sample | GenSample) -> None:
        """Buffer one sampled request (on the request path: an append, and amortised O(1) eviction)."""
        if sample.nbytes > self.max_bytes:
            self._on_dropped(sample.model, sample.rows)
            return
        with self._lock:
            self._buffer.append(sample)
            self._buffered_rows += sample.rows
            self._buffered_bytes += sample.nbytes
            # samples being written count too: they are in memory until the write is over
            while self._buffered_bytes + self._writing_bytes > self.max_bytes and self._buffer:
                oldest = self._buffer.popleft()
                self._buffered_rows -= oldest.rows
                self._buffered_bytes -= oldest.nbytes
                self._on_dropped(oldest.model, oldest.rows)
            if self._buffered_bytes >= self.flush_bytes:
                self._full.set()

    @property
    def buffered_rows(self) -> int:
        return self._buffered_rows

    @property
    def buffered_bytes(self) -> int:
        return self._buffered_bytes

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="inference-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + self.flush_s
        while not self._stop.is_set():
            wait = max(0.0, deadline - time.monotonic())
            if self.failing:  # a store that is down is asked again on the clock, not at every sample
                self._stop.wait(wait)
            else:
                self._full.wait(wait)
            if self._stop.is_set():
                return
            self._full.clear()
            self.flush()
            deadline = time.monotonic() + (min(self.flush_s, RETRY_S) if self.failing else self.flush_s)

    def flush(self) -> int:
        """Stage everything buffered as one file; return the rows written. On failure the samples
        go back to the buffer (the oldest dropped first if over ``max_bytes``)."""
        with self._lock:
            batch, self._buffer, self._buffered_rows = self._buffer, deque(), 0
            self._writing_bytes, self._buffered_bytes = self._buffered_bytes, 0
        if not batch:
            with self._lock:
                self._writing_bytes = 0
            return 0
        try:
            self._write(list(batch))
        except (FleetError, OSError) as exc:
            if not self.failing:
                log.warning("cannot write the inference log, keeping %d rows buffered: %s", _rows(batch), exc)
            self.failing = True
            self._requeue(batch)
            return 0
        except Exception:  # noqa: BLE001 - samples that cannot be made a table are dropped, never the writer
            log.exception("dropping %d inference log rows that could not be written", _rows(batch))
            with self._lock:
                self._writing_bytes = 0
            for s in batch:
                self._on_dropped(s.model, s.rows)
            return 0
        with self._lock:
            self._writing_bytes = 0
        self.failing = False
        rows: dict[str, int] = {}
        for s in batch:
            rows[s.model] = rows.get(s.model, 0) + s.rows
        for model, n in rows.items():
            self._on_written(model, n)
        return sum(rows.values())

    def _requeue(self, batch: deque[Sample | GenSample]) -> None:
        """A batch that could not be written goes back in front of what came meanwhile, and the
        oldest samples are dropped first while over ``max_bytes``."""
        with self._lock:
            self._writing_bytes = 0
            self._buffer.extendleft(reversed(batch))
            self._buffered_rows += _rows(batch)
            self._buffered_bytes += sum(s.nbytes for s in batch)
            while self._buffered_bytes > self.max_bytes and self._buffer:
                oldest = self._buffer.popleft()
                self._buffered_rows -= oldest.rows
                self._buffered_bytes -= oldest.nbytes
                self._on_dropped(oldest.model, oldest.rows)

    def _write(self, samples: list[Sample | GenSample]) -> None:
        from fleet.logs.staging import stage

        names = {s.model: list(s.feature_names) for s in samples if isinstance(s, Sample)}
        stage(self.store, "inference", to_table(samples), self.writer_id, names)
        self.files += 1

    def close(self, timeout_s: float = 30.0) -> int:
        """Stop the writer thread and write what is buffered; return rows still unwritten."""
        self._stop.set()
        self._full.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        while self._buffered_rows and time.monotonic() < deadline:
            self.flush()
            if self.failing:
                time.sleep(0.5)
        return self._buffered_rows


def _rows(samples: Iterable[Sample | GenSample]) -> int:
    return sum(s.rows for s in samples)


GEN_COLUMNS = ("ttft_ms", "prompt_tokens", "completion_tokens", "finish_reason", "output_digest", "prompt", "output")


def read_window(  # noqa: ANN201 - DataFrame
    store: ObjectStore,
    model: str,
    start: datetime,
    end: datetime,
    unreadable: list[str] | None = None,
    reading: Reading | None = None,
    *,
    columns: Sequence[str] | None = None,
):
    """Every logged row of ``model`` with ``start <= ts < end`` as one pandas DataFrame:
    ``ts``, ``request_id``, ``row``, ``model``, ``version``, ``tenant``, ``latency_ms``, then
    one column per feature (its name), ``prediction`` and ``score`` where the model is tabular,
    the generation's columns where it is generative. Committed and staged rows (see
    ``fleet.logs.reading``); a staged file that is not Parquet is skipped, named in the log and
    in ``unreadable``: one bad file never ends a monitor or an experiment. ``columns``: only
    these of the table's columns (the features are the column ``features``)."""
    from fleet.logs import reading as reads

    reading = reading if reading is not None else reads.Reading()
    table = reads.read(store, "inference", model, start, end, tuple(columns) if columns else None, unreadable, reading)
    return frame_of(store, model, table, reading)


def frame_of(store: ObjectStore, model: str, table, reading: Reading | None = None):  # noqa: ANN001, ANN201
    """The inference table's rows as the frame ``read_window`` returns (features by name)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc

    from fleet.logs import reading as reads

    if "status" in table.column_names:  # the answered rows: a failed request has no prediction to judge
        import pyarrow.compute as pc_

        status = table.column("status")
        table = table.filter(pc_.or_kleene(pc_.is_null(status), pc_.less(status, 400))).drop_columns("status")
    rest = [c for c in table.column_names if c not in ("features", "prediction", "score", *GEN_COLUMNS)]
    keep = [c for c in META_COLUMNS if c in rest] + [c for c in rest if c not in META_COLUMNS]
    out = table.select(keep)
    if "features" in table.column_names and table.num_rows and table.column("features").null_count < table.num_rows:
        lists = table.column("features").combine_chunks()
        width = int(pc.max(pc.list_value_length(lists)).as_py() or 0)
        names = reads.features(store, model, width, reading)
        flat = np.asarray(pc.list_flatten(lists.fill_null(pa.scalar([math.nan] * width, lists.type))))
        matrix = flat.reshape(-1, width) if width else flat.reshape(table.num_rows, 0)
        for i, name in enumerate(names):
            out = out.append_column(name, pa.array(matrix[:, i]))
        for c in ("prediction", "score"):
            out = out.append_column(c, table.column(c))
    gen = [c for c in GEN_COLUMNS if c in table.column_names]
    if gen and table.column("output_digest" if "output_digest" in gen else gen[0]).null_count < table.num_rows:
        for c in gen:
            out = out.append_column(c, table.column(c))
    if not out.num_rows:
        return pd.DataFrame({c: [] for c in out.column_names or META_COLUMNS})
    return out.to_pandas()
