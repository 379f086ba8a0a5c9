"""The gateway's request steps on their own, without an app or a process: decoding
(``protocol``), a model's answer (``answers``), blame and retry (``dispatch``), quota, and
the pipeline's authenticate / entitle / choose over a snapshot built by hand."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fleet import audit
from fleet.catalog.registry import ModelVersion, TensorSpec
from fleet.catalog.routes.table import Canary, Choice, RouteTable
from fleet.catalog.tenants import Quota, Tenant, _new_key
from fleet.errors import InvalidInput, NotFound, Unauthorized
from fleet.gateway.activate import Starting
from fleet.gateway.answers import BadAnswer, UpstreamError, decode_answer
from fleet.gateway.dispatch import Dispatcher, fallback
from fleet.gateway.generation.stream import GenerateExchange
from fleet.gateway.inputs import MalformedBody, TooManyRows, conforms
from fleet.gateway.pipeline import Call, Pipeline
from fleet.gateway.protocol import decode_v1, decode_v2
from fleet.gateway.quota import OverQuota, Quotas
from fleet.gateway.quota import release as quota_release
from fleet.gateway.quota.buckets import TokenBuckets
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.tensors import TensorExchange
from fleet.gateway.upstream import NoReplica, Rejected, UpstreamTimeout
from fleet.gateway.view import Snapshot

FEATURES = [TensorSpec(name="features", datatype="FP32", shape=[-1, 4])]


def body(data: object, shape: list = (1, 4), datatype: str = "FP32") -> bytes:
    import json

    return json.dumps(
        {"inputs": [{"name": "features", "shape": list(shape), "datatype": datatype, "data": data}]}
    ).encode()


# -- protocol ---------------------------------------------------------------------------------


def test_decode_takes_flat_or_nested_data_as_the_schemas_dtype() -> None:
    flat = decode_v2(body([1, 2, 3, 4, 5, 6, 7, 8], [2, 4]), FEATURES, 10)
    nested = decode_v2(body([[1, 2, 3, 4], [5, 6, 7, 8]], [2, 4], "INT64"), FEATURES, 10)
    assert flat.features.dtype == np.float32 and flat.features.shape == (2, 4)
    assert np.array_equal(flat.features, nested.features) and nested.features.dtype == np.float32
    assert decode_v1(b'{"instances": [[1, 2, 3, 4]], "id": "x"}', FEATURES, 10).id == "x"


@pytest.mark.parametrize(
    ("raw", "error", "message"),
    [
        (body([1, 2, 3, 4], [1, 4], "INT8"), None, ""),
        (body([1, 2, 3, 300], [1, 4], "INT8"), None, ""),  # cast to the schema's FP32: in range
        (body([3.5e38, 0, 0, 0]), InvalidInput, "out of range for FP32"),
        (body([0, 0, 0, 0], [10_001, 4]), TooManyRows, "has 10001 rows"),
        (body([], [0, 4]), InvalidInput, "no rows"),
        (body("abcd"), MalformedBody, "has data 'abcd'"),
        (body([1, 2, 3, 4], [1, 4, 1]), InvalidInput, "has shape [1, 4, 1]; expected [-1, 4]"),
    ],
)
def test_decode_refuses_what_the_schema_does_not_allow(raw: bytes, error: type | None, message: str) -> None:
    if error is None:
        assert decode_v2(raw, FEATURES, 10_000).features.dtype == np.float32
        return
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_v2(raw, FEATURES, 10_000)


def test_integer_inputs_are_range_checked_for_their_own_datatype() -> None:
    spec = [TensorSpec(name="features", datatype="UINT8", shape=[-1, 4])]
    assert decode_v2(body([0, 1, 2, 255], [1, 4], "UINT8"), spec, 10).features.dtype == np.uint8
    for values, message in (
        ([0, 1, 2, 256], "256, out of range for UINT8"),
        ([0, 1, 2, -1], "-1, out of range"),
        ([0, 1, 2, 0.5], "holds 0.5 at data\\[3\\]"),
    ):
        with pytest.raises(InvalidInput, match=message):
            decode_v2(body(values, [1, 4], "UINT8"), spec, 10)
    wide = [TensorSpec(name="features", datatype="INT64", shape=[-1, 4])]
    with pytest.raises(InvalidInput, match="holds 1.8446744073709552e\\+19 at data\\[3\\]; expected INT64"):
        decode_v2(body([0, 0, 0, 2**64], [1, 4], "INT64"), wide, 10)  # JSON parses it as a float: not an INT64


def test_an_input_decoded_for_one_schema_is_checked_against_another() -> None:
    x = decode_v2(body([1, 2, 3, 4]), FEATURES, 10).features
    assert conforms(x, FEATURES)
    assert not conforms(x, [TensorSpec(name="features", datatype="FP32", shape=[-1, 5])])
    assert not conforms(x, [TensorSpec(name="features", datatype="FP16", shape=[-1, 4])])


# -- a model's answer -------------------------------------------------------------------------


def test_an_answer_must_be_one_finite_row_per_input_row() -> None:
    assert decode_answer(b"[[0.25, 0.75]]", "m:1", 1).tolist() == [[0.25, 0.75]]
    assert decode_answer(b"[0.5, 0.5]", "m:1", 2).shape == (2, 1)
    for raw, message in (
        (b"[[NaN, 1]]", "non-finite"),
        (b"[[0.5, null]]", "non-finite"),
        (b"<html>", "not a JSON list"),
        (b'[["a", "b"]]', "not a JSON list"),
        (b"[[0.5, 0.5], [0.5, 0.5]]", "shape \\[2, 2\\] for 1"),
    ):
        with pytest.raises(BadAnswer, match=message) as info:
            decode_answer(raw, "m:1", 1)
        assert info.value.status == 502 and info.value.kind == "5xx"


def test_answer_errors_survive_the_trip_from_the_decode_worker() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(BadAnswer("m:1 answered NaN")))
    assert (type(error), str(error), error.kind, error.status) == (BadAnswer, "m:1 answered NaN", "5xx", 502)


# -- dispatch: who is asked again, who is blamed ----------------------------------------------

TABLE = RouteTable(model="m", stable="1.0.0", canary=Canary(version="1.1.0", weight=50))


class FakeUpstreams:
    """``Upstreams``' two steps the dispatch takes per version: ``ready`` (a version with no
    replica, or a cold one still starting, raises there) and ``ask`` (the exchange's result)."""

    def __init__(self, **outcomes: object) -> None:
        self.outcomes, self.asked = outcomes, []

    def _outcome(self, version: str) -> object:
        return self.outcomes.get(version.replace(".", "_"), np.zeros((1, 2), np.float32))

    async def ready(self, model: str, version: str, deadline: float, tenant: str = "") -> str:
        self.asked.append(version)
        outcome = self._outcome(version)
        if isinstance(outcome, NoReplica | Starting):
            raise outcome
        return version  # the "pool" ask is given

    async def ask(self, pool: str, exchange: object, *_: object) -> object:
        outcome = self._outcome(pool)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


# the same dispatch for both protocols: a tensor request's exchange and a generation's
EXCHANGES = {
    "tensor": lambda: TensorExchange(np.zeros((1, 4)), decode_answer),
    "generation": lambda: GenerateExchange(b"{}"),
}


def dispatched(choice: Choice, kind: str = "tensor", **outcomes: object) -> tuple[list[str], object, dict]:
    upstreams, telemetry = FakeUpstreams(**outcomes), Telemetry(lambda: iter(()))
    try:
        result = asyncio.run(
            Dispatcher(upstreams, telemetry)("m", TABLE, choice, EXCHANGES[kind](), 1000, "interactive")  # type: ignore[arg-type]
        )
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        result = exc
    _, _, versions = telemetry.stats.window("m", 60)
    return upstreams.asked, result, {v: w["errors"] for v, w in versions.items()}


@pytest.mark.parametrize("kind", list(EXCHANGES))
def test_a_failed_canary_is_asked_again_on_stable_and_blamed(kind: str) -> None:
    asked, result, errors = dispatched(Choice("1.1.0", "canary"), kind, **{"1_1_0": UpstreamError("5xx", "5xx")})
    assert asked == ["1.1.0", "1.0.0"] and result[0] == "1.0.0" and errors["1.1.0"]["5xx"] == 1


@pytest.mark.parametrize("kind", list(EXCHANGES))
def test_a_failed_stable_is_never_sent_to_the_canary(kind: str) -> None:
    asked, result, errors = dispatched(Choice("1.0.0", "stable"), kind, **{"1_0_0": NoReplica("none")})
    assert asked == ["1.0.0"] and isinstance(result, NoReplica) and errors["1.0.0"]["unreachable"] == 1
    assert fallback(TABLE, Choice("1.0.0", "stable")) is None and fallback(TABLE, Choice("1.0.0", "pinned")) is None


@pytest.mark.parametrize("kind", list(EXCHANGES))
def test_a_models_refusal_of_an_input_is_the_callers_error(kind: str) -> None:
    asked, result, errors = dispatched(Choice("1.1.0", "canary"), kind, **{"1_1_0": Rejected("bad input", 400)})
    assert asked == ["1.1.0"] and isinstance(result, Rejected) and result.status == 400 and errors == {}


@pytest.mark.parametrize("kind", list(EXCHANGES))
def test_a_canary_still_starting_lets_stable_answer_and_is_not_blamed(kind: str) -> None:
    asked, result, errors = dispatched(Choice("1.1.0", "canary"), kind, **{"1_1_0": Starting("a cold start", 1.0)})
    assert asked == ["1.1.0", "1.0.0"] and result[0] == "1.0.0" and "1.1.0" not in errors


@pytest.mark.parametrize(
    ("kind", "said"),
    [("tensor", "did not answer within 1000 ms"), ("generation", "sent no first token within 1000 ms")],
)
def test_a_timeout_is_blamed_and_not_asked_again(kind: str, said: str) -> None:
    timeout = UpstreamTimeout("m:1.1.0 did not answer within 999 ms")
    asked, result, errors = dispatched(Choice("1.1.0", "canary"), kind, **{"1_1_0": timeout})
    assert asked == ["1.1.0"] and isinstance(result, UpstreamTimeout) and said in str(result)
    assert errors["1.1.0"]["timeout"] == 1


# -- quota ------------------------------------------------------------------------------------


def test_the_quota_step_refuses_with_the_wait_and_counts_it() -> None:
    telemetry = Telemetry(lambda: iter(()))
    quotas = Quotas(TokenBuckets(lambda: 100.0), telemetry)
    t = Tenant(name="t", entitlements={"m": ["*"]}, quota=Quota(rps=2, burst=1), created_at=audit.now(), created_by="x")
    asyncio.run(quotas.take(t, {}))
    with pytest.raises(OverQuota, match="over its quota of 2 requests/s") as info:
        asyncio.run(quotas.take(t, {}))
    assert info.value.retry_after_s == pytest.approx(0.5)
    asyncio.run(quotas.take(t.model_copy(update={"quota": None}), {}))  # no quota, no limit


def test_a_concurrency_quota_holds_a_lease_until_the_request_is_answered() -> None:
    telemetry = Telemetry(lambda: iter(()))
    quotas = Quotas(TokenBuckets(lambda: 100.0), telemetry)
    t = Tenant(
        name="t",
        entitlements={"m": ["*"]},
        quota=Quota(rps=100, burst=100, concurrency=1),
        created_at=audit.now(),
        created_by="x",
    )
    first: dict = {}
    asyncio.run(quotas.take(t, first))
    assert "quota_lease" in first
    with pytest.raises(OverQuota, match="already has 1 requests in flight"):
        asyncio.run(quotas.take(t, {}))
    quota_release(first)  # answered (http.close_request does this)
    quota_release(first)  # idempotent: the middleware's last-chance release finds nothing
    asyncio.run(quotas.take(t, {}))


# -- authenticate, entitle, choose over a snapshot --------------------------------------------


def manifest(version: str, inputs: list[TensorSpec] = FEATURES) -> ModelVersion:
    from fleet.catalog.registry import FileDigest

    now = audit.now()
    return ModelVersion(
        model="m",
        version=version,
        framework="torch",
        inputs=inputs,
        outputs=[TensorSpec(name="p", datatype="FP32", shape=[-1, 2])],
        files={"w": FileDigest(sha256="0" * 64, size=1)},
        created_at=now,
        created_by="x",
        state_changed_at=now,
    )


class View:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot


def pipeline_over(pins: dict[str, str] | None = None) -> tuple[Pipeline, dict[str, str]]:
    keys, tenants = {}, {}
    for name, allowed in (("apps", ["*"]), ("limited", ["1.0.0"]), ("elsewhere", [])):
        plaintext, key = _new_key()
        tenants[key.id] = Tenant(
            name=name,
            entitlements={"m": allowed} if allowed else {"other": ["*"]},
            keys=[key],
            created_at=audit.now(),
            created_by="x",
        )
        keys[name] = plaintext
    table = TABLE.model_copy(update={"pins": pins or {}})
    manifests = {("m", v): manifest(v) for v in ("1.0.0", "1.1.0", "0.9.0")}
    snap = Snapshot(routes={"m": table}, keys=tenants, manifests=manifests, loaded_at=1.0)
    telemetry = Telemetry(lambda: iter(()))
    return Pipeline(View(snap), None, telemetry, Quotas(TokenBuckets(), telemetry), None, None, None), keys  # type: ignore[arg-type]


def call(key: str | None, model: str = "m", version: str | None = None) -> Call:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return Call(model=model, requested=version, headers=headers, state={"request_id": "r1"})


def test_authenticate_then_entitle_and_labels_only_what_is_real() -> None:
    pipeline, keys = pipeline_over()
    with pytest.raises(Unauthorized):
        pipeline.begin(call("sfk_nope_nope", "made-up-name"))
    c = call(None, "made-up-name")
    with pytest.raises(Unauthorized):
        pipeline.begin(c)
    assert c.state == {"request_id": "r1", "model": "unknown"}  # the claimed name never became a label
    ok = pipeline.begin(call(keys["apps"]))
    assert ok.state["tenant"] == "apps" and ok.state["model"] == "m" and ok.expected.version == "1.0.0"


def test_not_allowed_and_not_there_are_the_same_answer() -> None:
    pipeline, keys = pipeline_over(pins={"apps": "0.9.0"})
    answers = []
    for model in ("m", "no-such"):
        with pytest.raises(NotFound) as info:
            pipeline.begin(call(keys["elsewhere"], model))
        answers.append(str(info.value).replace(repr(model), "<m>"))
    assert answers[0] == answers[1]
    with pytest.raises(NotFound, match="versions you may use: 1.0.0$"):
        pipeline.begin(call(keys["limited"], version="0.9.0"))  # another tenant's pin is not listed
    assert pipeline.begin(call(keys["apps"])).expected.version == "0.9.0"  # its own pin decodes the body


def test_choose_rechecks_a_body_decoded_for_another_schema() -> None:
    from fleet.gateway.protocol import Decoded

    pipeline, keys = pipeline_over()
    wide = manifest("1.1.0", [TensorSpec(name="features", datatype="FP32", shape=[-1, 5])])
    pipeline.view.snapshot.manifests["m", "1.1.0"] = wide
    c = pipeline.begin(call(keys["apps"], version="1.1.0"))
    c.expected = manifest("1.0.0")  # as if decoded for stable, then sent to the canary
    with pytest.raises(InvalidInput, match="m:1.1.0 takes features: FP32 \\[-1, 5\\]"):
        pipeline.choose(c, Decoded(None, {}, np.zeros((1, 4), np.float32)))
