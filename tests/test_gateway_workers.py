"""``fleet gateway --workers N``: N gateway processes on one port (``fleet.gateway.workers``).

Real processes: the supervisor, its workers on SO_REUSEPORT sockets, a stub replica and a
real Redis. What must hold with workers as with one process: a tenant's quota once (not
once per worker), ``/metrics`` counting every worker's traffic, a route push reaching every
worker, a worker that dies started again, and nothing left running once the supervisor stops.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from fleet.catalog import gateway_directory
from fleet.gateway.quota import divide
from fleet.gateway.workers import merge_expositions, worker_argv
from tests.gateway_env import ADMIN_TOKEN, BODY, MODEL, GatewayEnv, metric, scrape, wait_for
from tests.redis_env import RedisServer
from tests.test_quota_redis import BURST, RPS, _flood, metered


def _records(env: GatewayEnv) -> list[gateway_directory.GatewayRecord]:
    return gateway_directory.live(env.store)


@pytest.fixture
def workers(tmp_path: Path):
    redis_server = RedisServer(tmp_path).start()
    env = None
    try:
        env, key = metered(tmp_path)
        url, proc = env.gateway("--workers", "2", FLEET_REDIS_URL=redis_server.url)
        log = tmp_path / f"gateway-{url.rsplit(':', 1)[1]}.log"
        # the supervisor's report: every worker ready (a worker lost before that fails the start)
        wait_for(lambda: "Ctrl-C stops" in log.read_text(), timeout=60, what="the supervisor's ready report")
        assert len(_records(env)) == 2
        yield env, url, proc, key
    finally:
        if env is not None:
            env.stop()
        redis_server.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_share_one_quota_and_metrics_add_up(workers) -> None:
    env, url, _, key = workers
    # one connection per request, whatever the answers' timing (a kept-alive connection would
    # carry them all to one worker): the kernel spreads connections over the workers' sockets
    times: list[float] = []
    admitted, refused, seconds = asyncio.run(
        _flood([url], key, rate=3 * RPS, seconds=6, new_connections=True, admitted_at=times)
    )
    allowed = RPS * seconds + BURST
    assert admitted <= 1.05 * allowed, f"{admitted} admitted in {seconds:.1f} s; the quota allows {allowed:.0f}"
    # the quota is taken as the gateway reads each request, which a busy machine may do later
    # and faster than they were sent: over the seconds the admitted answers span, at its rate
    span = max(times) - min(times)
    assert admitted >= 0.95 * RPS * span, f"{admitted} admitted over {span:.1f} s of answers; the quota allows {RPS}/s"
    own = [metric_of(r.url, "fleet_requests_total", worker="1") for r in _records(env)]
    assert all(n > 0 for n in own), f"each worker should have answered some requests: {own}"
    assert metric(url, "fleet_requests_total") == sum(own) == admitted + refused
    text = scrape(url)
    assert 'worker="0"' in text and 'worker="1"' in text  # each worker's series, once each


def metric_of(url: str, name: str, worker: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = scrape(url, worker=worker)
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_a_route_push_reaches_every_worker(workers) -> None:
    env, url, _, key = workers
    pushed = gateway_directory.notify(env.store, ADMIN_TOKEN)
    assert list(pushed.values()) == [True, True]  # each worker is a gateway the control plane reaches
    env.register("1.1.0")
    env.stub("1.1.0")
    env.route(canary="1.1.0", weight=100)
    gateway_directory.notify(env.store, ADMIN_TOKEN)
    for record in _records(env):  # every worker, not whichever one the kernel picks for us
        with httpx.Client(base_url=record.url, timeout=5) as client:
            wait_for(
                lambda c=client: (
                    c.post(
                        f"/v2/models/{MODEL}/infer", json=BODY, headers={"Authorization": f"Bearer {key}"}
                    ).headers.get("x-fleet-model-version")
                    == "1.1.0"
                ),
                timeout=10,
                what=f"{record.url} to route to 1.1.0",
            )


def test_a_key_revoked_through_one_worker_s_admin_api_is_refused_by_every_worker(workers) -> None:
    """The admin write commits a journal entry and publishes it on the change bus (both
    workers subscribe to FLEET_REDIS_URL): every worker drops the key, none after a poll of
    the whole store. Converges; how fast is bench/scale.py's to measure."""
    env, _, _, key = workers
    records = _records(env)
    for record in records:
        assert infer_at(record.url, key).status_code == 200
    revoked = httpx.post(
        f"{records[0].url}/admin/tenants/metered/revoke",
        json={},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    )
    assert revoked.status_code == 200, revoked.text
    for record in records:
        wait_for(lambda u=record.url: infer_at(u, key).status_code == 401, timeout=10, what=f"{record.url} to refuse")


