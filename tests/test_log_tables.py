"""The log tables: many writers, one committer, nothing acknowledged lost or doubled; reads
pruned by partition; the same answers from staged, committed and compacted rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from fleet.logs import committer, reading, tables
from fleet.logs.inference import InferenceLog, Sample, read_window
from fleet.store import open_store

ROOT = Path(__file__).resolve().parents[1]
WORKER = [sys.executable, str(ROOT / "tests" / "log_worker.py")]


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    url = request.getfixturevalue("s3_url")
    monkeypatch.setenv("FLEET_LOG_CATALOG", f"sqlite:///{tmp_path / 'catalog.db'}")  # the children inherit it
    return url


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _committed_ids(url: str) -> Counter:
    store = open_store(url)
    table = tables.tables_for(store).table("inference", fresh=True)
    return Counter(table.scan(selected_fields=("request_id",)).to_arrow().column("request_id").to_pylist())


def test_every_acknowledged_row_is_in_the_table_once_after_killed_writers_and_committers(store_url: str) -> None:
    writers = [
        subprocess.Popen([*WORKER, "write", store_url, f"gw{i}", "6", "40"], stdout=subprocess.PIPE, env=_env())
        for i in range(3)
    ]
    doomed = subprocess.Popen([*WORKER, "write", store_url, "gwx", "1000", "40"], stdout=subprocess.PIPE, env=_env())
    acknowledged: list[str] = []
    try:
        for _ in range(2):  # two flushes acknowledged, then killed mid-run (mid-write, most likely)
            acknowledged += json.loads(doomed.stdout.readline())
        doomed.kill()
        doomed.wait(30)
        for w in writers:
            out, _ = w.communicate(timeout=120)
            assert w.returncode == 0
            acknowledged += [rid for line in out.decode().splitlines() for rid in json.loads(line)]
        acknowledged += [rid for line in doomed.stdout.read().decode().splitlines() for rid in json.loads(line)]
    finally:
        for p in (*writers, doomed):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert len(acknowledged) >= 3 * 6 * 40 + 2 * 40
    store = open_store(store_url)

    # a committer killed after its intent (nothing appended), then one killed after its append
    # (the staged files not deleted), then one that finishes: each row once
    for step in ("after-intent", "after-append"):
        killed = subprocess.run([*WORKER, "commit", store_url, step], env=_env(), capture_output=True, timeout=120)
        assert killed.returncode == -9, killed.stderr.decode()[-2000:]
        assert list(store.list(f"{committer.COMMITS}inference/intents/")), "the killed run left its intent"
    between = _committed_ids(store_url)  # the append's rows are in, and still staged: read once all the same
    now = datetime.now(UTC)
    frame = read_window(store, "alpha", now - timedelta(hours=3), now + timedelta(minutes=1))
    assert frame["request_id"].is_unique and set(frame["request_id"]) == {
        r for r in acknowledged if int(r.rsplit("-", 1)[1]) % 3 == 0
    } | {r for r in between if int(r.rsplit("-", 1)[1]) % 3 == 0}
    done = subprocess.run([*WORKER, "commit", store_url, "none"], env=_env(), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    ids = _committed_ids(store_url)
    assert set(acknowledged) <= set(ids) and max(ids.values()) == 1  # every acknowledged row, none twice
    assert not list(store.list("logs/staging/inference/")) and not list(store.list(committer.COMMITS))

    # a second commit into the same model-hours, then compaction (the hours settled: run two
    # hours on) keeps every row once, one file per model-hour
    extra = InferenceLog(store, "gwy")
    for model in ("alpha", "beta", "gamma"):
        for back in (0, 1):
            _samples(extra, model, back, 5, f"y{model}{back}")
    extra.flush()
    committer.run(store, maintain=False)
    ids = _committed_ids(store_url)
    assert len(ids) == len(set(acknowledged) | set(between)) + 30 and max(ids.values()) == 1
    later = datetime.now(UTC) + timedelta(hours=2)
    (result, *_) = committer.run(store, now=later)
    assert result.compacted >= 3
    assert _committed_ids(store_url) == ids
    table = tables.tables_for(store).table("inference", fresh=True)
    parts = Counter(tuple(t.file.partition) for t in table.scan().plan_files())
    assert set(parts.values()) == {1}, parts
    frame = read_window(store, "alpha", now - timedelta(hours=3), now + timedelta(minutes=1))
    assert sorted(frame["request_id"]) == sorted(
        r for r in ids if r.startswith("yalpha") or (r.startswith("gw") and int(r.rsplit("-", 1)[1]) % 3 == 0)
    )
    assert list(frame.columns[-4:]) == ["a", "b", "prediction", "score"]  # the names last staged for the model


def _samples(log: InferenceLog, model: str, hours_back: int, n: int, tag: str) -> None:
    at = time.time() - hours_back * 3600
    for i in range(n):
        features = np.array([[float(i), 1.0]], np.float32)
        log.record(
            Sample(at + i, f"{tag}-{i}", model, "1.0.0", "apps", 1.0, features, np.array([[0.1, 0.9]]), ("a", "b"))
        )


def test_a_window_opens_only_its_models_hours(tmp_path: Path) -> None:
    """Partition pruning, counted: 3 models × 10 hours committed, a read of one model's hour
    opens the files of that partition and no other, whatever the history around it."""
    store = open_store(f"file://{tmp_path / 'store'}")
    log = InferenceLog(store, "gw")
    for hours_back in range(10):
        for model in ("alpha", "beta", "gamma"):
            _samples(log, model, hours_back, 20, f"{model}{hours_back}")
        log.flush()
        committer.run(store, maintain=False)
    hour = (datetime.now(UTC) - timedelta(hours=4)).replace(minute=0, second=0, microsecond=0)
    got = reading.Reading()
    frame = read_window(store, "beta", hour, hour + timedelta(hours=1), reading=got)
    assert got.staged == 0 and 1 <= got.files <= 2, got  # of 30 model-hours (a hour's rows may span two flushes)
    assert all("model=beta/" in p and f"ts_hour={hour:%Y-%m-%d-%H}" in p for p in got.paths)
    assert len(frame) > 0 and set(frame["model"]) == {"beta"}
    everything = reading.Reading()
    read_window(store, "beta", hour - timedelta(hours=20), hour + timedelta(hours=5), reading=everything)
    assert everything.files > got.files


def test_staged_committed_and_compacted_rows_read_the_same(tmp_path: Path) -> None:
    from fleet.logs.feedback import labelled, parse, with_outcomes, write, write_outcomes

    store = open_store(f"file://{tmp_path / 'store'}")
    log = InferenceLog(store, "gw")
    for model in ("alpha", "beta"):
        _samples(log, model, 0, 50, model)
    log.flush()
    _, given = parse(
        {
            "model": "alpha",
            "feedback": [
                {"request_id": f"alpha-{i}", "label": i % 2, "outcomes": {"clicked": i % 3}} for i in range(0, 50, 2)
            ],
        }
    )
    write(store, "alpha", "apps", given, "gw")
    write_outcomes(store, "alpha", "apps", given, "gw")
    now = datetime.now(UTC)
    start, end = now - timedelta(hours=1), now + timedelta(minutes=1)

    def answers():  # noqa: ANN202
        a = labelled(store, "alpha", start, end).sort_values(["request_id", "row"]).reset_index(drop=True)
        b = (
            with_outcomes(store, "alpha", start, end, ["clicked"])
            .sort_values(["request_id", "row"])
            .reset_index(drop=True)
        )
        return a, b

    staged = answers()
    committer.run(store, maintain=False)
    assert not list(store.list("logs/staging/"))
    committed = answers()
    committer.run(store, now=now + timedelta(hours=3))
    compacted = answers()
    for frames in (committed, compacted):
        for want, got in zip(staged, frames, strict=True):
            assert want.drop(columns="ts").equals(got.drop(columns="ts")), (want.head(), got.head())
    a, b = staged
    assert len(a) == 50 and a["label"].notna().sum() == 25 and b["outcome:clicked"].notna().sum() == 25


def test_a_staged_file_that_is_not_the_tables_columns_is_moved_aside(tmp_path: Path) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    store = open_store(f"file://{tmp_path / 'store'}")
    ms = int(time.time() * 1000)
    bad = f"logs/staging/inference/{datetime.now(UTC):%Y/%m/%d/%H}/{ms}-{ms}-gw-000001.parquet"
    out = io.BytesIO()
    pq.write_table(pa.table({"something": [1, 2]}), out)
    store.put(bad, out.getvalue())
    cut = bad.replace("000001", "000002")
    store.put(cut, b"PAR1 cut short")
    (result, *_) = committer.run(store, maintain=False)
    assert sorted(result.rejected) == sorted([bad, cut]) and result.files == 0
    assert sorted(store.list("logs/rejected/")) == sorted(
        k.replace("logs/staging/", "logs/rejected/") for k in (bad, cut)
    )
    assert not list(store.list("logs/staging/"))


def test_logs_query_runs_sql_over_the_tables(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fleet.cli import app

    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    log = InferenceLog(store, "gw")
    _samples(log, "alpha", 0, 30, "a")
    _samples(log, "beta", 0, 12, "b")
    log.flush()
    runner = CliRunner()
    env = {"FLEET_STORE": url}
    committed = runner.invoke(app, ["logs", "commit", "--json"], env=env)
    assert committed.exit_code == 0, committed.output
    asked = runner.invoke(
        app,
        ["logs", "query", "SELECT model, count(*) AS n FROM inference GROUP BY model ORDER BY model", "--json"],
        env=env,
    )
    assert asked.exit_code == 0, asked.output
    assert json.loads(asked.stdout) == [{"model": "alpha", "n": 30}, {"model": "beta", "n": 12}]
    refused = runner.invoke(app, ["logs", "query", "SELECT * FROM read_csv('/etc/passwd')"], env=env)
    assert refused.exit_code != 0 and "Permission Error" in str(refused.exception)  # nothing outside the tables
