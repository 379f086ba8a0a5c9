"""OIP over gRPC on a real ``fleet gateway --grpc-port 0`` process in front of stub model
services: Triton's own gRPC client, unchanged, and raw ``service_pb2`` calls for what that
client does not send (typed contents) or does not show (trailing metadata)."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fleet.catalog.tenants import Quota, Tenants

# first: loads tritonclient's protos (see _load_service)
from fleet.gateway.grpc_codec import SERVICE, grpc_code, pb, pb_grpc
from fleet.gateway.inputs import MalformedBody
from fleet.gateway.pipeline import Call, DeadlinePassed, Pipeline
from tests.gateway_env import MODEL, GatewayEnv, metric, wait_for
from tests.serving_env import FLEET, free_port, wait_ready

# isort: split
import tritonclient.grpc as triton  # after the protos are loaded
from tritonclient.utils import InferenceServerException

MAX_BODY_MIB = 1


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Versions 1.0.0 (stable) and 1.1.0 (canary at 0 %: reachable by version only), one stub
    each; tenants with every version, with 1.0.0 only, with a tight quota; a gateway with
    gRPC on a port it picks, the prediction cache on and 1 MiB messages at most."""
    root = tmp_path_factory.mktemp("grpc")
    env = GatewayEnv(root, limits={"max_body_mib": MAX_BODY_MIB}, cache={"enabled": True, "ttl_s": 60, "max_mib": 4})
    try:
        env.register("1.0.0", "1.1.0")
        stable = env.stub("1.0.0")
        slow = env.stub("1.1.0")
        env.route(stable="1.0.0")
        env.route(canary="1.1.0", weight=0)
        tenants = Tenants(env.store)
        keys = {name: env.tenant(name) for name in ("apps", "counted")}
        keys["limited"] = tenants.create("limited", {MODEL: ["1.0.0"]})[1]
        keys["tight"] = tenants.create("tight", {MODEL: ["*"]}, Quota(rps=0.2, burst=1))[1]
        url, address, _ = start_gateway(env, "--access-log")
        yield {"env": env, "url": url, "grpc": address, "keys": keys, "stable": stable, "slow": slow}
    finally:
        env.stop()


def start_gateway(env: GatewayEnv, *args: str) -> tuple[str, str, subprocess.Popen[bytes]]:
    """``fleet gateway --grpc-port 0`` (stopped by ``env.stop``; its output in ``gateway.out``):
    (its URL, the gRPC address its start-up lines print, the process)."""
    http_port = free_port()
    out = env.root / "gateway.out"
    with open(out, "wb") as stdout:
        proc = subprocess.Popen(
            [FLEET, "gateway", "--port", str(http_port), "--grpc-port", "0", *args],
            env=env.env(),
            cwd=env.root,
            stdout=stdout,
            stderr=subprocess.STDOUT,
        )
    env.procs.append(proc)
    url = f"http://127.0.0.1:{http_port}"
    wait_ready(f"{url}/v2/health/ready", proc, out)
    wait_for(lambda: "gRPC" in out.read_text(), what="the start-up lines")
    found = re.search(r"gRPC\s+127\.0\.0\.1:(\d+)\s+\(inference\.GRPCInferenceService\)", out.read_text())
    assert found, out.read_text()
    return url, f"127.0.0.1:{found.group(1)}", proc


def stub_requests(stub_url: str) -> int:
    """Predictions the stub model was asked for so far (it counts them as they arrive)."""
    return int(httpx.get(f"{stub_url}/_stats", timeout=5).json()["requests"])


def auth(fleet: dict, tenant: str = "apps") -> dict[str, str]:
    return {"authorization": f"Bearer {fleet['keys'][tenant]}"}


def features(rows: np.ndarray, datatype: str = "FP32", name: str = "features") -> triton.InferInput:
    x = triton.InferInput(name, list(rows.shape), datatype)
    x.set_data_from_numpy(rows)
    return x


