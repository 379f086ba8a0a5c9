"""The gateway's decision parts on their own: token buckets, priority slots, the prediction
cache, windowed stats and outlier ejection, driven by a fake clock where time matters."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fleet.gateway.cache import ENTRY_OVERHEAD, PredictionCache
from fleet.gateway.quota.buckets import TokenBuckets
from fleet.gateway.replicas import EJECT_AFTER, Replica
from fleet.gateway.slots import QueueFull, Slots
from fleet.gateway.stats import WindowedStats
from fleet.types import LATENCY_BUCKETS_MS, PREDICTION_BINS, latency_bucket, score_bins
from tests.fakes import Clock


def test_token_bucket_allows_the_burst_then_the_rate() -> None:
    clock = Clock(1000.0)
    buckets = TokenBuckets(clock)
    assert [buckets.take("t", rps=2, burst=3) for _ in range(3)] == [None, None, None]
    refusal = buckets.take("t", rps=2, burst=3)
    assert refusal.reason == "rate" and refusal.wait_s == pytest.approx(0.5)  # one token at 2/s
    clock.now += 0.25
    assert buckets.take("t", rps=2, burst=3).wait_s == pytest.approx(0.25)
    clock.now += 0.25
    assert buckets.take("t", rps=2, burst=3) is None
    assert buckets.take("other", rps=2, burst=3) is None  # buckets are per tenant
    clock.now += 100
    assert [buckets.take("t", rps=2, burst=3) for _ in range(4)].count(None) == 3  # refills to burst, no more


def test_a_token_quota_saves_up_a_minute_lets_one_answer_into_debt_and_waits_it_out() -> None:
    clock = Clock(1000.0)
    buckets = TokenBuckets(clock)
    assert asyncio.run(buckets.check_tokens("t", 600)) is None  # 600 tokens a minute: one per 0.1 s
    buckets.charge_tokens("t", 600, 590)
    assert asyncio.run(buckets.check_tokens("t", 600)) is None  # 10 left
    buckets.charge_tokens("t", 600, 100)  # an answer is not cut off: 90 tokens of debt
    refusal = asyncio.run(buckets.check_tokens("t", 600))
    assert refusal.reason == "tokens" and refusal.wait_s == pytest.approx(9.1)  # the debt, then one token
    clock.now += 9.1
    assert asyncio.run(buckets.check_tokens("t", 600)) is None
    shared = TokenBuckets(clock, divisor=lambda: 2)  # two gateways without Redis: each spends half
    shared.charge_tokens("u", 600, 300)
    assert asyncio.run(shared.check_tokens("u", 600)).wait_s == pytest.approx(0.2)


def test_a_reservation_takes_max_tokens_at_once_so_concurrent_generations_cannot_overshoot_and_refunds() -> None:
    clock = Clock(1000.0)
    buckets = TokenBuckets(clock)
    buckets.charge_tokens("t", 600, 598)  # two tokens left of 600 a minute

    async def five_at_once() -> list[object]:
        return list(await asyncio.gather(*(buckets.reserve_tokens("t", 600, 50) for _ in range(5))))

    admitted = [r for r in asyncio.run(five_at_once()) if r is None]
    assert len(admitted) == 1  # checking alone, all five would have started on the last tokens
    assert asyncio.run(buckets.check_tokens("t", 600)).wait_s == pytest.approx(4.9)  # 48 of debt, then one
    buckets.charge_tokens("t", 600, -45)  # it used 5 of its 50: the rest given back
    assert asyncio.run(buckets.check_tokens("t", 600)).wait_s == pytest.approx(0.4)
    buckets.charge_tokens("t", 600, -10_000)  # a refund never saves up more than a whole budget
    assert "t" not in buckets._tokens and asyncio.run(buckets.check_tokens("t", 600)) is None


def test_slots_hand_freed_slots_to_interactive_first_and_shed_past_the_bound() -> None:
    async def scenario() -> list[str]:
        slots = Slots(limit=1, max_waiting=3)
        await slots.acquire("batch", "m:1")  # the one slot
        order: list[str] = []

        async def wait(name: str, priority: str) -> None:
            await slots.acquire(priority, "m:1")
            order.append(name)
            slots.release()

        tasks = [asyncio.create_task(wait("b1", "batch")), asyncio.create_task(wait("b2", "batch"))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(wait("i1", "interactive")))
        await asyncio.sleep(0)
        assert (slots.waiting("batch"), slots.waiting("interactive")) == (2, 1)
        with pytest.raises(
            QueueFull, match="m:1 is saturated and tenant '' already has 3 requests waiting \\(its limit\\)"
        ):
            await asyncio.wait_for(asyncio.gather(slots.acquire("batch", "m:1"), wait("x", "batch")), 1)
        slots.release()
        await asyncio.gather(*tasks)
        assert slots.in_use == 0 and slots.waiting() == 0
        return order

    assert asyncio.run(scenario()) == ["i1", "b1", "b2"]


def test_a_larger_limit_admits_the_line_at_once_and_a_smaller_one_holds_it_until_the_pool_fits() -> None:
    async def scenario() -> None:
        slots = Slots(limit=1, max_waiting=10)
        await slots.acquire("batch", "m:1")
        admitted: list[str] = []

        async def wait(name: str, priority: str = "batch") -> None:
            await slots.acquire(priority, "m:1")
            admitted.append(name)

        waiting = [asyncio.create_task(wait(f"w{i}")) for i in range(3)]
        await asyncio.sleep(0)
        assert slots.waiting() == 3
        slots.resize(3, 10)  # a replica more, or a policy change: two of the line go now
        await asyncio.sleep(0)
        assert admitted == ["w0", "w1"] and slots.in_use == 3 and slots.waiting() == 1
        slots.resize(1, 10)  # and back: three in flight over a cap of one
        slots.release()
        slots.release()
        await asyncio.sleep(0)
        assert admitted == ["w0", "w1"] and slots.in_use == 1  # released slots ended, none handed on
        slots.release()  # now the pool fits: the next release hands over
        await asyncio.sleep(0)
        assert admitted == ["w0", "w1", "w2"] and slots.in_use == 1
        slots.release()
        await asyncio.gather(*waiting)
        assert slots.in_use == 0 and slots.waiting() == 0

    asyncio.run(scenario())


def test_a_waiter_that_gives_up_leaves_the_line_and_loses_no_slot() -> None:
    async def scenario() -> None:
        slots = Slots(limit=1, max_waiting=10)
        await slots.acquire("interactive", "m:1")
        other = asyncio.create_task(slots.acquire("batch", "m:1", "b"))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await slots.acquire("interactive", "m:1", "a", 2.0)
        assert slots.waiting() == slots.waiting_for("b") == 1 and slots.waiting_for("a") == 0
        other.cancel()
        with pytest.raises(asyncio.CancelledError):
            await other
        assert slots.waiting() == 0
        slots.release()
        assert slots.in_use == 0
        await asyncio.wait_for(slots.acquire("batch", "m:1"), 1)  # the slot is free again

    asyncio.run(scenario())


def test_slots_hand_over_to_tenants_in_proportion_to_their_weights() -> None:
    async def scenario() -> list[str]:
        slots = Slots(limit=1, max_waiting=100)
        await slots.acquire("interactive", "m:1")
        order: list[str] = []

        async def wait(tenant: str, weight: float) -> None:
            await slots.acquire("interactive", "m:1", tenant, weight)
            order.append(tenant)
            slots.release(tenant)

        tasks = [asyncio.create_task(wait(t, w)) for t, w in [("a", 1.0), ("b", 3.0)] for _ in range(40)]
        await asyncio.sleep(0)
        assert (slots.waiting_for("a"), slots.waiting_for("b"), slots.waiting("interactive")) == (40, 40, 80)
        slots.release()
        await asyncio.gather(*tasks)
        assert slots.in_use == 0 and slots.waiting() == 0
        return order

    order = asyncio.run(scenario())
    assert order[:8] == ["a", "b", "b", "b", "a", "b", "b", "b"]
    assert (order[:40].count("a"), order[:40].count("b")) == (10, 30)  # 1:3 while both wait


def test_a_flooding_tenant_sheds_its_own_requests_and_the_other_tenants_are_admitted() -> None:
    async def scenario() -> None:
        slots = Slots(limit=1, max_waiting=6, max_per_tenant=3)
        await slots.acquire("interactive", "m:1")
        admitted: list[str] = []

        async def wait(name: str, tenant: str) -> None:
            await slots.acquire("interactive", "m:1", tenant)
            admitted.append(name)
            slots.release(tenant)

        flood = [asyncio.create_task(wait(f"f{i}", "flood")) for i in range(5)]
        calm = [asyncio.create_task(wait(f"c{i}", "calm")) for i in range(2)]
        await asyncio.sleep(0)
        assert (slots.waiting_for("flood"), slots.waiting_for("calm")) == (3, 2)
        for task in flood[3:]:
            with pytest.raises(
                QueueFull, match="tenant 'flood' already has 3 requests waiting \\(its limit\\); retry later"
            ):
                await task
        slots.release()
        await asyncio.gather(*flood[:3], *calm)
        assert sorted(admitted) == ["c0", "c1", "f0", "f1", "f2"] and admitted[:2] == ["f0", "c0"]
        assert slots.in_use == 0 and slots.waiting() == 0

    asyncio.run(scenario())


def test_a_full_line_pushes_out_the_newest_waiter_of_the_tenant_with_the_most() -> None:
    async def scenario() -> None:
        slots = Slots(limit=1, max_waiting=4)  # a tenant may hold the whole line, until another comes
        await slots.acquire("interactive", "m:1")
        admitted: list[str] = []

        async def wait(name: str, tenant: str) -> None:
            await slots.acquire("batch", "m:1", tenant)
            admitted.append(name)
            slots.release(tenant)

        flood = [asyncio.create_task(wait(f"f{i}", "flood")) for i in range(4)]
        await asyncio.sleep(0)
        calm = asyncio.create_task(wait("c0", "calm"))
        await asyncio.sleep(0)
        with pytest.raises(
            QueueFull, match="tenant 'flood' had the most requests waiting \\(4\\), so its newest was shed"
        ):
            await flood[3]
        assert (slots.waiting_for("flood"), slots.waiting_for("calm")) == (3, 1)
        with pytest.raises(
            QueueFull,
            match="1 requests in flight and 4 waiting \\(the limit\\).*tenant 'flood' would with this one \\(4\\)",
        ):
            await slots.acquire("interactive", "m:1", "flood")  # under its own bound, but the longest
        slots.release()
        await asyncio.gather(*flood[:3], calm)
        assert admitted == ["f0", "c0", "f1", "f2"] and slots.in_use == 0 and slots.waiting() == 0

    asyncio.run(scenario())


def test_a_waiter_that_is_handed_the_slot_as_it_gives_up_passes_it_on() -> None:
    async def scenario() -> None:
        slots = Slots(limit=1, max_waiting=10)
        await slots.acquire("interactive", "m:1")
        admitted: list[str] = []

        async def wait(name: str, tenant: str) -> None:
            await slots.acquire("interactive", "m:1", tenant)
            admitted.append(name)

        first = asyncio.create_task(wait("first", "a"))
        second = asyncio.create_task(wait("second", "b"))
        await asyncio.sleep(0)
        slots.release()  # hands the slot to first...
        first.cancel()  # ...which gives up before it runs
        with pytest.raises(asyncio.CancelledError):
            await first
        await second
        assert admitted == ["second"] and slots.in_use == 1 and slots.waiting() == 0
        slots.release("b")
        assert slots.in_use == 0 and slots.held == {}

    asyncio.run(scenario())


def test_cache_is_lru_with_ttl_and_keys_on_dtype_and_shape() -> None:
    clock = Clock(1000.0)
    answer = np.array([[0.1, 0.9]], np.float32)
    entry = answer.nbytes + ENTRY_OVERHEAD
    cache = PredictionCache(max_bytes=2 * entry, ttl_s=10, clock=clock)
    a = np.zeros((1, 4), np.float32)
    k1 = cache.key("1", a)
    assert k1 != cache.key("1", a.reshape(4, 1)) != cache.key("2", a)
    assert k1 != cache.key("1", a.astype(np.float64)) and len(k1) == 32
    assert cache.key("1", a, "apps") != cache.key("1", a, "rivals") != k1  # per tenant unless shared (None)
    cache.put(k1, answer)
    cache.put(b"k2", answer)
    assert cache.get(k1) is not None  # k1 is now the most recent
    cache.put(b"k3", answer)  # evicts k2, the least recently used
    assert cache.get(b"k2") is None and cache.get(k1) is not None and len(cache) == 2
    assert cache.bytes == 2 * entry
    clock.now += 10
    assert cache.get(k1) is None and cache.bytes == entry  # expired, and no longer counted


def test_cache_evicts_until_under_its_byte_budget() -> None:
    """Counting entries let 10,000 answers of up to 4 MiB each in; bytes are what is bounded."""
    cache = PredictionCache(max_bytes=1024 * 1024, ttl_s=60, clock=Clock(1000.0))
    for i in range(100):
        cache.put(f"small{i}".encode(), np.zeros((1, 2), np.float32))
    big = np.zeros((40_000, 2), np.float32)  # 312 KiB
    for i in range(5):
        cache.put(f"big{i}".encode(), big)
        assert cache.bytes <= cache.max_bytes
    assert cache.get(b"big4") is not None and cache.get(b"big0") is None and cache.get(b"small0") is None
    cache.put(b"huge", np.zeros((200_000, 2), np.float32))  # larger than the whole budget: not cached
    assert cache.get(b"huge") is None and cache.get(b"big4") is not None


def test_windowed_stats_sum_the_last_seconds_by_version() -> None:
    clock = Clock(5000.2)
    stats = WindowedStats(clock)
    stats.answered("m", "1", 4.0, score_bins(np.array([0.0, 0.95, 1.0])))
    stats.failed("m", "1", "timeout")
    clock.now += 30
    stats.answered("m", "1", 12000.0, None)  # past the last bound: the open bucket
    stats.failed("m", "2", "5xx")
    stats.shadow_pair("m", "2", agreed=True)
    stats.shadow_pair("m", "2", agreed=False)
    start, end, recent = stats.window("m", 10)
    assert (start, end) == (5021.0, 5030.2)
    assert recent["1"]["requests"] == 1 and recent["1"]["latency_ms"][-1] == 1
    assert recent["2"] == {
        "requests": 1,
        "errors": {"5xx": 1, "timeout": 0, "unreachable": 0},
        "latency_ms": [0] * (len(LATENCY_BUCKETS_MS) + 1),
        "predictions": [0] * PREDICTION_BINS,
        "shadow_pairs": 2,
        "shadow_agreed": 1,
    }
    _, _, everything = stats.window("m", 60)
    first = everything["1"]
    assert first["requests"] == 3 and first["errors"]["timeout"] == 1
    assert first["latency_ms"][latency_bucket(4.0)] == 1 and LATENCY_BUCKETS_MS[latency_bucket(4.0)] == 5
    assert first["predictions"][0] == 1 and first["predictions"][9] == 2  # 0.95 and 1.0 in the last bin
    clock.now += 900  # past the horizon: old slots are not counted
    assert stats.window("m", 900)[2]["1"]["requests"] == 0


def test_ejection_backs_off_and_one_success_restores() -> None:
    replica = Replica("http://x", session=None)  # type: ignore[arg-type]
    for _ in range(EJECT_AFTER - 1):
        replica.failed(100.0)
    assert not replica.ejected(100.0)
    replica.failed(100.0)
    assert replica.ejected(100.5) and not replica.ejected(101.0)  # 1 s the first time
    replica.failed(101.0)  # the probe fails: ejected again, twice as long
    assert replica.ejected(102.9) and not replica.ejected(103.0)
    replica.succeeded()
    assert not replica.ejected(103.0) and replica.failures == 0


def test_score_bins_is_score_bin_for_many_and_counts_only_numbers() -> None:
    """One binning rule for the gateway, profiles, drift and retraining; a model's NaN has no bin."""
    import math

    from fleet.types import score_bin
    from fleet.types import score_bins as shared

    rng = np.random.default_rng(3)
    odd = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1.0000001, -0.0]
    scores = np.concatenate([rng.uniform(-0.2, 1.2, 500), np.arange(11) / 10, np.linspace(0, 1, 11), odd])
    one_by_one = [0] * PREDICTION_BINS
    for s in scores.tolist():
        if (i := score_bin(s)) is not None:
            one_by_one[i] += 1
    assert shared(scores) == score_bins(scores) == one_by_one  # the numpy path, and the gateway's name for it
    assert sum(one_by_one) == len(scores) - 3  # NaN and ±inf have no bin
    assert shared(np.array(odd)) == shared(odd) == [3, 0, 0, 0, 0, 0, 0, 0, 0, 2]  # the Python path
    assert (score_bin(math.nan), score_bin(1e308), score_bin(-3.0)) == (None, PREDICTION_BINS - 1, 0)


