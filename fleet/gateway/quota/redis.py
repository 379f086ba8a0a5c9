"""Quotas shared by every gateway and worker through Redis (``FLEET_REDIS_URL``), and the
local share while Redis is away.

Each request is one round trip: ``QUOTA_SCRIPT`` (``fleet.gateway.quota.scripts``) runs GCRA
(the generic cell rate algorithm, a token bucket kept as one timestamp) and, for a
concurrency quota, a lease set with expiry, atomically in Redis on Redis's clock, so
gateways with skewed clocks agree. When Redis cannot be reached (a refused connection, a
reply slower than ``REDIS_TIMEOUT_S``) the gateway neither fails open nor refuses
everything: it enforces its local share in in-process buckets
(``fleet.gateway.quota.buckets``), says so in ``/v2/health/ready`` and in
``fleet_quota_backend{state="shared"|"share_divisor"}``, and tries the script again in the
background every ``PROBE_S``; the first answer makes the budget shared again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from fleet.errors import ConfigError
from fleet.gateway.quota.buckets import LEASE_S, TokenBuckets
from fleet.gateway.quota.scripts import QUOTA_SCRIPT, TOKENS_SCRIPT
from fleet.types import Refusal

log = logging.getLogger("fleet.gateway.quota.redis")

REDIS_TIMEOUT_S = 0.1  # one quota check waits at most this for Redis, then the local share decides
PROBE_S = 0.5  # while Redis is down, how often it is tried again (in the background)
MAX_BATCH = 256  # commands in one pipelined round trip
MAX_OWED = 100_000  # leases kept to give back once Redis answers; past it they are left to expire
REDIS_CONNECTIONS = 32  # connections one gateway process keeps to Redis at most
KEY_PREFIX = "fleet:quota:"


class RedisQuotas:
    """One budget for every gateway through Redis; the local share while Redis is down.

    ``divisor()`` is how many gateways share a quota now (the gateway keeps it from the
    store's ``gateways/`` records); it is read only while Redis is down.

    Every command goes through one queue: what arrives in the same turn of the event loop
    (quota checks, and leases given back) is sent as one pipeline, at most ``MAX_BATCH``
    commands each — one round trip and one connection for all of them (redis-py's cost is
    per round trip: about 0.2 ms of CPU alone, 0.04 ms each in 16). A lease that could not
    be given back (Redis away, or a check whose answer never came: the script may have run)
    is kept and given back once Redis answers again; past that it expires on its own.
    """

    def __init__(
        self, url: str, divisor: Callable[[], int], *, timeout_s: float = REDIS_TIMEOUT_S, probe_s: float = PROBE_S
    ) -> None:
        import redis.asyncio as aioredis

        self.url, self.divisor, self.timeout_s, self.probe_s = url, divisor, timeout_s, probe_s
        self._pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=REDIS_CONNECTIONS,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            health_check_interval=0,
        )
        self._redis = aioredis.Redis(connection_pool=self._pool)
        self._sha: str | None = None  # the script's SHA1 once loaded into Redis
        self._tokens_sha: str | None = None  # TOKENS_SCRIPT's
        self._pending: list[_Op] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._unreleased = _Owed()  # (tenant, lease) not given back yet
        self.local = TokenBuckets()
        self.shared = True
        self.error: str | None = None
        self.down_since: float | None = None
        self._probe: asyncio.Task[None] | None = None
        self._local_leases: set[str] = set()
        self.failures = 0

    async def acquire(
        self, tenant: str, rps: float, burst: int, concurrency: int | None, lease: str, lease_s: float = LEASE_S
    ) -> Refusal | None:
        if self.shared:
            try:
                allowed, wait_us = await self._run(
                    "eval",
                    (
                        f"{KEY_PREFIX}{tenant}:t",
                        f"{KEY_PREFIX}{tenant}:c",
                        repr(float(rps)),
                        burst,
                        concurrency or 0,
                        lease,
                        int(lease_s * 1_000_000),
                    ),
                )
            except BaseException as exc:
                if concurrency:  # the script may have taken the lease before the answer was lost
                    self._unreleased.add((tenant, lease))
                if not isinstance(exc, Exception):
                    raise  # cancelled: the caller is gone
                self._went_down(exc)
            else:
                if allowed == 1:
                    return None
                if allowed == 0:
                    return Refusal("rate", int(wait_us) / 1e6)
                return Refusal("concurrency", 1.0)
        refusal = self.local.take_share(tenant, rps, burst, concurrency, max(1, self.divisor()))
        if refusal is None and concurrency is not None:
            self._local_leases.add(lease)
        return refusal

    async def check_tokens(self, tenant: str, per_minute: int) -> Refusal | None:
        if self.shared:
            try:
                wait_us = await self._run("tokens", (f"{KEY_PREFIX}{tenant}:k", per_minute, 0, 0))
            except Exception as exc:  # noqa: BLE001 - the local share decides
                self._went_down(exc)
            else:
                return Refusal("tokens", int(wait_us) / 1e6) if int(wait_us) > 0 else None
        return await self.local.check_tokens(tenant, max(1, per_minute // max(1, self.divisor())))

    def charge_tokens(self, tenant: str, per_minute: int, n: int) -> None:
        if n == 0:
            return
        if self.shared:  # nobody waits: one more command in the next pipeline
            self._enqueue("tokens", (f"{KEY_PREFIX}{tenant}:k", per_minute, n, 0), None, tenant)
        else:
            self.local.charge_tokens(tenant, max(1, per_minute // max(1, self.divisor())), n)

    async def reserve_tokens(self, tenant: str, per_minute: int, n: int) -> Refusal | None:
        if self.shared:
            try:
                wait_us = await self._run("tokens", (f"{KEY_PREFIX}{tenant}:k", per_minute, n, 1))
            except Exception as exc:  # noqa: BLE001 - the local share decides
                self._went_down(exc)
            else:
                return Refusal("tokens", int(wait_us) / 1e6) if int(wait_us) > 0 else None
        return await self.local.reserve_tokens(tenant, max(1, per_minute // max(1, self.divisor())), n)

    def release(self, tenant: str, lease: str) -> None:
        if lease in self._local_leases:
            self._local_leases.discard(lease)
            self.local.put_back(tenant)
        elif self.shared:
            self._enqueue("zrem", (f"{KEY_PREFIX}{tenant}:c", lease), None, tenant)
        else:
            self._unreleased.add((tenant, lease))  # given back once Redis answers again

    # -- the one queue to Redis -----------------------------------------------------------------
    async def _run(self, kind: str, args: tuple[Any, ...]) -> Any:  # noqa: ANN401
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._enqueue(kind, args, future)
        return await future

    def _enqueue(self, kind: str, args: tuple[Any, ...], future: asyncio.Future[Any] | None, tenant: str = "") -> None:
        self._pending.append(_Op(kind, args, future, tenant))
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self._send_pending)

    def _send_pending(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), MAX_BATCH):
            task = asyncio.get_running_loop().create_task(self._send(pending[i : i + MAX_BATCH]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_Op]) -> None:
        from redis.exceptions import NoScriptError

        try:
            async with asyncio.timeout(self.timeout_s):
                for attempt in (1, 2):
                    if self._sha is None:
                        self._sha = await self._redis.script_load(QUOTA_SCRIPT)
                    if self._tokens_sha is None and any(op.kind == "tokens" for op in batch):
                        self._tokens_sha = await self._redis.script_load(TOKENS_SCRIPT)
                    if len(batch) == 1 and batch[0].kind == "eval":  # a pipeline of one costs more
                        try:
                            results: list[Any] = [await self._redis.evalsha(self._sha, 2, *batch[0].args)]
                        except NoScriptError as exc:
                            results = [exc]
                    else:
                        pipe = self._redis.pipeline(transaction=False)
                        for op in batch:
                            if op.kind == "eval":
                                pipe.evalsha(self._sha, 2, *op.args)
                            elif op.kind == "tokens":
                                pipe.evalsha(self._tokens_sha, 1, *op.args)
                            else:
                                pipe.zrem(*op.args)
                        results = await pipe.execute(raise_on_error=False)
                    if attempt == 1 and any(isinstance(r, NoScriptError) for r in results):
                        self._sha = self._tokens_sha = None  # Redis restarted and forgot them: load them again
                        continue
                    break
        except BaseException as exc:  # every waiter learns it and decides locally; releases wait
            failure = exc if isinstance(exc, Exception) else ConnectionError("the send was cancelled")
            for op in batch:
                if op.future is None:
                    if op.kind == "zrem":  # a charge of tokens is lost with Redis: it is not owed
                        self._unreleased.add((op.tenant, op.args[1]))
                elif not op.future.done():
                    op.future.set_exception(failure)
            if not isinstance(exc, Exception):
                raise
            return
        for op, result in zip(batch, results, strict=True):
            if op.future is None:
                if isinstance(result, Exception) and op.kind == "zrem":
                    self._unreleased.add((op.tenant, op.args[1]))
            elif not op.future.done():
                if isinstance(result, Exception):
                    op.future.set_exception(result)
                else:
                    op.future.set_result(result)

    # -- down and up again -----------------------------------------------------------------------
    def _went_down(self, exc: BaseException) -> None:
        self.failures += 1
        if not self.shared:
            return
        self.shared = False
        self.down_since = time.time()
        self.error = _describe(exc)
        log.error(
            "Redis at %s failed (%s); enforcing this gateway's share of each quota (1/%d) until it answers again",
            _safe(self.url),
            self.error,
            max(1, self.divisor()),
        )
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        """Run the real script (on a key no tenant has: names are DNS labels) until it answers:
        a Redis that answers PING but refuses writes (read-only after a failover, out of
        memory) is still down for quotas."""
        while not self.shared:
            await asyncio.sleep(self.probe_s)
            try:
                await self._run(
                    "eval",
                    (f"{KEY_PREFIX}-probe:t", f"{KEY_PREFIX}-probe:c", "1000000000.0", 1_000_000_000, 0, "", 1_000_000),
                )
            except Exception as exc:  # noqa: BLE001 - still down
                self.error = _describe(exc)
                continue
            log.warning("Redis at %s answers again; quotas are shared again", _safe(self.url))
            self.shared, self.error, self.down_since = True, None, None
            owed, self._unreleased = self._unreleased, _Owed()
            for tenant, lease in owed:
                self._enqueue("zrem", (f"{KEY_PREFIX}{tenant}:c", lease), None, tenant)

    @property
    def degraded(self) -> bool:
        """Redis is away: the local share decides until it answers again."""
        return not self.shared

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": "redis", "url": _safe(self.url), "shared": self.shared}
        out["share_divisor"] = 1 if self.shared else max(1, self.divisor())
        if not self.shared:
            out["error"] = self.error
            out["down_since"] = self.down_since
            out["note"] = "Redis fails: this gateway enforces quota / share_divisor on its own"
        return out

    async def close(self) -> None:
        """Give back what can be (leases of requests just answered), then disconnect."""
        if self._probe is not None:
            self._probe.cancel()
        if self._pending:
            self._send_pending()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.timeout_s * 5)
        with contextlib.suppress(Exception):
            await self._redis.aclose()
        with contextlib.suppress(Exception):
            await self._pool.aclose()


class _Op(NamedTuple):
    kind: str  # "eval" (a quota check), "tokens" (a token budget asked or spent) or "zrem" (a lease given back)
    args: tuple[Any, ...]
    future: asyncio.Future[Any] | None  # None: nobody waits (a release)
    tenant: str = ""


class _Owed(set):  # type: ignore[type-arg]
    """Leases to give back, bounded: a lease not kept here expires in Redis on its own."""

    def add(self, item: tuple[str, str]) -> None:
        if len(self) < MAX_OWED:
            super().add(item)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300] if str(exc) else type(exc).__name__


def _safe(url: str) -> str:
    """The URL without its password, for logs and health."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}"


def from_env(divisor: Callable[[], int]) -> RedisQuotas | None:
    """``RedisQuotas`` when ``FLEET_REDIS_URL`` is set, else None (in-process buckets)."""
    url = os.environ.get("FLEET_REDIS_URL", "").strip()
    if not url:
        return None
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"FLEET_REDIS_URL {_safe(url)!r} is not a Redis URL; expected redis://HOST:PORT/DB, "
            "rediss://:PASSWORD@HOST:PORT/DB (TLS) or unix:///PATH"
        )
    return RedisQuotas(url, divisor)
