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
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np

from fleet.errors import FleetError
from fleet.names import check_name
from fleet.types import ObjectStore

log = logging.getLogger("fleet.logs.inference")

FLUSH_S = 2.0
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
    outputs: np.ndarray  # [rows, classes]
    feature_names: tuple[str, ...]

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
    return sample.layout if isinstance(sample, GenSample) else (sample.feature_names, sample.outputs.shape[-1])


def hour_prefix(model: str, at: datetime) -> str:
    return f"logs/inference/{check_name('model', model)}/{at:%Y/%m/%d/%H}/"


def feature_names(profile: dict | None, width: int) -> tuple[str, ...]:
    """Names from a baseline profile (``features`` keys, in order), else f0, f1, ..."""
    names = tuple((profile or {}).get("features", {}))
    return names if len(names) == width else tuple(f"f{i}" for i in range(width))


def gen_table(samples: Sequence[GenSample]):  # noqa: ANN201 - a pyarrow.Table
    """One row per sampled generation; ``prompt`` and ``output`` are null where not kept."""
    import pyarrow as pa

    columns = {
        "ts": pa.array([int(s.ts * 1000) for s in samples], pa.timestamp("ms", tz="UTC")),
        "request_id": pa.array([s.request_id for s in samples], pa.string()),
        "row": pa.array([0] * len(samples), pa.int32()),
        **{c: pa.array([getattr(s, c) for s in samples], pa.string()) for c in ("model", "version", "tenant")},
        **{c: pa.array([getattr(s, c) for s in samples], pa.float64()) for c in ("latency_ms", "ttft_ms")},
        **{c: pa.array([getattr(s, c) for s in samples], pa.int32()) for c in ("prompt_tokens", "completion_tokens")},
        **{
            c: pa.array([getattr(s, c) for s in samples], pa.string())
            for c in ("finish_reason", "output_digest", "prompt", "output")
        },
    }
    return pa.table(columns)


def to_table(samples: Sequence[Sample] | Sequence[GenSample]):  # noqa: ANN201 - a pyarrow.Table
    """One table of the samples' rows. Per-request strings are repeated per row by Arrow
    (a dictionary cast to strings), not as numpy string arrays: that took 50 ms for 100k
    rows in the writer thread, holding the GIL and so the gateway's event loop."""
    import pyarrow as pa

    if isinstance(samples[0], GenSample):
        return gen_table(samples)  # type: ignore[arg-type]
    rows = [s.rows for s in samples]
    names = samples[0].feature_names
    features = np.concatenate([s.features.reshape(s.rows, -1) for s in samples]).astype(np.float64)
    outputs = [s.outputs.reshape(s.rows, -1) for s in samples]
    owner = pa.array(np.repeat(np.arange(len(samples), dtype=np.int32), rows))  # row → its sample

    def per_row(values: list[str]):  # noqa: ANN202 - a pyarrow.Array
        return pa.DictionaryArray.from_arrays(owner, pa.array(values, pa.string())).cast(pa.string())

    columns = {
        "ts": pa.array(np.repeat([int(s.ts * 1000) for s in samples], rows), pa.timestamp("ms", tz="UTC")),
        "request_id": per_row([s.request_id for s in samples]),
        "row": pa.array(np.concatenate([np.arange(n) for n in rows]), pa.int32()),
        **{c: per_row([getattr(s, c) for s in samples]) for c in ("model", "version", "tenant")},
        "latency_ms": pa.array(np.repeat([s.latency_ms for s in samples], rows), pa.float64()),
        **{name: pa.array(features[:, i]) for i, name in enumerate(names)},
        "prediction": pa.array(np.concatenate([o.argmax(axis=1) for o in outputs]).astype(np.int64)),
        "score": pa.array(np.concatenate([o[:, -1] for o in outputs]).astype(np.float64)),
    }
    return pa.table(columns)