def test_the_shadow_queue_is_bounded_in_bytes_and_counts_what_it_drops() -> None:
    """The queue once held 1,000 jobs whatever their size; it now holds at most its bytes."""
    from fleet.gateway.shadow import ShadowJob, ShadowMirror

    async def scenario() -> tuple[list[str], int, int]:
        release = asyncio.Event()

        async def call(*_: object, **__: object) -> np.ndarray:
            await release.wait()
            return np.zeros((1, 2), np.float32)

        outcomes: list[str] = []
        big = np.zeros((10_000, 4), np.float32)  # 156 KiB of input
        job = ShadowJob("m", "2.0.0", "1.0.0", big, np.zeros((10_000, 2), np.float32), 1.0, 5.0)
        mirror = ShadowMirror(call, lambda j, outcome, *_: outcomes.append(outcome), max_bytes=3 * job.nbytes)
        mirror.start(workers=1)
        offered = [mirror.offer(job) for _ in range(10)]
        held = mirror.bytes
        release.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if mirror.bytes == 0:
                break
        await mirror.close()
        return offered, held, mirror.bytes

    offered, held, after = asyncio.run(scenario())
    assert offered == [True] * 3 + [False] * 7 and held <= 3 * (10_000 * 24 + 300) and after == 0


def test_a_mirrored_generation_is_compared_by_its_text_and_counted_in_its_bytes() -> None:
    from fleet.errors import FleetError
    from fleet.gateway.shadow import Generated, GenShadowJob, ShadowMirror

    async def scenario() -> list[tuple[str, object]]:
        async def generate(job: GenShadowJob, deadline: float) -> Generated:
            if job.served == "boom":
                raise type("Down", (FleetError,), {"kind": "5xx"})("the shadow is down")
            return Generated("dcba", 12.0, 3.0, 14, 4)

        seen: list[tuple[str, object]] = []
        mirror = ShadowMirror(
            lambda *_, **__: None, lambda j, outcome, ms, result, kind: seen.append((outcome, kind)), generate=generate
        )
        mirror.start(workers=1)
        jobs = [
            GenShadowJob("lm", "2.0.0", "1.0.0", b'{"prompt": "reverse abcd>"}', served, 10.0, 5.0)
            for served in ("dcba", "dcbx", "boom")
        ]
        assert all(mirror.offer(job) for job in jobs) and mirror.bytes == sum(j.nbytes for j in jobs)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if mirror.bytes == 0:
                break
        await mirror.close()
        return seen

    assert asyncio.run(scenario()) == [("agree", None), ("disagree", None), ("error", "5xx")]


