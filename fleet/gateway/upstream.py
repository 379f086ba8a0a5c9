"""Calls to model services, whatever the protocol: one pooled HTTP client per replica,
admission (a version's slots), replica order and outlier ejection (``fleet.gateway.replicas``),
and the retry of a version that sheds load.

``Upstreams.ask`` is the one way a version is asked: a slot (fair across tenants,
``fleet.gateway.slots``), then the replicas in order, then the answer read — all by one
deadline. What is sent and how the answer is read is the protocol's part, an ``Exchange``:
a tensor request's (``fleet.gateway.tensors``) or a generation's event stream
(``fleet.gateway.generation.stream``). ``fleet.gateway.dispatch`` asks versions in order
through it, for both.

A 503 is a replica shedding load before doing any work: it is asked again after 10 ms and
50 ms while the deadline allows, and counts as a failure only if it still sheds.

Errors carry the class canary analysis counts them as: ``unreachable``, ``5xx``, ``timeout``.
Only the version's own failures are errors: a refused connection, a 5xx, a timeout, or an
answer that is not what a model must answer (the exchange's check: for tensors, neither JSON
nor tensor bytes that match their headers, not one finite row per input row, larger than
``tensors.MAX_ANSWER_BYTES`` — a model that answers NaN has failed, and says so with 502).
A 4xx is the model refusing the input (``Rejected``): the caller's error, passed on, never
counted against the version or its replica.

The HTTP client is ``fleet.gateway.h1client``: one keep-alive pool per replica, capped at the
policy's ``concurrency``; a generation's event stream is read over the same connections
(``ConnectionPool.stream``). Not aiohttp (about 30 % of the gateway's CPU per request, an extra
loop turn per body on Python 3.11) nor httpx (0.55 ms a call against aiohttp's 0.2 ms).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from fleet.errors import FleetError
from fleet.gateway.answers import TensorAnswer, UpstreamError, decode_answer
from fleet.gateway.h1client.errors import HTTPClientError, Unreachable
from fleet.gateway.h1client.pool import ConnectionPool
from fleet.gateway.replicas import Pool, Replica
from fleet.gateway.slots import BATCH_AGING_S, Slots
from fleet.gateway.tensors import AnswerParser, TensorExchange

__all__ = ["CallerTimeout", "Exchange", "NoReplica", "Rejected", "UpstreamTimeout", "Upstreams"]
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

SHED_BACKOFF_S = (0.01, 0.05)  # waits before asking a shedding version again
_SHED_ROUNDS = (*SHED_BACKOFF_S, None)  # None: the last round, whose shed is the version's failure
# Below the 5 s keep-alive of uvicorn (BentoML's server): the gateway usually closes an idle
# connection before the replica does, so few requests meet a connection closing under them
# (those that do are sent again once on a new one, by h1).
IDLE_CLOSE_S = 4.0
HELD_AT_LEAST_S = 0.001  # ``ready`` returning later than this was a hold (a warm pool returns in microseconds)


class UpstreamTimeout(UpstreamError):
    status = 504

    def __init__(self, message: str, kind: str = "timeout") -> None:
        super().__init__(message, kind)


class CallerTimeout(FleetError):
    """The caller's own deadline, shorter than the model's ``timeout_ms``, ran out while the
    version worked: a 504 to the caller, counted apart (``fleet_caller_timeouts_total``) and
    never as the version's or its replica's failure. Not an ``UpstreamError``, so nothing can
    blame a version for it by mistake."""

    status = 504


class Rejected(FleetError):
    """The version refused the input with a 4xx: the caller's error, not the version's."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status if status in (400, 413, 422) else 422


class NoReplica(FleetError):
    """Nothing is deployed for the version (not a failure of the version itself)."""

    status = 503


class Exchange(Protocol[R_co]):
    """The protocol's part of asking a version: what one replica is sent, and how its answer
    is read. Everything else (slots, replica order and ejection, the shed retry, classing
    h1's errors and the answer's status) is ``Upstreams.ask``'s, the same for every protocol.

    ``streams``: the answer is read after the dispatch returns (a generation's events). The
    replica then stays in flight, the version's slot held and the replica's health unjudged
    until whoever reads it closes it; else all three are settled when the answer is in.
    ``late``: what a caller whose deadline passed is told (``{ref}``, ``{ms}``)."""

    streams: ClassVar[bool]
    late: ClassVar[str]
    asked: float  # written by ``ask``: when the version was asked (after its slot), monotonic
    took: float  # written by ``ask``: seconds from then until a replica answered (its head, for a stream)
    tenant: str  # written by ``ask``: whose slot the answer holds (a stream gives it back on close)

    def send(self, pool: Pool, replica: Replica) -> Awaitable[Any]:
        """Ask one replica; its answer's head (``h1.connection.Response`` or ``StreamedResponse``).
        h1's errors pass through, to be classed by ``ask``."""
        ...

    def head(self, response: Any) -> Awaitable[bytes]:  # noqa: ANN401 - the exchange's own response
        """The start of an answer that is not a 200 (for the error's message); its connection given back."""
        ...

    def opened(self, pool: Pool, replica: Replica, response: Any) -> Any:  # noqa: ANN401
        """A 200's answer as the exchange reads it on."""
        ...

    def result(self, pool: Pool, opened: Any) -> Awaitable[R_co]:  # noqa: ANN401
        """What the dispatch hands its caller, read within the deadline and the slot; an
        ``UpstreamError`` if the answer is broken (a stream gives its connection up then)."""
        ...


