"""A caller's own deadline is never the version's failure (a real gateway in front of stub
model services): any tenant entitled to a canary may ask it by name with a tiny timeout, and
before this each expiry counted against it — enough to roll back a healthy canary, stop an
experiment on its guardrail, or hide a bad canary behind a stable's inflated errors.

A timeout below the policy's ``min_timeout_ms`` is refused (400); one shorter than the
model's ``timeout_ms`` that runs out is a 504 counted in ``fleet_caller_timeouts_total``, never
in the version's errors or requests (what rollout gates and experiment guardrails read);
the model's own timeout running out is the version's, as before. The generation path (a
stream cut mid-answer by the caller's deadline) is proved on real processes in
tests/test_generation.py; the rollout promoting a good canary under such an attack, in
tests/test_rollout_flow.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.gateway_env import MODEL, GatewayEnv, admin, infer, metric

CANARY_DELAY_MS = 150  # the canary's every answer; the policy's own timeout_ms is 1000


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Stable 1.0.0 (answers at once) and a canary 1.1.0 answering in 150 ms, at 10 %."""
    e = GatewayEnv(tmp_path_factory.mktemp("deadlines"), timeout_ms=1000, min_timeout_ms=20)
    try:
        e.register("1.0.0", "1.1.0")
        e.stub("1.0.0")
        canary = e.stub("1.1.0", "--delay-ms", str(CANARY_DELAY_MS))
        e.route(stable="1.0.0")
        e.route(canary="1.1.0", weight=10)
        key = e.tenant("apps")  # before the gateway starts: its first snapshot has it
        url, _ = e.gateway()
        yield {"env": e, "url": url, "canary": canary, "key": key}
    finally:
        e.stop()


def canary_stats(url: str) -> dict:
    with admin(url) as adm:
        return adm.get(f"/admin/stats/{MODEL}").json()["versions"].get("1.1.0", {"requests": 0, "errors": {}})


def ask_canary(client: httpx.Client, key: str, **headers: str) -> httpx.Response:
    return client.post(
        f"/v2/models/{MODEL}/versions/1.1.0/infer",
        json={"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 0, 0, 0]}]},
        headers={"Authorization": f"Bearer {key}", **headers},
    )


def test_a_timeout_below_the_policys_minimum_is_refused_before_the_canary_is_asked(gw: dict) -> None:
    before = httpx.get(f"{gw['canary']}/_stats").json()["requests"]
    with httpx.Client(base_url=gw["url"], timeout=10) as client:
        for asked in ("0.01", "1", "19.9"):
            r = ask_canary(client, gw["key"], **{"X-Fleet-Timeout-Ms": asked})
            assert r.status_code == 400, r.text
            assert f"X-Fleet-Timeout-Ms '{asked}' is below {MODEL}'s min_timeout_ms 20" in r.json()["error"]
        assert httpx.get(f"{gw['canary']}/_stats").json()["requests"] == before
        r = infer(client, gw["key"], **{"X-Fleet-Timeout-Ms": "20"})  # the minimum itself is accepted
        assert r.status_code == 200 or "this request allowed" in r.json()["error"], r.text  # (a busy model may miss it)


def test_a_callers_short_timeout_running_out_is_counted_apart_never_against_the_version(gw: dict) -> None:
    url, key = gw["url"], gw["key"]
    before, timeouts = canary_stats(url), metric(url, "fleet_caller_timeouts_total", version="1.1.0")
    with httpx.Client(base_url=url, timeout=10) as client:
        for _ in range(20):  # the attack: the canary by name, a timeout it cannot meet
            r = ask_canary(client, key, **{"X-Fleet-Timeout-Ms": "40"})
            assert r.status_code == 504, r.text
            assert "within the 40 ms this request allowed" in r.json()["error"]
            assert "not counted against the version" in r.json()["error"]
        after = canary_stats(url)
        assert after["requests"] == before["requests"] and after["errors"] == before["errors"]
        assert metric(url, "fleet_caller_timeouts_total", version="1.1.0") == timeouts + 20
        assert metric(url, "fleet_version_errors_total", version="1.1.0") == 0
        # its replica was not held responsible either: a caller with time to wait is answered
        r = ask_canary(client, key)
        assert r.status_code == 200 and r.headers["x-fleet-model-version"] == "1.1.0", r.text
        assert canary_stats(url)["requests"] == before["requests"] + 1


def test_the_models_own_timeout_running_out_is_still_the_versions_failure(gw: dict) -> None:
    """No timeout asked, the policy's asked exactly, or more than the policy allows (capped to
    it): the deadline is the model's own each time, and the canary is blamed."""
    url, key = gw["url"], gw["key"]
    httpx.post(f"{gw['canary']}/_control", json={"delay_ms": 1200})
    try:
        before = canary_stats(url)
        caller_timeouts = metric(url, "fleet_caller_timeouts_total", version="1.1.0")
        with httpx.Client(base_url=url, timeout=10) as client:
            for headers in ({}, {"X-Fleet-Timeout-Ms": "1000"}, {"X-Fleet-Timeout-Ms": "5000"}):
                r = ask_canary(client, key, **headers)
                assert r.status_code == 504 and "did not answer within 1000 ms" in r.json()["error"], r.text
        after = canary_stats(url)
        assert after["errors"].get("timeout", 0) == before["errors"].get("timeout", 0) + 3
        assert after["requests"] == before["requests"] + 3
        assert metric(url, "fleet_caller_timeouts_total", version="1.1.0") == caller_timeouts
    finally:
        httpx.post(f"{gw['canary']}/_control", json={"delay_ms": CANARY_DELAY_MS})


def test_a_policy_whose_minimum_exceeds_its_timeout_is_refused_with_what_was_expected(tmp_path) -> None:  # noqa: ANN001
    import yaml

    from fleet.catalog.policies.loader import load_policies
    from fleet.errors import ConfigError
    from tests.gateway_env import model_policy
    from tests.serving_env import ROOT

    base = yaml.safe_load((ROOT / "policies" / "fleet.yaml").read_text())
    doc = {"models": {"m": model_policy(timeout_ms=300, min_timeout_ms=500)}}
    (tmp_path / "fleet.yaml").write_text(
        yaml.safe_dump({**doc, "rollout": base["rollout"], "monitoring": base["monitoring"]})
    )
    with pytest.raises(ConfigError, match=r"models\.m\.min_timeout_ms: got 500 — expected at most timeout_ms \(300\)"):
        load_policies(tmp_path)
