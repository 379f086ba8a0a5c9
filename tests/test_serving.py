"""End to end on real processes: train → register → package → serve → the gateway.

Two versions run as real ``bentoml serve`` processes behind a real gateway process;
requests use OIP v2 and v1 bodies and Triton's own HTTP client.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from fleet import audit
from fleet.catalog.routes.table import Canary, RouteTable, choose_version
from fleet.catalog.tenants import Tenant
from fleet.errors import FleetError
from tests.serving_env import FleetEnv

MODEL = "demo-classifier"
V2_BODY = {"inputs": [{"name": "features", "shape": [2, 4], "datatype": "FP32", "data": [1, 0, 0, 0, -1, 1, 0, 0]}]}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    env = FleetEnv(tmp_path_factory.mktemp("fleet"))
    try:
        env.fleet("models", "train", MODEL, "1.0.0", "--rows", "5000", "--epochs", "10")
        env.fleet("models", "train", MODEL, "1.1.0", "--rows", "5000", "--epochs", "10", "--seed", "11")
        env.fleet("models", "train", MODEL, "1.2.0", "--rows", "1000", "--epochs", "1", "--seed", "12")
        env.fleet("route", "set", MODEL, "--stable", "1.0.0", "-r", "first")
        env.fleet("route", "set", MODEL, "--canary", "1.1.0", "--weight", "30", "-r", "canary")
        keys = {}
        for name, models in [
            ("apps", [MODEL]),
            ("partner", [MODEL]),
            ("limited", [f"{MODEL}:1.0.0"]),
            ("outsider", ["other-model"]),
            ("orphan", [MODEL]),
        ]:
            args = [a for m in models for a in ("--model", m)]
            keys[name] = env.fleet_json("tenants", "create", name, *args)["api_key"]
        env.fleet("route", "pin", MODEL, "partner", "1.0.0", "-r", "partner stays on 1.0")
        env.fleet("route", "pin", MODEL, "orphan", "1.2.0", "-r", "a version nobody deployed")
        for version in ("1.0.0", "1.1.0"):
            env.fleet("deploy", MODEL, version)
        url = env.start_gateway()
        yield {"env": env, "url": url, "keys": keys}
    finally:
        env.stop()


def post(fleet: dict, path: str, body: object, tenant: str | None = "apps", **headers: str) -> httpx.Response:
    if tenant is not None:
        headers["Authorization"] = f"Bearer {fleet['keys'][tenant]}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(fleet["url"] + path, content=content, headers=headers, timeout=30)


def test_oip_v2_infer_answers_probabilities_with_fleet_headers(fleet: dict) -> None:
    r = post(fleet, f"/v2/models/{MODEL}/infer", V2_BODY, **{"X-Request-Id": "req-1", "X-Fleet-Routing-Key": "k"})
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["name"] == "probabilities" and out["shape"] == [2, 2]
    probs = np.array(out["data"]).reshape(2, 2)
    assert np.allclose(probs.sum(axis=1), 1, atol=1e-5)
    assert probs[0, 1] > 0.5 > probs[1, 1]  # the known rule: row 0 is positive, row 1 negative
    assert r.headers["x-request-id"] == "req-1" and r.json()["id"] == "req-1"
    assert r.headers["x-fleet-model-version"] == r.json()["model_version"]


def test_versioned_infer_and_v1_predict(fleet: dict) -> None:
    r = post(fleet, f"/v2/models/{MODEL}/versions/1.1.0/infer", V2_BODY)
    assert r.status_code == 200 and r.headers["x-fleet-model-version"] == "1.1.0"
    r = post(
        fleet,
        f"/v1/models/{MODEL}:predict",
        {"instances": [[1, 0, 0, 0], [-1, 1, 0, 0]]},
        **{"X-Fleet-Routing-Key": "k"},
    )
    assert r.status_code == 200, r.text
    preds = np.array(r.json()["predictions"])
    assert preds.shape == (2, 2) and preds[0].argmax() == 1 and preds[1].argmax() == 0


def test_tritons_own_http_client_works_against_v2(fleet: dict) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=fleet["url"].removeprefix("http://"))
    auth = {"Authorization": f"Bearer {fleet['keys']['apps']}"}
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL, headers=auth)
    meta = client.get_model_metadata(MODEL, headers=auth)
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}]
    features = triton.InferInput("features", [3, 4], "FP32")
    features.set_data_from_numpy(np.array([[1, 0, 0, 0], [-1, 1, 0, 0], [0, 0, 0, 0]], np.float32), binary_data=False)
    result = client.infer(
        MODEL,
        [features],
        model_version="1.0.0",
        headers=auth,
        outputs=[triton.InferRequestedOutput("probabilities", binary_data=False)],
    )
    probs = result.as_numpy("probabilities")
    assert probs.shape == (3, 2) and probs[0].argmax() == 1 and probs[1].argmax() == 0
    assert result.get_response()["model_version"] == "1.0.0"


@pytest.mark.parametrize(
    ("path", "body", "tenant", "headers", "status", "message"),
    [
        (f"/v2/models/{MODEL}/infer", b"{not json", "apps", {}, 400, "not valid JSON"),
        (f"/v2/models/{MODEL}/infer", {"input": []}, "apps", {}, 400, 'no "inputs" list'),
        (f"/v2/models/{MODEL}/infer", V2_BODY, None, {}, 401, "expected 'Authorization: Bearer <key>'"),
        (f"/v2/models/{MODEL}/infer", V2_BODY, None, {"Authorization": "Bearer sfk_00000000_nope"}, 401, "unknown"),
        # a model or version the tenant may not use is answered exactly like one that does not exist
        (f"/v2/models/{MODEL}/infer", V2_BODY, "outsider", {}, 404, "model 'demo-classifier' is not served here"),
        (
            f"/v2/models/{MODEL}/versions/1.1.0/infer",
            V2_BODY,
            "limited",
            {},
            404,
            "version '1.1.0' of demo-classifier is not served; versions you may use: 1.0.0",
        ),
        ("/v2/models/nope/infer", V2_BODY, "apps", {}, 404, "model 'nope' is not served here"),
        (
            f"/v2/models/{MODEL}/versions/9.9.9/infer",
            V2_BODY,
            "apps",
            {},
            404,
            "version '9.9.9' of demo-classifier is not served; versions you may use: 1.0.0, 1.1.0",
        ),
        (f"/v2/models/{MODEL}/infer", b"x" * (5 * 1024 * 1024), "apps", {}, 413, "over the limit"),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "features", "shape": [2, 3], "datatype": "FP32", "data": [0] * 6}]},
            "apps",
            {},
            422,
            "expected [-1, 4]",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "BYTES", "data": ["a"] * 4}]},
            "apps",
            {},
            422,
            "expected FP32",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [None] * 4}]},
            "apps",
            {},
            422,
            "holds null at data[0]; expected FP32 values",
        ),
        (
            f"/v2/models/{MODEL}/infer",
            {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1e39, 0, 0, 0]}]},
            "apps",
            {},
            422,
            "holds 1e+39, out of range for FP32",
        ),
        (f"/v2/models/{MODEL}/infer", V2_BODY, "orphan", {}, 503, "no running replica"),
        (
            f"/v2/models/{MODEL}/versions/1.0.0/infer",
            {"inputs": [{"name": "features", "shape": [4000, 4], "datatype": "FP32", "data": [0.5] * 16000}]},
            "apps",
            {"X-Fleet-Timeout-Ms": "1"},
            400,
            "below demo-classifier's min_timeout_ms 50; expected at least 50 ms",
        ),
    ],
)
def test_each_error_status_from_a_real_request(fleet, path, body, tenant, headers, status, message) -> None:
    r = post(fleet, path, body, tenant, **headers)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert r.headers["x-request-id"] and r.headers["x-fleet-model-version"]


def test_weighted_split_over_1000_requests_matches_the_routing_function(fleet: dict) -> None:
    table = RouteTable(model=MODEL, stable="1.0.0", canary=Canary(version="1.1.0", weight=30))
    apps = Tenant(name="apps", entitlements={MODEL: ["*"]}, created_at=audit.now(), created_by="t")
    served = {}
    with httpx.Client(base_url=fleet["url"], timeout=30) as client:
        for i in range(1000):
            r = client.post(
                f"/v2/models/{MODEL}/infer",
                json=V2_BODY,
                headers={"Authorization": f"Bearer {fleet['keys']['apps']}", "X-Fleet-Routing-Key": f"user-{i}"},
            )
            assert r.status_code == 200
            served[f"user-{i}"] = r.headers["x-fleet-model-version"]
    expected = {k: choose_version(table, apps, k).version for k in served}
    assert served == expected  # sticky and exactly the pure function's choice
    share = sum(v == "1.1.0" for v in served.values()) / len(served)
    assert abs(share - 0.30) < 0.05


def test_a_pinned_tenant_always_gets_its_version(fleet: dict) -> None:
    with httpx.Client(base_url=fleet["url"], timeout=30) as client:
        versions = {
            client.post(
                f"/v2/models/{MODEL}/infer",
                json=V2_BODY,
                headers={"Authorization": f"Bearer {fleet['keys']['partner']}", "X-Fleet-Routing-Key": f"g-{i}"},
            ).headers["x-fleet-model-version"]
            for i in range(200)
        }
    assert versions == {"1.0.0"}


def test_model_ready_and_metadata_follow_the_tenant(fleet: dict) -> None:
    auth = {"Authorization": f"Bearer {fleet['keys']['orphan']}"}
    r = httpx.get(f"{fleet['url']}/v2/models/{MODEL}/ready", headers=auth)
    assert r.status_code == 503 and r.json()["version"] == "1.2.0"
    r = httpx.get(f"{fleet['url']}/v2/models/{MODEL}", headers={"Authorization": f"Bearer {fleet['keys']['apps']}"})
    assert r.status_code == 200 and r.json()["versions"] == ["1.0.0", "1.1.0"]  # not 1.2.0: another tenant's pin
    r = httpx.get(f"{fleet['url']}/v2/models/{MODEL}", headers=auth)
    assert r.status_code == 200 and r.json()["versions"] == ["1.0.0", "1.1.0", "1.2.0"]  # its own pin it sees


def test_a_version_that_fails_to_start_reports_why(tmp_path: Path) -> None:
    from fleet.runtime.base import DeployFailed
    from fleet.runtime.local import LocalRuntime

    runtime = LocalRuntime(
        tmp_path / "run", bento_for=lambda m, v: "no-such-bento:1.0.0", env={"BENTOML_HOME": str(tmp_path / "bentoml")}
    )
    with pytest.raises(DeployFailed) as info:
        runtime.deploy(MODEL, "1.0.0")
    message = str(info.value)
    assert "exited while starting" in message and "no-such-bento" in message
    assert isinstance(info.value, FleetError) and runtime.list() == []


def test_status_shows_weights_replicas_and_health(fleet: dict) -> None:
    rows = {r["version"]: r for r in fleet["env"].fleet_json("status")}
    assert rows["1.0.0"]["traffic"].startswith("stable 70%") and rows["1.0.0"]["healthy"] == 1
    assert rows["1.1.0"]["traffic"] == "canary 30%" and rows["1.1.0"]["replicas"] == 1
    assert rows["1.2.0"]["replicas"] == 0 and "pin orphan" in rows["1.2.0"]["traffic"]


def test_a_canary_killed_under_load_costs_callers_nothing(fleet: dict) -> None:
    """Runs last: it kills the canary's Bento, then deploys it again.

    No caller sees a failure, whenever its request ran. Requests are told apart by when they
    *started*: one started once every canary process was dead must be served by stable. One
    in flight at the kill may have had its answer from the canary already (on a busy machine
    it comes back well after the kill), so it counts on neither side.
    """
    import concurrent.futures
    import os
    import signal
    import threading

    from fleet.processes import alive, tree
    from fleet.runtime.local import LocalRuntime

    runtime = LocalRuntime(fleet["env"].root / "run")
    canary = runtime._replicas(MODEL, "1.1.0")[0][1]
    assert len(tree(canary.pid)) >= 2  # the server and its worker(s), in sessions of their own
    failures: list[str] = []
    answers: list[tuple[float, float, str]] = []  # started, finished (monotonic), version that answered
    lock = threading.Lock()

    def worker(n: int) -> None:
        with httpx.Client(base_url=fleet["url"], timeout=30) as client:
            for i in range(n):
                body = {
                    "inputs": [
                        {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [n / 10, i / 100, 0.5, -0.5]}
                    ]
                }  # distinct: no cache hit hides the kill
                started = time.monotonic()
                r = client.post(
                    f"/v2/models/{MODEL}/infer",
                    json=body,
                    headers={
                        "Authorization": f"Bearer {fleet['keys']['apps']}",
                        "X-Fleet-Routing-Key": f"load-{n}-{i}",
                    },
                )
                with lock:
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text[:100]}")
                    answers.append((started, time.monotonic(), r.headers["x-fleet-model-version"]))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(worker, 60 + k) for k in range(8)]  # 500 requests, 8 at a time
        while len(answers) < 100:
            time.sleep(0.01)
        victims = tree(canary.pid)
        kill_began = time.monotonic()
        for pid in victims:  # the canary's server and its workers die mid-load
            os.kill(pid, signal.SIGKILL)
        while any(alive(pid, b"") for pid in victims):  # dead: nothing of the canary can answer any more
            time.sleep(0.005)
        killed = time.monotonic()
        for job in jobs:
            job.result()

    def count(rows: list[tuple[float, float, str]]) -> dict[str, int]:
        return {v: sum(1 for *_, w in rows if w == v) for v in sorted({w for *_, w in rows})}

    before = count([a for a in answers if a[1] < kill_began])  # answered before the kill began
    after = count([a for a in answers if a[0] >= killed])  # started after every canary process was dead
    in_flight = count([a for a in answers if a[1] >= kill_began and a[0] < killed])
    print(
        f"caller-visible failures: {len(failures)} of {len(answers)}; answered before the kill {before}, "
        f"in flight during it {in_flight}, started after it {after} (kill took {(killed - kill_began) * 1000:.0f} ms)"
    )
    assert failures == []
    assert before.get("1.1.0", 0) > 0 and after.get("1.1.0", 0) == 0 and after.get("1.0.0", 0) > 100
    fleet["env"].fleet("deploy", MODEL, "1.1.0")  # leave the fleet as it was


def test_undeploy_takes_replicas_off_the_list_first_and_stops_them_after_the_drain(tmp_path: Path) -> None:
    """A retired stable or a rolled-back canary: gateways that have not yet seen the route move
    away still reach its replica for the drain, then it stops (a real process here)."""
    import subprocess
    import sys
    import threading

    from fleet.processes import alive
    from fleet.runtime.local import LocalRuntime

    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "bentoml-stand-in"], start_new_session=True
    )
    try:
        folder = tmp_path / "run" / "demo" / "1.0.0"
        folder.mkdir(parents=True)
        replica = {"pid": proc.pid, "port": 1, "url": "http://127.0.0.1:1", "log": "x", "bento": "demo:1.0.0"}
        (folder / "replica-0.json").write_text(json.dumps(replica))
        runtime = LocalRuntime(tmp_path / "run")
        assert [d.version for d in runtime.list()] == ["1.0.0"]
        drain = threading.Thread(target=runtime.undeploy, args=("demo", "1.0.0"), kwargs={"drain_s": 3.0})
        drain.start()
        deadline = time.monotonic() + 2.5
        while runtime.list() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runtime.list() == [] and alive(proc.pid, b"bentoml")  # off the list, still serving
        drain.join(30)
        assert not drain.is_alive() and not alive(proc.pid, b"bentoml")  # stopped once drained
        assert list(folder.glob("*.json")) == []
    finally:
        proc.kill()
        proc.wait()
