"""Triton's binary tensor data extension on the OIP v2 HTTP infer route.

``tritonclient.http`` sends inputs as raw bytes after a JSON header by default
(``Inference-Header-Content-Length``, per-input ``binary_data_size``) and asks for binary
outputs; the gateway once answered that with "[400] request body is not valid JSON". Here:
the pure decode/encode functions (``fleet.gateway.protocol``), then a real ``fleet gateway``
process in front of a stub model service, called by Triton's own client, unchanged, and by
hostile bodies that must each get a 4xx naming the input and what was expected.
"""

from __future__ import annotations

import asyncio
import functools
import json
import struct

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.http import InferResult
from tritonclient.http._utils import _get_inference_request

from fleet.catalog.registry import Registry, TensorSpec, VersionMetadata
from fleet.catalog.routes.store import Router
from fleet.errors import InvalidInput
from fleet.gateway.body import Decoder
from fleet.gateway.inputs import MalformedBody, TooManyRows
from fleet.gateway.protocol import (
    Decoded,
    Output,
    binary_header_length,
    check_outputs,
    decode_v2,
    decode_v2_binary,
    split_binary,
    v2_reply,
)
from tests.gateway_env import MODEL, GatewayEnv

FEATURES = [TensorSpec(name="features", datatype="FP32", shape=[-1, 4])]
TEXT = [TensorSpec(name="text", datatype="BYTES", shape=[-1, 1])]
OUTPUTS = [TensorSpec(name="probabilities", datatype="FP32", shape=[-1, 2])]
INFER = f"/v2/models/{MODEL}/infer"


def features(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 4)).astype(np.float32)


def client_body(array: np.ndarray, outputs: list | None = None, binary: bool = True) -> tuple[bytes, int | None]:
    """The body ``tritonclient.http`` sends for ``array`` (its own code), and its header length."""
    x = triton.InferInput("features", list(array.shape), "FP32")
    x.set_data_from_numpy(array, binary_data=binary)
    return _get_inference_request([x], "", outputs, 0, False, False, 0, None, None)


def framed(header: dict, *chunks: bytes) -> tuple[bytes, int]:
    """A binary-extension body made by hand: ``header`` as JSON, then ``chunks``."""
    text = json.dumps(header).encode()
    return text + b"".join(chunks), len(text)


def tensor(size: object = 16, shape: object = (1, 4), datatype: str = "FP32", name: str = "features", **extra) -> dict:  # noqa: ANN003
    return {"name": name, "shape": list(shape), "datatype": datatype, "parameters": {"binary_data_size": size}, **extra}


ROW = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32).tobytes()


# -- decoding, pure -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 256])
def test_the_triton_clients_binary_body_decodes_to_what_its_json_twin_does(rows: int) -> None:
    array = features(rows)
    body, length = client_body(array, [triton.InferRequestedOutput("probabilities")])
    assert length is not None and len(body) == length + array.nbytes  # the client did send raw bytes
    binary = decode_v2_binary(body, FEATURES, 10_000, header_length=length)
    as_json, none = client_body(array, [triton.InferRequestedOutput("probabilities", binary_data=False)], binary=False)
    assert none is None
    plain = decode_v2(as_json, FEATURES, 10_000)
    assert binary.features.dtype == plain.features.dtype == np.float32
    assert np.array_equal(binary.features, plain.features) and np.array_equal(binary.features, array)
    assert binary.outputs == (Output("probabilities", True),) and plain.outputs == (Output("probabilities", False),)
    no_outputs, length = client_body(array)  # no outputs named: the client asks binary_data_output
    assert decode_v2_binary(no_outputs, FEATURES, 10_000, header_length=length).binary_output is True