def test_scoped_credentials_are_for_one_purpose_one_gateway_and_one_minute() -> None:
    from fleet.catalog import gateway_directory

    token, now = "t" * 40, 1_800_000_000
    given = gateway_directory.credential(token, "refresh", "gw-1", now)
    assert token not in given and gateway_directory.verify(given, token, "refresh", "gw-1", now + 59)
    assert not gateway_directory.verify(given, token, "stats", "gw-1", now)  # another purpose
    assert not gateway_directory.verify(given, token, "refresh", "gw-2", now)  # another gateway
    assert not gateway_directory.verify(given, token, "refresh", "gw-1", now + 61)  # too old
    assert not gateway_directory.verify(given, "another-token", "refresh", "gw-1", now)
    assert not gateway_directory.verify(f"Bearer {token}", token, "refresh", "gw-1", now)
    assert not gateway_directory.verify(
        given.replace(":" + str(now), ":" + str(now + 1)), token, "refresh", "gw-1", now
    )


def test_only_gateways_on_trusted_networks_are_pushed_to(monkeypatch) -> None:
    from fleet import audit
    from fleet.catalog import gateway_directory
    from fleet.errors import ConfigError

    def record(url: str) -> gateway_directory.GatewayRecord:
        now = audit.now()
        return gateway_directory.GatewayRecord(id="g", url=url, host="h", pid=1, started_at=now, heartbeat_at=now)

    monkeypatch.delenv("FLEET_GATEWAY_NETWORKS", raising=False)
    assert gateway_directory.trusted(record("http://127.0.0.1:8000")) and gateway_directory.trusted(
        record("http://[::1]:8000")
    )
    assert gateway_directory.trusted(record("http://localhost:8000"))
    for url in (
        "http://10.0.3.4:8000",
        "https://evil.example.com",
        "http://10.0.3.4.nip.io:8000",
        "file:///etc/passwd",
    ):
        assert not gateway_directory.trusted(record(url)), url
    monkeypatch.setenv("FLEET_GATEWAY_NETWORKS", "10.0.0.0/16, fd00::/8")
    assert gateway_directory.trusted(record("http://10.0.3.4:8000")) and not gateway_directory.trusted(
        record("http://10.1.0.1:8000")
    )
    assert not gateway_directory.trusted(
        record("https://evil.example.com")
    )  # a name is never trusted: DNS can point anywhere
    monkeypatch.setenv("FLEET_GATEWAY_NETWORKS", "10.0.0.0/33")
    with pytest.raises(ConfigError, match="FLEET_GATEWAY_NETWORKS has '10.0.0.0/33'; expected comma-separated CIDRs"):
        gateway_directory.trusted_networks()


