"""Calls to model services: one pooled HTTP client per replica, admission, outlier ejection.

Per version a ``Pool``: its replicas, and ``Slots`` (the policy's ``concurrency`` per
replica) that queue waiting requests by priority. A call goes to the ready replica with
the fewest requests in flight; one that refuses the connection or times out connecting
is skipped for the next replica of the same version (the request never reached a model).
``EJECT_AFTER`` consecutive failures eject a replica for a while (doubling each time, up
to ``MAX_EJECTION_S``); after that one request probes it back. When every replica is
ejected the one due back soonest is tried anyway: a 503 is only said after trying.

A 503 is a replica shedding load before doing any work: it is asked again after 10 ms and
50 ms while the deadline allows, and counts as a failure only if it still sheds.

Errors carry the class canary analysis counts them as: ``unreachable``, ``5xx``, ``timeout``.
Only the version's own failures are errors: a refused connection, a 5xx, a timeout, or an
answer that is not what a model must answer (neither JSON nor tensor bytes that match their
headers, not one finite row per input row, larger than ``MAX_ANSWER_BYTES``) — a model that
answers NaN has failed, and says so with 502. A 4xx is the model refusing the input
(``Rejected``): the caller's error, passed on, never counted against the version or its replica.

Tensors go to the model as tensors where its service takes them: ``POST /predict_tensor``
with the features' raw little-endian bytes (``Content-Type: application/octet-stream``,
``X-Fleet-Datatype: FP32``, ``X-Fleet-Shape: 256,4``), answered the same way (read by
``answers.decode_answer``). A binary-HTTP or gRPC request is so never turned into text on
its way to the model, and a JSON request's numbers are parsed once, by the gateway. A
replica whose service lacks that route says so with 404, 405 or 415: the same request goes
to it again as JSON (``POST /predict {"features": ...}``), and it gets JSON for the next
``TENSOR_REPROBE_S``. That probe costs one round trip per replica every few minutes; it is
never a failure of the replica.

The HTTP client is ``fleet.gateway.h1client``: one keep-alive pool per replica, capped at the
policy's ``concurrency``; a generation's event stream (``fleet.gateway.generation.routes``) is read
over the same connections (``ConnectionPool.stream``). Not aiohttp (about 30 % of the gateway's CPU per request, an extra
loop turn per body on Python 3.11) nor httpx (0.55 ms a call against aiohttp's 0.2 ms).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from fleet.errors import FleetError
from fleet.gateway import h1client
from fleet.gateway.answers import (
    DATATYPE_HEADER,
    SHAPE_HEADER,
    TENSOR_TYPE,
    BadAnswer,
    TensorAnswer,
    UpstreamError,
    decode_answer,
)
from fleet.gateway.protocol import NUMPY_DTYPES
from fleet.gateway.slots import BATCH_AGING_S, Slots

__all__ = ["BadAnswer", "NoReplica", "Rejected", "UpstreamError", "UpstreamTimeout", "Upstreams"]
AnswerParser = Callable[[bytes | TensorAnswer, str, int], Awaitable[np.ndarray]]
log = logging.getLogger("fleet.gateway.upstream")

EJECT_AFTER = 3
BASE_EJECTION_S = 1.0
MAX_EJECTION_S = 30.0
CONNECT_TIMEOUT_S = 0.5
SHED_BACKOFF_S = (0.01, 0.05)  # waits before asking a shedding version again
MAX_ANSWER_BYTES = 32 * 1024 * 1024
# Below the 5 s keep-alive of uvicorn (BentoML's server): the gateway usually closes an idle
# connection before the replica does, so few requests meet a connection closing under them
# (those that do are sent again once on a new one, by h1).
IDLE_CLOSE_S = 4.0
HELD_AT_LEAST_S = 0.001  # ``ready`` returning later than this was a hold (a warm pool returns in microseconds)
_JSON = ((b"Content-Type", b"application/json"),)
JSON_PATH, TENSOR_PATH = "/predict", "/predict_tensor"
# what a service without the tensor route answers it: no route, no POST there, not that body type
NO_TENSOR_ROUTE = frozenset({404, 405, 415})
TENSOR_REPROBE_S = 300.0  # a replica without the route is asked for it again this long after
_OIP_NAMES = {np.dtype(t): name.encode() for name, t in NUMPY_DTYPES.items()}  # native dtype → X-Fleet-Datatype
_TENSOR_TYPE = TENSOR_TYPE.encode()
_DATATYPE, _SHAPE = DATATYPE_HEADER.encode(), SHAPE_HEADER.encode()


class UpstreamTimeout(UpstreamError):
    status = 504

    def __init__(self, message: str, kind: str = "timeout") -> None:
        super().__init__(message, kind)


class Rejected(FleetError):
    """The version refused the input with a 4xx: the caller's error, not the version's."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status if status in (400, 413, 422) else 422


