"""Usage and cost per tenant, model and version (fleet.usage, ``fleet usage``): the gateway's
meter on a fake clock, its hour files in a real file:// store, the rollup over several
gateways, the cost arithmetic, the Prometheus collector and the command line."""

from __future__ import annotations

import json
import math
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError
from typer.testing import CliRunner

from fleet.errors import InvalidInput, StoreUnavailable
from fleet.store import open_store
from fleet.types import ObjectStore
from fleet.usage.meter import MAX_GAP_S, UsageMeter
from fleet.usage.prices import Price, prices_from_plan, prices_from_stack
from fleet.usage.records import TrafficRecord, UsageHour, hour_key, part_key
from fleet.usage.rollup import gateway_hour, rollup
from tests.fakes import Clock
from tests.quiet import assert_quiet

ROOT = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 12, 1, 14, 0, tzinfo=UTC).timestamp()  # the start of a UTC hour
H14 = datetime(2026, 12, 1, 14, 0, tzinfo=UTC)
PRICE = Price(
    2.0, "g5.xlarge", "placement: 1 of a g5.xlarge node per replica at Pulumi.test.yaml: nodePools[a10g].hourly_usd 2"
)
DEMO = ("demo", "1.0.0")


def priced(model: str) -> Price | None:
    return PRICE if model == "demo" else None


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return open_store(f"file://{tmp_path / 'store'}")


def meter(store: ObjectStore, gateway: str = "gw-a", at: float = T0, prices=priced) -> tuple[UsageMeter, Clock]:  # noqa: ANN001
    clock = Clock(at)
    return UsageMeter(store, gateway, prices, clock=clock), clock


def sample(m: UsageMeter, clock: Clock, counts: dict, seconds: int, step: float = 1.0) -> None:
    """The gateway's once-a-second replica sample, ``seconds`` long from the clock's time."""
    for _ in range(int(seconds / step)):
        clock.now += step
        m.replicas(counts, clock.now)


def stored(store: ObjectStore, hour: datetime, gateway: str = "gw-a") -> UsageHour:
    """The gateway's hour as the rollup reads it: its whole file, or its parts summed."""
    return gateway_hour(store, hour, gateway)


# -- the meter ---------------------------------------------------------------------------------


def test_served_counts_requests_rows_and_upstream_seconds_per_tenant_and_version(store: ObjectStore) -> None:
    m, _ = meter(store)
    m.served("acme", "demo", "1.0.0", 4, 0.5)
    m.served("acme", "demo", "1.0.0", 1, 0.25)
    m.served("globex", "demo", "1.1.0", 32, 1.0)
    traffic, replica = m.totals()
    assert traffic == {("acme", "demo", "1.0.0"): (2, 5, 0.75, 0), ("globex", "demo", "1.1.0"): (1, 32, 1.0, 0)}
    assert replica == {}
    # a NaN, infinite or negative upstream time counts the request, not the time
    for bad in (math.nan, math.inf, -1.0):
        m.served("acme", "demo", "1.0.0", 1, bad)
    assert m.totals()[0]["acme", "demo", "1.0.0"] == (5, 8, 0.75, 0) and m.invalid_upstream == 3


def test_replica_seconds_integrate_count_times_elapsed_with_gaps_capped(store: ObjectStore) -> None:
    m, clock = meter(store)
    m.replicas({DEMO: 2}, T0 + 10)  # the first sample only starts the clock
    m.replicas({DEMO: 2}, T0 + 11)
    m.replicas({DEMO: 3}, T0 + 13)  # 3 replicas over the last 2 s
    m.replicas({DEMO: 3}, T0 + 13 + 3600)  # a paused process: at most MAX_GAP_S
    m.replicas({DEMO: 1}, T0 + 13)  # the clock went back: a new start, nothing counted
    m.replicas({DEMO: 1}, T0 + 14)
    assert m.totals()[1] == {DEMO: 2 * 1 + 3 * 2 + 3 * MAX_GAP_S + 1}
    m.replicas({DEMO: 0, ("demo", "2.0.0"): 0}, T0 + 15)  # scaled to zero: known, and zero
    assert m.totals()[1] == {DEMO: 2 + 6 + 30 + 1, ("demo", "2.0.0"): 0.0}


