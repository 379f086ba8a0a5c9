"""The logs as Iceberg tables (staged writes, one committer) beside the writer and readers before
them (``--reference``, loaded from git into this process) on the same rows, in a FileStore in a
temp dir. Store requests are counted as S3 bills them (a listing: one per 1,000 keys); the files
pyiceberg opens itself (metadata, manifests, data) apart ("ice"). Its snapshots are stamped with
the simulated time the committer runs at, so expiry and file deletion behave as in production.

1. a gateway process's hour at ``--rate`` req/s, ``--sample`` logged, 5 models: ``flush()`` at
   its flush times (new 60 s, reference 2 s), no sleep;
2. the monitor's read (``read_window``, one model, 24 h) after each of ``--history`` days of
   ``--rows-per-day`` rows per model, committed by the committer a day at a time (one file per
   model-hour, as compaction leaves them), the newest hour a commit a minute and its last minute
   still staged by ``--gateways`` writers (production has 1-2 such hours). The reference's layout
   is written for the first day at its cadence (an object per model per 2 s per ``--ref-writers``;
   plain file writes); its read lists only the window's hours, so later days are not re-measured;
3. 24 h of 1,000 req/s at 10 % (8.64 M rows, one model, 4 features) read and judged
   (``drift_report`` of one version, aggregates, the error rate by SQL): ``--full``; else 1/10;
4. an experiment's looks after ``--looks`` days: ``with_outcomes`` from its start (all read again)
   and ``OutcomeJoin.look`` (the flow's: what was committed since its last look), also as ticks a
   minute apart in a measured day's last hour; ``--outcome-rate`` of rows get an outcome;
5. ``LoggedRequests.owned`` of a known id, an unknown id the gateway made and a caller's id:
   cold (a fresh index, the table loaded again) and warm (the same lookup again).

``~`` marks a figure projected from measured ones (the note beside it says how).

    .venv/bin/python bench/logs.py [--rows-per-day 20000] [--history 1,7,30] [--full]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import io
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.logs import committer, ids, query, staging, tables  # noqa: E402
from fleet.logs.feedback import labelled, with_outcomes  # noqa: E402
from fleet.logs.increments import OutcomeJoin  # noqa: E402
from fleet.logs.inference import InferenceLog, Sample, read_window  # noqa: E402
from fleet.logs.logged import LoggedRequests  # noqa: E402
from fleet.logs.reading import Reading  # noqa: E402
from fleet.store.file import FileStore  # noqa: E402

REFERENCE = "cf976f2"  # one object per model every 2 s under logs/inference/<model>/<hour>/
MODELS = tuple(f"m{i}" for i in range(5))
MODEL = MODELS[0]
NAMES = ["x0", "x1", "x2", "x3"]
TENANTS = [f"tenant-{i}" for i in range(20)]
VERSIONS = ["1.0.0", "1.1.0"]  # the experiment's arms
HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
DAY, HOUR, MINUTE = timedelta(days=1), timedelta(hours=1), timedelta(minutes=1)
PUT_USD = 0.005 / 1000  # S3 Standard PUT, us-east-1
FLEET_OBJECTS = 40 * 43_200  # the reference's objects of one model a day: 40 processes, one per 2 s
TABLE: list[tuple[int, str, str, str]] = []  # (section, figure, new, reference)
SIM: list[datetime] = []  # the simulated time the committer last ran at


class Counting:
    """A FileStore counting requests as S3 bills them, and the bytes got and put."""

    iceberg: Counter = Counter()  # files pyiceberg opened through its own FileIO

    def __init__(self, store: FileStore) -> None:
        self.store, self.root, self.url, self.counts = store, store.root, store.url, Counter()

    def get(self, key: str):  # noqa: ANN201
        found = self.store.get(key)
        self.counts.update({"GET": 1, "got": len(found.data)})
        return found

    def put(self, key: str, data: bytes, **kw: Any) -> str:
        self.counts.update({"PUT": 1, "put": len(data)})
        return self.store.put(key, data, **kw)

    def list(self, prefix: str = ""):  # noqa: ANN201
        keys = list(self.store.list(prefix))
        self.counts["LIST"] += max(1, -(-len(keys) // 1000))
        return iter(keys)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        return getattr(self.store, name)

    def reset(self) -> Counter:
        out = self.counts + Counter({f"ice {k}": v for k, v in Counting.iceberg.items()})
        self.counts, Counting.iceberg = Counter(), Counter()
        return out


def patch_iceberg() -> None:
    """Files pyiceberg opens are counted; its snapshots are stamped with the simulated time."""
    from pyiceberg.io.pyarrow import PyArrowFileIO
    from pyiceberg.table import snapshots

    new_input = PyArrowFileIO.new_input

    def opened(self, location: str):  # noqa: ANN001, ANN202
        Counting.iceberg["GET"] += 1
        return new_input(self, location)

    PyArrowFileIO.new_input = opened
    snapshots.time = types.SimpleNamespace(time=lambda: SIM[0].timestamp() if SIM else time.time())


def commit(store: Counting, now: datetime, maintain: bool = True) -> None:
    SIM[:] = [now]  # snapshots stamped with it: expiry and deleting replaced files compare them with ``now``
    committer.run(store, now=now, maintain=maintain)


def reqs(c: Counter) -> str:
    return " + ".join(f"{c[k]:,} {k}" for k in ("GET", "LIST", "PUT", "ice GET") if c[k]) or "no requests"


def reference_module(rev: str, path: str, name: str, swap: dict[str, str] | None = None) -> Any:  # noqa: ANN401
    """The module at ``path`` as of ``rev``, loaded from git beside this commit's (as bench/scale.py)."""
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, check=True, text=True).stdout
    for old, new in (swap or {}).items():
        text = text.replace(old, new)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))  # type: ignore[arg-type]
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(text, f"{rev}:{path}", "exec"), module.__dict__)  # noqa: S102
    return module


