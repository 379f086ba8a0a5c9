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
    table = tables.tables_for(store).table("inference", fresh=True)
    held = {tuple(t.file.partition) for t in table.scan().plan_files()}  # (model, hours since 1970)
    for n, (model, hour) in enumerate(sorted(held)):  # a row more in each model-hour the table holds
        at = hour * 3600 + 1
        features = np.zeros((1, 2), np.float32)
        extra.record(Sample(at, f"y{model}{n}", model, "1.0.0", "apps", 1.0, features, np.ones((1, 2)), ("a", "b")))
    extra.flush()
    committer.run(store, maintain=False)
    ids = _committed_ids(store_url)
    assert len(ids) == len(set(acknowledged) | set(between)) + len(held) and max(ids.values()) == 1
    later = datetime.now(UTC) + timedelta(hours=2)
    (result, *_) = committer.run(store, now=later)
    assert result.compacted == len(held) >= 3
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


def _stage_outcomes(store, rows: list[tuple[float, str, float]]) -> None:  # noqa: ANN001
    import pyarrow as pa

    from fleet.logs.staging import stage
    from fleet.logs.tables import arrow_schema

    n = len(rows)
    data = pa.table(
        {
            "ts": pa.array([int(t * 1e6) for t, _, _ in rows], pa.timestamp("us", tz="UTC")),
            "model": ["alpha"] * n,
            "request_id": [r for _, r, _ in rows],
            "tenant": ["apps"] * n,
            "row": pa.array([0] * n, pa.int32()),
            "name": ["clicked"] * n,
            "value": [v for _, _, v in rows],
        }
    ).cast(arrow_schema("outcomes"))
    stage(store, "outcomes", data, "gw")


@pytest.mark.parametrize("restart", [False, True])
def test_an_experiments_looks_read_only_what_was_committed_since_and_give_todays_intervals(
    tmp_path: Path, restart: bool
) -> None:
    """Three days of an experiment's requests and outcomes, committed in batches: outcomes
    that come before their request is committed, outcomes sent again with another value,
    requests logged twice. Looks every few hours read only the files committed since the
    last; each look's per-arm statistics equal those of reading everything since the start,
    as every look did before. With ``restart`` the flow starts again from its stored state
    before each look (the open window is read again)."""
    from fleet.analysis.ab import arm_stats, arm_stats_of_sums
    from fleet.logs.feedback import OUTCOME_COLUMN, with_outcomes
    from fleet.logs.increments import SETTLE, OutcomeJoin

    store = open_store(f"file://{tmp_path / 'store'}")
    rng = np.random.default_rng(7)
    start = (datetime.now(UTC) - timedelta(days=3)).replace(minute=0, second=0, microsecond=0)
    column = OUTCOME_COLUMN.format("clicked")
    join = OutcomeJoin(store, "alpha", "clicked", start, {}, None)
    settled: dict = {}
    until = None
    log = InferenceLog(store, "gw")
    late: list[tuple[float, str, float]] = []  # outcomes staged before their requests are
    reads = []
    for hours in range(0, 64, 4):  # 4 hours of traffic, committed, then a look
        outcomes = late
        late = []
        for i in range(hours * 20, (hours + 4) * 20):  # 20 requests an hour
            at = start.timestamp() + i * 180 + 1
            version = ("1.0.0", "2.0.0")[i % 2]
            rid = f"q{i}" if i % 50 else f"q{i - 1}"  # now and then an id logged again: its first counts
            log.record(Sample(at, rid, "alpha", version, "apps", 1.0, np.zeros((1, 2)), np.ones((1, 2)), ("a", "b")))
            if rng.random() < 0.7:
                value = float(rng.random() < 0.3 + 0.1 * (i % 2))
                sent = (at + rng.uniform(60, 4 * 3600), rid, value)
                (late if i % 7 == 0 else outcomes).append(sent)
                if i % 11 == 0:  # sent again, later, with the other value: the last counts
                    outcomes.append((sent[0] + 60, rid, 1.0 - value))
        if hours % 8 == 4:  # some outcomes of this batch committed before its requests
            _stage_outcomes(store, outcomes)
            committer.run(store, maintain=False)
            log.flush()
        else:
            log.flush()
            _stage_outcomes(store, outcomes)
        committer.run(store, maintain=False)
        end = start + timedelta(hours=hours + 4)
        if restart:
            join = OutcomeJoin(store, "alpha", "clicked", start, settled, until)
        looked = join.look(end)
        settled, until = looked.settled, looked.settled_until
        assert until == max(start, end - SETTLE)
        reads.append((looked.full, looked.rows, 80 + len(outcomes)))
        full = with_outcomes(store, "alpha", start, end, ["clicked"])
        full = full[full[column].notna()]
        for version in ("1.0.0", "2.0.0"):
            want = arm_stats(version, full[full["version"] == version][column].to_numpy())
            got = arm_stats_of_sums(version, looked.sums.get(version, (0, 0.0, 0.0)))
            assert got.n == want.n and got.mean == pytest.approx(want.mean, rel=1e-12)
            assert got.var == pytest.approx(want.var, rel=1e-9)
    assert sum(n for n, _, _ in settled.values()) > 0  # most of it settled: read no more
    if not restart:  # after the first look, each reads the rows committed since it and no other
        assert reads[0][0] and not any(full for full, _, _ in reads[1:])
        assert all(read == new for _, read, new in reads[1:]), reads