def test_an_hour_boundary_splits_requests_and_replica_seconds_between_hour_files(store: ObjectStore) -> None:
    m, clock = meter(store, at=T0 + 3595)
    m.replicas({DEMO: 2}, clock.now)
    m.served("acme", "demo", "1.0.0", 1, 0.1)
    clock.now = T0 + 3605
    m.replicas({DEMO: 2}, clock.now)  # 5 s before 15:00, 5 s after
    m.served("acme", "demo", "1.0.0", 2, 0.2)
    assert m.flush() == 2
    h14, h15 = stored(store, H14), stored(store, H14 + timedelta(hours=1))
    assert [(t.requests, t.rows) for t in h14.traffic] == [(1, 1)] and [(t.requests, t.rows) for t in h15.traffic] == [
        (1, 2)
    ]
    [v14], [v15] = h14.versions, h15.versions
    assert v14.replica_s_by_minute[59] == 10.0 and sum(v14.replica_s_by_minute) == 10.0
    assert v15.replica_s_by_minute[0] == 10.0 and sum(v15.replica_s_by_minute) == 10.0


def test_flush_appends_what_changed_and_writes_the_hour_whole_when_it_is_let_go(store: ObjectStore) -> None:
    m, clock = meter(store)
    for _ in range(3):
        m.served("acme", "demo", "1.0.0", 2, 0.5)
    m.served("globex", "demo", "1.0.0", 1, 0.5)
    assert m.flush() == 1
    assert [(t.requests, t.rows, t.upstream_s) for t in stored(store, H14).traffic] == [(3, 6, 1.5), (1, 1, 0.5)]
    assert m.flush() == 0  # nothing changed: nothing written
    clock.now += 600
    m.served("acme", "demo", "1.0.0", 1, 0.5)
    assert m.flush() == 1
    # the second part holds only what changed: one tenant, one request; the first is never rewritten
    first, second = (UsageHour.model_validate_json(store.get(part_key(H14, "gw-a", n)).data) for n in (0, 1))
    assert [(t.tenant, t.requests) for t in second.traffic] == [("acme", 1)] and len(first.traffic) == 2
    assert [(t.requests, t.rows, t.upstream_s) for t in stored(store, H14).traffic] == [(4, 7, 2.0), (1, 1, 0.5)]
    # two hours on, the hour is written whole, its parts deleted, and let go; the counters keep it
    clock.now = T0 + 2 * 3600
    m.served("acme", "demo", "1.0.0", 1, 0.5)
    assert m.flush() == 2 and 14 * 3600 not in m._traffic
    assert [k for k in store.list("usage/2026-12-01T14/")] == [hour_key(H14, "gw-a")]
    assert m.totals()[0]["acme", "demo", "1.0.0"] == (5, 8, 2.5, 0)
    assert [t.requests for t in stored(store, H14).traffic] == [4, 1]
    assert [t.requests for t in stored(store, H14 + timedelta(hours=2)).traffic] == [1]
    assert m.close() == 1 and list(store.list("usage/2026-12-01T16/")) == [hour_key(H14 + timedelta(hours=2), "gw-a")]


def test_a_part_whose_write_landed_but_whose_answer_was_lost_is_counted_once(store: ObjectStore) -> None:
    class LostAnswer:
        """The store, but the next write of a part lands and then reports a timeout."""

        def __init__(self, inner: ObjectStore) -> None:
            self.inner, self.url, self.lose = inner, inner.url, True

        def put(self, key: str, data: bytes, **kw) -> str:  # noqa: ANN003
            etag = self.inner.put(key, data, **kw)
            if self.lose and key.count("/") == 3:
                self.lose = False
                raise StoreUnavailable(f"read timeout on {key}")
            return etag

        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(self.inner, name)

    m, clock = meter(LostAnswer(store))  # type: ignore[arg-type]
    m.served("acme", "demo", "1.0.0", 2, 0.5)
    assert m.flush() == 0 and m.failing  # landed, but as far as the meter knows, not written
    m.served("acme", "demo", "1.0.0", 3, 0.5)
    assert m.flush() == 2  # the landed part is taken as written; the rest in the next part
    assert len(list(store.list("usage/2026-12-01T14/gw-a/"))) == 2
    assert [(t.requests, t.rows) for t in stored(store, H14).traffic] == [(2, 5)]  # nothing twice


