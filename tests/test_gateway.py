"""The gateway's data plane on real processes: a ``fleet gateway`` process in front of stub
model services (real HTTP on 127.0.0.1) that can be made slow, failing or dead on cue."""

from __future__ import annotations

import concurrent.futures
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.gateway_env import BODY, MODEL, GatewayEnv, admin, infer, metric, wait_for


@pytest.fixture
def env(tmp_path: Path):
    created: list[GatewayEnv] = []

    def make(store_url: str | None = None, **policy) -> GatewayEnv:  # noqa: ANN003
        root = tmp_path / f"env{len(created)}"
        root.mkdir()
        e = GatewayEnv(root, store_url, **policy)
        created.append(e)
        return e

    yield make
    for e in created:
        e.stop()


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "inputs": [
                {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": rng.normal(size=4).round(3).tolist()}
            ]
        }
        for _ in range(n)
    ]


@pytest.mark.parametrize("shadow", ["slow", "dead"])
def test_a_slow_or_dead_shadow_leaves_callers_answers_and_latency_unchanged(env, shadow: str) -> None:
    e = env()
    e.register("1.0.0", "2.0.0")
    e.stub("1.0.0")
    if shadow == "slow":
        shadow_url = e.stub("2.0.0", "--delay-ms", "3000")
    else:
        shadow_url = e.stub("2.0.0")
    e.route(stable="1.0.0")
    e.route(shadow="2.0.0", shadow_percent=100)
    key = e.tenant("apps")
    url, _ = e.gateway()
    if shadow == "dead":
        e.procs[-2].kill()  # the shadow's stub: its port now refuses connections
        e.procs[-2].wait()
    bodies = rows(60)
    with httpx.Client(base_url=url, timeout=30) as client:
        served, slowest = [], 0.0
        for body in bodies:
            start = time.monotonic()
            r = infer(client, key, body)
            slowest = max(slowest, time.monotonic() - start)
            assert r.status_code == 200, r.text
            assert r.headers["x-fleet-model-version"] == "1.0.0"
            served.append(r.json()["outputs"][0]["data"])
    from tests.stub_model import probabilities

    expected = [np.ravel(probabilities([b["inputs"][0]["data"]], flip=False)).tolist() for b in bodies]
    assert np.allclose(served, expected, atol=1e-5)  # the stable's answers, untouched
    assert slowest < 1.0  # a caller waiting on a 3 s shadow would take >= 3 s
    outcome = "error" if shadow == "dead" else None
    if outcome:
        wait_for(
            lambda: metric(url, "fleet_shadow_requests_total", version="2.0.0", outcome="error") == 60,
            what="every mirrored request counted as a shadow error",
        )
    else:
        assert httpx.get(f"{shadow_url}/_stats").json()["requests"] > 0  # it was mirrored to


def test_a_working_shadow_records_agreement(env) -> None:
    e = env()
    e.register("1.0.0", "2.0.0", "3.0.0")
    e.stub("1.0.0")
    e.stub("2.0.0")
    e.stub("3.0.0", "--flip")
    e.route(stable="1.0.0")
    e.route(shadow="2.0.0", shadow_percent=100)
    key = e.tenant("apps")
    url, _ = e.gateway()
    with httpx.Client(base_url=url, timeout=30) as client, admin(url) as adm:
        for body in rows(40):
            assert infer(client, key, body).status_code == 200
        wait_for(
            lambda: adm.get(f"/admin/stats/{MODEL}").json()["versions"]["2.0.0"]["shadow_pairs"] == 40,
            what="40 shadow pairs",
        )
        assert adm.get(f"/admin/stats/{MODEL}").json()["versions"]["2.0.0"]["shadow_agreed"] == 40
        assert (
            adm.post(f"/admin/routes/{MODEL}", json={"shadow": "3.0.0", "reason": "a disagreeing shadow"}).status_code
            == 200
        )
        for body in rows(40, seed=1):
            assert infer(client, key, body).status_code == 200
        wait_for(
            lambda: metric(url, "fleet_shadow_requests_total", version="3.0.0", outcome="disagree") == 40,
            what="40 disagreements",
        )