def test_json_and_binary_inputs_mix_in_input_order() -> None:
    payload = memoryview(bytes(range(12)))
    a, b, c, d = split_binary([("a", 8), ("b", None), ("c", 0), ("d", 4)], payload)
    assert bytes(a) == bytes(range(8)) and b is None and bytes(c) == b"" and bytes(d) == bytes(range(8, 12))
    assert a.obj is payload.obj  # views of the body, not copies
    # an input with JSON data inside a binary-framed body (the header says where the JSON ends)
    body, length = framed({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 0, 0, 0]}]})
    assert decode_v2_binary(body, FEATURES, 10, header_length=length).features.tolist() == [[1, 0, 0, 0]]
    # a schema input of another datatype: raw INT32 bytes become the schema's FP32
    body, length = framed({"inputs": [tensor(16, datatype="INT32")]}, np.array([[1, 2, 3, 4]], "<i4").tobytes())
    assert decode_v2_binary(body, FEATURES, 10, header_length=length).features.tolist() == [[1, 2, 3, 4]]


NAN = struct.pack("<4f", 1.0, float("nan"), 0.0, 0.0)
INF = struct.pack("<4f", 1.0, 0.0, float("inf"), 0.0)
HOSTILE_BINARY = [
    # (name, body, header_length, error, status, message)
    (
        "header length larger than the body",
        *framed({"inputs": [tensor()]}, ROW)[:1],
        10_000,
        MalformedBody,
        400,
        "Inference-Header-Content-Length is 10000, but the body has only",
    ),
    (
        "header length cutting the JSON",
        framed({"inputs": [tensor()]}, ROW)[0],
        20,
        MalformedBody,
        400,
        "the JSON part of the body (the first 20 bytes",
    ),
    (
        "binary_data_size missing",
        *framed({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32"}]}, ROW),
        MalformedBody,
        400,
        "16 bytes after the JSON part, but no input has binary_data_size (input 'features': none)",
    ),
    (
        "binary_data_size and no data at all",
        *framed({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32"}]}),
        MalformedBody,
        400,
        "input 'features' has no data; expected data (a list of FP32 values) or",
    ),
    (
        "binary_data_size a string",
        *framed({"inputs": [tensor("16")]}, ROW),
        MalformedBody,
        400,
        "input 'features' has binary_data_size '16'; expected a non-negative integer",
    ),
    (
        "binary_data_size negative",
        *framed({"inputs": [tensor(-16)]}, ROW),
        MalformedBody,
        400,
        "input 'features' has binary_data_size -16; expected a non-negative integer",
    ),
    (
        "binary_data_size wrong for the shape",
        *framed({"inputs": [tensor(12)]}, ROW[:12]),
        InvalidInput,
        422,
        "input 'features' has 12 bytes; shape [1, 4] of FP32 needs 16",
    ),
    (
        "a shape the bytes do not fill",
        *framed({"inputs": [tensor(16, shape=(2, 4))]}, ROW),
        InvalidInput,
        422,
        "input 'features' has 16 bytes; shape [2, 4] of FP32 needs 32",
    ),
    (
        "extra trailing bytes",
        *framed({"inputs": [tensor()]}, ROW, b"\0\0\0\0"),
        MalformedBody,
        400,
        "4 bytes after the JSON part beyond the inputs' binary_data_size ('features': 16 bytes); expected exactly 16",
    ),
    (
        "too few bytes",
        *framed({"inputs": [tensor()]}, ROW[:10]),
        MalformedBody,
        400,
        "input 'features' has binary_data_size 16, but only 10 bytes of tensor data are left",
    ),
    (
        "both data and binary_data_size",
        *framed({"inputs": [tensor(data=[1, 0, 0, 0])]}, ROW),
        MalformedBody,
        400,
        "input 'features' has both data and binary_data_size",
    ),
    (
        "NaN in FP32 bytes",
        *framed({"inputs": [tensor()]}, NAN),
        InvalidInput,
        422,
        "input 'features' holds nan; expected finite FP32 values",
    ),
    (
        "inf in FP32 bytes",
        *framed({"inputs": [tensor()]}, INF),
        InvalidInput,
        422,
        "input 'features' holds inf; expected finite FP32 values",
    ),
    (
        "more rows than max_rows",
        *framed({"inputs": [tensor(16 * 10_001, shape=(10_001, 4))]}, bytes(16 * 10_001)),
        TooManyRows,
        413,
        "input 'features' has 10001 rows; this model takes at most 10000",
    ),
    (
        "BOOL bytes for an FP32 input",
        *framed({"inputs": [tensor(4, datatype="BOOL")]}, b"\x00\x01\x02\x00"),
        InvalidInput,
        422,
        "has datatype 'BOOL'; expected FP32",
    ),
    (
        "shared memory",
        *framed({"inputs": [tensor(16, parameters={"shared_memory_region": "r"})]}, ROW),
        MalformedBody,
        400,
        "input 'features' asks for shared memory (shared_memory_region)",
    ),
    (
        "binary_data_output not a boolean",
        *framed({"inputs": [tensor()], "parameters": {"binary_data_output": "yes"}}, ROW),
        MalformedBody,
        400,
        "parameters.binary_data_output is 'yes'; expected true or false",
    ),
    (
        "an output's binary_data not a boolean",
        *framed({"inputs": [tensor()], "outputs": [{"name": "probabilities", "parameters": {"binary_data": 1}}]}, ROW),
        MalformedBody,
        400,
        "output 'probabilities' has binary_data 1; expected true or false",
    ),
    (
        "an output asked for classification",
        *framed(
            {"inputs": [tensor()], "outputs": [{"name": "probabilities", "parameters": {"classification": 2}}]}, ROW
        ),
        MalformedBody,
        400,
        "output 'probabilities' asks for classification, which this gateway does not support",
    ),
]


@pytest.mark.parametrize(
    ("name", "body", "length", "error", "status", "message"), HOSTILE_BINARY, ids=[case[0] for case in HOSTILE_BINARY]
)
def test_a_hostile_binary_body_is_refused_naming_what_was_wrong(
    name: str, body: bytes, length: int, error: type, status: int, message: str
) -> None:
    with pytest.raises(error) as info:
        decode_v2_binary(body, FEATURES, 10_000, header_length=length)
    assert message in str(info.value) and info.value.status == status


def test_a_bool_byte_other_than_0_or_1_is_refused() -> None:
    spec = [TensorSpec(name="mask", datatype="BOOL", shape=[-1, 4])]
    body, length = framed({"inputs": [tensor(4, datatype="BOOL", name="mask")]}, b"\x00\x01\x02\x00")
    with pytest.raises(InvalidInput, match="input 'mask' holds a BOOL byte other than 0 or 1"):
        decode_v2_binary(body, spec, 10, header_length=length)
    body, length = framed({"inputs": [tensor(4, datatype="BOOL", name="mask")]}, b"\x00\x01\x01\x00")
    assert decode_v2_binary(body, spec, 10, header_length=length).features.tolist() == [[False, True, True, False]]


def test_binary_data_size_without_the_header_is_refused_on_the_json_path() -> None:
    with pytest.raises(
        MalformedBody,
        match="input 'features' has binary_data_size 16, but the request has no Inference-Header-Content-Length header",
    ):
        decode_v2(json.dumps({"inputs": [tensor()]}).encode(), FEATURES, 10)


@pytest.mark.parametrize(("given", "expected"), [([], None), (["0"], 0), (["172"], 172), ([" 16 "], 16)])
def test_the_header_length_is_one_non_negative_integer(given: list[str], expected: int | None) -> None:
    assert binary_header_length(given) == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (["-1"], "is '-1'; expected the length"),
        (["abc"], "is 'abc'"),
        (["1e3"], "is '1e3'"),
        (["²"], "is '²'"),
        (["9" * 40], "is '999"),
        (["1", "2"], "given 2 times; expected it once"),
    ],
)
def test_a_header_length_that_is_not_a_byte_count_is_refused(given: list[str], message: str) -> None:
    with pytest.raises(MalformedBody, match=message):
        binary_header_length(given)


def test_bytes_inputs_are_refused_in_both_encodings_with_the_same_words() -> None:
    words = "input 'text' is BYTES in this model's schema; this gateway passes numeric and BOOL tensors to models"
    as_json = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]}).encode()
    with pytest.raises(InvalidInput, match=words):
        decode_v2(as_json, TEXT, 10)
    element = struct.pack("<I", 2) + b"hi"  # Triton's BYTES element: 4-byte little-endian length, then the bytes
    body, length = framed({"inputs": [tensor(len(element), shape=(1, 1), datatype="BYTES", name="text")]}, element)
    with pytest.raises(InvalidInput, match=words):
        decode_v2_binary(body, TEXT, 10, header_length=length)
    numeric = json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}).encode()
    with pytest.raises(InvalidInput, match=words):  # not "expected BYTES": sending BYTES would not help either
        decode_v2(numeric, TEXT, 10)