def test_notify_sends_a_scoped_credential_never_the_token_and_skips_untrusted_records(monkeypatch) -> None:
    import http.server
    import threading

    from fleet import audit, records
    from fleet.catalog import gateway_directory
    from fleet.store import MemoryStore

    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store, now, token = MemoryStore(), audit.now(), "admin-token-" + "x" * 30
        for gid, url in (
            ("real", f"http://127.0.0.1:{server.server_address[1]}"),
            ("planted", "http://203.0.113.9:8000"),
        ):
            record = gateway_directory.GatewayRecord(id=gid, url=url, host="h", pid=1, started_at=now, heartbeat_at=now)
            store.put(gateway_directory.key(gid), records.dump(record))
        monkeypatch.delenv("FLEET_GATEWAY_NETWORKS", raising=False)
        assert gateway_directory.notify(store, token) == {"real": True, "planted": False}
        assert len(seen) == 1 and token not in seen[0] and gateway_directory.verify(seen[0], token, "refresh", "real")
    finally:
        server.shutdown()


def test_bodies_in_flight_are_bounded_in_all_and_per_tenant() -> None:
    from fleet.gateway.body import BodyBudget, DecodeBusy

    budget = BodyBudget(max_bytes=8_000)
    with budget.holding("a") as first, budget.holding("a") as second:
        first.add(3_000)
        with pytest.raises(DecodeBusy, match="tenant 'a' has .* over its share") as info:
            second.add(1_500)  # 4,500 of a's 4,000
        assert info.value.status == 429
        with budget.holding("b") as third, budget.holding("c") as fourth:
            third.add(3_500)
            with pytest.raises(DecodeBusy, match="the gateway holds .* its budget") as info:
                fourth.add(2_000)  # 8,500 of 8,000 in all
            assert info.value.status == 503
        assert budget.held == 3_000  # what b and c held is given back when their requests end
    assert budget.held == 0 and budget._tenants == {}