def sample(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


def http_answer(fleet: dict, rows: np.ndarray, tenant: str = "apps") -> np.ndarray:
    body = {
        "inputs": [{"name": "features", "shape": list(rows.shape), "datatype": "FP32", "data": rows.ravel().tolist()}]
    }
    r = httpx.post(f"{fleet['url']}/v2/models/{MODEL}/infer", json=body, headers=auth(fleet, tenant), timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def refused(call) -> InferenceServerException:  # noqa: ANN001
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def raw_call(fleet: dict, request, tenant: str | None = "apps", timeout: float = 10, **headers: str):  # noqa: ANN001, ANN201
    """ModelInfer through the generated stub: (response or None, trailing metadata, the RpcError or None)."""
    metadata = (tuple(auth(fleet, tenant).items()) if tenant else ()) + tuple(headers.items())
    with grpc.insecure_channel(fleet["grpc"]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            response, call = stub.ModelInfer.with_call(request, metadata=metadata, timeout=timeout)
            return response, dict(call.trailing_metadata()), None
        except grpc.RpcError as exc:
            return None, dict(exc.trailing_metadata() or ()), exc


def request(rows: np.ndarray, version: str = "") -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(rows.shape))
    return pb.ModelInferRequest(model_name=MODEL, model_version=version, inputs=[tensor])


@pytest.fixture
def client(fleet: dict) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(fleet["grpc"])
    yield c
    c.close()


def test_health_and_metadata_through_tritons_client(fleet: dict, client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().name == "serving-fleet"
    assert client.is_model_ready(MODEL, headers=auth(fleet)) and client.is_model_ready(
        MODEL, "1.1.0", headers=auth(fleet)
    )
    meta = client.get_model_metadata(MODEL, headers=auth(fleet), as_json=True)
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert meta["outputs"][0]["name"] == "probabilities" and meta["versions"] == ["1.0.0", "1.1.0"]
    # only the versions a tenant may use; another model looks like no model
    assert client.get_model_metadata(MODEL, headers=auth(fleet, "limited"), as_json=True)["versions"] == ["1.0.0"]
    error = refused(lambda: client.get_model_metadata("no-such-model", headers=auth(fleet)))
    assert error.status() == "StatusCode.NOT_FOUND" and "model 'no-such-model' is not served here" in error.message()


@pytest.mark.parametrize("n", [1, 256])
def test_infer_answers_what_http_json_answers(fleet: dict, client: triton.InferenceServerClient, n: int) -> None:
    rows = sample(n, seed=n)
    result = client.infer(MODEL, [features(rows)], headers=auth(fleet), request_id=f"req-{n}")
    answer = result.as_numpy("probabilities")
    assert answer.dtype == np.float32 and answer.shape == (n, 2)
    np.testing.assert_array_equal(answer, http_answer(fleet, rows))  # a cache hit: the same features to the bit
    model = httpx.post(f"{fleet['stable']}/predict", json={"features": rows.tolist()}, timeout=10).json()
    np.testing.assert_allclose(answer, np.asarray(model, np.float32), atol=2e-6)  # what the model says
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (MODEL, "1.0.0", f"req-{n}")


def test_a_large_message_is_decoded_in_the_worker_and_answers_the_same(fleet: dict, client) -> None:  # noqa: ANN001
    rows = sample(8192, seed=3)  # 128 KiB of tensor: over the 64 KiB decoded on the event loop
    answer = client.infer(MODEL, [features(rows)], headers=auth(fleet)).as_numpy("probabilities")
    np.testing.assert_array_equal(answer, http_answer(fleet, rows))


def test_version_path_infer(fleet: dict, client: triton.InferenceServerClient) -> None:
    rows = sample(2, seed=7)
    for version in ("1.0.0", "1.1.0"):
        result = client.infer(MODEL, [features(rows)], model_version=version, headers=auth(fleet))
        assert result.get_response().model_version == version


def test_typed_contents_answer_like_raw_bytes(fleet: dict) -> None:
    rows = sample(3, seed=11)
    raw = request(rows)
    raw.raw_input_contents.append(rows.astype("<f4").tobytes())
    typed = request(rows)
    typed.inputs[0].contents.fp32_contents.extend(rows.ravel().tolist())
    answers = []
    for message in (raw, typed):
        response, trailers, error = raw_call(fleet, message)
        assert error is None, error
        assert response.outputs[0].datatype == "FP32" and list(response.outputs[0].shape) == [3, 2]
        assert trailers["x-fleet-model-version"] == "1.0.0" and trailers["x-request-id"] == response.id
        answers.append(np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(3, 2))
    np.testing.assert_array_equal(answers[0], answers[1])
    np.testing.assert_array_equal(answers[0], http_answer(fleet, rows))


def test_grpc_and_http_share_one_prediction_cache(fleet: dict) -> None:
    rows = sample(1, seed=123)
    message = request(rows)
    message.raw_input_contents.append(rows.astype("<f4").tobytes())
    cached = [raw_call(fleet, message)[1]["x-fleet-cache"] for _ in range(2)]
    body = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": rows.ravel().tolist()}]}
    r = httpx.post(f"{fleet['url']}/v2/models/{MODEL}/infer", json=body, headers=auth(fleet), timeout=10)
    assert cached + [r.headers["x-fleet-cache"]] == ["miss", "hit", "hit"]


@pytest.mark.parametrize(
    ("change", "code", "message"),
    [
        (
            lambda m: m.inputs[0].ClearField("shape") or m.inputs[0].shape.extend([1, 3]),
            "INVALID_ARGUMENT",
            "input 'features' has shape [1, 3]; expected [-1, 4]",
        ),
        (
            lambda m: setattr(m.inputs[0], "datatype", "BYTES"),
            "INVALID_ARGUMENT",
            "input 'features' has datatype 'BYTES'; expected FP32",
        ),
        (
            lambda m: setattr(m.inputs[0], "name", "feature"),
            "INVALID_ARGUMENT",
            "input 'feature' is not an input of this model; expected 'features'",
        ),
        (
            lambda m: m.raw_input_contents.__setitem__(0, b"\0" * 12),
            "INVALID_ARGUMENT",
            "input 'features' has 12 bytes; shape [1, 4] of FP32 needs 16",
        ),
        (
            lambda m: (m.raw_input_contents.pop(), m.inputs[0].contents.int64_contents.extend([1, 2, 3, 4])),
            "INVALID_ARGUMENT",
            "input 'features' is FP32 but has contents.int64_contents; expected contents.fp32_contents",
        ),
        (
            lambda m: setattr(m, "model_version", "9.9.9"),
            "NOT_FOUND",
            "version '9.9.9' of stub-model is not served; versions you may use: 1.0.0, 1.1.0",
        ),
    ],
)
def test_each_bad_request_is_refused_with_its_code_and_what_was_expected(
    fleet: dict, change, code: str, message: str
) -> None:  # noqa: ANN001
    bad = request(sample(1, seed=5))
    bad.raw_input_contents.append(b"\0" * 16)
    change(bad)
    _, trailers, error = raw_call(fleet, bad)
    assert error is not None and error.code().name == code and message in error.details(), error
    assert trailers["x-request-id"]


def test_routing_controls_come_from_metadata_or_parameters_as_over_http(fleet: dict) -> None:
    message = request(sample(1, seed=31))
    message.raw_input_contents.append(b"\0" * 16)
    assert raw_call(fleet, message, **{"x-fleet-priority": "batch", "x-fleet-routing-key": "user-7"})[2] is None
    _, _, error = raw_call(fleet, message, **{"x-fleet-priority": "urgent"})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "priority 'urgent' is not known; expected one of interactive, batch"
    message.parameters["routing_key"].string_param = "k" * 300
    _, _, error = raw_call(fleet, message)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "routing_key is 300 characters long; expected at most 256"


def test_shape_and_datatype_mismatches_through_tritons_client(
    fleet: dict, client: triton.InferenceServerClient
) -> None:
    error = refused(lambda: client.infer(MODEL, [features(np.zeros((2, 3), np.float32))], headers=auth(fleet)))
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "input 'features' has shape [2, 3]" in error.message()
    words = np.array([[b"a", b"b", b"c", b"d"]], dtype=np.object_)
    error = refused(lambda: client.infer(MODEL, [features(words, "BYTES")], headers=auth(fleet)))
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "'features' has datatype 'BYTES'" in error.message()


def test_keys_and_entitlements(fleet: dict, client: triton.InferenceServerClient) -> None:
    x = features(sample(1, seed=9))
    for headers in ({}, {"authorization": "Bearer sfk_00000000_nope"}):
        error = refused(lambda: client.infer(MODEL, [x], headers=headers))  # noqa: B023
        assert (
            error.status() == "StatusCode.UNAUTHENTICATED"
            and "expected 'Authorization: Bearer <key>'" in error.message()
        )
    error = refused(lambda: client.infer(MODEL, [x], model_version="1.1.0", headers=auth(fleet, "limited")))
    assert error.status() == "StatusCode.NOT_FOUND"
    assert "version '1.1.0' of stub-model is not served; versions you may use: 1.0.0" in error.message()
    result = client.infer(MODEL, [x], model_version="1.0.0", headers=auth(fleet, "limited"))
    assert result.as_numpy("probabilities").shape == (1, 2)


def test_over_quota_is_resource_exhausted_with_the_wait(fleet: dict, client: triton.InferenceServerClient) -> None:
    x = features(sample(1, seed=13))
    client.infer(MODEL, [x], headers=auth(fleet, "tight"))  # the burst of 1
    error = refused(lambda: client.infer(MODEL, [x], headers=auth(fleet, "tight")))
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED" and "over its quota of 0.2 requests/s" in error.message()
    message = request(sample(1, seed=13))
    message.raw_input_contents.append(b"\0" * 16)
    _, trailers, error = raw_call(fleet, message, "tight")
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in error.details()
    assert 1 <= int(trailers["retry-after"]) <= 5


def test_a_message_over_the_byte_budget_is_refused_by_grpc(fleet: dict) -> None:
    rows = np.zeros((MAX_BODY_MIB * 2**20 // 16 + 1024, 4), np.float32)
    message = request(rows)
    message.raw_input_contents.append(rows.tobytes())
    _, _, error = raw_call(fleet, message)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in error.details()


def test_the_deadline_caps_the_wait_and_the_policy_caps_the_deadline(
    fleet: dict, client: triton.InferenceServerClient
) -> None:
    slow = fleet["slow"]
    x = features(sample(1, seed=17))

    def counted() -> dict[str, float]:
        return {
            code: metric(fleet["url"], "fleet_requests_total", model=MODEL, version="1.1.0", code=code)
            for code in ("499", "504")
        }

    before = counted()
    httpx.post(f"{slow}/_control", json={"delay_ms": 4000}, timeout=5)
    try:
        started = time.monotonic()
        error = refused(
            lambda: client.infer(MODEL, [x], model_version="1.1.0", headers=auth(fleet), client_timeout=0.3)
        )
        # ended by the client's 0.3 s deadline, not by the model's 4 s
        assert error.status() == "StatusCode.DEADLINE_EXCEEDED" and time.monotonic() - started < 3.5, error
        error = refused(
            lambda: client.infer(
                MODEL,
                [x],
                model_version="1.1.0",
                client_timeout=30,
                headers={**auth(fleet), "x-fleet-timeout-ms": "200"},
            )
        )
        assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert "within the 200 ms this request allowed" in error.message()  # the caller's: not the version's failure
        assert "not counted against the version" in error.message()
        started = time.monotonic()  # a generous deadline: the policy's timeout_ms (2000) ends the wait
        error = refused(lambda: client.infer(MODEL, [x], model_version="1.1.0", headers=auth(fleet), client_timeout=30))
        assert error.status() == "StatusCode.DEADLINE_EXCEEDED" and "did not answer within 2000 ms" in error.message()
        assert time.monotonic() - started > 1.9  # the policy's cap, not the client's 30 s, ended it
        message = request(sample(1, seed=17), version="1.1.0")
        message.raw_input_contents.append(sample(1, seed=17).tobytes())
        with grpc.insecure_channel(fleet["grpc"]) as channel:  # a client that gives up: 499, as nginx counts it
            asked = stub_requests(slow)
            call = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer.future(
                message, metadata=tuple(auth(fleet).items())
            )
            wait_for(lambda: stub_requests(slow) > asked, what="the call to reach the slow model")
            call.cancel()
            wait_for(lambda: counted()["499"] == before["499"] + 1, what="the cancelled call counted as 499")
    finally:
        httpx.post(f"{slow}/_control", json={"delay_ms": 0}, timeout=5)
    assert counted() == {"499": before["499"] + 1, "504": before["504"] + 3}, (before, counted())


def test_grpc_requests_are_counted_like_http_ones(fleet: dict, client: triton.InferenceServerClient) -> None:
    labels = {"model": MODEL, "version": "1.0.0", "tenant": "counted"}
    ok, not_found = (
        metric(fleet["url"], "fleet_requests_total", **labels, code="200"),
        metric(fleet["url"], "fleet_requests_total", model=MODEL, tenant="counted", code="404"),
    )
    durations = metric(fleet["url"], "fleet_request_duration_seconds_count", model=MODEL, version="1.0.0")
    for seed in range(3):
        client.infer(MODEL, [features(sample(1, seed=100 + seed))], headers=auth(fleet, "counted"))
    http_answer(fleet, sample(1, seed=200), "counted")
    refused(
        lambda: client.infer(
            MODEL, [features(sample(1, seed=1))], model_version="9.9.9", headers=auth(fleet, "counted")
        )
    )
    assert metric(fleet["url"], "fleet_requests_total", **labels, code="200") == ok + 4
    assert metric(fleet["url"], "fleet_request_duration_seconds_count", model=MODEL, version="1.0.0") == durations + 4
    assert metric(fleet["url"], "fleet_requests_total", model=MODEL, tenant="counted", code="404") == not_found + 1
    log = (fleet["env"].root / "gateway.out").read_text()  # and logged like HTTP ones (--access-log)
    assert re.search(
        r"127\.0\.0\.1 gRPC /inference\.GRPCInferenceService/ModelInfer 200 [\d.]+ms tenant=counted "
        rf"model={MODEL} version=1\.0\.0 id=\w+",
        log,
    ), log[-2000:]


def test_a_grpc_port_in_use_stops_the_gateway_with_a_clear_error(tmp_path: Path) -> None:
    env = GatewayEnv(tmp_path)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [FLEET, "gateway", "--port", str(free_port()), "--grpc-port", str(port)],
            env=env.env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    expected = f"port {port} for the gateway's gRPC endpoint is in use on 127.0.0.1; free it or pass --grpc-port"
    assert proc.stderr == f"error: {expected}\n"


def test_sigterm_lets_a_grpc_call_in_flight_finish(tmp_path: Path) -> None:
    env = GatewayEnv(tmp_path)
    try:
        env.register("1.0.0")
        stub = env.stub("1.0.0", "--delay-ms", "1000")
        env.route(stable="1.0.0")
        key = env.tenant("apps")
        _, address, proc = start_gateway(env)
        client = triton.InferenceServerClient(address)
        x = features(sample(2, seed=21))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.infer, MODEL, [x], headers={"authorization": f"Bearer {key}"})
            wait_for(lambda: stub_requests(stub) == 1, what="the call waiting for the slow model")
            proc.send_signal(signal.SIGTERM)
            assert answer.result(timeout=10).as_numpy("probabilities").shape == (2, 2)
        assert proc.wait(timeout=15) == 0
        client.close()
    finally:
        env.stop()


# -- hostile messages ---------------------------------------------------------------------
INT64 = st.integers(-(2**63), 2**63 - 1)
TYPED = {
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": INT64,
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "bool_contents": st.booleans(),
    "bytes_contents": st.binary(max_size=8),
}
PARAMETERS = {
    "string_param": st.text(max_size=300),
    "int64_param": INT64,
    "double_param": st.floats(),
    "bool_param": st.booleans(),
    "uint64_param": st.integers(0, 2**64 - 1),
}


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    """Mostly near-valid ModelInferRequests, so most get past the key and the model to the
    checks of the tensor; some of everything else."""
    text = st.text(max_size=40)

    def mostly(usual: st.SearchStrategy, other: st.SearchStrategy) -> st.SearchStrategy:  # 7 in 8 the usual
        return st.integers(0, 7).flatmap(lambda i: other if i == 0 else usual)

    message = pb.ModelInferRequest(
        model_name=draw(mostly(st.just(MODEL), text)),
        model_version=draw(mostly(st.sampled_from(["", "", "", "1.0.0", "1.1.0"]), st.one_of(st.just("9.9.9"), text))),
        id=draw(mostly(st.text(max_size=20), st.text(max_size=200))),
    )
    for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):
        rows = draw(st.integers(0, 6))
        other_types = st.one_of(st.sampled_from(["FP64", "INT32", "INT64", "BOOL", "BYTES", "FP16", "BF16"]), text)
        tensor = message.inputs.add(
            name=draw(mostly(st.just("features"), text)), datatype=draw(mostly(st.just("FP32"), other_types))
        )
        tensor.shape.extend(draw(mostly(st.just([rows, 4]), st.lists(INT64, max_size=9))))
        if draw(st.booleans()):
            size = draw(mostly(st.just(rows * 16), st.integers(0, 200)))
            message.raw_input_contents.append(draw(st.binary(min_size=size, max_size=size)))
        else:
            field = draw(mostly(st.just("fp32_contents"), st.sampled_from(sorted(TYPED))))
            count = draw(mostly(st.just(rows * 4), st.integers(0, 40)))
            getattr(tensor.contents, field).extend(draw(st.lists(TYPED[field], min_size=count, max_size=count)))
    for name in draw(
        st.lists(
            st.sampled_from(["routing_key", "priority", "timeout_ms", "binary_data_output", "x"]),
            max_size=2,
            unique=True,
        )
    ):
        kind = draw(st.sampled_from(sorted(PARAMETERS)))
        setattr(message.parameters[name], kind, draw(PARAMETERS[kind]))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        message.outputs.add(name=draw(mostly(st.just("probabilities"), text)))
    return message


HOSTILE_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED}


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(message=infer_requests())
def test_no_message_gets_an_internal_error_or_an_unexplained_refusal(
    fleet: dict, message: pb.ModelInferRequest
) -> None:
    response, trailers, error = raw_call(fleet, message)
    event(error.code().name if error else "OK")
    if error is None:
        assert response.outputs[0].name == "probabilities" and trailers["x-fleet-model-version"] in ("1.0.0", "1.1.0")
        return
    assert error.code() in HOSTILE_CODES, (error.code(), error.details())
    assert error.details() and "\n" not in error.details() and trailers["x-request-id"]


def test_bytes_that_are_not_a_message_are_invalid_argument(fleet: dict) -> None:
    with grpc.insecure_channel(fleet["grpc"]) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
        for garbage in (b"\xff\xff\xff", b"\x0a\x80"):
            with pytest.raises(grpc.RpcError) as info:
                infer(garbage, metadata=tuple(auth(fleet).items()), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("the message is not a ModelInferRequest")
    assert httpx.get(f"{fleet['url']}/v2/health/live", timeout=5).status_code == 200


# -- the parts ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, "INVALID_ARGUMENT"),
        (413, "INVALID_ARGUMENT"),
        (422, "INVALID_ARGUMENT"),
        (401, "UNAUTHENTICATED"),
        (403, "PERMISSION_DENIED"),
        (404, "NOT_FOUND"),
        (429, "RESOURCE_EXHAUSTED"),
        (502, "INTERNAL"),
        (503, "UNAVAILABLE"),
        (504, "DEADLINE_EXCEEDED"),
        (500, "INTERNAL"),
        (418, "INVALID_ARGUMENT"),
        (599, "INTERNAL"),
    ],
)
def test_each_http_status_has_its_grpc_code(status: int, code: str) -> None:
    assert grpc_code(status).name == code


def test_the_time_left_before_a_deadline_caps_the_models_timeout() -> None:
    pipeline = Pipeline(*[None] * 7)  # type: ignore[arg-type]  # timeout() reads only the call
    call = Call(model="m", requested=None, headers={}, state={"request_id": "r"}, deadline=time.monotonic() + 0.5)
    assert 400 < pipeline.timeout(call, {}) <= 500  # the default policy's 5000 ms, the deadline's 500
    assert pipeline.timeout(call, {"timeout_ms": 100}) == 100
    assert pipeline.timeout(Call(model="m", requested=None, headers={}, state={}), {}) == 5000
    call.deadline = time.monotonic() - 0.1
    with pytest.raises(DeadlinePassed, match="the call's deadline passed 1\\d\\d ms before m was asked"):
        pipeline.timeout(call, {})
    # below the policy's min_timeout_ms (50 by default): refused (INVALID_ARGUMENT), never asked of a model
    call.deadline = time.monotonic() + 0.02
    with pytest.raises(MalformedBody, match="the call's deadline leaves \\d+ ms, below m's min_timeout_ms 50"):
        pipeline.timeout(call, {})
    with pytest.raises(MalformedBody, match="X-Fleet-Timeout-Ms '10' is below m's min_timeout_ms 50"):
        pipeline.timeout(Call(model="m", requested=None, headers={}, state={}), {"timeout_ms": 10})


def test_the_model_and_version_are_read_from_the_leading_fields_without_parsing_the_rest() -> None:
    from fleet.gateway.grpc_codec import leading_target

    message = request(sample(2, seed=5), version="1.1.0")
    assert leading_target(message.SerializeToString()) == (MODEL, "1.1.0")
    tail = pb.ModelInferRequest(id="x" * 10).SerializeToString()  # a field numbered after 1 and 2
    assert leading_target(tail + message.SerializeToString()) is None  # out of order: parsed later, once authenticated
    assert leading_target(b"\x0a\xff\xff\xff\x0f") is None  # a length past the end


def test_out_of_order_fields_are_parsed_only_for_a_known_caller(fleet: dict) -> None:
    message = request(sample(1, seed=6))
    message.raw_input_contents.append(sample(1, seed=6).tobytes())
    body = pb.ModelInferRequest(id="late").SerializeToString() + message.SerializeToString()
    with grpc.insecure_channel(fleet["grpc"]) as channel:
        raw = channel.unary_unary(
            f"/{SERVICE}/ModelInfer",
            request_serializer=lambda b: b,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            raw(body, metadata=(("authorization", "Bearer sfk_0badc0de_nope"),))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answer = raw(body, metadata=tuple(auth(fleet).items()))  # the same bytes from a tenant: served
        assert answer.model_name == MODEL and answer.id == "late"


def test_outputs_are_checked_by_the_http_rule(fleet: dict) -> None:
    message = request(sample(1, seed=7))
    message.raw_input_contents.append(sample(1, seed=7).tobytes())
    message.outputs.add(name="probabilities")
    message.outputs.add(name="probabilities")
    with grpc.insecure_channel(fleet["grpc"]) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, metadata=tuple(auth(fleet).items()))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "requested twice" in caught.value.details()