def infer_at(url: str, key: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v2/models/{MODEL}/infer", json=BODY, headers={"Authorization": f"Bearer {key}"}, timeout=5
    )


def test_a_dead_worker_is_started_again_and_stopping_the_supervisor_stops_all(workers) -> None:
    env, url, proc, key = workers
    victim = _records(env)[0]
    os.kill(victim.pid, signal.SIGKILL)
    wait_for(
        lambda: (
            len(_records(env)) == 2
            and victim.pid not in {r.pid for r in _records(env)}
            and httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200
        ),
        timeout=60,
        what="the killed worker replaced",
    )
    pids = [r.pid for r in _records(env)]
    with httpx.Client(base_url=url, timeout=5) as client:
        codes = {
            client.post(
                f"/v2/models/{MODEL}/infer",
                json=BODY,
                headers={"Authorization": f"Bearer {key}", "Connection": "close"},
            ).status_code
            for _ in range(4)
        }
    assert codes <= {200, 429} and 200 in codes
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=20, what="every worker stopped with the supervisor")


def test_worker_command_line_and_divided_limits() -> None:
    argv = worker_argv(["--store", "x", "gateway", "--workers", "3", "--port", "80", "--workers=3"], 1, 7, 8)
    assert argv == [sys.executable, "-m", "fleet", "--store", "x", "gateway", "--port", "80", "--worker-fds", "7,8"]
    assert [divide(32, 2), divide(33, 2), divide(1, 4), divide(8, 1)] == [16, 17, 1, 8]


def test_merged_metrics_keep_each_worker_s_series_apart() -> None:
    a = (
        '# HELP fleet_requests_total x\n# TYPE fleet_requests_total counter\nfleet_requests_total{code="200"} 3.0\n'
        "# HELP fleet_routing_stale s\n# TYPE fleet_routing_stale gauge\nfleet_routing_stale 0.0\n"
    )
    b = (
        '# HELP fleet_requests_total x\n# TYPE fleet_requests_total counter\nfleet_requests_total{code="200"} 4.0\n'
        'fleet_requests_total{code="429"} 1.0\n# HELP fleet_routing_stale s\n# TYPE fleet_routing_stale gauge\n'
        "fleet_routing_stale 1.0\n"
    )
    text = merge_expositions([(0, a), (1, b)]).decode()
    assert 'fleet_requests_total{code="200",worker="0"} 3.0' in text
    assert 'fleet_requests_total{code="200",worker="1"} 4.0' in text
    assert 'fleet_requests_total{code="429",worker="1"} 1.0' in text
    assert 'fleet_routing_stale{worker="1"} 1.0' in text  # one stale worker is seen, not averaged away


def test_a_worker_that_keeps_dying_at_once_stops_the_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.gateway import workers as gw_workers

    monkeypatch.setattr(gw_workers, "RESTART_BACKOFF_S", (0.01,))
    lines: list[str] = []
    sup = gw_workers.Supervisor(
        2, "127.0.0.1", 0, lambda i, a, b: [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), lines.append
    )
    try:
        sup.start_all()
        with pytest.raises(gw_workers.WorkersFailed, match="exited 5 times in a row"):
            sup.watch()
        assert any("exited with 3; starting it again" in line for line in lines)
    finally:
        sup.stop()
    assert all(p is None or p.poll() is not None for p in sup.procs)
