"""The gateway's decision parts on their own: token buckets, priority slots, the prediction
cache, windowed stats and outlier ejection, driven by a fake clock where time matters."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fleet.gateway.cache import PredictionCache
from fleet.gateway.quota import TokenBuckets
from fleet.gateway.slots import QueueFull, Slots
from fleet.gateway.stats import WindowedStats, score_bins
from fleet.gateway.upstream import EJECT_AFTER, Replica
from fleet.types import LATENCY_BUCKETS_MS, PREDICTION_BINS, latency_bucket


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_token_bucket_allows_the_burst_then_the_rate() -> None:
    clock = Clock()
    buckets = TokenBuckets(clock)
    assert [buckets.acquire("t", rps=2, burst=3) for _ in range(3)] == [None, None, None]
    wait = buckets.acquire("t", rps=2, burst=3)
    assert wait == pytest.approx(0.5)  # one token at 2/s
    clock.now += 0.25
    assert buckets.acquire("t", rps=2, burst=3) == pytest.approx(0.25)
    clock.now += 0.25
    assert buckets.acquire("t", rps=2, burst=3) is None
    assert buckets.acquire("other", rps=2, burst=3) is None  # buckets are per tenant
    clock.now += 100
    assert [buckets.acquire("t", rps=2, burst=3) for _ in range(4)].count(None) == 3  # refills to burst, no more


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
        with pytest.raises(QueueFull, match="1 requests in flight and 3 waiting"):
            await asyncio.wait_for(asyncio.gather(slots.acquire("batch", "m:1"), wait("x", "batch")), 1)
        slots.release()
        await asyncio.gather(*tasks)
        assert slots.in_use == 0 and slots.waiting() == 0
        return order

    assert asyncio.run(scenario()) == ["i1", "b1", "b2"]


def test_a_waiter_that_gives_up_leaves_the_line_and_loses_no_slot() -> None:
    async def scenario() -> None:
        slots = Slots(limit=1, max_waiting=10)
        await slots.acquire("interactive", "m:1")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await slots.acquire("interactive", "m:1")
        assert slots.waiting() == 0
        slots.release()
        assert slots.in_use == 0
        await asyncio.wait_for(slots.acquire("batch", "m:1"), 1)  # the slot is free again

    asyncio.run(scenario())


def test_cache_is_lru_with_ttl_and_keys_on_dtype_and_shape() -> None:
    clock = Clock()
    cache = PredictionCache(max_entries=2, ttl_s=10, clock=clock)
    a = np.zeros((1, 4), np.float32)
    k1 = cache.key("m", "1", a)
    assert k1 != cache.key("m", "1", a.reshape(4, 1)) != cache.key("m", "2", a)
    assert k1 != cache.key("m", "1", a.astype(np.float64))
    cache.put(k1, np.array([[0.1, 0.9]]))
    cache.put(("k2",), np.array([1]))
    assert cache.get(k1) is not None  # k1 is now the most recent
    cache.put(("k3",), np.array([2]))  # evicts k2, the least recently used
    assert cache.get(("k2",)) is None and cache.get(k1) is not None and len(cache) == 2
    clock.now += 10
    assert cache.get(k1) is None  # expired


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
    assert recent["2"] == {"requests": 1, "errors": {"5xx": 1, "timeout": 0, "unreachable": 0},
                           "latency_ms": [0] * (len(LATENCY_BUCKETS_MS) + 1), "predictions": [0] * PREDICTION_BINS,
                           "shadow_pairs": 2, "shadow_agreed": 1}  # fmt: skip
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
