"""The steps ``create_app`` wires, each on its own without an app or a process: how an error
is answered (``middleware.ErrorAnswers``), health, readiness and stats (``health.Health``),
and the heartbeat's count of live gateways, which divides a quota's local share
(``background.heartbeat``)."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.exceptions import HTTPException
from starlette.requests import Request

from fleet import audit
from fleet.catalog import gateway_directory
from fleet.errors import NotFound
from fleet.gateway import background
from fleet.gateway.activate import Starting
from fleet.gateway.health import Health, quota_state
from fleet.gateway.middleware import ErrorAnswers, Settings
from fleet.gateway.quota.buckets import TokenBuckets
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.view import FleetView
from fleet.store.memory import MemoryStore
from tests.fakes import FakeRuntime


def request(path: str = "/v2/models/m/infer", headers: dict[str, str] | None = None) -> Request:
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
        "state": {"request_id": "r-1"},
    }
    return Request(scope)


def answered(response: object) -> tuple[int, dict, dict]:
    return response.status_code, json.loads(response.body), dict(response.headers)  # type: ignore[attr-defined]


def test_errors_are_answered_with_their_status_and_a_wait_where_waiting_helps() -> None:
    errors = ErrorAnswers(Telemetry(lambda: iter(())))
    status, body, headers = answered(asyncio.run(errors.fleet_error(request(), NotFound("model 'm' is not served"))))
    assert (status, body) == (404, {"error": "model 'm' is not served"}) and "retry-after" not in headers
    status, body, headers = answered(asyncio.run(errors.fleet_error(request(), Starting("m:1 is starting", 2.2))))
    assert status == 503 and headers["retry-after"] == "3"  # whole seconds, rounded up
    status, body, _ = answered(
        asyncio.run(errors.http_error(request("/nowhere"), HTTPException(405, "Method Not Allowed")))
    )
    assert (status, body) == (405, {"error": "Method Not Allowed: POST /nowhere"})
    status, body, _ = answered(asyncio.run(errors.unexpected(request(), RuntimeError("a bug"))))
    assert status == 500 and "request id r-1" in body["error"] and "a bug" not in body["error"]


def health(admin_token: str | None = "secret") -> Health:
    view = FleetView(MemoryStore(), FakeRuntime())
    settings = Settings(admin_token=admin_token, gateway_id="gw-1")
    return Health(view, Telemetry(lambda: iter(())), settings, TokenBuckets(divisor=lambda: 2), {"name": "x"})


def test_not_ready_before_a_snapshot_and_the_admin_token_is_checked() -> None:
    h = health()
    status, body, _ = answered(asyncio.run(h.ready(request("/v2/health/ready"))))
    assert status == 503 and body["ready"] is False and body["gateway"] == "gw-1"
    assert body["quotas"]["backend"] == "in-process" and body["quotas"]["share_divisor"] == 2
    assert h.admin(request(headers={"Authorization": "Bearer secret"}))
    assert not h.admin(request(headers={"Authorization": "Bearer wrong"})) and not h.admin(request())
    assert not health(admin_token=None).admin(request(headers={"Authorization": "Bearer "}))
    assert answered(asyncio.run(h.live(request())))[:2] == (200, {"live": True})
    assert h.stats("m", 60)["versions"] == {} and h.stats("m", 60)["gateway"] == "gw-1"
    assert dict(quota_state(TokenBuckets(divisor=lambda: 3))) == {("shared",): 0.0, ("share_divisor",): 3.0}


class Quotas:
    """A quota backend as the heartbeat reads it."""

    def __init__(self, degraded: bool) -> None:
        self.degraded = degraded


class Stop(Exception):
    """Ends the heartbeat at a chosen beat (it survives only the store's errors)."""


@pytest.mark.parametrize(("degraded", "counted"), [(False, 4), (True, 7)])
def test_the_live_gateways_are_counted_every_beat_only_while_a_shared_budget_is_away(
    monkeypatch: pytest.MonkeyPatch, degraded: bool, counted: int
) -> None:
    """Seven beats: beats 1, 3, 5 and 7 count the live gateways (one listing each); while
    Redis is away, every beat."""
    store, beats, counts = MemoryStore(), [], []
    now = audit.now()
    for i in range(3):  # three gateways announced
        gateway_directory.announce(
            store,
            gateway_directory.GatewayRecord(
                id=f"g{i}", url="http://x", host="h", pid=i, started_at=now, heartbeat_at=now
            ),
        )
    announce, count_live = gateway_directory.announce, gateway_directory.count_live

    def beat(s: object, r: object) -> object:
        beats.append(1)
        if len(beats) > 7:
            raise Stop
        return announce(s, r)  # type: ignore[arg-type]

    monkeypatch.setattr(gateway_directory, "HEARTBEAT_S", 0.001)
    monkeypatch.setattr(gateway_directory, "announce", beat)
    monkeypatch.setattr(gateway_directory, "count_live", lambda s, i: counts.append(1) or count_live(s, i))
    record = gateway_directory.GatewayRecord(id="g0", url="http://x", host="h", pid=0, started_at=now, heartbeat_at=now)
    peers = background.Peers(1)
    with pytest.raises(Stop):
        asyncio.run(asyncio.wait_for(background.heartbeat(store, record, peers, Quotas(degraded)), 10))  # type: ignore[arg-type]
    assert peers() == 3 and len(counts) == counted
