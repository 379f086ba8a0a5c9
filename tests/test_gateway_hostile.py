"""A hostile tenant against a real gateway process (``fleet gateway`` in front of stub model
services on 127.0.0.1): each finding of the data-plane review, reproduced. Every one of
these failed before the hardening — a 500, a reset connection, a frozen event loop, a
metric per made-up name, another tenant's label joined onto a row, a canary failed on
purpose by a caller.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import numpy as np
import pytest

from fleet.logs import ids
from tests.gateway_env import MODEL, GatewayEnv, admin, infer, metric, scrape, wait_for

ROW = [1.0, 0.0, 0.0, 0.0]
UUID7 = r"[0-9a-f]{8}-[0-9a-f]{4}-7f1[0-9a-f]-[89ab][0-9a-f]{3}-[0-9a-f]{12}"  # the gateway's mark: f1


def v2(data: object, shape: object = (1, 4), datatype: object = "FP32", **extra: object) -> dict:
    tensor = {
        "name": "features",
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "datatype": datatype,
        "data": data,
    }
    return {"inputs": [tensor], **extra}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory):
    """One gateway in front of stable 1.0.0, logging every request, for the input tests."""
    e = GatewayEnv(tmp_path_factory.mktemp("hostile"), inference_log={"sample_rate": 1.0})
    try:
        e.register("1.0.0")
        stub = e.stub("1.0.0")
        e.route(stable="1.0.0")
        keys = {name: e.tenant(name) for name in ("apps", "rivals", "third")}
        url, proc = e.gateway()
        yield {"env": e, "url": url, "stub": stub, "keys": keys, "proc": proc}
    finally:
        e.stop()


@pytest.fixture
def env(tmp_path: Path):
    created: list[GatewayEnv] = []

    def make(**policy) -> GatewayEnv:  # noqa: ANN003
        root = tmp_path / f"env{len(created)}"
        root.mkdir()
        created.append(GatewayEnv(root, **policy))
        return created[-1]

    yield make
    for e in created:
        e.stop()


def post(gw: dict, path: str, body: object, tenant: str | None = "apps", **headers: str) -> httpx.Response:
    if tenant is not None:
        headers["Authorization"] = f"Bearer {gw['keys'][tenant]}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        gw["url"] + path, content=content, headers={"Content-Type": "application/json", **headers}, timeout=30
    )


INFER = f"/v2/models/{MODEL}/infer"
HOSTILE = [
    # (name, path, body, headers, status, message)
    ("nulls", INFER, v2([None] * 4), {}, 422, "holds null at data[0]; expected FP32 values"),
    (
        "a NaN literal",
        INFER,
        b'{"inputs":[{"name":"features","shape":[1,4],"datatype":"FP32","data":[NaN,1,1,1]}]}',
        {},
        400,
        "not valid JSON",
    ),
    ("1e39 for FP32", INFER, v2([1e39, 0, 0, 0]), {}, 422, "holds 1e+39, out of range for FP32"),
    ("-1e39 as FP64 for FP32", INFER, v2([0, -1e39, 0, 0], datatype="FP64"), {}, 422, "out of range for FP32"),
    ("strings", INFER, v2(["1", "2", "3", "4"]), {}, 422, "holds '1' at data[0]"),
    ("booleans", INFER, v2([True, False, True, False]), {}, 422, "holds True at data[0]"),
    ("a shape whose product overflows", INFER, v2([], shape=(2**62, 4)), {}, 413, "has 4611686018427387904 rows"),
    ("more rows than max_rows", INFER, v2([0.5] * 4 * 10_001, shape=(10_001, 4)), {}, 413, "at most 10000 per request"),
    ("zero rows", INFER, v2([], shape=(0, 4)), {}, 422, "has no rows"),
    ("too few values", INFER, v2([0.0] * 8, shape=(3, 4)), {}, 422, "has 8 values; shape [3, 4] needs 12"),
    ("ragged rows", INFER, v2([[1, 2, 3, 4], [1]], shape=(2, 4)), {}, 422, "not a rectangular list"),
    ("nesting past JSON's depth", INFER, b'{"inputs":' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400, "not valid JSON"),
    ("a negative dimension", INFER, v2(ROW, shape=[1, -4]), {}, 400, "expected a list of 1 to 8 non-negative integers"),
    ("a boolean dimension", INFER, v2(ROW, shape=[True, 4]), {}, 400, "non-negative integers"),
    ("an unknown datatype", INFER, v2(ROW, datatype="FP128"), {}, 400, "expected an OIP datatype"),
    ("inputs not a list", INFER, {"inputs": "features"}, {}, 400, 'no "inputs" list'),
    ("an input that is not an object", INFER, {"inputs": [1]}, {}, 400, "inputs[0] is 1"),
    ("an unknown input", INFER, {"inputs": [{**v2(ROW)["inputs"][0], "name": "x" * 5000}]}, {}, 400, "inputs[0].name"),
    ("an input given twice", INFER, {"inputs": v2(ROW)["inputs"] * 2}, {}, 422, "given twice"),
    ("an id that is not a string", INFER, v2(ROW, id={"a": 1}), {}, 400, '"id" is a JSON object'),
    ("parameters that are not an object", INFER, v2(ROW, parameters=[1]), {}, 400, '"parameters" is a JSON list'),
    ("a routing key of 1000 characters", INFER, v2(ROW), {"X-Fleet-Routing-Key": "k" * 1000}, 400, "at most 256"),
    (
        "a routing key object in parameters",
        INFER,
        v2(ROW, parameters={"routing_key": {"x": 1}}),
        {},
        400,
        "parameters.routing_key is a JSON dict",
    ),
    ("an unknown priority", INFER, v2(ROW), {"X-Fleet-Priority": "urgent"}, 400, "priority 'urgent' is not known"),
    ("a timeout that is not a number", INFER, v2(ROW), {"X-Fleet-Timeout-Ms": "soon"}, 400, "not a number"),
    ("a NaN timeout", INFER, v2(ROW), {"X-Fleet-Timeout-Ms": "nan"}, 400, "expected a positive number of milliseconds"),
    ("a negative timeout", INFER, v2(ROW), {"X-Fleet-Timeout-Ms": "-1"}, 400, "expected a positive number"),
    (
        "a timeout too short",
        INFER,
        v2(ROW),
        {"X-Fleet-Timeout-Ms": "0.01"},
        400,
        "min_timeout_ms 50; expected at least",
    ),
    ("a JSON list body", INFER, [1, 2], {}, 400, "is a JSON list; expected a JSON object"),
    ("a body over 4 MiB", INFER, b" " * (4 * 1024 * 1024 + 1), {}, 413, "over the limit of 4194304 bytes"),
    (
        "v1 nulls",
        f"/v1/models/{MODEL}:predict",
        {"instances": [[None, 1, 1, 1]]},
        {},
        422,
        "holds null at instances[0][0]",
    ),
    ("v1 too many rows", f"/v1/models/{MODEL}:predict", {"instances": [ROW] * 10_001}, {}, 413, "at most 10000"),
    ("v1 strings", f"/v1/models/{MODEL}:predict", {"instances": ["abcd"]}, {}, 422, "holds 'abcd' at instances[0]"),
]


def test_hostile_bodies_get_a_4xx_that_says_what_was_wrong_and_never_reach_the_model(gw: dict) -> None:
    asked_before = httpx.get(f"{gw['stub']}/_stats").json()["requests"]
    failures = []
    for name, path, body, headers, status, message in HOSTILE:
        r = post(gw, path, body, **headers)
        if r.status_code != status or message not in r.json().get("error", ""):
            failures.append(f"{name}: {r.status_code} {r.text[:300]}")
        assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"]
    assert failures == []
    assert httpx.get(f"{gw['stub']}/_stats").json()["requests"] == asked_before  # nothing reached the model
    with admin(gw["url"]) as adm:
        errors = adm.get(f"/admin/stats/{MODEL}").json()["versions"].get("1.0.0", {}).get("errors", {})
    assert sum(errors.values()) == 0  # and nothing was counted against the version
    assert httpx.get(f"{gw['url']}/v2/health/live").status_code == 200


def test_feedback_refuses_labels_outside_the_models_classes_and_integer_range(gw: dict) -> None:
    rid = post(gw, INFER, v2(ROW)).headers["x-request-id"]
    for label, row, message in [
        (7, 0, "label is 7; expected a class of this model, 0 to 1"),
        (-5, 0, "label is -5; expected a class"),
        (2**63, 0, "label is 9223372036854775808"),
        (1, 2**40, "row is 1099511627776"),
        ("1", 0, "expected the true class as an integer"),
    ]:
        r = post(gw, "/v1/feedback", {"model": MODEL, "feedback": [{"request_id": rid, "label": label, "row": row}]})
        assert r.status_code == 422 and message in r.json()["error"], r.text
    r = post(gw, "/v1/feedback", {"model": MODEL, "feedback": [{"request_id": "a b/../c", "label": 1}]})
    assert r.status_code == 422 and "request_id is 'a b/../c'" in r.json()["error"]
    r = post(gw, "/v1/feedback", {"model": MODEL, "feedback": [{"request_id": rid, "label": 1}]})
    assert r.status_code == 200 and r.json()["accepted"] == 1
    # a large feedback body is decoded off the event loop like an inference body, and its limits hold there too
    many = [{"request_id": f"r{i:031d}", "label": i % 2} for i in range(10_001)]
    r = post(gw, "/v1/feedback", {"model": MODEL, "feedback": many})
    assert r.status_code == 413 and "has 10001 labels; at most 10000" in r.json()["error"], r.text
    r = post(gw, "/v1/feedback", {"model": MODEL, "feedback": [*many[:9_999], {"request_id": rid, "label": 9}]})
    assert r.status_code == 422 and "feedback[9999].label is 9" in r.json()["error"], r.text


def test_a_model_the_tenant_may_not_use_looks_exactly_like_one_that_does_not_exist(gw: dict) -> None:
    from fleet.catalog.tenants import Tenants

    e = gw["env"]
    _, key = Tenants(e.store).create("elsewhere", {"other-model": ["*"]})
    wait_for(
        lambda: httpx.get(f"{gw['url']}/v2/models/nope", headers={"Authorization": f"Bearer {key}"}).status_code == 404,
        what="the new tenant known",
    )
    answers = []
    for model in (MODEL, "no-such-model"):
        for method, path, body in [
            ("GET", f"/v2/models/{model}", None),
            ("GET", f"/v2/models/{model}/ready", None),
            ("POST", f"/v2/models/{model}/infer", v2(ROW)),
            ("POST", "/v1/feedback", {"model": model, "feedback": [{"request_id": "r", "label": 1}]}),
        ]:
            r = httpx.request(method, gw["url"] + path, json=body, headers={"Authorization": f"Bearer {key}"})
            answers.append((r.status_code, r.json()["error"].replace(model, "<m>")))
    assert answers[:4] == answers[4:] and {s for s, _ in answers} == {404}


def test_unauthenticated_requests_to_made_up_names_leave_metrics_the_same_size(gw: dict) -> None:
    """300 such requests once grew /metrics from 34 KB to 2.4 MB, never freed."""
    from prometheus_client.parser import text_string_to_metric_families

    def series() -> set[tuple]:
        text = scrape(gw["url"])
        return {
            (s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(text) for s in f.samples
        }

    rng = random.Random(7)
    names = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz-", k=rng.randint(1, 40))) for _ in range(1000)]
    with httpx.Client(base_url=gw["url"], timeout=30) as client:
        for name in names[:5]:  # the first of each kind creates its series once
            client.post(f"/v2/models/{name}/infer", json=v2(ROW))
            client.post(f"/v2/models/{name}/infer", json=v2(ROW), headers={"Authorization": "Bearer sfk_bogus_key"})
            client.get(f"/v2/models/{name}", headers={"Authorization": f"Bearer {gw['keys']['apps']}"})
        wait_for(
            lambda: metric(gw["url"], "fleet_buffer_bytes", buffer="inference_log") == 0,
            timeout=15,
            what="earlier tests' log rows written (their series made)",
        )
        wait_for(  # sampled once a second from the routing snapshot: its series is made by the first sample
            lambda: metric(gw["url"], "fleet_version_replica_seconds_total") > 0,
            timeout=15,
            what="the replica-seconds series sampled",
        )
        before = series()
        size = len(scrape(gw["url"]))
        for name in names[5:]:
            assert client.post(f"/v2/models/{name}/infer", json=v2(ROW)).status_code == 401
            client.post(f"/v1/models/{name}:predict", json={"instances": [ROW]}, headers={"Authorization": "Bearer x"})
            client.get(
                f"/v2/models/{name}/versions/9.9.{rng.randint(0, 99)}",
                headers={"Authorization": f"Bearer {gw['keys']['apps']}"},
            )
    assert series() == before
    assert len(scrape(gw["url"])) < size + 2000  # only counters' digits grew
    assert metric(gw["url"], "fleet_auth_failures_total", surface="inference") >= 2 * 995


def test_request_ids_are_unguessable_and_a_clients_id_is_scoped_to_its_tenant(gw: dict) -> None:
    before = time.time()
    made = [post(gw, INFER, v2(ROW)).headers["x-request-id"] for _ in range(50)]
    assert all(re.fullmatch(UUID7, rid) for rid in made) and len(set(made)) == 50
    # UUIDv7: the time (what a label's lookup needs) and then 66 random bits, not a process prefix and a counter
    assert all(before - 1 <= ids.time_of(rid) <= time.time() + 1 for rid in made)
    assert len({rid[-12:] for rid in made}) == 50
    for hostile in (b"a b", b"x" * 129, b"../../etc", "ümlaut".encode()):  # not a plain token: replaced, never echoed
        given = post(gw, INFER, v2(ROW), **{"X-Request-Id": hostile}).headers["x-request-id"]
        assert re.fullmatch(UUID7, given), given

    same = "order-4711"
    mine = post(gw, INFER, v2([1, 0, 0, 0]), "apps", **{"X-Request-Id": same})
    theirs = post(gw, INFER, v2([-1, 1, 0, 0]), "rivals", **{"X-Request-Id": same})
    assert mine.headers["x-request-id"] == theirs.headers["x-request-id"] == same
    for tenant, label in (("apps", 1), ("rivals", 0)):  # each labels its own request; neither overwrites the other
        r = post(gw, "/v1/feedback", {"model": MODEL, "feedback": [{"request_id": same, "label": label}]}, tenant)
        assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    r = post(gw, "/v1/feedback", {"model": MODEL, "feedback": [{"request_id": same, "label": 1}]}, "third")
    assert r.status_code == 404 and r.json()["unknown"] == [{"request_id": same, "row": 0}]  # learns nothing

    from fleet.logs.feedback import labelled

    e = gw["env"]
    wait_for(lambda: any(True for _ in e.store.list("logs/staging/inference/")), timeout=15, what="the log flushed")
    now = datetime.now(UTC)

    def joined() -> dict:
        frame = labelled(e.store, MODEL, now - timedelta(hours=1), now + timedelta(minutes=1))
        rows = frame[frame["request_id"] == same]
        return {(r.tenant, float(r.income)): r.label for r in rows.itertuples()}

    wait_for(lambda: len(joined()) == 2, timeout=15, what="both requests in the log")
    assert joined() == {("apps", 1.0): 1, ("rivals", -1.0): 0}  # each label on its own tenant's row


def test_a_caller_error_is_passed_on_and_never_blamed_on_the_version(env) -> None:
    url, key, stub = env().one_version()
    with httpx.Client(base_url=url, timeout=30) as client, admin(url) as adm:
        assert infer(client, key, v2([1e39, 0, 0, 0])).status_code == 422  # refused here: never sent upstream as null
        httpx.post(f"{stub}/_control", json={"reject_next": 3})
        for _ in range(3):
            r = infer(client, key)
            assert r.status_code == 400 and "refused the input: HTTP 400" in r.json()["error"]
        assert infer(client, key).status_code == 200
        stats = adm.get(f"/admin/stats/{MODEL}").json()["versions"]["1.0.0"]
        assert sum(stats["errors"].values()) == 0 and stats["requests"] == 1
    assert metric(url, "fleet_upstream_rejections_total", version="1.0.0") == 3


def test_a_model_answering_nan_is_the_models_failure_not_the_gateways(env) -> None:
    url, key, stub = env().one_version()
    httpx.post(f"{stub}/_control", json={"nan": True})
    with httpx.Client(base_url=url, timeout=30) as client, admin(url) as adm:
        r = infer(client, key)
        assert r.status_code == 502 and "answered non-finite values" in r.json()["error"], r.text
        assert adm.get(f"/admin/stats/{MODEL}").json()["versions"]["1.0.0"]["errors"]["5xx"] == 1
        httpx.post(f"{stub}/_control", json={"nan": False})
        assert infer(client, key).status_code == 200


def test_a_failed_stable_request_is_never_sent_to_the_canary(env) -> None:
    from fleet.catalog.routes.table import Canary, RouteTable, choose_version

    e = env()
    e.register("1.0.0", "1.1.0")
    stable = e.stub("1.0.0", "--fail-rate", "1.0")
    canary = e.stub("1.1.0")
    e.route(stable="1.0.0")
    e.route(canary="1.1.0", weight=30)
    key = e.tenant("apps")
    url, _ = e.gateway()
    table = RouteTable(model=MODEL, stable="1.0.0", canary=Canary(version="1.1.0", weight=30))
    keys = [f"user-{i}" for i in range(60)]
    to_canary = {k for k in keys if choose_version(table, None, k).version == "1.1.0"}
    with httpx.Client(base_url=url, timeout=30) as client:
        codes = {k: infer(client, key, **{"X-Fleet-Routing-Key": k}).status_code for k in keys}
    assert {k for k, c in codes.items() if c == 200} == to_canary
    assert {c for k, c in codes.items() if k not in to_canary} == {503}  # the stable's error, not a canary answer
    assert httpx.get(f"{canary}/_stats").json()["requests"] == len(to_canary)
    assert httpx.get(f"{stable}/_stats").json()["requests"] >= 1


def test_the_admin_api_refuses_hostile_input_and_counts_failed_logins(gw: dict) -> None:
    url = gw["url"]
    for _ in range(3):
        assert httpx.get(f"{url}/admin/models", headers={"Authorization": "Bearer guess"}).status_code == 401
    assert metric(url, "fleet_auth_failures_total", surface="admin") >= 3
    with admin(url) as adm:
        cases = [
            (adm.post(f"/admin/routes/{'m' * 5000}", json={"stable": "1.0.0", "reason": "x"}), 422, "model name 'mmmm"),
            (adm.get(f"/admin/models/{MODEL}/versions/{'9' * 3000}"), 422, "not a semantic version"),
            (
                adm.post(f"/admin/routes/{MODEL}", json={"clear_canary": "false", "reason": "x"}),
                422,
                "clear_canary: got 'false'",
            ),
            (adm.post(f"/admin/routes/{MODEL}", json={"weight": "50", "reason": "x"}), 422, "weight: got '50'"),
            (
                adm.post(f"/admin/routes/{MODEL}", json={"weight": 50, "reason": "x", "why": "y"}),
                422,
                "unknown key 'why'",
            ),
            (adm.post(f"/admin/routes/{MODEL}", json={"weight": 50, "reason": "   "}), 422, "reason: got '   '"),
            (
                adm.post(f"/admin/routes/{MODEL}", content=b'{"reason": "' + b"x" * 70_000 + b'"}'),
                413,
                "over the limit",
            ),
            (
                adm.post("/admin/tenants", content=b'{"name": "t", "models": ["stub-model"], "rps": 1e309}'),
                400,
                "not valid JSON",
            ),
            (
                adm.post("/admin/tenants", content=b'{"name": "t", "models": ["stub-model"], "rps": "inf"}'),
                422,
                "rps: got 'inf'",
            ),
            (adm.post("/admin/tenants", json={"name": "t", "models": [MODEL], "burst": 2**70, "rps": 1}), 422, "burst"),
            (adm.post("/admin/tenants", json={"name": "t", "models": [MODEL], "weight": 0}), 422, "weight"),
            (adm.post("/admin/tenants", json={"name": "t", "models": [MODEL], "weight": "inf"}), 422, "weight"),
            (adm.post("/admin/tenants", json={"name": "t", "models": [MODEL], "weight": 1e6}), 422, "weight"),
            (
                adm.post("/admin/tenants", json={"name": "t", "models": [MODEL], "rps": 1, "concurrency": 0}),
                422,
                "concurrency",
            ),
            (adm.post("/admin/tenants", json={"name": "t", "models": [MODEL], "concurrency": 4}), 422, "without rps"),
            (adm.get(f"/admin/stats/{MODEL}", params={"window_s": "-5"}), 400, "whole number of seconds"),
        ]
        for r, status, message in cases:
            assert r.status_code == status and message in r.json()["error"], r.text


def test_large_requests_never_hold_the_event_loop(env) -> None:
    """While one tenant sends maximum-size requests as fast as it can (valid ones of 10,000
    rows, over-limit and malformed ones of ~4 MiB), the liveness probe answers within 100 ms
    and another tenant's small requests are all served. Ten 60,000-row requests once froze
    the loop for 24 s."""
    e = env(inference_log={"sample_rate": 1.0}, max_queue=1000)
    e.register("1.0.0")
    e.stub("1.0.0")
    e.route(stable="1.0.0")
    flooder, victim = e.tenant("flooder"), e.tenant("victim")
    url, _ = e.gateway()
    rng = np.random.default_rng(0)
    biggest = json.dumps(v2(rng.normal(size=40_000).round(4).tolist(), shape=(10_000, 4))).encode()
    over = json.dumps(v2(rng.normal(size=240_000).round(4).tolist(), shape=(60_000, 4))).encode()[: 4 * 1024 * 1024]
    malformed = b'{"inputs":[{"name":"features","shape":[100000,4],"datatype":"FP32","data":[' + b"1.5," * 1_000_000
    bodies = [biggest, over, malformed[: 4 * 1024 * 1024]]
    stop = threading.Event()
    flood_codes: list[int] = []

    def flood(i: int) -> None:
        with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {flooder}"}) as client:
            n = i
            while not stop.is_set():
                flood_codes.append(client.post(f"/v2/models/{MODEL}/infer", content=bodies[n % 3]).status_code)
                n += 1

    probes: list[float] = []
    victims: list[tuple[int, float]] = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(flood, i) for i in range(3)]
        wait_for(lambda: len(flood_codes) >= 6, timeout=60, what="the flood under way")
        with httpx.Client(base_url=url, timeout=30) as client:
            # at least 60 probes and 3 s of flood: the loop watch (a tick per 20 ms) then
            # samples > 100 ticks of it however fast this machine answers
            until = time.monotonic() + 3.0
            i = 0
            while i < 60 or time.monotonic() < until:
                i += 1
                t0 = time.monotonic()
                assert client.get("/v2/health/live").status_code == 200
                probes.append(time.monotonic() - t0)
                t0 = time.monotonic()
                r = infer(client, victim, v2([(i % 60) / 60, 0, 0, 0]))
                victims.append((r.status_code, time.monotonic() - t0))
                time.sleep(0.02)
        stop.set()
        for job in jobs:
            job.result()
    # The gateway never held its loop for 100 ms (what it computed, measured by itself: on a
    # machine too busy to schedule it, wall-clock lateness is the machine's, not the loop's) ...
    from prometheus_client.parser import text_string_to_metric_families

    held = {
        s.labels.get("le", s.name): s.value
        for f in text_string_to_metric_families(scrape(url))
        for s in f.samples
        if s.name.startswith("fleet_event_loop_held_seconds")
    }  # one scrape
    assert (
        held["fleet_event_loop_held_seconds_count"] > 100 and held["0.1"] == held["fleet_event_loop_held_seconds_count"]
    )
    # ... so the probe always answered, and far inside a kubelet's 1 s probe timeout
    assert max(probes) < 1.0 and sorted(probes)[len(probes) // 2] < 0.1, f"liveness answers: {sorted(probes)[-5:]}"
    assert {code for code, _ in victims} == {200}
    assert set(flood_codes) <= {200, 400, 413, 429} and 413 in flood_codes
    # in the flood the valid 10,000-row bodies may always meet the tenant's others in flight
    # (429, its share of the body budget: how often depends on the machine's speed); alone, one is served
    alone = httpx.post(
        f"{url}/v2/models/{MODEL}/infer", content=biggest, headers={"Authorization": f"Bearer {flooder}"}, timeout=60
    )
    assert alone.status_code == 200, alone.text
    # the flooder has no quota: each 429 it got was its share of large bodies, and counted as such
    assert metric(url, "fleet_decode_refusals_total", scope="tenant") == flood_codes.count(429)


def test_a_client_that_leaves_mid_body_is_counted_499_not_as_the_gateway_s_500(gw: dict) -> None:
    import socket

    host, port = gw["url"].removeprefix("http://").split(":")
    key = gw["keys"]["third"]
    before_500 = metric(gw["url"], "fleet_requests_total", tenant="third", code="500")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(
                f"POST {INFER} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"inputs":'.encode()
            )
    wait_for(
        lambda: metric(gw["url"], "fleet_requests_total", tenant="third", code="499") == 3,
        what="three requests counted as the client's leaving (499)",
    )
    assert metric(gw["url"], "fleet_requests_total", tenant="third", code="500") == before_500
    assert post(gw, INFER, v2([1.0, 0.0, 0.0, 0.0]), tenant="third").status_code == 200


def test_metrics_name_tenants_so_they_need_the_scrape_or_the_admin_token(gw: dict) -> None:
    """/metrics shows every tenant's name, traffic and cost and every version: not to a caller
    with no token or an inference key, only to Prometheus's scrape token or the admin's."""
    url, before = gw["url"], metric(gw["url"], "fleet_auth_failures_total", surface="metrics")
    for headers in ({}, {"Authorization": f"Bearer {gw['keys']['apps']}"}, {"Authorization": "Bearer x"}):
        r = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
        assert r.status_code == 401 and "expected the scrape token" in r.json()["error"], r.text
        assert "rivals" not in r.text and "fleet_requests_total" not in r.text
    assert "fleet_requests_total" in scrape(url)  # the scrape token
    with admin(url) as adm:
        assert "fleet_requests_total" in adm.get("/metrics").text  # the admin token
    assert metric(url, "fleet_auth_failures_total", surface="metrics") == before + 3