def timed(fn: Any) -> tuple[Any, float]:  # noqa: ANN401
    gc.collect()
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def row(section: int, figure: str, new: str, ref: str) -> None:
    TABLE.append((section, figure, new, ref))
    print(f"  {figure}: new {new} | reference {ref}", flush=True)


def fresh(store: Counting) -> None:
    """The next read loads the table from the catalog again (a new monitor or flow process)."""
    tables.tables_for(store)._loaded.clear()  # noqa: SLF001
    store.reset()


# -- data -------------------------------------------------------------------------------------
def uuid7(ms: np.ndarray, rng: np.random.Generator) -> pa.Array:
    """``fleet.logs.ids.new(ms)`` for every ms at once (the gateway's ids: its mark in them)."""
    d = rng.integers(0, 16, (ms.size, 32), dtype=np.uint8)
    for i in range(12):
        d[:, i] = (ms >> (4 * (11 - i))) & 0xF
    d[:, 12], d[:, 13], d[:, 14], d[:, 16] = 7, ids.MARK >> 4, ids.MARK & 0xF, 8 | (d[:, 16] & 3)
    c, out = HEX[d], np.full((ms.size, 36), ord("-"), np.uint8)
    for a, b, at in ((0, 8, 0), (8, 12, 9), (12, 16, 14), (16, 20, 19), (20, 32, 24)):
        out[:, at : at + b - a] = c[:, a:b]
    return pa.array(out.view("S36").ravel()).cast(pa.string())


def _strings(values: list[str], index: np.ndarray) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(index.astype(np.int32)), pa.array(values)).cast(pa.string())


def _table(name: str, columns: dict[str, pa.Array], n: int) -> pa.Table:
    schema = tables.arrow_schema(name)
    return pa.Table.from_arrays([columns.get(f.name, pa.nulls(n, f.type)).cast(f.type) for f in schema], schema=schema)


