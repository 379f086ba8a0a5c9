"""Monitoring and retraining end to end: real Bentos, gateway, inference log, feedback and Prefect.

Each branch: a corrupted batch raises an alert and never retrains; drift on good data,
with labels fed back, retrains a version with its lineage and rolls it out; a retrain
that regresses is refused before anything is registered.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import yaml

from bentos.tabular_mlp import data
from fleet.catalog.registry import Registry, State
from fleet.catalog.routes.store import Router
from tests.rollout_env import FAST, MODEL, Load, serving_fleet
from tests.serving_env import ROOT, FleetEnv


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("monitor")
    policies = yaml.safe_load((ROOT / "policies" / "fleet.yaml").read_text())
    policies["models"][MODEL]["inference_log"]["sample_rate"] = (
        1.0  # every request logged, so every one can be labelled
    )
    policies["models"][MODEL]["cache"]["enabled"] = False
    # these tests are about what monitoring decides, not latency budgets: while torch retrains
    # beside live traffic on a busy 2-core machine, a batch can wait past the shipped 250 ms and
    # be shed with 503 (an honest overload answer, which a caller would see)
    policies["models"][MODEL]["batching"]["max_latency_ms"] = 5000
    policies["monitoring"]["default"].update(window_hours=1, min_rows=300)
    policies["monitoring"]["default"]["retrain"].update(min_feedback_rows=300, cooldown_hours=0)
    (root / "policies").mkdir()
    (root / "policies" / "fleet.yaml").write_text(yaml.safe_dump(policies))
    env = FleetEnv(root)
    env.env["FLEET_POLICIES"] = str(root / "policies")
    with serving_fleet(env) as fleet:
        yield fleet


def send(fleet: dict, rows: np.ndarray, label: bool) -> int:
    """One request per row through the gateway; with ``label``, the true class fed back. Returns rows sent."""
    headers = {"Authorization": f"Bearer {fleet['key']}"}
    feedback, sent = [], []
    with httpx.Client(base_url=fleet["url"], timeout=30, headers=headers) as client:
        for i, row in enumerate(rows):
            body = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": row.tolist()}]}
            r = client.post(
                f"/v2/models/{MODEL}/infer", json=body, headers={"X-Fleet-Routing-Key": f"m-{time.time_ns()}-{i}"}
            )
            assert r.status_code == 200, r.text
            sent.append(r.headers["x-request-id"])
            if label:
                true = int(data.rule(row[None, :].astype(np.float32))[0] > data.THRESHOLD)
                feedback.append({"request_id": r.headers["x-request-id"], "label": true})
        for start in range(0, len(feedback), 200):
            r = client.post("/v1/feedback", json={"model": MODEL, "feedback": feedback[start : start + 200]})
            assert r.status_code == 200 and r.json()["unknown"] == [], r.text
    wait_logged(fleet, sent)
    return len(rows)


def wait_logged(fleet: dict, ids: list[str], timeout: float = 30) -> None:
    """Until the gateway's inference log (written every 2 s) holds every one of ``ids``: a count
    of rows would also count an earlier test's rows flushed after ``clear_logs``, and return
    before this test's last ones are written."""
    from datetime import UTC, datetime, timedelta

    from fleet.logs.inference import read_window

    deadline, wanted = time.monotonic() + timeout, set(ids)
    while time.monotonic() < deadline:
        now = datetime.now(UTC)
        window = read_window(fleet["store"], MODEL, now - timedelta(hours=1), now + timedelta(minutes=1))
        if wanted <= set(window.get("request_id", [])):
            return
        time.sleep(0.2)
    raise AssertionError(f"the inference log did not hold this test's {len(ids)} requests within {timeout} s")


def clear_logs(fleet: dict) -> None:
    """Each test judges its own traffic: drop what earlier tests logged."""
    for key in list(fleet["store"].list("logs/staging/")):  # nothing commits here: every row is staged
        fleet["store"].delete(key)


def test_a_corrupted_batch_raises_an_alert_and_never_retrains(fleet: dict) -> None:
    from flows.monitor import monitor

    clear_logs(fleet)
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(400, 4)).astype(np.float32)
    rows[::6, 0] = 1e6  # a client bug: one value in six a million times off
    send(fleet, rows, label=True)
    versions = Registry(fleet["store"]).versions(MODEL)
    state = monitor(MODEL, return_state=True)
    assert (
        state.is_failed() and "data quality failed, retraining blocked" in state.message and "income" in state.message
    )
    assert Registry(fleet["store"]).versions(MODEL) == versions  # nothing trained
    reports = [k for k in fleet["store"].list(f"reports/{MODEL}/monitor/") if k.endswith(".json") and "state" not in k]
    assert reports