def test_the_readme_queries_run_and_answer(tmp_path: Path) -> None:
    """Every ``fleet logs query`` line of the README, run as written against committed rows."""
    import shlex

    from typer.testing import CliRunner

    from fleet.cli import app
    from fleet.logs.feedback import parse, write

    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    log = InferenceLog(store, "gw")
    _samples(log, "demo-classifier", 0, 40, "d")
    at = time.time()
    for i in range(10):  # ten requests that failed: logged with their status, never labelled
        log.record(
            Sample(
                at,
                f"e-{i}",
                "demo-classifier",
                "1.0.0",
                "apps",
                9.0,
                np.zeros((1, 2)),
                np.empty((1, 0)),
                ("a", "b"),
                503,
            )
        )
    log.flush()
    _, given = parse(
        {"model": "demo-classifier", "feedback": [{"request_id": f"d-{i}", "label": 1} for i in range(10)]}
    )
    write(store, "demo-classifier", "apps", given, "gw")
    committer.run(store, maintain=False)
    section = (ROOT / "README.md").read_text().split("## The log tables", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("fleet logs query ")]
    assert len(lines) == 4
    runner = CliRunner()
    answers = []
    for line in lines:
        args = shlex.split(line)[1:] + ["--json"]
        result = runner.invoke(app, args, env={"FLEET_STORE": url})
        assert result.exit_code == 0, (line, result.output, result.exception)
        answers.append(json.loads(result.stdout))
    p99, errors, _, matched = answers
    assert [r["tenant"] for r in p99] == ["apps"] and p99[0]["requests"] == 50
    assert sum(r["requests"] for r in errors) == 50
    failed = sum(r["error_rate"] * r["requests"] for r in errors)
    assert round(failed) == 10  # the ten 503s
    assert matched == [{"version": "1.0.0", "match_rate": 1.0, "labels": 10}]  # every prediction was class 1