def test_a_tenant_holds_at_most_its_share_of_the_slots_and_others_take_the_rest() -> None:
    async def scenario() -> None:
        slots = Slots(limit=4, max_waiting=20, share=0.5)
        assert slots.tenant_cap == 2
        for _ in range(2):
            await asyncio.wait_for(slots.acquire("interactive", "m:1", "greedy"), 1)
        more = [asyncio.create_task(slots.acquire("interactive", "m:1", "greedy")) for _ in range(3)]
        await asyncio.sleep(0)
        assert slots.in_use == 2 and slots.waiting_for("greedy") == 3  # two slots free, but not for it
        await asyncio.wait_for(slots.acquire("interactive", "m:1", "other"), 1)  # another tenant goes at once
        await asyncio.wait_for(slots.acquire("batch", "m:1", "third"), 1)
        assert slots.in_use == 4 and slots.held == {"greedy": 2, "other": 1, "third": 1}
        late = asyncio.create_task(slots.acquire("interactive", "m:1", "other"))
        await asyncio.sleep(0)
        slots.release("third")  # greedy waited first, but holds its share: other's goes
        await asyncio.wait_for(late, 1)
        assert slots.held == {"greedy": 2, "other": 2} and slots.waiting_for("greedy") == 3
        slots.release("greedy")  # its own slot back: its next waiter takes it
        await asyncio.sleep(0)
        assert slots.held["greedy"] == 2 and slots.waiting_for("greedy") == 2
        slots.release("other")
        slots.release("other")  # slots free, and only a capped tenant waits: they stay free
        assert slots.in_use == 2 and slots.waiting_for("greedy") == 2
        slots.resize(4, 20, share=1.0)  # the policy lets one tenant hold everything: the line goes now
        await asyncio.wait_for(asyncio.gather(*more), 1)
        assert slots.in_use == 4 and slots.held == {"greedy": 4} and slots.waiting() == 0
        for _ in range(4):
            slots.release("greedy")
        assert slots.in_use == 0 and slots.held == {}

    asyncio.run(scenario())