def test_nulls_written_by_a_broken_producer_raise_an_alert(fleet: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flows.monitor import monitor

    clear_logs(fleet)
    send(fleet, np.random.default_rng(2).normal(size=(350, 4)).astype(np.float32), label=False)
    # every file the producer wrote loses a third of its values (one file might hold only a few
    # rows: an earlier test's, flushed after clear_logs)
    for key in list(fleet["store"].list("logs/staging/inference/")):
        table = pq.read_table(io.BytesIO(fleet["store"].get(key).data))
        features = table.column("features").to_pylist()
        for row in features[::3]:
            row[1] = None  # debt_ratio: a third of the values lost
        table = table.set_column(
            table.schema.get_field_index("features"),
            "features",
            pa.array(features, table.schema.field("features").type),
        )
        out = io.BytesIO()
        pq.write_table(table, out)
        fleet["store"].put(key.replace(".parquet", "-broken.parquet"), out.getvalue())
        fleet["store"].delete(key)
    state = monitor(MODEL, return_state=True)
    assert state.is_failed() and "retraining blocked" in state.message and "debt_ratio" in state.message


def test_drift_on_good_data_retrains_and_rolls_out_a_new_version_with_its_lineage(fleet: dict) -> None:
    from flows.monitor import monitor

    clear_logs(fleet)
    rng = np.random.default_rng(3)
    drifted = (rng.normal(size=(700, 4)) + np.array([1.2, -0.8, 0.8, 0.8])).astype(np.float32)
    send(fleet, drifted, label=True)
    load = Load(fleet["url"], fleet["key"], rps=60).start()  # live traffic for the canary's analysis
    try:
        state = monitor(MODEL, retrain_overrides=FAST, return_state=True)
    finally:
        load.stop()
    print(f"monitor: {state.message}; load: {load.report()}")
    assert state.is_completed() and "features drifting" in state.message and "promoted" in state.message
    new = Router(fleet["store"]).get(MODEL).stable
    assert new == "1.1.0"
    mv = Registry(fleet["store"]).get(MODEL, new)
    assert mv.parent_version == "1.0.0" and mv.state == State.STABLE
    assert mv.training_data.uri == f"store://datasets/{MODEL}/1.1.0.parquet" and mv.training_data.sha256
    assert mv.hyperparameters["feedback_rows"] >= 300 and "features drifting" in mv.hyperparameters["retrain_reason"]
    assert mv.metrics["accuracy"] >= mv.metrics["champion_accuracy"] - 0.01
    assert load.failures == []


def test_a_retrain_that_regresses_is_never_rolled_out(fleet: dict) -> None:
    from flows.retrain import retrain

    clear_logs(fleet)
    send(fleet, np.random.default_rng(4).normal(size=(350, 4)).astype(np.float32), label=True)
    before = Registry(fleet["store"]).versions(MODEL)
    stable = Router(fleet["store"]).get(MODEL).stable
    state = retrain(MODEL, reason="test", hyperparameters={"epochs": 1, "lr": 1e-6}, return_state=True)
    assert (
        state.is_failed() and "the candidate regresses" in state.message and "nothing was registered" in state.message
    )
    assert Registry(fleet["store"]).versions(MODEL) == before
    assert Router(fleet["store"]).get(MODEL).stable == stable and Router(fleet["store"]).get(MODEL).canary is None


def test_a_retrain_on_corrupted_feedback_is_refused_before_training(fleet: dict) -> None:
    from flows.retrain import retrain

    clear_logs(fleet)
    rows = np.random.default_rng(5).normal(size=(400, 4)).astype(np.float32)
    rows[::6, 2] = -1e6  # labelled, but broken: mixed into 20,000 registered rows it would be 0.3 %
    send(fleet, rows, label=True)
    before = Registry(fleet["store"]).versions(MODEL)
    state = retrain(MODEL, reason="test", return_state=True)
    assert (
        state.is_failed()
        and "failed its quality checks, nothing was trained" in state.message
        and "age" in state.message
    )
    assert Registry(fleet["store"]).versions(MODEL) == before