def generate(
    start: datetime, seconds: float, per_model: int, models: tuple[str, ...], rng: np.random.Generator, fail=0.0
):  # noqa: ANN001, ANN201
    """``per_model`` rows of each model in [start, start + seconds), by time, in the inference
    table's columns; ``fail`` of them failed requests (status 500, no prediction)."""
    n, t0 = per_model * len(models), int(start.timestamp() * 1000)
    ms = np.sort(rng.integers(t0, t0 + int(seconds * 1000), n))
    x = rng.normal(size=(n, len(NAMES)))
    score = 1 / (1 + np.exp(-x[:, 0]))
    columns = {
        "ts": pa.array(ms * 1000, pa.timestamp("us", tz="UTC")),
        "model": _strings(list(models), rng.integers(0, len(models), n)),
        "request_id": uuid7(ms, rng),
        "tenant": _strings(TENANTS, rng.integers(0, len(TENANTS), n)),
        "row": pa.array(np.zeros(n, np.int32)),
        "version": _strings(VERSIONS, rng.integers(0, 2, n)),
        "latency_ms": pa.array(rng.gamma(2.0, 4.0, n)),
        "features": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), len(NAMES)).cast(pa.list_(pa.float64())),
        "prediction": pa.array((score > 0.5).astype(np.int64), mask=(failed := rng.random(n) < fail)),
        "score": pa.array(score, mask=failed),
        "status": pa.array(np.where(failed, 500, 200).astype(np.int32)),
    }
    return _table("inference", columns, n)


def outcomes_of(t: pa.Table, rng: np.random.Generator, rate: float) -> pa.Table:
    """A ``clicked`` outcome for ``rate`` of MODEL's rows, sent 0-10 min after the request, by time."""
    t = t.filter(pc.equal(t.column("model"), MODEL))
    t = t.filter(pa.array(rng.random(t.num_rows) < rate))
    ts = t.column("ts").cast(pa.int64()).to_numpy() + rng.integers(0, 600_000_000, t.num_rows)
    order = np.argsort(ts, kind="stable")
    columns = {c: t.column(c).take(order) for c in ("model", "request_id", "tenant", "row")}
    columns |= {"ts": pa.array(ts[order], pa.timestamp("us", tz="UTC")), "name": pa.array(["clicked"] * t.num_rows)}
    columns["value"] = pa.array((rng.random(t.num_rows) < 0.1).astype(np.float64))
    return _table("outcomes", columns, t.num_rows)