class _Cycle:
    """uvicorn's request cycle as the write deadline sees it: a flow control paused until the
    buffer is under the low-water mark, and a transport whose buffer the caller drains at
    ``rate`` bytes a tick (``send`` is its method, as uvicorn's is)."""

    def __init__(self, buffered: int, rate: int) -> None:
        self.buffered, self.rate = buffered, rate
        self.flow, self.transport = self, self

    @property
    def write_paused(self) -> bool:
        return self.buffered > 16 * 1024

    async def drain(self) -> None:
        while self.write_paused:
            await asyncio.sleep(0.01)
            self.buffered = max(self.buffered - self.rate, 0)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    async def send(self, message: dict) -> None: ...


@pytest.mark.parametrize(("rate", "cut"), [(0, True), (100, False)])
def test_an_answer_is_cut_only_when_no_byte_is_taken_within_the_write_deadline(rate: int, cut: bool) -> None:
    """The write deadline is on progress: a caller taking 100 bytes a tick needs far longer
    than the deadline for the whole answer and is not cut; one taking none is."""
    from fleet.gateway.middleware import _drained

    cycle = _Cycle(20 * 1024, rate)

    async def scenario() -> None:
        await _drained(cycle.send, 0.05)

    if cut:
        with pytest.raises(TimeoutError):
            asyncio.run(scenario())
    else:
        asyncio.run(scenario())  # 4 KiB at 100 bytes a 10 ms tick: about 0.4 s, eight deadlines
        assert not cycle.write_paused


