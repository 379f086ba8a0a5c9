"""Property: whatever a client sends to the generation routes — OpenAI's completions and chat,
OIP's generate and generate_stream, by model or by version — with whatever headers, streamed
or not, reading the answer to its end or leaving at any point of it, a running gateway
answers without a 5xx: an error is a JSON ``{"error": ...}`` (before a stream starts) or an
SSE ``error`` event (after), every event is JSON, and afterwards every slot and every
concurrency lease is back.

A real ``fleet gateway`` process in front of the stub model's generation route
(``tests/stub_model.py``: a character-level model, 2 ms a token), the tenant under a
concurrency quota so that leases are taken and must come back. Hypothesis with a fixed seed
(``derandomize``) and a bounded number of examples.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fleet.catalog.tenants import Quota, Tenants
from tests.gateway_env import MODEL, GatewayEnv, metric, wait_for

EXAMPLES = 1500
CONCURRENCY = 4  # the tenant's concurrency quota: its leases


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory):
    e = GatewayEnv(
        tmp_path_factory.mktemp("fuzz-gen"),
        generative=True,
        family="tiny-lm",
        timeout_ms=5000,
        generation={"max_tokens": 64, "default_max_tokens": 8, "first_token_timeout_ms": 2000},
    )
    try:
        e.register("1.0.0", "1.1.0")
        for version in ("1.0.0", "1.1.0"):
            stub = e.stub(version)
            httpx.post(f"{stub}/_control", json={"token_ms": 2})
        e.route(stable="1.0.0")
        e.route(canary="1.1.0", weight=50)
        key = Tenants(e.store).create(
            "apps", {MODEL: ["*"]}, Quota(rps=100_000, burst=100_000, concurrency=CONCURRENCY)
        )[1]
        url, _ = e.gateway()
        with httpx.Client(base_url=url, timeout=30) as client:
            yield {"url": url, "key": key, "client": client}
    finally:
        e.stop()


ascii_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
scalars = st.one_of(
    st.integers(-5, 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    ascii_text,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=20,
)


def mostly(valid: st.SearchStrategy, junk: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` about four times in five, so most examples get past parsing to the dispatch and
    the stream (a value inside the range: Hypothesis draws its ends more often than the rest)."""
    return st.integers(0, 9).flatmap(lambda i: junk if i in (3, 6) else valid)


names = mostly(st.sampled_from([MODEL, MODEL, f"{MODEL}:1.1.0"]), st.one_of(st.just("no-such-model"), ascii_text))
prompts = mostly(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=30), json_values)
tokens = mostly(st.integers(1, 24), st.one_of(st.integers(-3, 100), scalars))
settings_ = {
    "max_tokens": tokens,
    "min_tokens": tokens,
    "temperature": mostly(st.floats(0, 2), scalars),
    "top_p": mostly(st.floats(0.01, 1), scalars),
    "seed": mostly(st.integers(0, 2**31), scalars),
    "stop": mostly(st.lists(ascii_text.filter(bool), max_size=3), scalars),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "n": mostly(st.just(1), scalars),
}
streams = mostly(st.booleans(), scalars)
completion = st.fixed_dictionaries({"model": names, "prompt": prompts, "stream": streams}, optional=settings_)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": mostly(st.sampled_from(["system", "user", "assistant"]), ascii_text), "content": prompts}
        ),
        min_size=1,
        max_size=3,
    ),
    json_values,
)
chat = st.fixed_dictionaries({"model": names, "messages": messages, "stream": streams}, optional=settings_)
oip_parameters = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": tokens,
        "min_tokens": tokens,
        "temperature": mostly(st.floats(0, 2), scalars),
        "stop": mostly(st.lists(ascii_text.filter(bool), max_size=2), scalars),
        "timeout_ms": mostly(st.sampled_from([100, 4000]), scalars),
        "priority": mostly(st.just("batch"), scalars),
    },
)
oip = st.fixed_dictionaries({"text_input": prompts}, optional={"parameters": mostly(oip_parameters, json_values)})
q = lambda m: quote(m, safe="")  # noqa: E731