class _Shed(Exception):
    """A replica refused for now (HTTP 503): retried after a short back-off while time is left."""


class NoReplica(FleetError):
    """Nothing is deployed for the version (not a failure of the version itself)."""

    status = 503


@dataclass
class Replica:
    url: str
    session: h1client.ConnectionPool  # shared by every pool that lists the URL
    in_flight: int = 0
    failures: int = 0  # consecutive
    ejections: int = 0  # consecutive ejections, for the back-off
    ejected_until: float = 0.0
    json_until: float = 0.0  # its /predict_tensor answered 404, 405 or 415: JSON until then (monotonic)

    @property
    def takes_tensors(self) -> bool:
        return time.monotonic() >= self.json_until

    def ejected(self, now: float) -> bool:
        return self.ejected_until > now

    def succeeded(self) -> None:
        self.failures = self.ejections = 0
        self.ejected_until = 0.0

    def failed(self, now: float) -> None:
        self.failures += 1
        if self.failures >= EJECT_AFTER:
            self.ejections += 1
            self.ejected_until = now + min(MAX_EJECTION_S, BASE_EJECTION_S * 2 ** (self.ejections - 1))
            self.failures = EJECT_AFTER - 1  # the probe after the ejection decides at once


@dataclass
class Pool:
    ref: str
    replicas: list[Replica]
    slots: Slots
    turn: int = field(default=0)

    def order(self, last_resort: bool) -> list[Replica]:
        """Replicas to try, best first: those not ejected, by fewest in flight. As the last
        resort (no other version to ask), the ejected one due back soonest too."""
        now = time.monotonic()
        if len(self.replicas) == 1:
            only = self.replicas[0]
            return [only] if not only.ejected(now) or last_resort else []
        self.turn += 1
        n = len(self.replicas)
        rotated = [self.replicas[(self.turn + i) % n] for i in range(n)]
        ready = sorted((r for r in rotated if not r.ejected(now)), key=lambda r: r.in_flight)
        ejected = sorted((r for r in rotated if r.ejected(now)), key=lambda r: r.ejected_until)
        return ready + ejected[: 1 if last_resort and not ready else 0]


class Outbound:
    """One request's features in the encodings replicas take, each made at most once and only
    when a replica needs it: a pool may hold replicas that take tensors and some that take
    JSON only, and a request may meet both when one replica fails over to the next."""

    __slots__ = ("_json", "_tensor", "features")

    def __init__(self, features: np.ndarray) -> None:
        self.features = features
        self._json: bytes | None = None
        self._tensor: tuple[bytes, tuple[tuple[bytes, bytes], ...]] | None = None

    @property
    def tensor_ok(self) -> bool:
        """Whether the features have a fixed-size OIP encoding (BYTES or object arrays do not)."""
        return self.features.dtype.isnative and self.features.dtype in _OIP_NAMES and self.features.ndim >= 1

    def json(self) -> bytes:
        if self._json is None:
            self._json = orjson.dumps({"features": self.features}, option=orjson.OPT_SERIALIZE_NUMPY)
        return self._json

    def tensor(self) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
        """(raw little-endian row-major bytes, the headers that describe them)."""
        if self._tensor is None:
            x = self.features
            raw = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<")).tobytes()
            shape = ",".join(map(str, x.shape)).encode()
            self._tensor = raw, ((b"Content-Type", _TENSOR_TYPE), (_DATATYPE, _OIP_NAMES[x.dtype]), (_SHAPE, shape))
        return self._tensor


def read_answer(resp: h1client.Response) -> bytes | TensorAnswer:
    """An answer as its ``Content-Type`` says: the tensor contract's bytes with their headers
    (checked by ``decode_answer``, not here: this runs on the event loop), else JSON."""
    content_type = resp.header(b"content-type")
    if content_type is not None and content_type.split(b";", 1)[0].strip().lower() == _TENSOR_TYPE:
        return TensorAnswer(resp.body, resp.header(_DATATYPE), resp.header(_SHAPE))
    return resp.body