def test_a_label_finds_its_request_in_its_hour_and_an_unknown_id_costs_a_bounded_lookup(tmp_path: Path) -> None:
    """A day of committed log, 24 model-hours: a label for a gateway-made (UUIDv7) id reads
    the files of its hour whose id bounds hold it; a made-up id of the same form costs no
    more; an id a caller chose is looked for in the last two hours only."""
    from fleet.logs import ids
    from fleet.logs.logged import LoggedRequests
    from fleet.store import FileStore

    class Counting(FileStore):
        gets = 0

        def get(self, key: str):  # noqa: ANN202 - FileStore's
            Counting.gets += 1
            return super().get(key)

    store = Counting(tmp_path / "store")
    log = InferenceLog(store, "gw")
    now = time.time()
    made: dict[int, list[str]] = {}
    for hours_back in range(24):
        at = now - hours_back * 3600 - 60
        made[hours_back] = [ids.new(int((at + i) * 1000)) for i in range(30)]
        for i, rid in enumerate(made[hours_back]):
            log.record(
                Sample(at + i, rid, "alpha", "1.0.0", "apps", 1.0, np.zeros((1, 2)), np.ones((1, 2)), ("a", "b"))
            )
        log.flush()
        committer.run(store, maintain=False)  # a commit an hour: 24 files
    table = tables.tables_for(store).table("inference", fresh=True)
    assert len(list(table.scan().plan_files())) >= 24
    for wanted in (made[5][7], made[20][0], ids.new(int((now - 5 * 3600) * 1000))):
        index = LoggedRequests(store)
        Counting.gets = 0
        found = index.owned("alpha", "apps", {(wanted, 0)})
        assert found == ({(wanted, 0)} if wanted in made[5] + made[20] else set())
        # its hour's file (and the next hour's) whose id bounds hold it, not the day's 24
        assert index.files_read <= 2 and index.plans == 1 and Counting.gets == 0, (index.files_read, Counting.gets)
    index = LoggedRequests(store)
    assert index.owned("alpha", "apps", {("order-4711", 0)}) == set()
    assert index.files_read <= 3  # the last two hours' files, whatever the id
    # ten thousand made-up ids of one hour: one plan of that hour, not one per id
    flood = {(ids.new(int((now - 7 * 3600) * 1000) + i), 0) for i in range(10_000)}
    index = LoggedRequests(store)
    assert index.owned("alpha", "apps", flood) == set()
    assert index.plans <= 2 * 10 and index.files_read <= 2 * 10  # chunks of 1,000 ids, a file or two each


def test_final_usage_hours_are_copied_into_the_usage_table_once(tmp_path: Path) -> None:
    """Every gateway's usage of an hour that is final becomes rows of the usage table, in one
    commit that records the hour done: a second run copies nothing again, a later one the
    hours that became final since; a gateway that died mid-hour counts by its parts."""
    from fleet import records
    from fleet.logs.query import run as query
    from fleet.usage.records import TrafficRecord, UsageHour, hour_key, part_key
    from flows.logs import USAGE_FINAL_H, copy_usage

    store = open_store(f"file://{tmp_path / 'store'}")
    now = datetime(2026, 12, 7, 12, 30, tzinfo=UTC)
    final = now.replace(minute=0) - timedelta(hours=USAGE_FINAL_H)  # 09:00: the last final hour

    def usage(hour: datetime, gateway: str, tenant: str, n: int, part: int | None = None) -> None:
        rec = UsageHour(
            hour=hour,
            gateway=gateway,
            traffic=[
                TrafficRecord(tenant=tenant, model="alpha", version="1.0.0", requests=n, rows=2 * n, upstream_s=n / 10)
            ],
            versions=[],
        )
        store.put(hour_key(hour, gateway) if part is None else part_key(hour, gateway, part), records.dump(rec))

    for back in range(3):
        usage(final - timedelta(hours=back), "gw-a", "acme", 10 + back)
        usage(final - timedelta(hours=back), "gw-b", "globex", 5)
    usage(final, "gw-dead", "acme", 3, part=1)  # died mid-hour: its parts count
    usage(final, "gw-dead", "acme", 4, part=2)
    usage(final + timedelta(hours=1), "gw-a", "acme", 99)  # not final yet
    logs = tables.tables_for(store)
    logs.create()
    copied = copy_usage(store, logs, lambda: None, now=now)
    assert copied[-1] == f"{final:%Y-%m-%dT%H}" and len(copied) == 49  # the first run looks 48 hours back
    assert copy_usage(store, logs, lambda: None, now=now) == []  # done: nothing twice
    answer = query(
        store, 'SELECT tenant, sum(requests) AS n, sum("rows") AS r FROM usage GROUP BY tenant ORDER BY tenant'
    )
    assert answer.rows == [("acme", 10 + 11 + 12 + 3 + 4, 2 * (10 + 11 + 12 + 3 + 4)), ("globex", 15, 30)]
    later = copy_usage(store, logs, lambda: None, now=now + timedelta(hours=1))
    assert later == [f"{final + timedelta(hours=1):%Y-%m-%dT%H}"]
    assert query(store, "SELECT sum(requests) FROM usage").rows == [(10 + 11 + 12 + 3 + 4 + 15 + 99,)]
