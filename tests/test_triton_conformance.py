"""Conformance: Triton's own clients, unchanged, against a running gateway.

The same checks for ``tritonclient.http`` with its defaults (binary tensors), with
``binary_data=False`` (JSON), and ``tritonclient.grpc``: live, ready, server and model
metadata, infer with 1 and 256 rows (equal across the three, and to the model's own
answer), infer by version path, a bad key, a version the tenant may not use, over quota.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from fleet.catalog.tenants import Quota, Tenants

# first: loads tritonclient's protos (see _load_service)
from fleet.gateway.grpc_codec import pb  # noqa: F401
from tests.gateway_env import MODEL, GatewayEnv, scrape
from tests.test_grpc import start_gateway

# isort: split
import tritonclient.grpc as triton_grpc  # after the protos are loaded
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

CLIENTS = ("http-binary", "http-json", "grpc")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    env = GatewayEnv(tmp_path_factory.mktemp("triton"))
    try:
        env.register("1.0.0", "1.1.0")
        stub = env.stub("1.0.0")
        env.stub("1.1.0")
        env.route(stable="1.0.0")
        env.route(canary="1.1.0", weight=0)  # reachable by version path only
        tenants = Tenants(env.store)
        keys = {
            "apps": env.tenant("apps"),
            "limited": tenants.create("limited", {MODEL: ["1.0.0"]})[1],
            "tight": tenants.create("tight", {MODEL: ["*"]}, Quota(rps=0.05, burst=1))[1],
        }
        url, address, _ = start_gateway(env)
        yield {"url": url, "grpc": address, "keys": keys, "stub": stub}
    finally:
        env.stop()


class Client:
    """One Triton client mode behind one small interface."""

    def __init__(self, mode: str, fleet: dict) -> None:
        self.mode, self.fleet = mode, fleet
        grpc = mode == "grpc"
        self.lib = triton_grpc if grpc else triton_http
        self.client = (
            triton_grpc.InferenceServerClient(fleet["grpc"])
            if grpc
            else triton_http.InferenceServerClient(fleet["url"].removeprefix("http://"))
        )

    def headers(self, tenant: str = "apps", key: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {key or self.fleet['keys'][tenant]}"}

    def infer(self, rows: np.ndarray, tenant: str = "apps", version: str = "", key: str | None = None) -> np.ndarray:
        x = self.lib.InferInput("features", list(rows.shape), "FP32")
        if self.mode == "http-json":
            x.set_data_from_numpy(rows, binary_data=False)
            out = [self.lib.InferRequestedOutput("probabilities", binary_data=False)]
        else:
            x.set_data_from_numpy(rows)  # the client's default: binary over HTTP, raw contents over gRPC
            out = [self.lib.InferRequestedOutput("probabilities")]
        result = self.client.infer(MODEL, [x], model_version=version, outputs=out, headers=self.headers(tenant, key))
        return result.as_numpy("probabilities")

    def close(self) -> None:
        self.client.close()


@pytest.fixture(params=CLIENTS)
def client(request: pytest.FixtureRequest, fleet: dict) -> Iterator[Client]:
    c = Client(request.param, fleet)
    yield c
    c.close()


def rows(n: int) -> np.ndarray:
    return np.random.default_rng(n).uniform(-1, 1, (n, 4)).astype(np.float32)


def direct(fleet: dict, x: np.ndarray) -> np.ndarray:
    """The model service's own answer for ``x`` (no gateway)."""
    r = httpx.post(f"{fleet['stub']}/predict", json={"features": x.tolist()}, timeout=10)
    return np.asarray(r.json(), dtype=np.float32)


def test_live_ready_and_server_metadata(client: Client) -> None:
    h = client.headers()
    assert client.client.is_server_live(headers=h) and client.client.is_server_ready(headers=h)
    meta = client.client.get_server_metadata(headers=h)
    assert (meta["name"] if isinstance(meta, dict) else meta.name) == "serving-fleet"


def test_model_ready_and_metadata_list_only_usable_versions(client: Client) -> None:
    assert client.client.is_model_ready(MODEL, headers=client.headers())
    meta = client.client.get_model_metadata(MODEL, headers=client.headers("limited"))
    as_dict = (
        meta
        if isinstance(meta, dict)
        else {
            "versions": list(meta.versions),
            "inputs": [{"name": i.name, "datatype": i.datatype, "shape": list(i.shape)} for i in meta.inputs],
        }
    )
    assert as_dict["versions"] == ["1.0.0"]  # 1.1.0 is served, but not to this tenant
    assert as_dict["inputs"][0]["name"] == "features" and as_dict["inputs"][0]["datatype"] == "FP32"


@pytest.mark.parametrize("n", [1, 256])
def test_infer_answers_what_the_model_answers(client: Client, fleet: dict, n: int) -> None:
    x = rows(n)
    got = client.infer(x)
    assert got.shape == (n, 2) and got.dtype == np.float32
    np.testing.assert_allclose(got, direct(fleet, x), rtol=1e-6)


def test_infer_by_version_path(client: Client, fleet: dict) -> None:
    x = rows(3)
    np.testing.assert_allclose(client.infer(x, version="1.1.0"), direct(fleet, x), rtol=1e-6)


def _refused(client: Client, **kwargs: object) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        client.infer(rows(1), **kwargs)  # type: ignore[arg-type]
    return caught.value


def test_a_bad_key_is_refused(client: Client) -> None:
    err = _refused(client, key="sfk_0badc0de_not-a-key")
    assert ("UNAUTHENTICATED" if client.mode == "grpc" else "401") in str(err.status())
    assert "API key" in err.message()


def test_a_version_the_tenant_may_not_use_looks_not_served(client: Client) -> None:
    err = _refused(client, tenant="limited", version="1.1.0")
    assert ("NOT_FOUND" if client.mode == "grpc" else "404") in str(err.status())
    assert "versions you may use: 1.0.0" in err.message()


def test_over_quota_is_refused_with_a_wait(client: Client) -> None:
    first = None
    for _ in range(3):  # burst 1 at 0.05 rps: at most one of three passes, whatever came before
        try:
            client.infer(rows(1), tenant="tight")
        except InferenceServerException as exc:
            first = exc
            break
    assert first is not None
    assert ("RESOURCE_EXHAUSTED" if client.mode == "grpc" else "429") in str(first.status())
    assert "retry" in first.message().lower()


def test_the_three_clients_get_the_same_answer(fleet: dict) -> None:
    x = rows(64)
    answers = []
    for mode in CLIENTS:
        c = Client(mode, fleet)
        try:
            answers.append(c.infer(x))
        finally:
            c.close()
    for other in answers[1:]:
        np.testing.assert_array_equal(answers[0], other)


def test_the_client_requests_are_counted_under_real_names(fleet: dict) -> None:
    text = scrape(fleet["url"])
    assert f'model="{MODEL}"' in text and 'tenant="apps"' in text