async def _inline(body: bytes | TensorAnswer, ref: str, rows: int) -> np.ndarray:
    return decode_answer(body, ref, rows)


class Upstreams:
    def __init__(self, parse: AnswerParser = _inline) -> None:
        """``parse(body, ref, rows)`` turns an answer into an array (``answers.decode_answer``,
        off the event loop for large answers when the gateway passes its decoder's)."""
        self._parse = parse
        self._pools: dict[tuple[str, str], Pool] = {}
        self._sessions: dict[str, h1client.ConnectionPool] = {}
        # (model, version) → when this gateway last sent it a request (unix s): fleet.control.lazy's idle clock
        self.last_used: dict[tuple[str, str], float] = {}
        self.activator: Any = None  # fleet.gateway.activate.Activator: holds a request for a cold lazy version

    def _session(self, url: str, limit: int) -> h1client.ConnectionPool:
        """The replica's connection pool, at most ``limit`` connections (the policy's
        per-replica concurrency); requests past it wait for a free connection."""
        session = self._sessions.get(url)
        if session is None or session.closed:
            session = self._sessions[url] = h1client.ConnectionPool.from_url(
                url, limit=limit, idle_timeout=IDLE_CLOSE_S
            )
        return session

    def sync(
        self, endpoints: dict[tuple[str, str], tuple[str, ...]], concurrency: dict[str, tuple[int, int, float]]
    ) -> None:
        """Make the pools match the deployments; ``concurrency``: model → (per replica, max
        waiting, seconds after which a waiting batch request counts as interactive)."""
        caps: dict[str, int] = {}  # per replica URL: the largest cap of the models it serves
        for key, urls in endpoints.items():
            limit, waiting, aging_s = concurrency.get(key[0], (32, 256, BATCH_AGING_S))
            pool = self._pools.get(key)
            if pool is None or [r.url for r in pool.replicas] != list(urls):
                kept = {r.url: r for r in pool.replicas} if pool else {}
                replicas = [kept.get(u) or Replica(u, self._session(u, limit)) for u in urls]
                pool = self._pools[key] = Pool(
                    f"{key[0]}:{key[1]}", replicas, pool.slots if pool else Slots(limit, waiting)
                )
            pool.slots.resize(limit * len(urls), waiting, aging_s=aging_s)
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

    async def ready(self, model: str, version: str, deadline: float) -> Pool:
        """The version's pool, noting the request for the idle clock; a version with no replica
        is held while it starts if its model is lazy (``activator``), else ``NoReplica``."""
        key = (model, version)
        self.last_used[key] = time.time()
        pool = self._pools.get(key)
        if pool is not None and pool.replicas:
            return pool
        if self.activator is None:
            raise NoReplica(f"{model}:{version} has no running replica; expected it to be deployed")
        return await self.activator.hold(model, version, deadline)

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
        timing: list[float] | None = None,
        held: list[float] | None = None,
    ) -> np.ndarray:
        """Ask one replica of ``model:version``; raise ``UpstreamError`` (with its class) or ``NoReplica``.

        ``last_resort=False``: another version will be asked if this one fails, so ejected
        replicas are not tried. ``tenant`` and its ``weight``: whose turn it is when the
        version's slots are full (``fleet.gateway.fairqueue``). ``timing``: the seconds the
        version took (from a slot to its answer) are appended to it. ``held``: the seconds the
        request waited for a cold version to start, if it did (not the version's latency).
        """
        before = time.monotonic()
        pool = await self.ready(model, version, deadline)
        if held is not None and (waited := time.monotonic() - before) > HELD_AT_LEAST_S:
            held.append(waited)
        remaining = deadline - time.monotonic()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                await pool.slots.acquire(priority, pool.ref, tenant, weight)
                asked = time.monotonic()
                try:
                    answer = await self._answer(pool, Outbound(features), last_resort, deadline)
                    if timing is not None:  # the version's own time: its wait for a slot left out
                        timing.append(time.monotonic() - asked)
                    return await self._parse(answer, pool.ref, len(features))
                finally:
                    pool.slots.release()
        except TimeoutError:
            raise UpstreamTimeout(f"{pool.ref} did not answer within {remaining * 1000:.0f} ms") from None

    async def _answer(self, pool: Pool, outbound: Outbound, last_resort: bool, deadline: float) -> bytes | TensorAnswer:
        """Ask the pool; a version that sheds is asked again after each back-off the deadline allows."""
        for backoff in (*SHED_BACKOFF_S, None):
            try:
                return await self._attempt(pool, outbound, last_resort)
            except _Shed as shed:
                if backoff is None or deadline - time.monotonic() < 2 * backoff:
                    raise UpstreamError(str(shed), "5xx") from None
            await asyncio.sleep(backoff)
        raise AssertionError("unreachable: the last round raises")

    async def _attempt(self, pool: Pool, outbound: Outbound, last_resort: bool) -> bytes | TensorAnswer:
        failures, shed = [], ""
        replicas = pool.order(last_resort)
        if not replicas:
            raise UpstreamError(f"every replica of {pool.ref} is ejected after consecutive failures", "unreachable")
        for replica in replicas:
            replica.in_flight += 1
            try:
                resp = await self._exchange(pool, replica, outbound)
            except h1client.BodyTooLarge as exc:
                if exc.declared is not None:
                    raise BadAnswer(
                        f"{pool.ref} answered {exc.declared} bytes; at most {MAX_ANSWER_BYTES} are read"
                    ) from None
                raise BadAnswer(
                    f"{pool.ref} answered more than {MAX_ANSWER_BYTES} bytes; that many are read at most"
                ) from None
            except h1client.Unreachable as exc:  # refused, connect timeout, closed before answering
                replica.failed(time.monotonic())
                failures.append(f"{replica.url}: {type(exc).__name__}")
                continue  # the request never reached a model: the next replica may answer
            except h1client.HTTPClientError as exc:  # the answer broke off or is not HTTP
                replica.failed(time.monotonic())
                raise UpstreamError(f"{pool.ref} at {replica.url} failed: {type(exc).__name__}: {exc}", "5xx") from None
            finally:
                replica.in_flight -= 1
            body = resp.body
            if resp.status == 503:
                # "overloaded, not now" (BentoML's batcher sheds so): nothing was computed, so
                # another replica, or this one a moment later, may take it; not a replica fault
                shed = f"{pool.ref} at {replica.url} shed the request: HTTP 503 {body[:120].decode(errors='replace')}"
                continue
            if resp.status >= 500:
                replica.failed(time.monotonic())
                raise UpstreamError(
                    f"{pool.ref} answered HTTP {resp.status}: {body[:200].decode(errors='replace')}", "5xx"
                )
            if resp.status != 200:
                replica.succeeded()  # it answered: the replica is healthy, the input was not
                raise Rejected(
                    f"{pool.ref} refused the input: HTTP {resp.status} {body[:200].decode(errors='replace')}",
                    resp.status,
                )
            replica.succeeded()
            return read_answer(resp)
        if shed:
            raise _Shed(shed)
        raise UpstreamError(f"no replica of {pool.ref} could be reached ({'; '.join(failures)})", "unreachable")

    async def _exchange(self, pool: Pool, replica: Replica, outbound: Outbound) -> h1client.Response:
        """Send the request to one replica: as a tensor unless the replica is known to lack
        the route. A 404, 405 or 415 there says it lacks it (no such route, no POST there, or
        not this body type): the same request goes to it at once as JSON, and JSON from then
        on. That is not a failure, so nothing is counted: ``_attempt`` only sees the answer
        to the JSON request. h1's errors pass through to ``_attempt``, which classes them."""
        if replica.takes_tensors and outbound.tensor_ok:
            body, headers = outbound.tensor()
            resp = await replica.session.request(
                "POST", TENSOR_PATH, body, headers, max_body=MAX_ANSWER_BYTES, connect_timeout=CONNECT_TIMEOUT_S
            )
            if resp.status not in NO_TENSOR_ROUTE:
                return resp
            # asked again later: a service redeployed at the same address may have gained the route
            replica.json_until = time.monotonic() + TENSOR_REPROBE_S
            log.info(
                "%s at %s answered HTTP %d to POST %s: sending it JSON (POST %s) for the next %.0f s",
                pool.ref,
                replica.url,
                resp.status,
                TENSOR_PATH,
                JSON_PATH,
                TENSOR_REPROBE_S,
            )
        return await replica.session.request(
            "POST", JSON_PATH, outbound.json(), _JSON, max_body=MAX_ANSWER_BYTES, connect_timeout=CONNECT_TIMEOUT_S
        )

    async def close(self) -> None:
        for session in list(self._sessions.values()):
            session.close()
        self._sessions.clear()
        self._pools.clear()
