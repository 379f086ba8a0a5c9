"""Weighted fair queuing at a saturated version, end to end (``fleet.gateway.fairqueue``):
a real gateway in front of a stub replica that answers one request at a time.

The pure scheduler is tested tick by tick in ``tests/test_fairqueue.py``; here the
question is whether the gateway's admission really divides a saturated version by weight,
and whether a flooding tenant sheds its own requests instead of everyone's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from fleet.catalog.tenants import Tenants
from tests.gateway_env import BODY, MODEL, GatewayEnv

DELAY_MS = 20  # the replica's time per request: 50 requests/s at concurrency 1


@pytest.fixture
def saturated(tmp_path: Path):
    """One replica, one request at a time (policy concurrency 1), a wait queue of 24."""
    env = GatewayEnv(tmp_path, concurrency=1, max_queue=24, timeout_ms=30_000)
    env.register("1.0.0")
    env.stub("1.0.0", "--delay-ms", str(DELAY_MS))
    env.route(stable="1.0.0")
    tenants = Tenants(env.store)
    keys = {name: tenants.create(name, {MODEL: ["*"]}, weight=w)[1] for name, w in (("light", 1.0), ("heavy", 3.0))}
    try:
        url, _ = env.gateway()
        yield url, keys
    finally:
        env.stop()


async def _closed_loop(
    url: str, key: str, concurrency: int, until: float, window: tuple[float, float], out: dict[str, list]
) -> None:
    """``concurrency`` callers, each sending its next request as soon as the last is answered,
    until ``until``; answers finished inside ``window`` (monotonic) are kept in ``out``."""
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def caller() -> None:
            while time.monotonic() < until:
                sent = time.monotonic()
                r = await client.post(
                    f"/v2/models/{MODEL}/infer", json=BODY, headers={"Authorization": f"Bearer {key}"}
                )
                done = time.monotonic()
                if window[0] <= done < window[1]:
                    out.setdefault(r.status_code, []).append((done - sent, r))

        await asyncio.gather(*(caller() for _ in range(concurrency)))


def test_two_tenants_weighted_1_to_3_share_a_saturated_version_1_to_3(saturated) -> None:
    url, keys = saturated

    async def run() -> tuple[dict, dict]:
        start = time.monotonic()
        window = (start + 1.0, start + 5.0)  # after both queues filled; before either stops sending
        light: dict[int, list] = {}
        heavy: dict[int, list] = {}
        await asyncio.gather(
            _closed_loop(url, keys["light"], 8, start + 5.5, window, light),
            _closed_loop(url, keys["heavy"], 8, start + 5.5, window, heavy),
        )
        return light, heavy

    light, heavy = asyncio.run(run())
    assert set(light) == {200} and set(heavy) == {200}, "a queue of 24 holds both tenants' 8 callers: nothing shed"
    n_light, n_heavy = len(light[200]), len(heavy[200])
    assert n_light + n_heavy >= 40, f"the version should stay saturated: only {n_light + n_heavy} answers in 4 s"
    ratio = n_heavy / n_light
    assert 3 * 0.9 <= ratio <= 3 * 1.1, f"heavy:light = {n_heavy}:{n_light} = {ratio:.2f}; weights say 3"


def test_a_flooding_tenant_sheds_its_own_requests_not_the_others(saturated) -> None:
    url, keys = saturated

    async def run() -> tuple[dict, dict]:
        # every answer of the whole run counts: the flood's first 60 arrive at once (the first
        # sheds happen then, whatever the machine's load), and the steady tenant is never shed
        start = time.monotonic()
        window = (start, start + 4.0 + 60.0)
        flood: dict[int, list] = {}
        steady: dict[int, list] = {}
        await asyncio.gather(
            _closed_loop(url, keys["heavy"], 60, start + 4.0, window, flood),
            _closed_loop(url, keys["light"], 2, start + 4.0, window, steady),
        )
        return flood, steady

    flood, steady = asyncio.run(run())
    assert set(steady) == {200}, f"the steady tenant got {sorted(steady)}; only 200 expected"
    assert len(steady[200]) >= 10
    assert 503 in flood, "60 callers against one slot and a queue of 24 must shed some of the flood"
    error = flood[503][0][1].json()["error"]
    assert "'heavy'" in error and "waiting" in error, error