def _slices(t: pa.Table, start: datetime, step: timedelta, n: int) -> list[pa.Table]:
    """``t`` (sorted by ts) cut at start, start + step, ... : n slices."""
    at = [int((start + i * step).timestamp() * 1e6) for i in range(n + 1)]
    cuts = np.searchsorted(t.column("ts").cast(pa.int64()).to_numpy(), at).tolist()
    return [t.slice(a, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]


def stage(store: Counting, name: str, part: pa.Table, writer: str, features: dict | None = None) -> None:
    if part.num_rows:  # a slice of a quiet minute may be empty
        staging.stage(store, name, part, writer, features)


def add_day(store: Counting, start: datetime, per_model: int, rng: Any, rate: float, tail: int, on_minute: Any):
    """A day of rows in the tables through the committer: whole hours staged and committed at once;
    with ``tail`` writers the last hour a commit a minute (``on_minute(i, now)`` after each), its
    last minute left staged, one file per writer. Returns the day's rows and outcomes."""
    t, features = generate(start, 86400, per_model, MODELS, rng), {m: NAMES for m in MODELS}
    hours = _slices(t, start, HOUR, 24)
    for part in hours[: 23 if tail else 24]:
        stage(store, "inference", part, "hist", features)
    sent = outcomes_of(t, rng, rate)
    for part in _slices(sent, start, HOUR, 25):
        stage(store, "outcomes", part, "hist")
    cut = start + DAY - (HOUR if tail else timedelta(0))
    commit(store, cut)
    if tail:
        minutes = _slices(hours[-1], cut, MINUTE, 60)
        for i, part in enumerate(minutes[:-1]):
            stage(store, "inference", part, f"gw{i % tail}", features)
            commit(store, cut + (i + 1) * MINUTE)
            on_minute(i + 1, cut + (i + 1) * MINUTE)
        last = minutes[-1]
        for g in range(tail):
            stage(store, "inference", last.filter(pa.array(np.arange(last.num_rows) % tail == g)), f"gw{g}")
    return t, sent


def write_reference(root: Path, t: pa.Table, sent: pa.Table, writers: int, batch: int) -> tuple[int, int]:
    """MODEL's rows of ``t`` in the reference's layout and columns: one object per writer per 2 s,
    outcomes ``batch`` an object. Returns (inference objects, their bytes)."""
    t = t.filter(pc.equal(t.column("model"), MODEL))
    ms = t.column("ts").cast(pa.int64()).to_numpy() // 1000
    x = np.asarray(pc.list_flatten(t.column("features"))).reshape(-1, len(NAMES))
    old = pa.table(
        {"ts": pa.array(ms, pa.timestamp("ms", tz="UTC"))}
        | {c: t.column(c) for c in ("request_id", "row", "model", "version", "tenant", "latency_ms")}
        | {name: pa.array(x[:, i]) for i, name in enumerate(NAMES)}
        | {c: t.column(c) for c in ("prediction", "score")}
    )
    key = (np.arange(t.num_rows) % writers) * 2**40 + ms // 2000
    order = np.argsort(key, kind="stable")
    old, key = old.take(order), key[order]
    cuts = [0, *(np.flatnonzero(np.diff(key)) + 1).tolist(), t.num_rows]

    def write(prefix: str, at_ms: int, writer: str, seq: int, part: pa.Table) -> int:
        pq.write_table(part, out := io.BytesIO(), compression="zstd")
        path = (
            root
            / f"{prefix}/{datetime.fromtimestamp(at_ms / 1000, UTC):%Y/%m/%d/%H}/{at_ms}-{writer}-{seq:06d}.parquet"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.write_bytes(out.getvalue())

    size = 0
    for seq, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        writer, bucket = divmod(int(key[a]), 2**40)
        size += write(f"logs/inference/{MODEL}", bucket * 2000, f"gw{writer}", seq, old.slice(a, b - a))
    sent_ms = sent.column("ts").cast(pa.int64()).to_numpy() // 1000
    got = sent.select(["request_id", "row", "tenant", "name", "value"])
    got = got.add_column(0, "ts", pa.array(sent_ms, pa.timestamp("ms", tz="UTC")))
    for seq, a in enumerate(range(0, got.num_rows, batch)):
        write(f"logs/outcomes/{MODEL}", int(sent_ms[a]), "fb", seq, got.slice(a, batch))
    return len(cuts) - 1, size


# -- the measurements -------------------------------------------------------------------------
def writes(rate: float, sample: float, ref: Any) -> None:  # noqa: ANN401
    rng = np.random.default_rng(1)
    print(f"\n1. a gateway process for an hour: {rate:g} req/s, {sample:.0%} sampled, {len(MODELS)} models, 4 features")
    out, sides = {}, (("new", InferenceLog, Sample, 60.0), ("reference", ref.InferenceLog, ref.Sample, 2.0))
    for label, log_cls, sample_cls, every in sides:
        root = Path(tempfile.mkdtemp(prefix="fleet-logs-w-"))
        store = Counting(FileStore(root))
        log, t0, made = log_cls(store, "gw0"), time.time() // 3600 * 3600 - 7200, 0
        for k in range(int(3600 / every)):
            n = rng.poisson(rate * sample * every)
            ts = np.sort(rng.uniform(t0 + k * every, t0 + (k + 1) * every, n))
            x, m = rng.normal(size=(n, 1, len(NAMES))).astype(np.float32), rng.integers(0, len(MODELS), n)
            for i in range(n):
                rid, y = ids.new(int(ts[i] * 1000)), np.array([[0.3, 0.7]])
                log.record(sample_cls(ts[i], rid, MODELS[m[i]], "1.0.0", TENANTS[i % 20], 8.0, x[i], y, tuple(NAMES)))
            made += n
            log.flush()
        out[label] = store.reset()
        shutil.rmtree(root)
    new, old = out["new"], out["reference"]
    row(1, "objects written per process-hour", f"{new['PUT']:,}", f"{old['PUT']:,}")
    row(1, "bytes written per process-hour", f"{new['put'] / 2**20:.2f} MiB", f"{old['put'] / 2**20:.2f} MiB")
    row(1, "mean object", f"{new['put'] / new['PUT'] / 1024:,.1f} KiB", f"{old['put'] / old['PUT'] / 1024:,.1f} KiB")
    month = 40 * 720 * PUT_USD
    row(1, "gateways' PUTs, 40 processes, $/month", f"{new['PUT'] * month:,.2f}", f"{old['PUT'] * month:,.2f}")
    print(f"  ({made:,} samples in the hour; the committer's own requests are not in these figures)")


def monitor_read(store: Counting, end: datetime, repeat: int = 3) -> tuple[str, int, int]:
    """The median of ``repeat`` reads of MODEL's last 24 h and of their scans' planning alone;
    what the last read read."""
    times, plans = [], []
    for _ in range(repeat):
        fresh(store)
        reading = Reading()
        frame, seconds = timed(lambda reading=reading: read_window(store, MODEL, end - DAY, end, reading=reading))
        counts, table = store.reset(), tables.tables_for(store).table("inference")
        times.append(seconds)
        plans.append(timed(lambda table=table: tables.scan(table, tables.window_filter(MODEL, end - DAY, end)))[1])
    manifests = counts["ice GET"] - reading.files - 2  # less the table's metadata and its manifest list
    text = (
        f"{statistics.median(times):.2f} s (planning {statistics.median(plans) * 1e3:.0f} ms, {manifests} manifests), "
        f"{len(frame):,} rows, {reading.files} files + {reading.staged} staged; {reqs(counts)}"
    )
    return text, len(frame), reading.files


def lookups(store: Counting, now: datetime, t: pa.Table, ref: Any, note: str = "") -> None:  # noqa: ANN401
    mine = t.filter(pc.equal(t.column("model"), MODEL))
    at = int(np.searchsorted(mine.column("ts").cast(pa.int64()).to_numpy(), (now - 12 * HOUR).timestamp() * 1e6))
    known, tenant = mine.column("request_id")[at].as_py(), mine.column("tenant")[at].as_py()
    unknown = ids.new(int((now - 12 * HOUR).timestamp() * 1000) + 1)
    cases = {"a known id, 12 h old": known, "an unknown gateway id, 12 h old": unknown, "a caller's id": "order-1"}
    for what, rid in cases.items():
        figures = []
        for cls in (LoggedRequests, ref.LoggedRequests) if ref else (LoggedRequests,):
            fresh(store)
            index = cls(store)
            found, cold = timed(lambda index=index, rid=rid: index.owned(MODEL, tenant, {(rid, 0)}, now))
            cold_reqs, cold_files = reqs(store.reset()), getattr(index, "files_read", 0)
            _, warm = timed(lambda index=index, rid=rid: index.owned(MODEL, tenant, {(rid, 0)}, now))
            wrong = "" if bool(found) == (rid == known) else " WRONG ANSWER"
            warm_reqs, warm_files = reqs(store.reset()), getattr(index, "files_read", 0) - cold_files
            if cls is LoggedRequests:  # it reads committed files through pyarrow (row groups), not the store
                cold_reqs, warm_reqs = f"{cold_reqs}; {cold_files} files read", f"{warm_reqs}; {warm_files} files read"
            figures.append(f"cold {cold * 1e3:,.0f} ms ({cold_reqs}), warm {warm * 1e3:,.1f} ms ({warm_reqs}){wrong}")
        row(5, f"lookup of {what}{note}", *figures, *([] if ref else ["(as after 1 d: not measured again)"]))


def experiment(store: Counting, join: OutcomeJoin, start: datetime, end: datetime, ref_day: tuple) -> None:
    """4: the look after ``end - start`` days, read whole (``with_outcomes``) and incrementally
    (``OutcomeJoin.look``, what the experiment flow does: the files committed since its last look)."""
    fresh(store)
    frame, seconds = timed(lambda: with_outcomes(store, MODEL, start, end, ["clicked"]))
    counts, sent, k = store.reset(), int(frame["outcome:clicked"].notna().sum()), round((end - start) / DAY)
    looked, inc = timed(lambda: join.look(end))
    n, whole = sum(v[0] for v in looked.sums.values()), ", whole window" if looked.full else ""
    new = (
        f"with_outcomes {seconds:.2f} s ({len(frame):,} rows, {sent:,} outcomes; {reqs(counts)}); "
        f"OutcomeJoin.look {inc:.2f} s ({looked.files} files{whole}, {n:,} outcomes; {reqs(store.reset())})"
    )
    m = "" if k == 1 else "~"
    ref = f"{m}{ref_day[0] * k:.1f} s ({m}{ref_day[1]['GET'] * k:,} GET + {m}{ref_day[1]['LIST'] * k:,} LIST)"
    row(4, f"experiment look after {k} d", new, ref)


def big(full: bool, per_object: float) -> None:
    from fleet.analysis.drift import drift_report
    from fleet.catalog import profile
    from fleet.catalog.policies.monitoring import MonitoringPolicy

    rows = 8_640_000 // (1 if full else 10)
    print(f"\n3. 24 h of 1,000 req/s at 10 %: {rows:,} rows of one model, 4 features{'' if full else ' (1/10 scale)'}")
    root = Path(tempfile.mkdtemp(prefix="fleet-logs-big-"))
    store, rng = Counting(FileStore(root)), np.random.default_rng(3)
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - 2 * DAY
    for h in range(24):  # an hour staged and committed at a time: one file an hour, as compaction leaves them
        part = generate(start + h * HOUR, 3600, rows // 24, ("big",), rng, fail=0.01)
        staging.stage(store, "inference", part, "b", {"big": NAMES})
        commit(store, start + (h + 1) * HOUR, maintain=False)
    base = rng.normal(size=(100_000, len(NAMES)))
    p = 1 / (1 + np.exp(-base[:, 0]))
    prof = profile.baseline_profile(base, NAMES, np.stack([1 - p, p], axis=1))
    policy = MonitoringPolicy(schedule="*/15 * * * *", window_hours=24, min_rows=1000)

    sql = (  # errors are not in read_window's frame (answered rows only): a query of the table
        "SELECT version, avg((status >= 500)::INT), quantile_cont(latency_ms, [0.5, 0.95, 0.99]) FROM inference "
        f"WHERE model = 'big' AND ts >= '{start.isoformat()}' AND ts < '{(start + DAY).isoformat()}' GROUP BY version"
    )

    def judge(frame: Any) -> Any:  # noqa: ANN401 - drift of the stable version's rows, and aggregates
        report = drift_report(prof, frame[frame["version"] == VERSIONS[0]].reset_index(drop=True), policy)
        latency = frame.groupby("version")["latency_ms"].quantile([0.5, 0.95, 0.99])
        return report, latency, frame.groupby(frame["ts"].dt.floor("h")).size(), query.run(store, sql).rows

    rss0, reading = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, Reading()
    fresh(store)
    frame, read_s = timed(lambda: read_window(store, "big", start, start + DAY, reading=reading))
    _, judge_s = timed(lambda frame=frame: judge(frame))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    del frame
    ref = f"~{rows / 5 * per_object:,.0f} s (~{rows / 5:,.0f} objects of 5 rows at the 1-day read's s/object)"
    files = f"{reading.files} files, {reading.bytes / 2**20:.0f} MiB"
    row(3, f"read_window, 24 h, {rows / 1e6:.2f} M rows", f"{read_s:.1f} s ({files})", ref)
    row(3, "judgement (drift_report; latency p50/95/99, hourly counts; errors by SQL)", f"{judge_s:.1f} s", "-")
    peak = f"peak RSS {rss:.1f} GiB (before {rss0:.1f})"
    row(3, "read + judgement (target: <= 30 s at 8.64 M rows)", f"{read_s + judge_s:.1f} s; {peak}", "-")
    cols = ("ts", "version", "latency_ms", "features", "prediction", "score")
    _, few_s = timed(lambda: read_window(store, "big", start, start + DAY, columns=cols))
    row(3, "read_window(columns= the 6 the judgement needs)", f"{few_s:.1f} s", "-")
    _, labelled_s = timed(lambda: labelled(store, "big", start, start + DAY))
    row(3, "labelled() (what flows/monitor.py reads: + feedback, dedup, merge)", f"{labelled_s:.1f} s", "-")
    shutil.rmtree(root)


def history(args: argparse.Namespace, refs: tuple) -> float:
    """2, 4 and 5 on one store whose history grows a day at a time; the reference's time per object."""
    stages, looks = sorted({1, *(int(d) for d in args.history.split(","))}), [int(k) for k in args.looks.split(",")]
    root = Path(tempfile.mkdtemp(prefix="fleet-logs-"))
    store, rng = Counting(FileStore(root)), np.random.default_rng(2)
    t0 = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0) - (stages[-1] + 1) * DAY
    print(f"\n2. the monitor's read of {MODEL}, 24 h; {args.rows_per_day:,} rows per model-day, {len(MODELS)} models")
    ref_day, per_object = (0.0, Counter()), 0.0
    join = OutcomeJoin(store, MODEL, "clicked", t0, {}, None)
    for day in range(stages[-1]):
        at, measured = t0 + day * DAY, day + 1 in stages
        if day and day in stages:
            commit(store, at + 2 * HOUR)  # the staged minute committed, the last hour compacted
        ticks: list[tuple[float, Any]] = []  # the flow's looks a minute apart, in the last 10 minutes

        def tick(i: int, now: datetime, day: int = day, ticks: list = ticks) -> None:
            if i >= 50 and day + 1 in looks:
                ticks.append(timed(lambda: join.look(now))[::-1])

        tail = args.gateways if measured else 0
        t, sent = add_day(store, at, args.rows_per_day, rng, args.outcome_rate, tail, tick)
        if ticks:
            (first, done), rest = ticks[0], ticks[1:]
            median, files = statistics.median(s for s, _ in rest), max(d.files for _, d in rest)
            what = "whole open window" if done.full else f"{done.files} files"
            new = f"{first:.2f} s first ({what}), then {median * 1e3:.0f} ms (<= {files} files)"
            row(4, f"experiment ticks a minute apart, day {day + 1} (OutcomeJoin.look)", new, "(each look reads all)")
        end = at + DAY
        if measured:
            per_object = measured_day(store, root, day, at, t, sent, args, refs) or per_object
        if day == 0:
            print("\n4. an experiment's looks from its start: read whole, and incrementally")
            store.reset()
            _, seconds = timed(lambda at=at, end=end: refs[1].with_outcomes(store, MODEL, at, end, ["clicked"]))
            ref_day = (seconds, store.reset())
        if day + 1 in looks:
            experiment(store, join, t0, end, ref_day)
    shutil.rmtree(root)
    return per_object


def measured_day(
    store: Counting, root: Path, day: int, at: datetime, t: pa.Table, sent: pa.Table, args: Any, refs: Any
) -> float:  # noqa: ANN401
    """2 after ``day + 1`` days (and 5 after the first and the last); the reference's read after
    the first, and its time per object."""
    end, per_object = at + DAY, 0.0
    new, rows, files = monitor_read(store, end)
    ref = "(reads the window's 24 hour prefixes only: as after 1 d)"
    if day == 0:
        objects, size = write_reference(root, t, sent, args.ref_writers, args.outcome_batch)
        store.reset()
        frame, seconds = timed(lambda: refs[0].read_window(store, MODEL, at, end))
        counts, per_object = store.reset(), seconds / objects
        same = "" if len(frame) == rows else f" ROWS DIFFER: {len(frame):,}"
        ref = (
            f"{seconds:.2f} s, {len(frame):,} rows, {objects:,} objects ({size / 2**20:.0f} MiB); {reqs(counts)}{same}"
        )
    row(2, f"monitor read after {day + 1} d of history", new, ref)
    if day == 0:
        new = f"~{files} files + ~{args.gateways} staged: more rows per file, not more files"
        ref = f"~{per_object * FLEET_OBJECTS:,.0f} s (~{FLEET_OBJECTS:,} GET at {per_object * 1e3:.2f} ms, in turn)"
        row(2, "monitor read at 40 processes x 125 req/s (~)", new, ref)
        print("\n5. a label's lookup (LoggedRequests.owned) after a day")
        lookups(store, end, t, refs[2])
    elif day + 1 == max(int(d) for d in args.history.split(",")):
        lookups(store, end, t, None, f", {day + 1} d of history")
    return per_object


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=125.0, help="requests/s of one gateway process (1)")
    parser.add_argument("--sample", type=float, default=0.1, help="fraction of requests logged (1)")
    parser.add_argument("--rows-per-day", type=int, default=20_000, help="rows per model and day of history (2, 4, 5)")
    parser.add_argument("--history", default="1,7,30", help="days of history the monitor's read is timed after (2)")
    parser.add_argument("--gateways", type=int, default=40, help="writers whose last minute is still staged (2)")
    parser.add_argument("--ref-writers", type=int, default=1, help="writers of the reference's day (2, 4, 5)")
    parser.add_argument("--looks", default="1,2,3,4,5,6,7", help="days after an experiment's start it is looked at (4)")
    parser.add_argument("--outcome-rate", type=float, default=0.2, help="fraction of rows that get an outcome (4)")
    parser.add_argument("--outcome-batch", type=int, default=50, help="outcomes per feedback request (4, reference)")
    parser.add_argument("--full", action="store_true", help="3 at full size: 8.64 M rows, a few GiB of memory")
    parser.add_argument("--reference", default=REFERENCE, help="git revision of the reference's logs")
    args = parser.parse_args()
    patch_iceberg()
    swap = {"from fleet.logs.inference import": "from reference_inference import"}
    ref_inf = reference_module(args.reference, "fleet/logs/inference.py", "reference_inference")
    ref_fb = reference_module(args.reference, "fleet/logs/feedback.py", "reference_feedback", swap)
    swap["from fleet.logs.feedback import"] = "from reference_feedback import"
    ref_logged = reference_module(args.reference, "fleet/logs/logged.py", "reference_logged", swap)
    started = time.perf_counter()
    writes(args.rate, args.sample, ref_inf)
    per_object = history(args, (ref_inf, ref_fb, ref_logged))
    big(args.full, per_object)
    print(f"\ndone in {time.perf_counter() - started:.0f} s; reference: {args.reference}; ~: projected (see the note)")
    print("\n| figure | new | reference |\n|---|---|---|")
    for _, figure, new, ref in sorted(TABLE, key=lambda r: r[0]):
        print(f"| {figure} | {new} | {ref} |")


if __name__ == "__main__":
    main()
