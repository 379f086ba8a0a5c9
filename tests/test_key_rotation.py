"""Key rotation against a running gateway: the new key works at once, the old one through
its grace period, and after it the old key is refused exactly like an unknown key.

The gateway builds its key index only when a tenant record changes, and nothing changes in
the store when a grace period runs out: these tests catch a gateway that checks expiry
only when it builds the index. Every wait polls a condition against a deadline; every
process started (a stub model, the gateway) is stopped by ``GatewayEnv.stop``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from fleet.catalog.tenants import Tenants
from tests.gateway_env import GatewayEnv, admin, infer, wait_for

# Long enough that the new key is seen and the old one called before it ends even on a busy
# 2-core machine (the waits below allow 8 s), short enough to see it stop.
GRACE_S = 12.0
UNKNOWN_KEY = "sfk_0badc0de_not-a-key-anyone-was-given"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[GatewayEnv]:
    e = GatewayEnv(tmp_path)
    yield e
    e.stop()


def refused_like_unknown(client: httpx.Client, key: str) -> None:
    """``key`` gets the very answer a key nobody was given gets (status, body, challenge)."""
    got, unknown = infer(client, key), infer(client, UNKNOWN_KEY)
    assert got.status_code == unknown.status_code == 401
    assert got.json() == unknown.json()
    assert got.headers.get("www-authenticate") == unknown.headers.get("www-authenticate")


def served_until(client: httpx.Client, key: str, stops_at: datetime, deadline_s: float = 20.0) -> datetime:
    """Call with ``key`` until it is refused; return when that happened.

    Every answer before the refusal must be a success (the key works through its grace),
    and the refusal must come, within ``deadline_s`` after ``stops_at``.
    """
    deadline = time.monotonic() + (stops_at - datetime.now(UTC)).total_seconds() + deadline_s
    while time.monotonic() < deadline:
        status = infer(client, key).status_code
        if status == 401:
            return datetime.now(UTC)
        assert status == 200, f"the old key got {status} before its grace ended"
        time.sleep(0.05)
    raise AssertionError(f"the old key still worked {deadline_s} s after its grace ended at {stops_at}")


def test_rotating_through_the_admin_api_keeps_the_old_key_for_its_grace_then_refuses_it(env: GatewayEnv) -> None:
    url, old, _ = env.one_version()
    with httpx.Client(base_url=url, timeout=30) as client, admin(url) as adm:
        assert infer(client, old).status_code == 200
        added = adm.post("/admin/tenants/apps/keys", json={})
        assert added.status_code == 201, added.text
        extra = added.json()["api_key"]
        assert all("sha256" not in k for k in added.json()["tenant"]["keys"])
        wait_for(lambda: infer(client, extra).status_code == 200, timeout=8, what="the added key accepted")

        rotated = adm.post("/admin/tenants/apps/rotate", json={"grace_s": GRACE_S})
        assert rotated.status_code == 200, rotated.text
        answer = rotated.json()
        new = answer["api_key"]
        assert new.startswith(f"sfk_{answer['key_id']}_")
        stops = {r["id"]: datetime.fromisoformat(r["stops_at"]) for r in answer["retired"]}
        assert set(stops) == {old.split("_")[1], extra.split("_")[1]} and len(set(stops.values())) == 1
        stops_at = next(iter(stops.values()))

        wait_for(lambda: infer(client, new).status_code == 200, timeout=8, what="the new key accepted")
        assert datetime.now(UTC) < stops_at, "the test machine was too slow to see the grace period"
        assert infer(client, old).status_code == 200  # still within the grace
        refused_at = served_until(client, old, stops_at)
        assert refused_at >= stops_at
        refused_like_unknown(client, old)
        refused_like_unknown(client, extra)
        assert infer(client, new).status_code == 200

        listed = {t["name"]: t for t in adm.get("/admin/tenants").json()}["apps"]["keys"]
        assert [k["expires_at"] is not None for k in listed] == [True, True, False]


def test_a_rotation_written_to_the_store_reaches_the_gateway_without_a_push(env: GatewayEnv) -> None:
    """``fleet tenants rotate`` writes the store only; the gateway's poll picks it up."""
    url, old, _ = env.one_version()
    with httpx.Client(base_url=url, timeout=30) as client:
        assert infer(client, old).status_code == 200
        tenant, new = Tenants(env.store).rotate("apps", grace=timedelta(seconds=GRACE_S))
        stops_at = tenant.keys[0].expires_at
        wait_for(lambda: infer(client, new).status_code == 200, timeout=8, what="the new key accepted")
        assert datetime.now(UTC) < stops_at, "the test machine was too slow to see the grace period"
        assert infer(client, old).status_code == 200
        assert served_until(client, old, stops_at) >= stops_at
        refused_like_unknown(client, old)

        _, newest = Tenants(env.store).rotate("apps", grace=timedelta(0))  # no grace: refused at once
        wait_for(lambda: infer(client, new).status_code == 401, timeout=8, what="the key rotated with no grace refused")
        assert infer(client, newest).status_code == 200


def test_the_admin_api_refuses_bad_rotations_in_one_line(env: GatewayEnv) -> None:
    url, _, _ = env.one_version()
    with admin(url) as adm:
        cases = [
            ("/admin/tenants/apps/rotate", {"grace_s": -1}, 422, "grace_s"),
            ("/admin/tenants/apps/rotate", {}, 422, "grace_s"),
            (
                "/admin/tenants/apps/rotate",
                {"grace_s": 31 * 86400},
                422,
                "expected seconds from 0 (stop the old key at once) to 2592000 (30d)",
            ),
            ("/admin/tenants/apps/rotate", {"grace_s": 1, "key_id": "nope"}, 404, "has no key 'nope'"),
            ("/admin/tenants/apps/rotate", {"grace_s": "60"}, 422, "grace_s"),
            ("/admin/tenants/ghost/rotate", {"grace_s": 1}, 404, "tenant 'ghost' does not exist"),
            ("/admin/tenants/Bad_Name/rotate", {"grace_s": 1}, 422, "tenant"),
            ("/admin/tenants/apps/keys", {"extra": 1}, 422, "extra"),
            ("/admin/tenants/ghost/keys", {}, 404, "tenant 'ghost' does not exist"),
        ]
        other_key = env.tenant("others")  # another tenant's key id is not this tenant's key
        cases.append(
            ("/admin/tenants/apps/rotate", {"grace_s": 1, "key_id": other_key.split("_")[1]}, 404, "has no key")
        )
        for path, body, status, said in cases:
            r = adm.post(path, json=body)
            assert r.status_code == status and said in r.json()["error"], (path, body, r.status_code, r.text)
            assert "\n" not in r.json()["error"]
        for raw in (b'{"grace_s": Infinity}', b'{"grace_s": NaN}', b'{"grace_s": 1e308}', b'{"grace_s": 1e400}'):
            r = adm.post("/admin/tenants/apps/rotate", content=raw, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500 and "\n" not in r.json()["error"], (raw, r.status_code, r.text)
        assert httpx.post(f"{url}/admin/tenants/apps/rotate", json={"grace_s": 1}).status_code == 401