def test_the_binary_decode_runs_in_the_decode_worker_and_its_errors_come_back() -> None:
    """A large body is decoded in a worker process: the partial must pickle and work there."""
    decoder = Decoder(1, inline_bytes=0)
    decoder.start()
    try:
        array = features(300)
        body, length = client_body(array)
        decode = functools.partial(decode_v2_binary, header_length=length)
        decoded = asyncio.run(decoder.run("t", decode, body, FEATURES, 10_000))
        assert np.array_equal(decoded.features, array) and decoded.binary_output is True
        with pytest.raises(MalformedBody, match="bytes after the JSON part beyond"):
            asyncio.run(decoder.run("t", decode, body + b"\0", FEATURES, 10_000))
    finally:
        decoder.close()


# -- encoding, pure -----------------------------------------------------------------------------------


def answer(decoded: Decoded, result: np.ndarray) -> tuple[bytes, int | None]:
    return v2_reply(MODEL, "1.0.0", "rid", OUTPUTS, result, decoded)


def test_a_binary_answer_is_what_the_triton_client_reads() -> None:
    result = np.random.default_rng(1).random((256, 2), dtype=np.float32)
    wants = Decoded(None, {}, np.zeros((256, 4), np.float32), (Output("probabilities", True),))
    body, length = answer(wants, result)
    assert length is not None and len(body) == length + result.nbytes
    header = json.loads(body[:length])
    assert header["outputs"] == [
        {
            "name": "probabilities",
            "datatype": "FP32",
            "shape": [256, 2],
            "parameters": {"binary_data_size": result.nbytes},
        }
    ]
    read = InferResult.from_response_body(body, header_length=length).as_numpy("probabilities")
    assert read.dtype == np.float32 and np.array_equal(read, result)
    # the request's binary_data_output covers outputs it does not name; a named output's own setting wins
    assert answer(Decoded(None, {}, result, (), True), result)[1] is not None
    body, length = answer(Decoded(None, {}, result, (Output("probabilities", False),), True), result)
    assert length is None and np.array_equal(
        np.array(json.loads(body)["outputs"][0]["data"], np.float32), result.ravel()
    )
    assert answer(Decoded(None, {}, result), result)[1] is None  # nothing asked: plain JSON, as before


