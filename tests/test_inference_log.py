"""The inference log writer and reader: batches in Parquet, nothing lost when the store fails."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from fleet.logs.inference import InferenceLog, Sample, feature_names, read_window
from fleet.store import MemoryStore
from tests.fakes import DownStore

NAMES = ("income", "debt_ratio", "age", "tenure")


def sample(i: int, rows: int = 2, ts: float | None = None) -> Sample:
    features = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + i
    outputs = np.tile(np.array([[0.2, 0.8]], np.float32), (rows, 1))
    return Sample(ts or time.time(), f"r{i}", "demo", "1.0.0", "apps", 3.5, features, outputs, NAMES)


def window(store) -> object:  # noqa: ANN001
    now = datetime.now(UTC)
    return read_window(store, "demo", now - timedelta(hours=2), now + timedelta(minutes=1))


def test_a_flush_stages_one_parquet_file_with_one_row_per_input_row() -> None:
    store = MemoryStore()
    log = InferenceLog(store, "gw1")
    for i in range(3):
        log.record(sample(i))
    log.record(Sample(time.time(), "x", "other", "2.0.0", "apps", 1.0, np.ones((1, 2)), np.ones((1, 3)), ("a", "b")))
    assert log.flush() == 7
    keys = list(store.list("logs/"))
    # one file for every model and layout in the flush, named by its rows' oldest and newest times
    assert len(keys) == 1 and keys[0].startswith("logs/staging/inference/") and "-gw1-" in keys[0]
    frame = window(store)
    assert list(frame.columns) == [
        "ts",
        "request_id",
        "row",
        "model",
        "version",
        "tenant",
        "latency_ms",
        *NAMES,
        "prediction",
        "score",
    ]
    assert frame["request_id"].tolist() == ["r0", "r0", "r1", "r1", "r2", "r2"]
    assert frame["row"].tolist() == [0, 1] * 3
    assert frame.loc[1, list(NAMES)].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert set(frame["prediction"]) == {1} and np.allclose(frame["score"], 0.8)


def test_a_failing_store_keeps_rows_buffered_until_it_is_back() -> None:
    store = DownStore(down=True)
    dropped: list[int] = []
    log = InferenceLog(store, "gw1", max_bytes=3 * sample(0).nbytes, on_dropped=lambda m, n: dropped.append(n))
    for i in range(3):
        log.record(sample(i))
    assert log.flush() == 0 and log.failing and log.buffered_rows == 6
    log.record(sample(3))  # over the byte budget: the oldest request's rows go
    assert dropped == [2] and log.buffered_rows == 6 and log.buffered_bytes == 3 * sample(0).nbytes
    store.down.clear()
    assert log.close(timeout_s=5) == 0
    assert sorted(set(window(store)["request_id"])) == ["r1", "r2", "r3"]


def test_close_flushes_what_the_writer_thread_had_not_written() -> None:
    store = MemoryStore()
    log = InferenceLog(store, "gw1", flush_s=3600)
    log.start()
    for i in range(5):
        log.record(sample(i, rows=1))
    assert list(store.list("logs/")) == []
    assert log.close() == 0
    assert len(window(store)) == 5


def test_rows_land_in_the_hour_they_were_served_and_the_window_filters_by_time() -> None:
    store = MemoryStore()
    log = InferenceLog(store, "gw1")
    old = time.time() - 3 * 3600
    log.record(sample(0, ts=old))
    log.record(sample(1))
    log.flush()
    (key,) = store.list("logs/staging/inference/")
    oldest, newest = (int(t) for t in key.rsplit("/", 1)[1].split("-")[:2])
    assert oldest == int(old * 1000) and newest >= oldest + 3 * 3600 * 1000 - 1000
    assert key.split("/")[3:7] == f"{datetime.fromtimestamp(old, UTC):%Y/%m/%d/%H}".split("/")  # the oldest row's hour
    assert set(window(store)["request_id"]) == {"r1"}  # the last two hours only


def test_feature_names_come_from_the_profile_or_are_numbered() -> None:
    assert feature_names({"features": {"a": {}, "b": {}}}, 2) == ("a", "b")
    assert feature_names({"features": {"a": {}}}, 2) == ("f0", "f1")
    assert feature_names(None, 3) == ("f0", "f1", "f2")


def test_the_buffer_stays_under_its_byte_budget_whatever_size_the_samples_are() -> None:
    """Five 100k-row samples once left 500,995 rows buffered under a 1,000-row bound: eviction
    dropped one sample per insert. It now evicts until the buffer is under budget again."""
    dropped: list[int] = []
    budget = 2 * 1024 * 1024
    log = InferenceLog(MemoryStore(), "gw1", max_bytes=budget, on_dropped=lambda m, n: dropped.append(n))
    for i in range(40):
        log.record(sample(i, rows=1))
    small = log.buffered_bytes
    for i in range(5):
        log.record(sample(100 + i, rows=40_000))  # 0.96 MiB each: two fit, the rest evict
        assert log.buffered_bytes <= budget
    assert log.buffered_rows == 80_000 and log.buffered_bytes <= budget and small < budget
    assert sum(dropped) == 40 + 3 * 40_000  # every small sample, then the oldest large ones, counted
    log.record(sample(200, rows=200_000))  # larger than the whole budget: dropped at once, nothing evicted
    assert dropped[-1] == 200_000 and log.buffered_rows == 80_000


def test_a_full_buffer_flushes_before_the_interval_and_a_down_store_is_not_hammered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Flush by bytes: a buffer past ``flush_bytes`` is staged at once, not after ``flush_s``.
    With the store down, the samples put back make the buffer full again; the writer then
    tries again every ``RETRY_S``, not in a loop."""
    from fleet.logs import inference

    monkeypatch.setattr(inference, "RETRY_S", 30.0)  # no retry within the test, however slow the machine
    store = DownStore(down=False)
    log = InferenceLog(store, "gw1", flush_s=3600, flush_bytes=4 * sample(0).nbytes)
    log.start()
    try:
        for i in range(4):
            log.record(sample(i))
        deadline = time.monotonic() + 10
        while not list(store.list("logs/staging/")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(list(store.list("logs/staging/"))) == 1 and log.buffered_rows == 0  # long before an hour
        store.down.set()
        for i in range(4, 8):
            log.record(sample(i))  # full again: the writer tries, fails, and puts them back
        deadline = time.monotonic() + 10
        while store.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.refused == 1 and log.failing
        time.sleep(0.5)  # well within RETRY_S: a loop on the full buffer would have tried again by now
        assert store.refused == 1 and log.buffered_rows == 8
    finally:
        store.down.clear()
        assert log.close(timeout_s=5) == 0
    assert len(list(store.list("logs/staging/"))) == 2
