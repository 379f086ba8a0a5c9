"""Tensors reach the model as tensors (issue 13, upstream encoding).

The gateway sends a request's features to ``POST /predict_tensor`` as raw little-endian bytes
described by ``X-Fleet-Datatype`` and ``X-Fleet-Shape``, and reads the answer the same way;
a replica without that route (404, 405, 415) is sent the same request as JSON at once and
JSON from then on, and that probe is never counted against it. Here: the decoding of tensor
answers (pure, and in the decode worker), then real processes — a ``fleet gateway`` in
front of ``tests/stub_model.py`` replicas, one with the route and one started
``--json-only`` — called over JSON, Triton's binary extension and gRPC, with faults on each
route; last, the demo Bento under a real ``bentoml serve``, directly and behind a gateway.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import re
import time
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import orjson
import pytest

from fleet.catalog.routes.store import Router
from fleet.gateway.answers import BadAnswer, TensorAnswer, decode_answer
from fleet.gateway.body import Decoder
from fleet.gateway.grpc_codec import pb, pb_grpc  # first: loads tritonclient's protos (see _load_service)
from fleet.gateway.upstream import Upstreams
from fleet.store import open_store
from tests.gateway_env import MODEL, GatewayEnv, admin, metric, wait_for
from tests.serving_env import FleetEnv
from tests.test_grpc import start_gateway

REF = "m:1"
RESET = {"fail_rate": 0.0, "nan": False, "shed_next": 0, "reject_next": 0, "truncate": False}


def sample(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 4)).astype(np.float32)


def tensor_answer(array: np.ndarray, datatype: str = "FP32", shape: str | None = None) -> TensorAnswer:
    raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return TensorAnswer(raw, datatype.encode(), (shape or ",".join(map(str, array.shape))).encode())


# -- tensor answers, pure -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, datatype",
    [(np.float32, "FP32"), (np.float64, "FP64"), (np.float16, "FP16"), (np.int64, "INT64"), (np.uint8, "UINT8")],
)
def test_a_tensor_answer_decodes_to_what_its_json_twin_does(dtype: type, datatype: str) -> None:
    values = (np.random.default_rng(1).uniform(0, 100, size=(3, 2))).astype(dtype)
    got = decode_answer(tensor_answer(values, datatype), REF, 3)
    assert got.dtype == np.float32 and got.shape == (3, 2)
    np.testing.assert_array_equal(got, decode_answer(orjson.dumps(values.tolist()), REF, 3))


def test_a_one_dimensional_tensor_answer_is_one_column_as_a_flat_json_list_is() -> None:
    values = np.array([0.1, 0.2, 0.3], np.float32)
    got = decode_answer(tensor_answer(values), REF, 3)
    assert got.shape == (3, 1)
    np.testing.assert_array_equal(got, decode_answer(b"[0.1, 0.2, 0.3]", REF, 3))


GOOD = np.array([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]], np.float32)
RAW = GOOD.astype("<f4").tobytes()


@pytest.mark.parametrize(
    "answer, message",
    [
        (TensorAnswer(RAW, None, b"3,2"), "answered application/octet-stream without X-Fleet-Datatype; expected both"),
        (
            TensorAnswer(RAW, b"FP32", None),
            "without X-Fleet-Shape; expected both (e.g. X-Fleet-Datatype: FP32, X-Fleet-Shape: 3,2)",
        ),
        (TensorAnswer(RAW, None, None), "without X-Fleet-Datatype and X-Fleet-Shape"),
        (
            TensorAnswer(RAW[:6], b"BOOL", b"3,2"),
            "answered X-Fleet-Datatype: 'BOOL'; expected a numeric OIP datatype (UINT8",
        ),
        (TensorAnswer(RAW, b"BYTES", b"3,2"), "answered X-Fleet-Datatype: 'BYTES'; expected a numeric OIP datatype"),
        (TensorAnswer(RAW, b"FP32", b"3,2,1"), "answered X-Fleet-Shape: '3,2,1'; expected [rows] or [rows, columns]"),
        (TensorAnswer(RAW, b"FP32", b"3x2"), "answered X-Fleet-Shape: '3x2'; expected [rows] or [rows, columns]"),
        (TensorAnswer(RAW, b"FP32", b"-3,2"), "answered X-Fleet-Shape: '-3,2'"),
        (TensorAnswer(RAW, b"FP32", b""), "answered X-Fleet-Shape: ''"),
        (
            TensorAnswer(RAW[:-4], b"FP32", b"3,2"),
            "answered 20 bytes; its shape [3, 2] of FP32 needs 24 (6 values × 4 bytes",
        ),
        (
            TensorAnswer(RAW, b"FP32", b"999999999999999999,999999999999999999"),
            "answered 24 bytes; its shape [999999999999999999",
        ),
        (
            TensorAnswer(RAW[:16], b"FP32", b"2,2"),
            "answered shape [2, 2] for 3 input rows; expected one row per input row",
        ),
        (TensorAnswer(RAW, b"FP32", b"6"), "answered shape [6] for 3 input rows"),
        (tensor_answer(np.array([[0.5, np.nan], [0.5, 0.5], [0.5, 0.5]], np.float32)), "answered non-finite values"),
        (tensor_answer(np.array([[1e39, 0.0]] * 3, np.float64), "FP64"), "answered non-finite values"),  # not an FP32
    ],
)
def test_a_malformed_tensor_answer_is_the_versions_failure_saying_what_was_wrong(
    answer: TensorAnswer, message: str
) -> None:
    with pytest.raises(BadAnswer, match=re.escape(message)) as info:
        decode_answer(answer, REF, 3)
    assert str(info.value).startswith(f"{REF} answered") and info.value.status == 502 and info.value.kind == "5xx"


def test_a_large_tensor_answer_is_decoded_in_the_decode_worker_and_its_errors_come_back() -> None:
    """What the gateway's decoder does with an answer over its inline limit: the answer and
    its headers cross to the worker process as one value, and a refusal crosses back."""
    rows = 20_000  # 160 KB of FP32: over the 64 KiB decoded on the event loop
    values = np.random.default_rng(2).uniform(size=(rows, 2)).astype(np.float32)
    answer = tensor_answer(values)
    assert len(answer) == values.nbytes and pickle.loads(pickle.dumps(answer)) == answer
    decoder = Decoder(1)
    decoder.start()
    try:
        assert len(answer) > decoder.inline_bytes
        np.testing.assert_array_equal(asyncio.run(decoder.answer(answer, REF, rows)), values)
        broken = TensorAnswer(answer.raw[:-4], answer.datatype, answer.shape)
        with pytest.raises(BadAnswer, match=f"answered {values.nbytes - 4} bytes"):
            asyncio.run(decoder.answer(broken, REF, rows))
    finally:
        decoder.close()


# -- the gateway in front of stub services --------------------------------------------------------------


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Stable 1.0.0 on a stub with the tensor route; 1.1.0 (canary at 0 %: reached by version
    path only) on a stub started ``--json-only``; a gateway that also speaks gRPC."""
    env = GatewayEnv(tmp_path_factory.mktemp("tensor"))
    try:
        env.register("1.0.0", "1.1.0")
        tensor = env.stub("1.0.0")
        legacy = env.stub("1.1.0", "--json-only")
        env.route(stable="1.0.0")
        env.route(canary="1.1.0", weight=0)
        key = env.tenant("apps")
        url, address, _ = start_gateway(env)
        yield {"env": env, "url": url, "grpc": address, "key": key, "tensor": tensor, "legacy": legacy}
    finally:
        env.stop()