def test_quota_exhaustion_and_recovery(env) -> None:
    e = env()
    e.register("1.0.0")
    e.stub("1.0.0")
    e.route(stable="1.0.0")
    key = e.tenant("small", rps=2, burst=3)
    other = e.tenant("other")
    url, _ = e.gateway()
    with httpx.Client(base_url=url, timeout=30) as client:
        codes = [infer(client, key).status_code for _ in range(6)]
        assert codes[:3] == [200, 200, 200] and 429 in codes[3:]
        refused = next(r for r in (infer(client, key) for _ in range(3)) if r.status_code == 429)
        assert "tenant 'small' is over its quota of 2 requests/s (burst 3)" in refused.json()["error"]
        retry_after = int(refused.headers["retry-after"])
        assert retry_after >= 1
        assert infer(client, other).status_code == 200  # one tenant's quota is not another's
        time.sleep(retry_after)  # the bucket refills at 2 tokens/s: after Retry-After one is there
        assert infer(client, key).status_code == 200
    assert metric(url, "fleet_quota_rejections_total", tenant="small") >= 1


def test_interactive_requests_overtake_batch_ones_under_saturation(env) -> None:
    # batch never ages into interactive here (the fair queue's aging is tested tick by tick)
    e = env(concurrency=1, max_queue=20, timeout_ms=10000, batch_aging_ms=600_000)
    e.register("1.0.0")
    stub = e.stub("1.0.0", "--delay-ms", "2000")  # the first request holds the only slot for 2 s
    e.route(stable="1.0.0")
    key = e.tenant("apps")
    url, _ = e.gateway()
    finished: list[str] = []

    def call(priority: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            r = infer(client, key, **{"X-Fleet-Priority": priority})
            assert r.status_code == 200, r.text
            finished.append(priority)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        batch = [pool.submit(call, "batch") for _ in range(6)]
        wait_for(lambda: metric(url, "fleet_queue_depth", priority="batch") == 5, what="1 batch in flight, 5 queued")
        assert metric(url, "fleet_version_in_flight", version="1.0.0") == 1  # what KEDA's queue_depth adds to the line
        httpx.post(f"{stub}/_control", json={"delay_ms": 50})  # the ones still queued will be quick
        interactive = [pool.submit(call, "interactive") for _ in range(3)]
        wait_for(lambda: metric(url, "fleet_queue_depth", priority="interactive") == 3, what="3 interactive queued")
        for f in batch + interactive:
            f.result()
    # the request in flight finishes, then every interactive one, then the batch ones that waited longer
    assert finished == ["batch"] + ["interactive"] * 3 + ["batch"] * 5, finished
    assert metric(url, "fleet_version_in_flight", version="1.0.0") == 0


def test_a_full_wait_queue_sheds_with_503(env) -> None:
    e = env(concurrency=1, max_queue=2)
    e.register("1.0.0")
    e.stub("1.0.0", "--delay-ms", "300")
    e.route(stable="1.0.0")
    key = e.tenant("apps")
    url, _ = e.gateway()

    def call() -> httpx.Response:
        with httpx.Client(base_url=url, timeout=60) as client:
            return infer(client, key)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: call(), range(8)))
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 3 and 503 in codes
    shed = next(r for r in results if r.status_code == 503)
    assert "saturated" in shed.json()["error"]


def test_cache_hit_and_miss_and_never_for_shadow(env) -> None:
    e = env(cache={"enabled": True, "ttl_s": 60, "max_mib": 1})
    e.register("1.0.0", "2.0.0")
    stable = e.stub("1.0.0")
    shadow = e.stub("2.0.0")
    e.route(stable="1.0.0")
    e.route(shadow="2.0.0", shadow_percent=100)
    key, rival = e.tenant("apps"), e.tenant("rivals")
    url, _ = e.gateway()
    with httpx.Client(base_url=url, timeout=30) as client:
        first = infer(client, key, **{"X-Fleet-Routing-Key": "u1"})
        second = infer(client, key, **{"X-Fleet-Routing-Key": "u1"})
        other = infer(client, key, rows(1, seed=5)[0], **{"X-Fleet-Routing-Key": "u1"})
        # another tenant's same input is not answered from apps' entry: a hit would tell rivals
        # that apps sent it within the last minute
        theirs = [infer(client, rival, **{"X-Fleet-Routing-Key": "u1"}) for _ in range(2)]
    assert [r.headers["x-fleet-cache"] for r in (first, second, other, *theirs)] == [
        "miss",
        "hit",
        "miss",
        "miss",
        "hit",
    ]
    assert first.json()["outputs"] == second.json()["outputs"] == theirs[0].json()["outputs"]
    assert httpx.get(f"{stable}/_stats").json()["requests"] == 3  # the hits never reached the model
    wait_for(lambda: httpx.get(f"{shadow}/_stats").json()["requests"] == 5, what="every request mirrored, hit or not")
    assert metric(url, "fleet_cache_requests_total", result="hit") == 2