@pytest.mark.parametrize("callers", [True, False])
def test_a_generation_s_deadline_is_judged_once_however_many_readers_see_it(callers: bool) -> None:
    """The read-ahead sees the replica's "timeout" event while the caller's own clock runs out:
    one caller timeout (or one version failure), the same error for both."""
    from types import SimpleNamespace

    from fleet.gateway.generation.stream import Stream
    from fleet.gateway.telemetry import Telemetry
    from fleet.gateway.upstream import CallerTimeout, UpstreamTimeout

    telemetry, failures = Telemetry(lambda: iter(())), []
    replica = SimpleNamespace(failed=lambda at: failures.append(at))
    stream = Stream(
        model="lm",
        version="1.0.0",
        tenant="acme",
        opened=SimpleNamespace(replica=replica),  # type: ignore[arg-type]
        first={},
        asked=0.0,
        first_at=0.0,
        deadline=0.0,
        telemetry=telemetry,
        usage=None,
        charge=lambda n: None,
        callers=callers,
    )
    first, second = stream._late(), stream._late()
    assert first is second and isinstance(first, CallerTimeout if callers else UpstreamTimeout)
    text = telemetry.exposition().decode()
    timeouts = [ln for ln in text.splitlines() if ln.startswith("fleet_caller_timeouts_total{")]
    errors = [ln for ln in text.splitlines() if ln.startswith("fleet_version_errors_total{")]
    if callers:
        assert [ln.split()[-1] for ln in timeouts] == ["1.0"] and errors == [] and failures == []
    else:
        assert timeouts == [] and [ln.split()[-1] for ln in errors] == ["1.0"] and len(failures) == 1