def routes(stub: str) -> dict[str, int]:
    """The POSTs a stub was sent, by path (a probe of its missing route included)."""
    return httpx.get(f"{stub}/_stats", timeout=5).json()["routes"]


def infer_path(gw: dict, version: str | None) -> str:
    return gw["url"] + f"/v2/models/{gw.get('model', MODEL)}" + (f"/versions/{version}" if version else "") + "/infer"


def via_json(gw: dict, x: np.ndarray, version: str | None = None) -> httpx.Response:
    body = {"inputs": [{"name": "features", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    return httpx.post(infer_path(gw, version), json=body, headers={"Authorization": f"Bearer {gw['key']}"}, timeout=30)


def via_binary(gw: dict, x: np.ndarray, version: str | None = None) -> httpx.Response:
    """Triton's binary extension: a JSON header, then the input's raw bytes."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "features",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ]
        }
    ).encode()
    headers = {"Authorization": f"Bearer {gw['key']}", "Inference-Header-Content-Length": str(len(header))}
    return httpx.post(infer_path(gw, version), content=header + x.astype("<f4").tobytes(), headers=headers, timeout=30)


def via_grpc(gw: dict, x: np.ndarray) -> np.ndarray:
    tensor = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(x.shape))
    message = pb.ModelInferRequest(model_name=MODEL, inputs=[tensor], raw_input_contents=[x.astype("<f4").tobytes()])
    with grpc.insecure_channel(gw["grpc"]) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            message, metadata=(("authorization", f"Bearer {gw['key']}"),), timeout=30
        )
    out = response.outputs[0]
    return np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(list(out.shape))


def answered(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


@pytest.mark.parametrize("rows", [1, 256])
def test_json_binary_and_grpc_requests_reach_the_model_as_tensors(gw: dict, rows: int) -> None:
    x = sample(rows, seed=rows)
    before = routes(gw["tensor"])
    got = {"json": answered(via_json(gw, x)), "binary": answered(via_binary(gw, x)), "grpc": via_grpc(gw, x)}
    after = routes(gw["tensor"])
    assert after["/predict_tensor"] - before.get("/predict_tensor", 0) == 3  # one each, as tensors ...
    assert after.get("/predict", 0) == before.get("/predict", 0)  # ... and none as JSON
    model = httpx.post(f"{gw['tensor']}/predict", json={"features": x.tolist()}, timeout=10).json()
    for protocol, answer in got.items():  # what the model's JSON route says, to the bit
        assert answer.shape == (rows, 2), protocol
        np.testing.assert_array_equal(answer, np.asarray(model, np.float32), err_msg=protocol)
    np.testing.assert_array_equal(got["json"], answered(via_json(gw, x, "1.1.0")))  # the JSON-only version agrees


def test_a_json_only_service_is_probed_once_and_never_blamed_for_it(tmp_path) -> None:  # noqa: ANN001
    """The first request to a replica without /predict_tensor meets a 404 there and is sent
    again as JSON; every later one goes as JSON. The caller never sees the probe, and the
    version's error counts stay at zero."""
    env = GatewayEnv(tmp_path)
    try:
        env.register("1.0.0")
        stub = env.stub("1.0.0", "--json-only")
        env.route(stable="1.0.0")
        gw = {"key": env.tenant("apps")}
        gw["url"], _ = env.gateway()
        x = sample(8, seed=4)
        answers = [answered(via_json(gw, x)) for _ in range(4)] + [answered(via_binary(gw, x)) for _ in range(2)]
        assert routes(stub) == {"/predict_tensor": 1, "/predict": 6}  # one probe, then JSON only
        for answer in answers:
            np.testing.assert_array_equal(answer, answers[0])
        assert metric(gw["url"], "fleet_version_errors_total", version="1.0.0") == 0
        with admin(gw["url"]) as adm:
            stats = adm.get(f"/admin/stats/{MODEL}").json()["versions"]["1.0.0"]
        assert stats["requests"] == 6 and sum(stats["errors"].values()) == 0
    finally:
        env.stop()


@pytest.mark.parametrize("json_only", [False, True], ids=["tensor", "json-only"])
def test_upstreams_remember_which_encoding_each_replica_takes(tmp_path, json_only: bool) -> None:  # noqa: ANN001
    """The probe's 404 is not a failure: the replica keeps zero failures and is not ejected."""
    env = GatewayEnv(tmp_path)
    stub = env.stub("1.0.0", *(["--json-only"] if json_only else []))
    x = sample(3, seed=5)

    async def scenario() -> tuple[list[np.ndarray], object]:
        upstreams = Upstreams()
        upstreams.sync({("m", "1"): (stub,)}, {"m": (4, 16, 2.0)})
        try:
            got = [await upstreams.predict("m", "1", x, time.monotonic() + 5, "interactive") for _ in range(4)]
            return got, upstreams.pool("m", "1").replicas[0]  # type: ignore[union-attr]
        finally:
            await upstreams.close()

    try:
        got, replica = asyncio.run(scenario())
        assert replica.takes_tensors is not json_only
        assert replica.failures == 0 and not replica.ejected(time.monotonic())
        expected = {"/predict_tensor": 1, "/predict": 4} if json_only else {"/predict_tensor": 4}
        assert routes(stub) == expected
        for answer in got:
            np.testing.assert_array_equal(answer, got[0])
    finally:
        env.stop()


FAULTS = [
    ({"fail_rate": 1.0}, 503, "answered HTTP 500", "5xx"),
    ({"nan": True}, 502, "answered non-finite values (NaN or infinity) for 2 input rows", "5xx"),
    ({"shed_next": 3}, 503, "shed the request: HTTP 503", "5xx"),  # asked three times, shed each time
    ({"reject_next": 1}, 400, "refused the input: HTTP 400", None),
]


@pytest.mark.parametrize("change, status, message, kind", FAULTS, ids=[next(iter(f[0])) for f in FAULTS])
def test_a_fault_on_the_tensor_route_is_the_same_gateway_error_as_on_json(
    gw: dict, change: dict, status: int, message: str, kind: str | None
) -> None:
    x = sample(2, seed=6)
    for version, stub in (("1.0.0", gw["tensor"]), ("1.1.0", gw["legacy"])):
        counted = {
            c: metric(gw["url"], "fleet_version_errors_total", version=version, **{"class": c})
            for c in ("5xx", "unreachable", "timeout")
        }
        rejected = metric(gw["url"], "fleet_upstream_rejections_total", version=version)
        before = routes(stub)
        httpx.post(f"{stub}/_control", json=change)
        try:
            r = via_json(gw, x, version)
        finally:
            httpx.post(f"{stub}/_control", json=RESET)
        assert r.status_code == status and message in r.json()["error"], (version, r.text)
        for c, n in counted.items():
            assert metric(gw["url"], "fleet_version_errors_total", version=version, **{"class": c}) == n + (c == kind)
        assert metric(gw["url"], "fleet_upstream_rejections_total", version=version) == rejected + (kind is None)
        if version == "1.0.0":  # the fault was met on the tensor route
            after = routes(stub)
            assert after.get("/predict", 0) == before.get("/predict", 0) and after["/predict_tensor"] > before.get(
                "/predict_tensor", 0
            )
        assert via_json(gw, x, version).status_code == 200  # and it recovers


def test_a_tensor_answer_that_does_not_match_its_headers_is_a_502_blamed_on_the_version(gw: dict) -> None:
    x = sample(1, seed=7)
    errors = metric(gw["url"], "fleet_version_errors_total", version="1.0.0", **{"class": "5xx"})
    httpx.post(f"{gw['tensor']}/_control", json={"truncate": True})
    try:
        replies = [via_json(gw, x), via_binary(gw, x)]
    finally:
        httpx.post(f"{gw['tensor']}/_control", json=RESET)
    for r in replies:
        assert r.status_code == 502, r.text
        assert "answered 4 bytes; its shape [1, 2] of FP32 needs 8" in r.json()["error"]
    assert metric(gw["url"], "fleet_version_errors_total", version="1.0.0", **{"class": "5xx"}) == errors + 2


def test_the_stub_refuses_a_tensor_body_that_does_not_match_its_headers(gw: dict) -> None:
    """The contract's refusals, as the Bento makes them: 400 for the bytes, 415 for JSON."""
    x = sample(2).tobytes()
    ok = {"Content-Type": "application/octet-stream", "X-Fleet-Datatype": "FP32", "X-Fleet-Shape": "2,4"}
    cases = [
        (x[:-1], {}, 400, "body has 31 bytes; shape 2,4 of FP32 needs 32"),
        (x, {"X-Fleet-Datatype": "FP64"}, 400, "X-Fleet-Datatype is 'FP64'; this model takes FP32"),
        (x, {"X-Fleet-Shape": "2,3"}, 400, "X-Fleet-Shape is '2,3'; expected rows,4"),
        (x, {"Content-Type": "application/json"}, 415, "expected application/octet-stream"),
    ]
    for body, change, status, message in cases:
        r = httpx.post(f"{gw['tensor']}/predict_tensor", content=body, headers={**ok, **change}, timeout=10)
        assert r.status_code == status and message in r.json()["error"], r.text


# -- the demo Bento under a real `bentoml serve` --------------------------------------------------------

DEMO = "demo-classifier"
TENSOR_HEADERS = {"Content-Type": "application/octet-stream", "X-Fleet-Datatype": "FP32"}


@pytest.fixture(scope="module")
def bento(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The demo model trained small (fast, not accurate: the routes are under test, not the
    model), packaged and served by ``fleet deploy``: 1.0.0 stable, and 1.1.0 built with the
    rehearsal fault that fails every request (canary at 0 %: reached by version path)."""
    from fleet.runtime.local import LocalRuntime

    env = FleetEnv(tmp_path_factory.mktemp("bento"))
    env.env["PYTHONUNBUFFERED"] = "1"  # each access-log line reaches the replica's log file as it is written
    try:
        env.fleet("models", "train", DEMO, "1.0.0", "--rows", "1000", "--epochs", "1")
        env.fleet("models", "train", DEMO, "1.1.0", "--rows", "1000", "--epochs", "1", "--fault-error-rate", "1")
        router = Router(open_store(env.env["FLEET_STORE"]))
        router.set(DEMO, stable="1.0.0", why="tensor route tests")
        router.set(DEMO, canary="1.1.0", weight=0, why="tensor route tests")
        key = env.fleet_json("tenants", "create", "apps", "--model", DEMO)["api_key"]
        for version in ("1.0.0", "1.1.0"):
            env.fleet("deploy", DEMO, version)
        served = {d.version: d.endpoints[0] for d in LocalRuntime(env.root / "run").list()}
        yield {"env": env, "url": env.start_gateway(), "key": key, "served": served}
    finally:
        env.stop()


def bento_posts(bento: dict, version: str) -> dict[str, int]:
    """POSTs a replica answered, by path, from BentoML's access log in the replica's log file.
    (Not its ``/metrics``: every ``bentoml serve`` of one BENTOML_HOME empties the shared
    Prometheus folder when it starts, so a replica started later hides an earlier one's counts.)
    A 503 is left out: BentoML's batcher sheds a request it cannot fit in its latency budget
    (on a busy machine), nothing is computed, and the gateway asks again, as it should."""
    text = (bento["env"].root / "run" / DEMO / version / "replica-0.log").read_text()
    posts = re.findall(r"\(scheme=http,method=POST,path=([^,]+),[^)]*\) \(status=(\d+)", text)
    paths = [path for path, status in posts if status != "503"]
    return {p: paths.count(p) for p in set(paths)}


def bento_gw(bento: dict) -> dict:
    """The gateway in front of the Bento, as ``via_json``/``via_binary`` take it."""
    return {"url": bento["url"], "key": bento["key"], "model": DEMO}


def taken(post, within_s: float = 30.0) -> httpx.Response:
    """The answer to ``post()``, sent again while the Bento's batcher sheds it (503, nothing
    computed), as the gateway does; a busy machine makes the batcher shed a first large batch."""
    by = time.monotonic() + within_s
    while (r := post()).status_code == 503 and time.monotonic() < by:
        time.sleep(0.05)
    return r


def test_the_bentos_tensor_route_answers_what_its_json_route_does(bento: dict) -> None:
    url = bento["served"]["1.0.0"]
    x = sample(256, seed=8)
    r = taken(
        lambda: httpx.post(
            f"{url}/predict_tensor",
            content=x.tobytes(),
            headers={**TENSOR_HEADERS, "X-Fleet-Shape": "256,4"},
            timeout=30,
        )
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert (r.headers["x-fleet-datatype"], r.headers["x-fleet-shape"]) == ("FP32", "256,2")
    tensor = decode_answer(TensorAnswer(r.content, b"FP32", b"256,2"), DEMO, 256)
    model = taken(lambda: httpx.post(f"{url}/predict", json={"features": x.tolist()}, timeout=30)).json()
    np.testing.assert_allclose(
        tensor, np.asarray(model, np.float32), rtol=0, atol=1e-6
    )  # batched apart: near, not bitwise


def test_the_bento_refuses_a_tensor_body_that_does_not_match_its_headers(bento: dict) -> None:
    url = bento["served"]["1.0.0"]
    x = sample(2).tobytes()
    cases = [
        (x[:-4], {"X-Fleet-Shape": "2,4"}, 400, "body has 28 bytes; shape 2,4 of FP32 needs 32"),
        (
            x,
            {"X-Fleet-Shape": "2,4", "X-Fleet-Datatype": "INT64"},
            400,
            "X-Fleet-Datatype is 'INT64'; this model takes FP32",
        ),
        (x, {"X-Fleet-Shape": "4,2"}, 400, "X-Fleet-Shape is '4,2'; expected rows,4"),
        (x, {"X-Fleet-Shape": "0,4"}, 400, "expected at least one row"),
        (
            x,
            {"X-Fleet-Shape": "2,4", "Content-Type": "text/plain"},
            415,
            "/predict_tensor takes application/octet-stream",
        ),
    ]
    for body, change, status, message in cases:
        r = httpx.post(f"{url}/predict_tensor", content=body, headers={**TENSOR_HEADERS, **change}, timeout=30)
        assert r.status_code == status and message in r.text, r.text


def test_the_gateway_sends_the_bento_tensors_and_answers_as_over_json(bento: dict) -> None:
    url = bento["served"]["1.0.0"]
    x, y = sample(16, seed=9), sample(16, seed=10)  # two inputs: the demo model's policy caches answers
    before = bento_posts(bento, "1.0.0")
    got = {"json": answered(via_json(bento_gw(bento), x)), "binary": answered(via_binary(bento_gw(bento), y))}
    expected = {**before, "/predict_tensor": before.get("/predict_tensor", 0) + 2}
    wait_for(
        lambda: bento_posts(bento, "1.0.0") == expected,
        timeout=5,
        what=f"two tensor POSTs logged, nothing else: {before} → {expected}",
    )
    for protocol, features in (("json", x), ("binary", y)):
        model = httpx.post(f"{url}/predict", json={"features": features.tolist()}, timeout=30).json()
        np.testing.assert_allclose(got[protocol], np.asarray(model, np.float32), rtol=0, atol=1e-6, err_msg=protocol)


def test_a_rehearsal_fault_fails_both_routes_of_the_bento(bento: dict) -> None:
    url = bento["served"]["1.1.0"]
    x = sample(2, seed=10)
    assert httpx.post(f"{url}/predict", json={"features": x.tolist()}, timeout=30).status_code == 500
    r = httpx.post(
        f"{url}/predict_tensor", content=x.tobytes(), headers={**TENSOR_HEADERS, "X-Fleet-Shape": "2,4"}, timeout=30
    )
    assert r.status_code == 500
    r = via_json(bento_gw(bento), x, "1.1.0")
    assert r.status_code == 503 and "answered HTTP 500" in r.json()["error"], r.text