def _warm() -> None:
    """Do once, at start-up, what the first write would otherwise do in the writer thread:
    pyarrow imports pandas (about 0.2 s, holding the GIL) the first time it builds a
    timezone-aware timestamp column, which stalled the gateway's event loop at the first
    flush after every start. Called when the log is made (``create_app``, before the loop
    serves anything or its watch starts), not in ``start`` (inside the running lifespan)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ts = pa.array(np.zeros(1, dtype=np.int64), pa.timestamp("ms", tz="UTC"))
    pq.write_table(pa.table({"ts": ts}), io.BytesIO(), compression="zstd")


class InferenceLog:
    def __init__(
        self,
        store: ObjectStore,
        writer_id: str,
        *,
        flush_s: float = FLUSH_S,
        max_bytes: int = MAX_BYTES,
        on_written: Callable[[str, int], None] = lambda model, rows: None,
        on_dropped: Callable[[str, int], None] = lambda model, rows: None,
    ) -> None:
        self.store, self.writer_id, self.flush_s, self.max_bytes = store, writer_id, flush_s, max_bytes
        self._on_written, self._on_dropped = on_written, on_dropped
        self._buffer: deque[Sample | GenSample] = deque()  # dropping the oldest must not cost O(n) on the request path
        self._buffered_rows = 0
        self._buffered_bytes = 0
        self._writing_bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0
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
        while not self._stop.wait(self.flush_s):
            self.flush()

    def flush(self) -> int:
        """Write everything buffered; return the rows written. Failed groups go back to the buffer."""
        with self._lock:
            batch, self._buffer, self._buffered_rows = self._buffer, deque(), 0
            self._writing_bytes, self._buffered_bytes = self._buffered_bytes, 0
        groups: dict[tuple, list[Sample | GenSample]] = {}
        for s in batch:
            hour = datetime.fromtimestamp(s.ts, UTC).replace(minute=0, second=0, microsecond=0)
            groups.setdefault((s.model, hour, _layout(s)), []).append(s)
        written = 0
        for (model, hour, _), samples in groups.items():
            try:
                self._write(model, hour, samples)
            except (FleetError, OSError) as exc:
                self._written(samples)
                if not self.failing:
                    log.warning(
                        "cannot write the inference log, keeping %d rows buffered: %s",
                        sum(s.rows for s in samples),
                        exc,
                    )
                self.failing = True
                for s in samples:
                    self.record(s)  # back in line, oldest dropped first if over max_bytes
                continue
            self._written(samples)
            self.failing = False
            rows = sum(s.rows for s in samples)
            written += rows
            self._on_written(model, rows)
        return written

    def _written(self, samples: list[Sample]) -> None:
        """The write of ``samples`` is over (either way): their memory is no longer held here."""
        with self._lock:
            self._writing_bytes -= sum(s.nbytes for s in samples)

    def _write(self, model: str, hour: datetime, samples: list[Sample]) -> None:
        import pyarrow.parquet as pq

        out = io.BytesIO()
        pq.write_table(to_table(samples), out, compression="zstd")
        self._seq += 1
        key = f"{hour_prefix(model, hour)}{int(time.time() * 1000)}-{self.writer_id}-{self._seq:06d}.parquet"
        self.store.put(key, out.getvalue(), if_none_match=True)

    def close(self, timeout_s: float = 30.0) -> int:
        """Stop the writer thread and write what is buffered; return rows still unwritten."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        while self._buffered_rows and time.monotonic() < deadline:
            self.flush()
            if self.failing:
                time.sleep(0.5)
        return self._buffered_rows


def read_window(  # noqa: ANN201 - DataFrame
    store: ObjectStore, model: str, start: datetime, end: datetime, unreadable: list[str] | None = None
):
    """Every logged row of ``model`` with ``start <= ts < end`` as one pandas DataFrame. A file
    that is not Parquet (cut short, overwritten by hand) is skipped, named in the log and in
    ``unreadable``: one bad file never ends a monitor or an experiment."""
    import pandas as pd
    import pyarrow as pa

    if start.tzinfo is None or end.tzinfo is None:
        raise ValueError("read_window needs timezone-aware datetimes")
    tables = []
    hour = start.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    while hour < end:
        for key in store.list(hour_prefix(model, hour)):
            table = read_parquet(store, key, unreadable)
            if table is not None:
                tables.append(table)
        hour += timedelta(hours=1)
    if not tables:
        return pd.DataFrame({c: [] for c in META_COLUMNS})
    frame = pa.concat_tables(tables, promote_options="permissive").to_pandas()
    ts = frame["ts"]
    return frame[(ts >= pd.Timestamp(start)) & (ts < pd.Timestamp(end))].reset_index(drop=True)


def read_parquet(store: ObjectStore, key: str, unreadable: list[str] | None = None):  # noqa: ANN201 - a pyarrow Table
    """One log file's table; None (named in the log and in ``unreadable``) if it is not Parquet."""
    import pyarrow.parquet as pq

    data = store.get(key).data  # a store that cannot be read raises: that is not a bad file
    try:
        return pq.read_table(io.BytesIO(data))
    except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid / ArrowIOError
        log.warning("skipping %s: not a readable Parquet file (%s)", key, exc)
        if unreadable is not None:
            unreadable.append(key)
        return None