def test_a_cache_the_policy_shares_answers_one_tenants_input_for_another(env) -> None:
    e = env(cache={"enabled": True, "ttl_s": 60, "max_mib": 1, "shared": True})
    e.register("1.0.0")
    stable = e.stub("1.0.0")
    e.route(stable="1.0.0")
    keys = [e.tenant("apps"), e.tenant("rivals")]
    url, _ = e.gateway()
    with httpx.Client(base_url=url, timeout=30) as client:
        assert [infer(client, k).headers["x-fleet-cache"] for k in keys] == ["miss", "hit"]
    assert httpx.get(f"{stable}/_stats").json()["requests"] == 1


def test_a_failing_canary_is_retried_on_stable_counted_and_ejected_then_probed_back(env) -> None:
    e = env()
    e.register("1.0.0", "1.1.0")
    e.stub("1.0.0")
    canary = e.stub("1.1.0", "--fail-rate", "1.0")
    e.route(stable="1.0.0")
    e.route(canary="1.1.0", weight=100)
    key = e.tenant("apps")
    url, _ = e.gateway()
    with httpx.Client(base_url=url, timeout=30) as client, admin(url) as adm:
        for i in range(20):
            r = infer(client, key, **{"X-Fleet-Routing-Key": f"k{i}"})
            assert r.status_code == 200 and r.headers["x-fleet-model-version"] == "1.0.0"
        stats = adm.get(f"/admin/stats/{MODEL}").json()["versions"]
        canary_errors = stats["1.1.0"]["errors"]
        assert sum(canary_errors.values()) == stats["1.1.0"]["requests"] == 20  # each counted against the canary
        assert stats["1.0.0"]["requests"] == 20
        hits = httpx.get(f"{canary}/_stats").json()["requests"]
        assert 3 <= hits < 20 and canary_errors["5xx"] == hits  # ejected after 3 failures in a row
        assert canary_errors["unreachable"] == 20 - hits  # ... so the rest went straight to stable
        httpx.post(f"{canary}/_control", json={"fail_rate": 0})  # the canary recovers
        wait_for(
            lambda: infer(client, key).headers["x-fleet-model-version"] == "1.1.0",
            timeout=20,
            what="the recovered canary probed back into service",
        )


def test_a_version_shedding_load_is_asked_again_while_the_deadline_allows(env) -> None:
    url, key, stub = env().one_version()
    with httpx.Client(base_url=url, timeout=30) as client, admin(url) as adm:
        httpx.post(f"{stub}/_control", json={"shed_next": 2})
        assert infer(client, key).status_code == 200  # shed twice, answered the third time
        assert httpx.get(f"{stub}/_stats").json()["requests"] == 3
        assert adm.get(f"/admin/stats/{MODEL}").json()["versions"]["1.0.0"]["errors"]["5xx"] == 0
        httpx.post(f"{stub}/_control", json={"shed_next": 100})
        r = infer(client, key)
        assert r.status_code == 503 and "shed the request" in r.json()["error"]
        assert adm.get(f"/admin/stats/{MODEL}").json()["versions"]["1.0.0"]["errors"]["5xx"] == 1


def test_a_dead_canary_costs_callers_nothing_and_503_only_when_nothing_answers(env) -> None:
    e = env()
    e.register("1.0.0", "1.1.0")
    e.stub("1.0.0")
    e.stub("1.1.0")
    e.route(stable="1.0.0")
    e.route(canary="1.1.0", weight=50)
    key = e.tenant("apps")
    url, _ = e.gateway()
    with httpx.Client(base_url=url, timeout=30) as client:
        e.procs[1].kill()  # the canary dies
        e.procs[1].wait()
        assert all(infer(client, key, **{"X-Fleet-Routing-Key": f"k{i}"}).status_code == 200 for i in range(40))
        e.procs[0].kill()  # and now the stable too
        e.procs[0].wait()
        r = infer(client, key)
        assert r.status_code == 503 and "could be reached" in r.json()["error"]


