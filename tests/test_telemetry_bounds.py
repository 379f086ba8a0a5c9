"""What the gateway's telemetry holds stays bounded at fleet size: windowed stats allocated as
they are used and freed once a version has been out of every route for their horizon; the
tenant label only on counters, dropped for idle tenants; ``/metrics`` at 10,000 tenants."""

from __future__ import annotations

import numpy as np

from fleet.gateway import telemetry as telemetry_module
from fleet.gateway.stats import HORIZON_S, WindowedStats
from fleet.gateway.telemetry import FORGET_AFTER_S, PRUNE_S, TENANT_IDLE_S, Telemetry


def _telemetry() -> Telemetry:
    return Telemetry(lambda: iter(()))


def test_a_version_asked_once_holds_one_slot_not_a_whole_horizon() -> None:
    stats = WindowedStats(clock=lambda: 1000.0)
    stats.answered("demo", "1.0.0", 5.0, None)
    series = stats._series["demo", "1.0.0"]
    assert sum(slot is not None for slot in series.slots) == 1
    assert stats.window("demo", 60)[2]["1.0.0"]["requests"] == 1


def test_a_version_out_of_every_route_is_freed_after_the_horizon_and_kept_before() -> None:
    t = _telemetry()
    t.routed({("demo", "1.0.0"), ("demo", "1.1.0")}, now=0.0)
    for version in ("1.0.0", "1.1.0"):
        t.answered("demo", version, 3.0, np.array([0.4]))
        t.finished("demo", version, "acme", 200, 4.0)
    t.routed({("demo", "1.0.0")}, now=10.0)  # 1.1.0 rolled back
    t.prune(now=10.0 + FORGET_AFTER_S - 1)
    assert "1.1.0" in t.stats.window("demo", HORIZON_S)[2]  # still readable by a window
    assert b'version="1.1.0"' in t.exposition()
    t.prune(now=10.0 + FORGET_AFTER_S)
    assert t.stats.versions() == {("demo", "1.0.0")}
    assert b'version="1.1.0"' not in t.exposition() and b'version="1.0.0"' in t.exposition()
    t.routed({("demo", "1.0.0"), ("demo", "1.2.0")}, now=20.0)  # routed again before its time: kept
    t.answered("demo", "1.2.0", 3.0, np.array([0.4]))
    t.routed({("demo", "1.0.0")}, now=30.0)
    t.routed({("demo", "1.0.0"), ("demo", "1.2.0")}, now=40.0)
    t.prune(now=40.0 + FORGET_AFTER_S)
    assert ("demo", "1.2.0") in t.stats.versions()


def test_an_idle_tenant_s_samples_are_dropped_and_an_active_one_s_kept() -> None:
    t = _telemetry()
    t.finished("demo", "1.0.0", "idle", 200, 4.0)
    t.quota_refused("idle")
    t.finished("demo", "1.0.0", "busy", 200, 4.0)
    for _ in range(int(TENANT_IDLE_S / PRUNE_S) + 1):
        t.prune(now=0.0)
        t.finished("demo", "1.0.0", "busy", 200, 4.0)
    t.prune(now=0.0)
    text = t.exposition()
    assert b'tenant="idle"' not in text and b'tenant="busy"' in text
    assert b"fleet_request_duration_seconds_count" in text and b'tenant="busy",le=' not in text
    t.finished("demo", "1.0.0", "idle", 429, 1.0)  # back: counted from zero again
    assert b'fleet_requests_total{code="429",model="demo",tenant="idle",version="1.0.0"} 1.0' in t.exposition()


def test_metrics_at_ten_thousand_tenants_stay_under_the_stated_ceiling() -> None:
    """The ceiling the architecture note states: ~110 bytes per active tenant, version and
    status code; no histogram per tenant."""
    t = _telemetry()
    for i in range(10_000):
        t.finished("demo", "1.0.0", f"tenant-{i:05d}", 200, 4.0)
    size = len(t.exposition())
    assert size < 10_000 * 110 + 64 * 1024, size
    assert size > 10_000 * 60  # every tenant is there
    assert telemetry_module.TENANT_IDLE_S >= 2 * 60  # longer than any scrape interval: the last count is read