def test_an_output_declared_as_fp64_is_sent_as_fp64_bytes() -> None:
    result = np.array([[0.25, 0.75]], np.float32)
    body, length = v2_reply(
        MODEL,
        "1",
        "r",
        [TensorSpec(name="p", datatype="FP64", shape=[-1, 2])],
        result,
        Decoded(None, {}, result, (), True),
    )
    read = InferResult.from_response_body(body, header_length=length).as_numpy("p")
    assert read.dtype == np.float64 and read.tolist() == [[0.25, 0.75]]


def test_requested_outputs_the_model_does_not_have_are_named() -> None:
    with pytest.raises(
        InvalidInput, match="requested output 'scores' is not an output of this model; expected 'probabilities'"
    ):
        check_outputs((Output("scores", True),), OUTPUTS)
    two = [*OUTPUTS, TensorSpec(name="logits", datatype="FP32", shape=[-1, 2])]
    with pytest.raises(InvalidInput, match="'logits', 'x' are not an output of this model \\(the gateway answers with"):
        check_outputs((Output("logits", True), Output("x", False)), two)
    check_outputs((Output("probabilities", False),), two)


# -- a real gateway -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory):
    """Stable 1.0.0 (FP32 features) for tenant ``apps``; tenant ``texts`` pinned to 2.0.0,
    whose schema takes a BYTES input."""
    e = GatewayEnv(tmp_path_factory.mktemp("binary"))
    try:
        e.register("1.0.0")
        artifact = e.root / "artifact"  # written by register()
        meta = VersionMetadata(framework="torch", baseline_profile={"text": {}}, inputs=TEXT, outputs=OUTPUTS)
        Registry(e.store).register(MODEL, "2.0.0", artifact, meta)
        stub = e.stub("1.0.0")  # 2.0.0 needs no replica: its requests are refused before any is chosen
        e.route(stable="1.0.0")
        keys = {name: e.tenant(name) for name in ("apps", "texts")}
        Router(e.store).pin(MODEL, "texts", "2.0.0", why="test")
        url, proc = e.gateway()
        yield {"env": e, "url": url, "stub": stub, "keys": keys, "proc": proc}
    finally:
        e.stop()