def _body(values: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    return mostly(st.builds(lambda v: json.dumps(v, allow_nan=True).encode(), values), st.binary(max_size=60))


oip_paths = st.one_of(
    st.builds(lambda m, verb: f"/v2/models/{q(m)}/{verb}", names, st.sampled_from(["generate", "generate_stream"])),
    st.builds(
        lambda v, verb: f"/v2/models/{MODEL}/versions/{q(v)}/{verb}",
        st.one_of(st.sampled_from(["1.0.0", "1.1.0", "9.9.9"]), ascii_text),
        st.sampled_from(["generate", "generate_stream"]),
    ),
)
requests = st.one_of(
    st.tuples(st.just("/v1/completions"), _body(completion)),
    st.tuples(st.just("/v1/chat/completions"), _body(chat)),
    st.tuples(oip_paths, _body(oip)),
)
headers = st.fixed_dictionaries(
    {"Authorization": mostly(st.just("Bearer KEY"), ascii_text)},
    optional={
        "X-Request-Id": ascii_text,
        "X-Fleet-Routing-Key": ascii_text,
        "X-Fleet-Priority": mostly(st.sampled_from(["batch", "interactive"]), ascii_text),
        "X-Fleet-Timeout-Ms": mostly(
            st.sampled_from(["50", "100", "4000"]), st.one_of(ascii_text, st.floats().map(str))
        ),
        "Content-Type": mostly(st.just("application/json"), ascii_text),
    },
)
# how much of the answer the caller reads before it leaves: None reads it all
leaves_after = mostly(st.integers(0, 12), st.none())


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(request=requests, head=headers, leaves=leaves_after)
def test_any_generation_request_gets_json_or_sse_and_never_a_5xx(
    gw: dict, request: tuple, head: dict, leaves: int | None
) -> None:
    path, body = request
    head = {k: v.replace("KEY", gw["key"]) for k, v in head.items()}
    try:
        with gw["client"].stream("POST", path, content=body, headers=head) as r:
            kind = r.headers.get("content-type", "")
            event(f"HTTP {r.status_code}{' stream' if kind.startswith('text/event-stream') else ''}")
            said = f"{path} {head} {body[:200]!r} -> {r.status_code}"
            if not kind.startswith("text/event-stream"):
                text = r.read()
                if r.status_code == 504:  # only the caller's own deadline, one it asked for, may run out
                    assert "X-Fleet-Timeout-Ms" in head and b"this request allowed" in text, f"{said} {text[:300]!r}"
                    event("the caller's own deadline ran out")
                else:
                    assert r.status_code < 500, f"{said} {text[:300]!r}"
                if r.status_code >= 400:
                    assert kind == "application/json" and isinstance(json.loads(text).get("error"), str), text
                else:
                    json.loads(text)
                return
            lines = r.iter_lines()
            for n, line in enumerate(lines):
                if leaves is not None and n >= leaves:
                    event("left mid-stream")
                    return  # the caller leaves: the stream closes under it
                if line.startswith("data: ") and line != "data: [DONE]":
                    data = json.loads(line[6:])  # every event is JSON, an error event too
                    if "error" in data:
                        event("error event")
                        assert isinstance(data["error"], (str, dict)), data
    except httpx.LocalProtocolError:
        return  # a header httpx itself will not send


def test_after_the_fuzzing_every_slot_and_lease_is_back(gw: dict) -> None:
    """Runs after the property (file order)."""
    url, key = gw["url"], gw["key"]
    wait_for(lambda: metric(url, "fleet_version_in_flight") == 0, timeout=30, what="every slot given back")

    def stream(_: int) -> int:  # as many at once as the tenant's leases: a lease kept by the fuzzing refuses one
        with httpx.Client(base_url=url, timeout=30) as client:
            r = client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "leases", "max_tokens": 24},
                headers={"Authorization": f"Bearer {key}"},
            )
            return r.status_code

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        assert list(pool.map(stream, range(CONCURRENCY))) == [200] * CONCURRENCY
    assert httpx.get(f"{url}/v2/health/live").status_code == 200