def test_a_route_change_reaches_two_gateway_processes_within_a_second(env) -> None:
    e = env()
    e.register("1.0.0", "1.1.0")
    e.stub("1.0.0")
    e.stub("1.1.0")
    e.route(stable="1.0.0")
    key = e.tenant("apps")
    (a, _), (b, _) = e.gateway(), e.gateway()
    with httpx.Client(timeout=10) as client, admin(a) as adm:
        for url in (a, b):
            assert (
                client.post(
                    f"{url}/v2/models/{MODEL}/infer", json=BODY, headers={"Authorization": f"Bearer {key}"}
                ).headers["x-fleet-model-version"]
                == "1.0.0"
            )
        from fleet.catalog.routes.store import Router

        Router(e.store).set(MODEL, canary="1.1.0", weight=100, why="canary for everyone")  # a CLI-style change: no push
        changed = time.monotonic()
        seen: dict[str, float] = {}
        while len(seen) < 2 and time.monotonic() - changed < 5:
            for url in (a, b):
                if url not in seen:
                    r = client.post(
                        f"{url}/v2/models/{MODEL}/infer", json=BODY, headers={"Authorization": f"Bearer {key}"}
                    )
                    if r.headers["x-fleet-model-version"] == "1.1.0":
                        seen[url] = time.monotonic() - changed
        assert set(seen) == {a, b} and max(seen.values()) < 1.0, seen  # by polling alone
        r = adm.post(f"/admin/routes/{MODEL}/rollback", json={"reason": "bad canary"})  # pushed to both
        assert r.status_code == 200, r.text
        assert r.json()["to_version"] == "1.0.0" and r.json()["rejected"] == "1.1.0"
        assert sorted(r.json()["gateways_notified"].values()) == [True, True]
        pushed = time.monotonic()
        for url in (a, b):
            wait_for(
                lambda url=url: (
                    client.post(
                        f"{url}/v2/models/{MODEL}/infer", json=BODY, headers={"Authorization": f"Bearer {key}"}
                    ).headers["x-fleet-model-version"]
                    == "1.0.0"
                ),
                timeout=1.0,
                what=f"rollback seen by {url}",
            )
        assert time.monotonic() - pushed < 1.0


def test_the_inference_log_holds_what_was_served_and_a_clean_shutdown_flushes_it(env) -> None:
    e = env(inference_log={"sample_rate": 1.0})
    e.register("1.0.0")
    e.stub("1.0.0")
    e.route(stable="1.0.0")
    key = e.tenant("apps")
    url, proc = e.gateway()
    bodies = [
        {"inputs": [{"name": "features", "shape": [2, 4], "datatype": "FP32", "data": list(range(i, i + 8))}]}
        for i in range(25)
    ]
    with httpx.Client(base_url=url, timeout=30) as client:
        ids = [infer(client, key, b).headers["x-request-id"] for b in bodies]
    proc.send_signal(signal.SIGTERM)  # before the 2 s flush interval is up: all of it is buffered
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a graceful stop
    from datetime import UTC, datetime, timedelta

    from fleet.logs.inference import read_window

    now = datetime.now(UTC)
    frame = read_window(e.store, MODEL, now - timedelta(minutes=5), now + timedelta(minutes=1))
    assert len(frame) == 50  # two rows per request
    assert sorted(set(frame["request_id"])) == sorted(ids)
    assert set(frame["version"]) == {"1.0.0"} and set(frame["tenant"]) == {"apps"}
    first = frame[frame["request_id"] == ids[0]].sort_values("row")
    assert first[["income", "debt_ratio", "age", "tenure"]].to_numpy().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (frame["latency_ms"] > 0).all() and set(frame["prediction"]) <= {0, 1}


def test_a_failed_request_is_logged_with_its_status_and_no_prediction(env) -> None:
    """The log's error rate per version is a query: a sampled request the version failed is a
    row with its status; the readers of answers (monitor, experiments, feedback) skip it."""
    e = env(inference_log={"sample_rate": 1.0})
    e.register("1.0.0")
    e.stub("1.0.0", "--fail-rate", "1.0")
    e.route(stable="1.0.0")
    key = e.tenant("apps")
    url, proc = e.gateway()
    body = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    with httpx.Client(base_url=url, timeout=30) as client:
        codes = [infer(client, key, body).status_code for _ in range(5)]
    assert all(c >= 500 for c in codes), codes
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    from datetime import UTC, datetime, timedelta

    from fleet.logs.reading import read

    now = datetime.now(UTC)
    rows = read(e.store, "inference", MODEL, now - timedelta(minutes=5), now + timedelta(minutes=1))
    assert rows.num_rows == 5 and set(rows.column("status").to_pylist()) == set(codes)
    assert rows.column("prediction").null_count == 5 and rows.column("version").to_pylist() == ["1.0.0"] * 5
    from fleet.logs.inference import read_window

    assert read_window(e.store, MODEL, now - timedelta(minutes=5), now + timedelta(minutes=1)).empty