def test_a_gateway_that_dies_mid_hour_leaves_parts_the_rollup_reads_like_a_whole_file(store: ObjectStore) -> None:
    m, clock = meter(store)
    m.replicas({DEMO: 2}, clock.now)
    for step in range(5):
        sample(m, clock, {DEMO: 2}, 30)
        m.served("acme", "demo", "1.0.0", step + 1, 0.25)
        assert m.flush() == 1
    from_parts = rollup(store, H14, H14 + timedelta(hours=1))  # the process dies here: parts only
    assert len(list(store.list("usage/2026-12-01T14/gw-a/"))) == 5
    m.close()
    whole = rollup(store, H14, H14 + timedelta(hours=1))
    assert list(store.list("usage/2026-12-01T14/")) == [hour_key(H14, "gw-a")]
    assert from_parts.versions == whole.versions and from_parts.tenants == whole.tenants
    assert whole.version(*DEMO).replica_s == 300.0 and whole.version(*DEMO).rows == 15


def test_a_store_that_is_down_keeps_the_counts_until_a_flush_gets_through(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, clock = meter(store)
    m.served("acme", "demo", "1.0.0", 2, 0.5)
    real = store.put

    def down(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise StoreUnavailable("the store is down")

    monkeypatch.setattr(store, "put", down)
    clock.now = T0 + 3 * 3600  # long past: still not let go, since it is not written
    assert m.flush() == 0 and m.failing
    monkeypatch.setattr(store, "put", real)
    assert m.flush() == 1 and not m.failing
    assert [t.requests for t in stored(store, H14).traffic] == [1]


def test_the_thread_flushes_and_close_writes_what_is_left(store: ObjectStore) -> None:
    m = UsageMeter(store, "gw-a", priced, flush_s=0.05)
    m.start()
    m.served("acme", "demo", "1.0.0", 1, 0.1)
    deadline = time.monotonic() + 5
    while not list(store.list("usage/")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(store.list("usage/"))
    m.served("acme", "demo", "1.0.0", 1, 0.1)
    m.close()
    files = [UsageHour.model_validate_json(store.get(k).data) for k in store.list("usage/")]
    assert sum(t.requests for f in files for t in f.traffic) == 2


def test_each_file_names_the_price_and_its_source_and_none_when_unknown(store: ObjectStore) -> None:
    m, clock = meter(store)
    m.replicas({DEMO: 1, ("other", "2.0.0"): 1}, clock.now)
    sample(m, clock, {DEMO: 1, ("other", "2.0.0"): 1}, 1)
    m.served("acme", "other", "2.0.0", 1, 0.1)
    m.flush()
    raw = json.loads(store.get(part_key(H14, "gw-a", 0)).data)
    prices = {(v["model"], v["version"]): v["price"] for v in raw["versions"]}
    assert prices[DEMO] == {"usd_per_replica_hour": 2.0, "instance": "g5.xlarge", "source": PRICE.source}
    assert prices["other", "2.0.0"] == {"usd_per_replica_hour": None, "instance": None, "source": "none"}


def test_records_refuse_nan_and_a_price_without_source(store: ObjectStore) -> None:
    with pytest.raises(ValidationError):
        TrafficRecord(tenant="a", model="m", version="1", requests=1, rows=1, upstream_s=math.nan)
    with pytest.raises(ValidationError, match="a price has a number and a source"):
        UsageHour.model_validate(
            {
                "hour": H14,
                "gateway": "g",
                "traffic": [],
                "versions": [
                    {
                        "model": "m",
                        "version": "1",
                        "replica_s_by_minute": None,
                        "price": {"usd_per_replica_hour": 1.0, "source": "none"},
                    }
                ],
            }
        )
    with pytest.raises(InvalidInput, match="gateway id"):
        UsageMeter(store, "a/b", priced)


# -- several gateways, cost ---------------------------------------------------------------------


def test_two_gateways_sum_requests_and_take_the_max_of_replica_seconds(store: ObjectStore) -> None:
    a, ca = meter(store, "gw-a")
    b, cb = meter(store, "gw-b")
    a.replicas({DEMO: 2}, ca.now)
    b.replicas({DEMO: 2}, cb.now)
    sample(a, ca, {DEMO: 2}, 600)
    sample(b, cb, {DEMO: 2}, 599)  # started a moment later: the max keeps a's second
    for _ in range(3):
        a.served("acme", "demo", "1.0.0", 10, 1.0)
    b.served("acme", "demo", "1.0.0", 10, 1.0)
    b.served("globex", "demo", "1.0.0", 10, 2.0)
    a.flush(), b.flush()
    report = rollup(store, H14, H14 + timedelta(hours=1))
    v = report.version(*DEMO)
    assert (v.requests, v.rows, v.upstream_s, v.replica_s) == (5, 50, 6.0, 1200.0)
    assert report.files == 2


def test_a_gateway_that_restarts_mid_hour_counts_both_halves_of_the_hour(store: ObjectStore) -> None:
    old, c1 = meter(store, "gw-old")
    old.replicas({DEMO: 1}, c1.now)
    sample(old, c1, {DEMO: 1}, 1800)
    old.flush()
    new, c2 = meter(store, "gw-new", at=T0 + 1800)  # a new process, a new id, a new file
    new.replicas({DEMO: 1}, c2.now)
    sample(new, c2, {DEMO: 1}, 1800)
    new.flush()
    assert rollup(store, H14, H14 + timedelta(hours=1)).version(*DEMO).replica_s == 3600.0


def test_cost_per_version_and_per_tenant_by_share_of_upstream_seconds(store: ObjectStore) -> None:
    m, clock = meter(store)
    m.replicas({DEMO: 2}, clock.now)
    sample(m, clock, {DEMO: 2}, 900)  # 1,800 replica-s = 0.5 replica-h at 2 USD: 1 USD, idle time included
    for _ in range(6):
        m.served("acme", "demo", "1.0.0", 50, 0.5)  # 300 rows, 3 s upstream
    m.served("globex", "demo", "1.0.0", 200, 1.0)  # 200 rows, 1 s upstream
    m.flush()
    report = rollup(store, H14, H14 + timedelta(hours=1))
    v = report.version(*DEMO)
    assert (v.requests, v.rows, v.upstream_s, v.replica_s) == (7, 500, 4.0, 1800.0)
    assert v.usd == 1.0 and v.usd_per_1k_inferences == 2.0
    assert (v.price.usd_per_replica_hour, v.price.instance, v.price.source) == (2.0, "g5.xlarge", PRICE.source)
    tenants = {t.tenant: t for t in report.tenants}
    assert (tenants["acme"].share, tenants["acme"].usd, tenants["acme"].usd_per_1k_inferences) == (0.75, 0.75, 2.5)
    assert (tenants["globex"].share, tenants["globex"].usd, tenants["globex"].usd_per_1k_inferences) == (
        0.25,
        0.25,
        1.25,
    )
    assert tenants["acme"].replica_s == 1350.0


def test_generations_count_tokens_and_cost_per_1k_tokens_and_tensor_hours_stay_as_they_were(store: ObjectStore) -> None:
    m, clock = meter(store)
    m.replicas({DEMO: 1}, clock.now)
    sample(m, clock, {DEMO: 1}, 1800)  # 0.5 replica-h at 2 USD: 1 USD
    m.served("acme", "demo", "1.0.0", 1, 3.0, tokens=1500)
    m.served("globex", "demo", "1.0.0", 1, 1.0, tokens=500)
    m.served("globex", "demo", "1.0.0", 4, 0.0)  # a tensor request of the same tenant: no tokens
    m.flush()
    assert all("tokens" in t.model_dump() for t in stored(store, H14).traffic)
    v = rollup(store, H14, H14 + timedelta(hours=1)).version(*DEMO)
    assert v.tokens == 2000 and v.usd == 1.0 and v.usd_per_1k_tokens == 0.5
    tenants = {t.tenant: t for t in rollup(store, H14, H14 + timedelta(hours=1)).tenants}
    assert (tenants["acme"].tokens, tenants["acme"].usd, tenants["acme"].usd_per_1k_tokens) == (1500, 0.75, 0.5)
    m2, _ = meter(store, "gw-b")
    m2.served("acme", "demo", "1.0.0", 2, 0.1)
    m2.flush()
    assert b'"tokens"' not in store.get(part_key(H14, "gw-b", 0)).data  # readable by a gateway that predates tokens


def test_a_version_without_price_or_without_replica_samples_costs_unknown_never_zero(store: ObjectStore) -> None:
    m, clock = meter(store)
    m.replicas({("other", "2.0.0"): 1}, clock.now)
    sample(m, clock, {("other", "2.0.0"): 1}, 60)
    m.served("acme", "other", "2.0.0", 5, 0.5)  # no price
    m.served("acme", "demo", "1.0.0", 5, 0.5)  # priced, but its replicas were never sampled
    m.flush()
    report = rollup(store, H14, H14 + timedelta(hours=1))
    other, demo = report.version("other", "2.0.0"), report.version(*DEMO)
    assert other.replica_s == 60.0 and other.usd is None and other.usd_per_1k_inferences is None
    assert other.price.source == "none" and other.price.usd_per_replica_hour is None
    assert demo.usd is None and demo.price.source == PRICE.source
    assert all(t.usd is None and t.usd_per_1k_inferences is None for t in report.tenants)


def test_rollup_filters_by_tenant_model_and_window_and_skips_unreadable_files(store: ObjectStore) -> None:
    m, clock = meter(store)
    m.replicas({DEMO: 1, ("other", "2.0.0"): 1}, clock.now)
    sample(m, clock, {DEMO: 1, ("other", "2.0.0"): 1}, 60)
    m.served("acme", "demo", "1.0.0", 1, 1.0)
    m.served("globex", "demo", "1.0.0", 1, 3.0)
    m.served("globex", "other", "2.0.0", 1, 1.0)
    clock.now = T0 + 5 * 3600
    m.served("acme", "demo", "1.0.0", 1, 1.0)  # 19:00, outside a window that ends at 15:00
    m.flush()
    store.put("usage/2026-12-01T14/gw-broken.json", b"{not json")
    store.put(
        "usage/2026-12-01T14/gw-elsewhere.json", store.get(hour_key(H14, "gw-a")).data
    )  # another gateway's file (written whole: 5 h on)

    report = rollup(store, H14 + timedelta(minutes=30), H14 + timedelta(hours=1), tenant="acme")
    assert report.since == H14  # whole hours
    assert [(v.model, v.version) for v in report.versions] == [DEMO]  # only what acme used
    assert report.version(*DEMO).requests == 2  # the version's totals stay every tenant's
    [acme] = report.tenants
    assert (acme.tenant, acme.requests, acme.share) == ("acme", 1, 0.25)
    assert sorted(b.key for b in report.skipped) == [
        "usage/2026-12-01T14/gw-broken.json",
        "usage/2026-12-01T14/gw-elsewhere.json",
    ]

    by_model = rollup(store, H14, H14 + timedelta(hours=1), model="other")
    assert [(v.model, v.version) for v in by_model.versions] == [("other", "2.0.0")]
    assert [t.tenant for t in by_model.tenants] == ["globex"] and by_model.tenants[0].share == 1.0
    everything = rollup(store, H14, H14 + timedelta(hours=6))
    assert everything.version(*DEMO).requests == 3 and everything.files == 2
    with pytest.raises(InvalidInput, match="timezone-aware"):
        rollup(store, datetime(2026, 12, 1), datetime(2026, 12, 2))


# -- Prometheus ---------------------------------------------------------------------------------


def test_the_collector_exposes_usage_counters_replica_seconds_and_price(store: ObjectStore) -> None:
    m, clock = meter(store)
    registry = CollectorRegistry()
    registry.register(m.collector())
    m.replicas({DEMO: 2, ("other", "2.0.0"): 1}, clock.now)
    sample(m, clock, {DEMO: 2, ("other", "2.0.0"): 1}, 5)
    m.served("acme", "demo", "1.0.0", 4, 0.5)
    text = generate_latest(registry).decode()
    for line in (
        'fleet_usage_requests_total{model="demo",tenant="acme",version="1.0.0"} 1.0',
        'fleet_usage_rows_total{model="demo",tenant="acme",version="1.0.0"} 4.0',
        'fleet_usage_upstream_seconds_total{model="demo",tenant="acme",version="1.0.0"} 0.5',
        'fleet_version_replica_seconds_total{model="demo",version="1.0.0"} 10.0',
        'fleet_version_replica_seconds_total{model="other",version="2.0.0"} 5.0',
        'fleet_version_price_usd_per_replica_hour{model="demo",version="1.0.0"} 2.0',
        "# TYPE fleet_usage_requests_total counter",
        "# TYPE fleet_version_price_usd_per_replica_hour gauge",
    ):
        assert line in text, f"{line} not in:\n{text}"
    assert 'fleet_version_price_usd_per_replica_hour{model="other"' not in text  # unknown: absent, not 0
    # three hours on, acme's hour is let go: its series leave /metrics; back, with its whole total
    clock.now += 3 * 3600
    m.served("globex", "demo", "1.0.0", 1, 0.5)
    m.flush()
    text = generate_latest(registry).decode()
    assert 'tenant="acme"' not in text and 'tenant="globex"' in text
    m.served("acme", "demo", "1.0.0", 1, 0.5)
    assert (
        'fleet_usage_requests_total{model="demo",tenant="acme",version="1.0.0"} 2.0'
        in generate_latest(registry).decode()
    )


# -- prices from the placement ----------------------------------------------------------------


def test_prices_come_from_the_placement_plan_of_a_stack() -> None:
    from fleet.catalog.policies.loader import load_policies
    from fleet.planning.costs import inference_costs
    from fleet.planning.planner import plan
    from fleet.planning.stack import placement_inputs, read_stack_file

    path = ROOT / "Pulumi.dev.yaml"
    loaded = load_policies(ROOT / "policies")
    pools, models = placement_inputs(read_stack_file(path), str(path), loaded)
    result = plan(loaded, pools, models)
    prices = prices_from_plan(result, pools, path.name)
    costs = {c.model: c.replica_usd_per_hour for c in inference_costs(result, pools)}
    assert prices and {m: p.usd_per_replica_hour for m, p in prices.items()} == costs
    for m in result.models:
        assert prices[m.model].instance == m.instance_type
        assert f"Pulumi.dev.yaml: nodePools[{m.pool}].hourly_usd" in prices[m.model].source
    assert prices_from_stack(str(path), ROOT / "policies") == prices


# -- fleet usage ---------------------------------------------------------------------------------


def _fleet(*args: str):  # noqa: ANN202
    from fleet.cli import app

    return CliRunner().invoke(app, ["usage", *args], catch_exceptions=False)


@pytest.fixture
def recent(store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    """Ten minutes ago: demo 1.0.0 served acme and globex on 2 replicas at 2 USD; other 2.0.0 unpriced."""
    monkeypatch.setenv("FLEET_STORE", store.url if "://" in store.url else f"file://{store.url}")
    m, clock = meter(store, at=time.time() - 600)
    counts = {DEMO: 2, ("other", "2.0.0"): 1}
    m.replicas(counts, clock.now)
    sample(m, clock, counts, 60, step=10.0)  # 120 replica-s of demo
    for _ in range(3):
        m.served("acme", "demo", "1.0.0", 100, 1.0)
    m.served("globex", "demo", "1.0.0", 100, 1.0)
    m.served("acme", "other", "2.0.0", 7, 0.5)
    m.flush()
    return store


def test_fleet_usage_json(recent: ObjectStore) -> None:
    out = _fleet("--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    versions = {(v["model"], v["version"]): v for v in data["versions"]}
    demo = versions[DEMO]
    assert (demo["requests"], demo["rows"], demo["replica_s"]) == (4, 400, 120.0)
    assert demo["usd"] == pytest.approx(120 / 3600 * 2.0) and demo["price"]["source"] == PRICE.source
    assert demo["usd_per_1k_inferences"] == pytest.approx(120 / 3600 * 2.0 / 400 * 1000)
    assert versions["other", "2.0.0"]["usd"] is None and versions["other", "2.0.0"]["price"]["source"] == "none"
    tenants = {(t["tenant"], t["model"]): t for t in data["tenants"]}
    assert tenants["acme", "demo"]["share"] == 0.75 and tenants["globex", "demo"]["usd"] == pytest.approx(
        demo["usd"] / 4
    )
    assert "row" in data["inference"]

    only = json.loads(_fleet("--tenant", "globex", "--since", "90m", "--json").stdout)
    assert [(t["tenant"], t["model"]) for t in only["tenants"]] == [("globex", "demo")]
    assert [v["model"] for v in json.loads(_fleet("--model", "other", "--json").stdout)["versions"]] == ["other"]


def test_fleet_usage_table(recent: ObjectStore) -> None:
    out = _fleet()
    assert out.exit_code == 0, out.output
    text = out.stdout
    for column in ("tenant", "model", "version", "requests", "rows", "upstream s", "replica h", "USD", "price source"):
        assert column in text
    words = set(text.split())
    assert {"acme", "globex", "(all)", "demo", "1.0.0", "other", "2.0.0", "none", "-"} <= words
    assert f"{120 / 3600 * 2:.4f}" in words  # demo's USD
    assert "an inference is one input row" in " ".join(text.split())
    assert "nothing served" in _fleet("--tenant", "nobody").stdout


def test_fleet_usage_refuses_a_bad_since(
    recent: ObjectStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidInput, match=r"--since 'abc' is not a duration; expected like 90m, 24h, 7d"):
        _fleet("--since", "abc")
    for bad in ("0h", "24", "1w", "999d"):
        with pytest.raises(InvalidInput, match="expected like 90m, 24h, 7d"):
            _fleet("--since", bad)
    from fleet.cli import main

    monkeypatch.setattr(sys, "argv", ["fleet", "usage", "--since", "abc"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 1
    assert capsys.readouterr().err.startswith("error: --since 'abc' is not a duration; expected like 90m, 24h, 7d")


# -- end to end: a real gateway meters, `fleet usage` reads ------------------------------------


def test_a_gateway_meters_what_it_served_and_fleet_usage_prices_it(tmp_path: Path) -> None:
    import json as json_
    import subprocess

    import httpx

    from fleet.usage.prices import write_prices
    from tests.gateway_env import MODEL, GatewayEnv, metric, wait_for
    from tests.serving_env import FLEET

    env = GatewayEnv(tmp_path)
    prices = tmp_path / "prices.json"
    prices.write_text(write_prices({MODEL: Price(0.36, "m6i.large", "test price file")}))
    env.register("1.0.0")
    env.stub("1.0.0")
    env.route(stable="1.0.0")
    key = env.tenant("apps")
    try:
        url, proc = env.gateway(FLEET_PRICES_FILE=str(prices))
        body = {"inputs": [{"name": "features", "shape": [2, 4], "datatype": "FP32", "data": [1.0, 0, 0, 0] * 2}]}
        with httpx.Client(base_url=url, timeout=10) as client:
            for _ in range(5):
                r = client.post(f"/v2/models/{MODEL}/infer", json=body, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200
        assert metric(url, "fleet_usage_rows_total", tenant="apps", model=MODEL, version="1.0.0") == 10
        assert metric(url, "fleet_version_price_usd_per_replica_hour", model=MODEL, version="1.0.0") == 0.36
        wait_for(
            lambda: metric(url, "fleet_version_replica_seconds_total", model=MODEL, version="1.0.0") > 0,
            what="a replica sample after the first (about 1 s)",
        )
        proc.terminate()  # a clean stop flushes the hour file
        assert proc.wait(timeout=30) == 0
    finally:
        env.stop()
    out = subprocess.run(
        [FLEET, "usage", "--json"], env=env.env(), cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert_quiet(out.stdout + out.stderr, "fleet usage")
    report = json_.loads(out.stdout)
    (version,) = [v for v in report["versions"] if v["model"] == MODEL]
    assert version["requests"] == 5 and version["rows"] == 10 and version["upstream_s"] > 0
    assert version["replica_s"] > 0 and version["price"]["source"] == "test price file"
    assert version["usd"] == pytest.approx(version["replica_s"] / 3600 * 0.36)
    (tenant,) = [t for t in report["tenants"] if t["tenant"] == "apps"]
    assert tenant["share"] == pytest.approx(1.0) and tenant["usd_per_1k_inferences"] == pytest.approx(
        version["usd"] / 10 * 1000
    )
