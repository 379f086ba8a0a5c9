"""Property: whatever a client sends — generated bodies (JSON, and Triton's binary tensor
extension), headers, paths and query strings —
a running gateway answers it without a 5xx, every error is a JSON ``{"error": ...}``, the
gateway stays live, and the memory it holds stays under its budgets.

Hypothesis with a fixed seed (``derandomize``) and a bounded number of examples, so a run
takes about a minute and a failure reproduces. The gateway is a real ``fleet gateway``
process in front of a stub model, with small byte budgets so that "under budget" means
something.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.gateway_env import ADMIN_TOKEN, MODEL, GatewayEnv, metric, scrape, wait_for

LIMITS = {"shadow_queue_mib": 1, "inference_log_buffer_mib": 1, "feedback_index_mib": 1}
EXAMPLES = 2000


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory):
    e = GatewayEnv(
        tmp_path_factory.mktemp("fuzz"),
        limits=LIMITS,
        inference_log={"sample_rate": 1.0},
        cache={"enabled": True, "ttl_s": 60, "max_mib": 1},
    )
    try:
        e.register("1.0.0", "1.1.0")
        e.stub("1.0.0")
        e.stub("1.1.0")
        e.route(stable="1.0.0")
        e.route(canary="1.1.0", weight=50, shadow=None)
        key = e.tenant("apps")
        url, proc = e.gateway()
        with httpx.Client(base_url=url, timeout=30) as client:
            big = {"inputs": [{"name": "features", "shape": [5000, 4], "datatype": "FP32", "data": [0.25] * 20000}]}
            for _ in range(3):  # warm: the decode worker is up and every code path has run once
                assert (
                    client.post(
                        f"/v2/models/{MODEL}/infer", json=big, headers={"Authorization": f"Bearer {key}"}
                    ).status_code
                    == 200
                )
            wait_for(
                lambda: metric(url, "fleet_inference_log_rows_total", outcome="written") > 0,
                timeout=30,
                what="the first inference-log write (pyarrow loaded)",
            )
            yield {"url": url, "key": key, "pid": proc.pid, "client": client, "rss0": _rss(proc.pid)}
    finally:
        e.stop()


def _rss(pid: int) -> int:
    """Resident memory of the gateway process, in bytes (its decode worker holds one body at a time)."""
    with open(f"/proc/{pid}/status") as status:  # noqa: PTH123
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


# -- what a client may send ---------------------------------------------------------------
# Mostly near-valid requests, so most examples get past authentication and parsing to the
# checks deep in the pipeline; some of everything else.
ascii_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
names = st.one_of(st.just(MODEL), st.just(MODEL), st.just("no-such-model"), ascii_text, st.text(max_size=20))
versions = st.one_of(st.sampled_from(["1.0.0", "1.1.0", "9.9.9", "-1", ""]), ascii_text)
numbers = st.one_of(st.floats(-10, 10), st.integers(-5, 5), st.floats(allow_nan=False, allow_infinity=False))
scalars = st.one_of(
    numbers,
    numbers,
    numbers,
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)
datatypes = st.one_of(
    st.just("FP32"),
    st.just("FP32"),
    st.sampled_from(["FP64", "INT64", "BOOL", "BYTES", "FP16", "UINT8", "BF16"]),
    ascii_text,
)


@st.composite
def tensors(draw: st.DrawFn) -> dict:
    rows = draw(st.integers(0, 6))
    shape = draw(
        st.one_of(st.just([rows, 4]), st.just([rows, 4]), st.lists(st.integers(-3, 2**63), max_size=4), json_values)
    )
    flat = st.lists(scalars, min_size=rows * 4, max_size=rows * 4)
    nested = st.lists(st.lists(scalars, min_size=4, max_size=4), min_size=rows, max_size=rows)
    data = draw(st.one_of(flat, flat, nested, st.lists(scalars, max_size=30), json_values))
    name = draw(st.one_of(st.just("features"), st.just("features"), ascii_text))
    return {"name": name, "shape": shape, "datatype": draw(datatypes), "data": data}


oip = st.fixed_dictionaries(
    {"inputs": st.one_of(st.lists(tensors(), min_size=1, max_size=2), json_values)},
    optional={
        "id": json_values,
        "parameters": st.one_of(
            json_values, st.dictionaries(st.sampled_from(["routing_key", "priority", "timeout_ms"]), scalars)
        ),
    },
)
v1 = st.builds(
    lambda rows: {"instances": rows},
    st.one_of(st.lists(st.lists(scalars, min_size=4, max_size=4), max_size=5), json_values),
)
feedback = st.fixed_dictionaries(
    {
        "model": names,
        "feedback": st.one_of(
            json_values,
            st.lists(
                st.fixed_dictionaries(
                    {"request_id": st.one_of(ascii_text, json_values), "label": scalars}, optional={"row": scalars}
                ),
                max_size=4,
            ),
        ),
    }
)
admin_bodies = st.fixed_dictionaries(
    {},
    optional={
        "stable": versions,
        "canary": versions,
        "weight": scalars,
        "clear_canary": scalars,
        "reason": st.one_of(ascii_text, scalars),
    },
)


_RAW = {"FP32": "<f4", "FP64": "<f8", "FP16": "<f2", "INT64": "<i8", "UINT8": "u1", "BOOL": "u1"}


@st.composite
def binary_oip(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    """Triton's binary extension: a JSON part, then raw tensor bytes, with an
    Inference-Header-Content-Length that is mostly right and sometimes a lie."""
    import numpy as np

    rows = draw(st.integers(0, 6))
    datatype = draw(st.sampled_from([*_RAW, "BYTES", "FP32", "FP32"]))
    if draw(st.booleans()) and datatype in _RAW:  # exactly sized, with values that may be out of range
        values = draw(
            st.lists(
                st.floats(allow_nan=True, allow_infinity=True, width=32) | st.integers(-300, 300),
                min_size=rows * 4,
                max_size=rows * 4,
            )
        )
        with np.errstate(all="ignore"):
            raw = np.array(values, dtype=np.float64).astype(_RAW[datatype]).tobytes()
    else:
        raw = draw(st.binary(max_size=200))
    size = draw(st.one_of(st.just(len(raw)), st.just(len(raw)), st.integers(-2, 300), scalars))
    tensor = {
        "name": draw(st.one_of(st.just("features"), st.just("features"), ascii_text)),
        "shape": draw(st.one_of(st.just([rows, 4]), st.just([rows, 4]), json_values)),
        "datatype": datatype,
        "parameters": draw(st.one_of(st.just({"binary_data_size": size}), json_values)),
    }
    header: dict = {"inputs": [tensor]}
    if draw(st.booleans()):
        header["outputs"] = [
            {
                "name": draw(st.one_of(st.just("probabilities"), ascii_text)),
                "parameters": draw(st.one_of(st.just({"binary_data": True}), json_values)),
            }
        ]
    if draw(st.booleans()):
        header["parameters"] = {"binary_data_output": draw(scalars)}
    json_part = json.dumps(header, allow_nan=True).encode()
    length = draw(
        st.one_of(
            st.just(str(len(json_part))), st.just(str(len(json_part))), st.integers(-5, 10**6).map(str), ascii_text
        )
    )
    return json_part + raw, {"Inference-Header-Content-Length": length}


def encoded(values: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    return st.one_of(st.builds(lambda v: json.dumps(v, allow_nan=True).encode(), values), st.binary(max_size=100))


auth = st.one_of(
    st.just("Bearer KEY"),
    st.just("Bearer KEY"),
    st.just("Bearer KEY"),
    st.builds(lambda t: f"Bearer {t}", ascii_text),
    ascii_text,
    st.just(f"Bearer {ADMIN_TOKEN}"),
)
headers = st.fixed_dictionaries(
    {"Authorization": auth},
    optional={
        "X-Request-Id": ascii_text,
        "X-Fleet-Routing-Key": ascii_text,
        "X-Fleet-Priority": st.one_of(st.just("batch"), ascii_text),
        "X-Fleet-Timeout-Ms": st.one_of(ascii_text, st.floats().map(str)),
        "Content-Type": ascii_text,
        "Content-Length": st.integers(min_value=0, max_value=10**12).map(str),
    },
)
queries = st.dictionaries(st.sampled_from(["window_s", "reason", "x"]), ascii_text, max_size=2)
q = lambda m: quote(m, safe="")  # noqa: E731
requests = st.one_of(
    st.tuples(st.just("POST"), st.builds(lambda m: f"/v2/models/{q(m)}/infer", names), encoded(oip)),
    st.tuples(st.just("POST"), st.builds(lambda m: f"/v2/models/{q(m)}/infer", names), encoded(oip)),
    st.tuples(
        st.just("POST"),
        st.builds(lambda m, v: f"/v2/models/{q(m)}/versions/{q(v)}/infer", names, versions),
        encoded(oip),
    ),
    st.tuples(st.just("POST"), st.builds(lambda m: f"/v1/models/{q(m)}:predict", names), encoded(v1)),
    st.tuples(st.just("POST"), st.just("/v1/feedback"), encoded(feedback)),
    st.tuples(st.just("GET"), st.builds(lambda m: f"/v2/models/{q(m)}", names), st.just(b"")),
    st.tuples(
        st.just("GET"),
        st.builds(lambda m, v: f"/v2/models/{q(m)}/versions/{q(v)}/ready", names, versions),
        st.just(b""),
    ),
    st.tuples(
        st.sampled_from(["POST", "GET"]), st.builds(lambda m: f"/admin/routes/{q(m)}", names), encoded(admin_bodies)
    ),
    st.tuples(st.just("GET"), st.builds(lambda m: f"/admin/stats/{q(m)}", names), st.just(b"")),
    st.tuples(
        st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
        st.builds(lambda t: "/" + quote(t, safe="/"), st.text(max_size=40)),
        st.binary(max_size=100),
    ),
).map(lambda r: (*r, {}))
binary_requests = st.builds(
    lambda m, b: ("POST", f"/v2/models/{q(m)}/infer", *b),
    st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), names),
    binary_oip(),
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(request=st.one_of(requests, requests, binary_requests), head=headers, query=queries)
def test_any_request_gets_a_json_answer_and_never_a_5xx(gw: dict, request: tuple, head: dict, query: dict) -> None:
    method, path, body, extra = request
    head = {k: v.replace("KEY", gw["key"]) for k, v in {**head, **extra}.items()}
    if "Content-Length" in head:  # a lying Content-Length: httpx would refuse to send it; say the truth or less
        head["Content-Length"] = (
            str(min(int(head["Content-Length"]), len(body))) if head["Content-Length"].isdigit() else "0"
        )
        body = body[: int(head["Content-Length"])]
    try:
        r = gw["client"].request(method, path, content=body, headers=head, params=query)
    except httpx.LocalProtocolError:
        return  # a header httpx itself will not send (h11 refuses it before it leaves)
    if r.status_code == 200 and path.endswith("/infer"):
        event("answered by a model" + (" (binary extension)" if extra else ""))
    if extra and r.status_code in (400, 413, 422):
        event("binary extension refused in the decoder")
    event(f"HTTP {r.status_code}")
    assert r.status_code < 500, f"{method} {path} {head} {body[:200]!r} -> {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        assert r.headers["content-type"] == "application/json" and isinstance(r.json().get("error"), str), r.text


def test_after_the_fuzzing_the_gateway_is_live_and_within_its_budgets(gw: dict) -> None:
    """Runs after the property (file order): what the fuzzing left behind."""
    url = gw["url"]
    assert httpx.get(f"{url}/v2/health/live").status_code == 200
    for buffer, mib in [("shadow_queue", 1), ("inference_log", 1), ("feedback_index", 1), ("prediction_cache", 1)]:
        assert metric(url, "fleet_buffer_bytes", buffer=buffer) <= mib * 1024 * 1024
    grown = _rss(gw["pid"]) - gw["rss0"]
    budgets = sum(LIMITS.values()) + 1  # + the cache
    # the allocator keeps what parsing freed; beyond the budgets, a few tens of MiB of that is all
    assert grown < (budgets + 64) * 1024 * 1024, f"gateway grew by {grown / 2**20:.0f} MiB"
    # and whatever names the fuzzing made up, it counted only under real ones
    from prometheus_client.parser import text_string_to_metric_families

    labels = [
        s.labels
        for f in text_string_to_metric_families(scrape(url))
        for s in f.samples
        if s.name == "fleet_requests_total"
    ]
    assert (
        labels
        and {x["model"] for x in labels} <= {MODEL, "unknown"}
        and {x["tenant"] for x in labels} <= {"apps", "unknown"}
    )
    assert {x["version"] for x in labels} <= {"1.0.0", "1.1.0", "none"}