def test_the_store_going_down_leaves_the_gateway_serving_from_the_last_good_state(env, monkeypatch) -> None:
    import boto3

    from tests.moto_s3 import start_server

    server = start_server()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)  # restored afterwards: other tests have their own
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="fleet-down")
        e = env(store_url="s3://fleet-down/state")
        e.register("1.0.0")
        e.stub("1.0.0")
        e.route(stable="1.0.0")
        key = e.tenant("apps")
        url, _ = e.gateway(AWS_ENDPOINT_URL_S3=endpoint)
        with httpx.Client(base_url=url, timeout=30) as client:
            assert infer(client, key).status_code == 200
            server.stop()  # the store is gone
            wait_for(
                lambda: client.get("/v2/health/ready").json()["routing_state"] == "stale",
                timeout=30,
                what="the gateway to notice the store is down",
            )
            ready = client.get("/v2/health/ready")
            assert ready.status_code == 200 and ready.json()["store_reachable"] is False
            # what failed, and where, is the admin's to read: no bucket or endpoint to anyone else
            assert "fleet-down" not in ready.text and endpoint.split("//")[1] not in ready.text
            assert "admin token" in ready.json()["store_error"]
            with admin(url) as adm:
                shown = adm.get("/v2/health/ready").json()["store_error"]
                assert shown and "admin token" not in shown  # the store's own error, for the operator
            assert all(infer(client, key).status_code == 200 for _ in range(20))
            assert metric(url, "fleet_routing_stale") == 1
    finally:
        server.stop()


def test_admin_api_needs_the_token_and_runs_the_cli_operations(env) -> None:
    e = env()
    e.register("1.0.0", "1.1.0")
    e.stub("1.0.0")
    e.stub("1.1.0")
    e.route(stable="1.0.0")
    url, _ = e.gateway()
    assert httpx.get(f"{url}/admin/models").status_code == 401
    assert httpx.get(f"{url}/admin/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with admin(url) as adm:
        assert [v["version"] for v in adm.get("/admin/models").json()] == ["1.0.0", "1.1.0"]
        made = adm.post("/admin/tenants", json={"name": "newco", "models": [MODEL], "rps": 100})
        assert made.status_code == 201, made.text
        key = made.json()["api_key"]
        r = adm.post(f"/admin/routes/{MODEL}", json={"canary": "1.1.0", "weight": 25})
        assert r.status_code == 422 and "reason" in r.json()["error"]
        r = adm.post(f"/admin/routes/{MODEL}", json={"canary": "1.1.0", "weight": 25, "reason": "try 1.1"})
        assert r.status_code == 200 and r.json()["canary"] == {"version": "1.1.0", "weight": 25.0}
        assert (
            adm.put(f"/admin/routes/{MODEL}/pins/newco", json={"version": "1.1.0", "reason": "early"}).status_code
            == 200
        )
        wait_for(
            lambda: infer(httpx.Client(base_url=url), key).headers.get("x-fleet-model-version") == "1.1.0",
            what="the pinned new tenant served 1.1.0",
        )
        history = adm.get(f"/admin/routes/{MODEL}/history").json()
        assert [h["why"] for h in history if h["kind"] == "route"][-2:] == ["try 1.1", "early"]
        assert {h["who"] for h in history if h["why"] in ("try 1.1", "early")} == {"gateway-test"}
        assert adm.post("/admin/tenants/newco/revoke", json={}).status_code == 200
        wait_for(lambda: infer(httpx.Client(base_url=url), key).status_code == 401, what="the revoked key refused")
        assert (
            adm.post(f"/admin/routes/{MODEL}/rollback", json={"reason": "x", "to_version": "9.9.9"}).status_code == 422
        )


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_a_gateway_leaves_no_decode_worker_behind(env, stop: signal.Signals) -> None:
    """Its decode workers once outlived every gateway; stopped cleanly or killed, they go with it."""
    from fleet.processes import alive, tree

    e = env()
    e.one_version()
    gateway = e.procs[-1]  # the last process started
    wait_for(lambda: len(tree(gateway.pid)) >= 2, timeout=30, what="the decode worker started")
    workers = [p for p in tree(gateway.pid) if p != gateway.pid]
    assert workers and all(alive(p, b"multiprocessing") for p in workers)
    gateway.send_signal(stop)
    gateway.wait(timeout=30)
    wait_for(
        lambda: not any(alive(p, b"multiprocessing") for p in workers),
        timeout=10,
        what=f"the decode workers gone after {stop.name}",
    )