async def _inline(body: bytes | TensorAnswer, ref: str, rows: int) -> np.ndarray:
    return decode_answer(body, ref, rows)


class Upstreams:
    def __init__(self, parse: AnswerParser = _inline) -> None:
        """``parse(body, ref, rows)`` turns a tensor answer into an array (``answers.decode_answer``,
        off the event loop for large answers when the gateway passes its decoder's)."""
        self.parse = parse
        self._pools: dict[tuple[str, str], Pool] = {}
        self._sessions: dict[str, ConnectionPool] = {}
        # (model, version) → when this gateway last sent it a request (unix s): fleet.control.lazy's idle clock
        self.last_used: dict[tuple[str, str], float] = {}
        self.activator: Any = None  # fleet.gateway.activate.Activator: holds a request for a cold lazy version

    def _session(self, url: str, limit: int) -> ConnectionPool:
        """The replica's connection pool, at most ``limit`` connections (the policy's
        per-replica concurrency); requests past it wait for a free connection."""
        session = self._sessions.get(url)
        if session is None or session.closed:
            session = self._sessions[url] = ConnectionPool.from_url(url, limit=limit, idle_timeout=IDLE_CLOSE_S)
        return session

    def sync(
        self,
        endpoints: dict[tuple[str, str], tuple[str, ...]],
        concurrency: dict[str, tuple[int, int, float] | tuple[int, int, float, float]],
    ) -> None:
        """Make the pools match the deployments; ``concurrency``: model → (per replica, max
        waiting, seconds after which a waiting batch request counts as interactive[, the
        share of the version's slots one tenant may hold: ``tenant_share``, default all])."""
        caps: dict[str, int] = {}  # per replica URL: the largest cap of the models it serves
        for key, urls in endpoints.items():
            limit, waiting, aging_s, *rest = concurrency.get(key[0], (32, 256, BATCH_AGING_S))
            share = rest[0] if rest else 1.0
            pool = self._pools.get(key)
            if pool is None or [r.url for r in pool.replicas] != list(urls):
                kept = {r.url: r for r in pool.replicas} if pool else {}
                replicas = [kept.get(u) or Replica(u, self._session(u, limit)) for u in urls]
                pool = self._pools[key] = Pool(
                    f"{key[0]}:{key[1]}", replicas, pool.slots if pool else Slots(limit, waiting)
                )
            pool.slots.resize(limit * len(urls), waiting, aging_s=aging_s, share=share)
            for url in urls:
                caps[url] = max(caps.get(url, 0), limit)
        for key in set(self._pools) - set(endpoints):
            del self._pools[key]
        for url, cap in caps.items():  # a changed policy reaches the connections too
            if self._sessions[url].limit != cap:
                self._sessions[url].resize(cap)
        live = {r.url for p in self._pools.values() for r in p.replicas}
        for url in set(self._sessions) - live:
            # a replica taken out of the list finishes what it is answering: a request in
            # flight is not failed (and charged to the version) for a routing change
            self._sessions.pop(url).drain()

    def pool(self, model: str, version: str) -> Pool | None:
        return self._pools.get((model, version))

    async def ready(self, model: str, version: str, deadline: float, tenant: str = "") -> Pool:
        """The version's pool, noting the request for the idle clock; a version with no replica
        is held while it starts if its model is lazy (``activator``, counting ``tenant``'s
        held requests), else ``NoReplica``."""
        key = (model, version)
        self.last_used[key] = time.time()
        pool = self._pools.get(key)
        if pool is not None and pool.replicas:
            return pool
        if self.activator is None:
            raise NoReplica(f"{model}:{version} has no running replica; expected it to be deployed")
        return await self.activator.hold(model, version, deadline, tenant)

    def pools(self) -> dict[tuple[str, str], Pool]:
        return self._pools

    async def predict(
        self,
        model: str,
        version: str,
        features: np.ndarray,
        deadline: float,
        priority: str,
        last_resort: bool = True,
        tenant: str = "",
        weight: float = 1.0,
        held: list[float] | None = None,
    ) -> np.ndarray:
        """One version's answer to ``features``, nobody blamed (a shadow's, ``fleet.gateway.shadow``):
        ``ready`` then ``ask``. ``held``: the seconds the request waited for a cold version to
        start are appended to it, if it did (not the version's latency)."""
        before = time.monotonic()
        pool = await self.ready(model, version, deadline)
        if held is not None and (waited := time.monotonic() - before) > HELD_AT_LEAST_S:
            held.append(waited)
        return await self.ask(
            pool, TensorExchange(features, self.parse), deadline, priority, last_resort, tenant, weight
        )

    async def ask(
        self,
        pool: Pool,
        exchange: Exchange[R],
        by: float,
        priority: str,
        last_resort: bool = True,
        tenant: str = "",
        weight: float = 1.0,
    ) -> R:
        """Ask one version through ``exchange``, all by ``by`` (monotonic): a slot, then a
        replica (``_replica``), then the exchange's result. Raise ``UpstreamError`` (with its
        class; ``UpstreamTimeout`` past ``by``) or ``Rejected``; the slot is released on every
        path (a stream's: when it is closed).

        ``last_resort=False``: another version will be asked if this one fails, so ejected
        replicas are not tried. ``tenant`` and its ``weight``: whose turn it is when the
        version's slots are full (``fleet.gateway.fairqueue``)."""
        remaining = by - time.monotonic()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                await pool.slots.acquire(priority, pool.ref, tenant, weight)
                kept = False
                try:
                    exchange.tenant = tenant
                    exchange.asked = asked = time.monotonic()
                    opened = await self._replica(pool, exchange, last_resort, by)
                    exchange.took = time.monotonic() - asked  # the version's own time: its wait for a slot left out
                    result = await exchange.result(pool, opened)
                    kept = exchange.streams  # the stream's to give back when it closes
                    return result
                finally:
                    if not kept:
                        pool.slots.release(tenant)
        except TimeoutError:
            raise UpstreamTimeout(f"{pool.ref} did not answer within {remaining * 1000:.0f} ms") from None

    async def _replica(self, pool: Pool, exchange: Exchange[Any], last_resort: bool, by: float) -> Any:  # noqa: ANN401
        """A replica's answer, opened: the replicas in order (a refused connection skips to
        the next); a version whose replicas all shed is asked again after each back-off that
        ``by`` allows, and fails only if it still sheds."""
        for backoff in _SHED_ROUNDS:
            failures, shed = [], ""
            replicas = pool.order(last_resort)
            if not replicas:
                raise UpstreamError(f"every replica of {pool.ref} is ejected after consecutive failures", "unreachable")
            for replica in replicas:
                replica.in_flight += 1
                try:
                    response = await exchange.send(pool, replica)
                except Unreachable as exc:  # refused, connect timeout, closed before answering
                    replica.in_flight -= 1
                    replica.failed(time.monotonic())
                    failures.append(f"{replica.url}: {type(exc).__name__}")
                    continue  # the request never reached a model: the next replica may answer
                except HTTPClientError as exc:  # the answer broke off or is not HTTP
                    replica.in_flight -= 1
                    replica.failed(time.monotonic())
                    raise UpstreamError(
                        f"{pool.ref} at {replica.url} failed: {type(exc).__name__}: {exc}", "5xx"
                    ) from None
                except BaseException:
                    replica.in_flight -= 1
                    raise
                if response.status == 200:
                    if not exchange.streams:
                        replica.in_flight -= 1
                        replica.succeeded()
                    return exchange.opened(pool, replica, response)
                try:
                    body = await exchange.head(response)
                finally:
                    replica.in_flight -= 1
                if response.status == 503:
                    # "overloaded, not now" (BentoML's batcher sheds so): nothing was computed, so
                    # another replica, or this one a moment later, may take it; not a replica fault
                    shed = (
                        f"{pool.ref} at {replica.url} shed the request: HTTP 503 {body[:120].decode(errors='replace')}"
                    )
                    continue
                if response.status >= 500:
                    replica.failed(time.monotonic())
                    raise UpstreamError(
                        f"{pool.ref} answered HTTP {response.status}: {body[:200].decode(errors='replace')}", "5xx"
                    )
                replica.succeeded()  # it answered: the replica is healthy, the input was not
                raise Rejected(
                    f"{pool.ref} refused the input: HTTP {response.status} {body[:200].decode(errors='replace')}",
                    response.status,
                )
            if not shed:
                raise UpstreamError(f"no replica of {pool.ref} could be reached ({'; '.join(failures)})", "unreachable")
            if backoff is None or by - time.monotonic() < 2 * backoff:
                raise UpstreamError(shed, "5xx")
            await asyncio.sleep(backoff)
        raise AssertionError("unreachable: the last round raises")

    async def close(self) -> None:
        for session in list(self._sessions.values()):
            session.close()
        self._sessions.clear()
        self._pools.clear()