def auth(gw: dict, tenant: str = "apps") -> dict[str, str]:
    return {"Authorization": f"Bearer {gw['keys'][tenant]}"}


def json_answer(gw: dict, array: np.ndarray) -> np.ndarray:
    body = {
        "inputs": [{"name": "features", "shape": list(array.shape), "datatype": "FP32", "data": array.ravel().tolist()}]
    }
    r = httpx.post(gw["url"] + INFER, json=body, headers=auth(gw), timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.array(out["data"], np.float32).reshape(out["shape"])


@pytest.mark.parametrize("rows", [1, 256])
def test_the_triton_client_with_its_defaults_gets_the_json_paths_answer(gw: dict, rows: int) -> None:
    client = triton.InferenceServerClient(url=gw["url"].removeprefix("http://"))
    array = features(rows, seed=rows)
    expected = json_answer(gw, array)
    x = triton.InferInput("features", [rows, 4], "FP32")
    x.set_data_from_numpy(array)  # binary_data=True, the default
    as_json = triton.InferInput("features", [rows, 4], "FP32")
    as_json.set_data_from_numpy(array, binary_data=False)  # a plain JSON body may still ask for binary outputs
    for inputs, outputs, version, binary in [  # binary: whether the answer's output comes as raw bytes
        ([x], None, "", True),
        ([x], [triton.InferRequestedOutput("probabilities")], "", True),
        ([x], [triton.InferRequestedOutput("probabilities", binary_data=False)], "", False),
        ([x], None, "1.0.0", True),
        ([as_json], None, "", True),
        ([as_json], [triton.InferRequestedOutput("probabilities")], "1.0.0", True),
    ]:
        result = client.infer(MODEL, inputs, model_version=version, outputs=outputs, headers=auth(gw))
        got = result.as_numpy("probabilities")
        assert got.dtype == np.float32 and got.shape == (rows, 2)
        assert np.array_equal(got, expected), (outputs, version)
        assert result.get_response()["model_version"] == "1.0.0"
        assert ("binary_data_size" in result.get_output("probabilities").get("parameters", {})) == binary
    client.close()


def test_a_binary_answer_carries_the_headers_tritons_client_reads(gw: dict) -> None:
    body, length = client_body(features(2))
    r = httpx.post(
        gw["url"] + INFER, content=body, headers={**auth(gw), "Inference-Header-Content-Length": str(length)}
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    header = int(r.headers["inference-header-content-length"])
    assert json.loads(r.content[:header])["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert len(r.content) == header + 16 and r.headers["x-request-id"]


def test_a_large_binary_body_is_decoded_in_the_worker_within_the_same_limits(gw: dict) -> None:
    array = features(5_000, seed=5)  # 80 KB of tensor bytes: past the inline limit, decoded in a worker
    body, length = client_body(array)
    r = httpx.post(
        gw["url"] + INFER,
        content=body,
        headers={**auth(gw), "Inference-Header-Content-Length": str(length)},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    got = InferResult.from_response_body(r.content, header_length=n).as_numpy("probabilities")
    assert np.array_equal(got, json_answer(gw, array))
    too_many, length = client_body(np.zeros((10_001, 4), np.float32))
    r = httpx.post(
        gw["url"] + INFER,
        content=too_many,
        headers={**auth(gw), "Inference-Header-Content-Length": str(length)},
        timeout=30,
    )
    assert r.status_code == 413 and "input 'features' has 10001 rows" in r.json()["error"], r.text


LIVE_HOSTILE = [
    # (name, body, header value, status, message)
    (
        "a header length that is not a number",
        framed({"inputs": [tensor()]}, ROW)[0],
        "12a",
        400,
        "Inference-Header-Content-Length is '12a'; expected the length",
    ),
    ("a negative header length", framed({"inputs": [tensor()]}, ROW)[0], "-5", 400, "is '-5'; expected the length"),
    (
        "a header length larger than the body",
        framed({"inputs": [tensor()]}, ROW)[0],
        "99999",
        400,
        "is 99999, but the body has only",
    ),
    *[(name, body, length, status, message) for name, body, length, _, status, message in HOSTILE_BINARY],
    (
        "an output the model does not have",
        *framed({"inputs": [tensor()], "outputs": [{"name": "scores"}]}, ROW),
        422,
        "requested output 'scores' is not an output of this model; expected 'probabilities'",
    ),
]


def test_hostile_binary_bodies_get_a_4xx_naming_the_input_and_never_reach_the_model(gw: dict) -> None:
    asked = httpx.get(f"{gw['stub']}/_stats").json()["requests"]
    failures = []
    with httpx.Client(base_url=gw["url"], timeout=30) as client:
        for name, body, header, status, message in LIVE_HOSTILE:
            r = client.post(INFER, content=body, headers={**auth(gw), "Inference-Header-Content-Length": str(header)})
            if r.status_code != status or message not in r.json().get("error", ""):
                failures.append(f"{name}: {r.status_code} {r.text[:300]}")
            assert r.headers["content-type"] == "application/json"
        assert failures == []
        assert httpx.get(f"{gw['stub']}/_stats").json()["requests"] == asked  # nothing reached the model
        assert client.get("/v2/health/live").status_code == 200
        body, length = client_body(features(1))
        ok = client.post(INFER, content=body, headers={**auth(gw), "Inference-Header-Content-Length": str(length)})
        assert ok.status_code == 200  # and it still answers


def test_a_bytes_input_is_refused_in_both_encodings_over_http(gw: dict) -> None:
    words = "input 'text' is BYTES in this model's schema; this gateway passes numeric and BOOL tensors to models"
    client = triton.InferenceServerClient(url=gw["url"].removeprefix("http://"))
    for binary in (True, False):
        text = triton.InferInput("text", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"hello"]], dtype=object), binary_data=binary)
        with pytest.raises(triton.InferenceServerException) as info:
            client.infer(MODEL, [text], headers=auth(gw, "texts"))
        assert info.value.status() == "422" and words in info.value.message(), info.value
    client.close()
    assert httpx.get(f"{gw['url']}/v2/health/live").status_code == 200


def test_a_compressed_body_is_refused_with_415_not_misread(tmp_path) -> None:  # noqa: ANN001
    import gzip

    from tests.gateway_env import BODY

    env = GatewayEnv(tmp_path)
    try:
        url, key, _ = env.one_version()
        body = gzip.compress(json.dumps(BODY).encode())
        r = httpx.post(
            f"{url}/v2/models/{MODEL}/infer",
            content=body,
            timeout=10,
            headers={"Authorization": f"Bearer {key}", "Content-Encoding": "gzip"},
        )
        assert r.status_code == 415 and "identity" in r.json()["error"], r.text
    finally:
        env.stop()
