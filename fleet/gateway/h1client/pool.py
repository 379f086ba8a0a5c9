"""Connections to one origin, capped, kept alive and reused: the client's interface
(``fleet.gateway.h1client``'s docstring says what it does and why)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from fleet.gateway.h1client.connection import Connection, Response, StreamedResponse
from fleet.gateway.h1client.errors import (
    ConnectError,
    ConnectTimeout,
    Disconnected,
    NoAnswer,
    PoolClosed,
    PoolTimeout,
)

Headers = Mapping[str | bytes, str | bytes] | Iterable[tuple[str | bytes, str | bytes]]

_SET_BY_POOL = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection"})
_HEAD_CACHE_SIZE = 64  # request heads by (method, path, headers): a gateway sends a handful
_TIMER_SLACK_S = 0.001  # timers may fire up to a clock tick early
_UNBOUNDED = 1 << 62  # a streamed body has no total bound here: its reader bounds what it keeps


class ConnectionPool:
    """Connections to one origin, ``limit`` at most; ``request`` is the whole interface.

    A slot is one open (or opening) connection. Whoever holds a connection holds its slot:
    the idle list or one request. A freed slot or a returned connection goes to the first
    waiter in line before anyone else, so the line is FIFO and nobody overtakes it.
    """

    def __init__(
        self, host: str, port: int, *, limit: int = 32, idle_timeout: float = 30.0, pool_timeout: float | None = 30.0
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.host, self.port, self.limit = host, port, limit
        self.idle_timeout, self.pool_timeout = idle_timeout, pool_timeout
        self.origin = f"http://{host}:{port}"
        self._host_header = (f"[{host}]" if ":" in host else host) + f":{port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open = 0  # slots taken: connections open or opening
        self._idle: list[Connection] = []  # oldest first; reused from the end
        self._all: set[Connection] = set()
        self._waiters: deque[asyncio.Future[Connection | None]] = deque()
        self._reaper: asyncio.TimerHandle | None = None
        self._heads: dict[tuple, bytes] = {}
        self.closed = False  # no new requests (drain or close)
        self._aborted = False  # close(): nothing more at all

    @classmethod
    def from_url(cls, url: str, **options: float | int | None) -> ConnectionPool:
        """A pool for ``http://host[:port]`` (a path in the URL is ignored)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only plain http://host:port origins are supported, got {url!r}")
        return cls(parts.hostname, parts.port or 80, **options)  # type: ignore[arg-type]

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def stats(self) -> dict[str, int]:
        """Open connections (incl. opening), idle ones, requests waiting for one."""
        return {"open": self._open, "idle": len(self._idle), "waiting": len(self._waiters)}

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: Headers = (), *, max_body: int, connect_timeout: float
    ) -> Response:
        """Send one request and read the whole answer (any status: a 5xx is a ``Response``).

        Raises ``Unreachable`` (no answer began), ``ResponseError`` (the answer broke off or
        is not HTTP), ``BodyTooLarge`` (over ``max_body``), ``ValueError`` (a bad header,
        method or path). Cancelling the caller closes the connection in use.
        """
        data = self._head(method, path, headers, len(body)) + body
        conn = await self._checkout(connect_timeout)
        retried = False
        while True:
            try:
                response = await conn.send(data, max_body)
                break
            except NoAnswer as exc:
                conn.abort()
                if conn.reused and not retried and not self._aborted:
                    # stale keep-alive: the server closed it while idle; the request met the
                    # close and no answer began, so it is sent again, once, on a new connection
                    retried = True
                    conn = await self._connect(connect_timeout)  # in the slot the stale one held
                    continue
                self.free_slot()
                raise Disconnected(f"{self.origin} closed the connection before answering ({exc})") from None
            except BaseException:  # an error, or the caller cancelled: the connection's state is unknown
                conn.abort()
                self.free_slot()
                raise
        if conn.reusable:
            self.checkin(conn)  # closed there if the pool is draining and nobody waits for it
        else:
            conn.close()
            self.free_slot()
        return response

    async def stream(
        self, method: str, path: str, body: bytes = b"", headers: Headers = (), *, connect_timeout: float
    ) -> StreamedResponse:
        """Send one request and return as soon as its answer's head is in (any status); the
        body is read with ``StreamedResponse.read()``, and the caller must ``close()`` it.

        Raises as ``request`` does, before the head; the same one retry of a stale keep-alive
        connection. Cancelling the caller before the head closes the connection in use.
        """
        data = self._head(method, path, headers, len(body)) + body
        conn = await self._checkout(connect_timeout)
        retried = False
        while True:
            try:
                return await conn.send(data, _UNBOUNDED, streaming=True)  # type: ignore[return-value]
            except NoAnswer as exc:
                conn.abort()
                if conn.reused and not retried and not self._aborted:
                    retried = True
                    conn = await self._connect(connect_timeout)
                    continue
                self.free_slot()
                raise Disconnected(f"{self.origin} closed the connection before answering ({exc})") from None
            except BaseException:
                conn.streaming = False
                conn.abort()
                self.free_slot()
                raise

    def close(self) -> None:
        """Close every connection, idle or busy (a request in flight fails), refuse the line
        and anything after. Idempotent."""
        self.drain()
        self._aborted = True
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(PoolClosed(f"the pool for {self.origin} was closed"))
        for conn in list(self._all):
            conn.close()

    def drain(self) -> None:
        """Refuse new requests and close the idle connections; a request in flight finishes,
        and one already in line gets the next connection that comes back. A connection closes
        once nobody is left to use it. Idempotent."""
        self.closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.idle = False
            conn.close()
            self._open -= 1

    def resize(self, limit: int) -> None:
        """A new connection cap: under a larger one, requests in line connect now; over a
        smaller one, connections close as they come back until the pool fits."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = limit
        while self._idle and self._open > limit:
            conn = self._idle.pop(0)  # the oldest
            conn.idle = False
            conn.close()
            self._open -= 1
        while self._waiters and self._open < limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._open += 1  # a slot of its own, to connect in
                waiter.set_result(None)

    # -- the request head ------------------------------------------------------------------------
    def _head(self, method: str, path: str, headers: Headers, length: int) -> bytes:
        """``METHOD path HTTP/1.1``, Host, the caller's headers, Content-Length; built once
        per (method, path, headers) and cached, the length appended per request."""
        items = tuple(headers.items() if isinstance(headers, Mapping) else headers)
        key = (method, path, items)
        prefix = self._heads.get(key)
        if prefix is None:
            if method == "HEAD":
                raise ValueError("HEAD is not supported: its answer has no body to frame")
            if not method.isalpha() or not path.startswith("/") or any(c in path for c in " \r\n\0"):
                raise ValueError(f"refusing request line {method!r} {path!r}")
            lines = [f"{method} {path} HTTP/1.1\r\nHost: {self._host_header}\r\n".encode()]
            for name, value in items:
                name_b = name.encode("latin-1") if isinstance(name, str) else name
                value_b = value.encode("latin-1") if isinstance(value, str) else value
                if name_b.lower() in _SET_BY_POOL:
                    raise ValueError(f"header {name!r} is set by the pool")
                if not name_b or any(c in name_b for c in b" :\r\n\0") or any(c in value_b for c in b"\r\n\0"):
                    raise ValueError(f"refusing header {name!r}: {value!r}")
                lines.append(name_b + b": " + value_b + b"\r\n")
            lines.append(b"Content-Length: ")
            prefix = b"".join(lines)
            if len(self._heads) >= _HEAD_CACHE_SIZE:
                self._heads.clear()
            self._heads[key] = prefix
        return prefix + b"%d\r\n\r\n" % length

    # -- slots and connections -------------------------------------------------------------------
    async def _checkout(self, connect_timeout: float) -> Connection:
        """A connection for one request: the newest idle one, a new one in a free slot, or
        the first one freed while waiting in line."""
        if self.closed:
            raise PoolClosed(f"the pool for {self.origin} is closed")
        while self._idle:
            conn = self._idle.pop()
            conn.idle = False
            if not conn.closed:
                return conn
            self.free_slot()  # closed, its connection_lost not yet delivered
        if self._open < self.limit and not self._waiters:
            self._open += 1
            return await self._connect(connect_timeout)
        handed = await self._wait()
        return handed if handed is not None else await self._connect(connect_timeout)

    async def _wait(self) -> Connection | None:
        """Wait in line: a connection handed over, or None for a slot to connect in."""
        waiter: asyncio.Future[Connection | None] = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.pool_timeout):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()  # handed over just as this one gave up: pass it on
                if handed is not None and handed.reusable:
                    self.checkin(handed)
                else:
                    if handed is not None:
                        handed.close()
                    self.free_slot()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise PoolTimeout(f"no connection to {self.origin} was free within {self.pool_timeout} s") from None
            raise

    async def _connect(self, connect_timeout: float) -> Connection:
        """Open a connection in a slot the caller holds; on failure the slot is freed."""
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await self.loop.create_connection(lambda: Connection(self), self.host, self.port)
        except TimeoutError:
            self.free_slot()
            raise ConnectTimeout(f"{self.origin} did not accept a connection within {connect_timeout} s") from None
        except OSError as exc:
            self.free_slot()
            raise ConnectError(f"cannot connect to {self.origin}: {exc}") from exc
        except BaseException:
            self.free_slot()
            raise
        if self._aborted:  # closed while connecting (a draining pool still serves its line)
            conn.close()
            self.free_slot()
            raise PoolClosed(f"the pool for {self.origin} was closed")
        self._all.add(conn)
        return conn

    # -- what its connections call (``connection.Owner``) ----------------------------------------
    def checkin(self, conn: Connection) -> None:
        """A connection after a complete keep-alive answer: to the first waiter, else idle;
        closed instead while the pool holds more than its cap (``resize``)."""
        if self._open > self.limit:
            conn.close()
            self._open -= 1
            return
        conn.reused = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        if self.closed:  # draining: nobody waits for it
            conn.close()
            self._open -= 1
            return
        conn.idle, conn.idle_since = True, self.loop.time()
        self._idle.append(conn)
        if self._reaper is None:
            self._reaper = self.loop.call_later(self.idle_timeout, self._reap)

    def free_slot(self) -> None:
        """A connection is gone: its slot goes to the first waiter (who connects), else is freed
        (always, while the pool holds more than its cap)."""
        while self._waiters and self._open <= self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._open -= 1

    def lost(self, conn: Connection) -> None:
        """connection_lost: an idle connection the server closed leaves the pool here; a busy
        one is settled by the request that holds it."""
        self._all.discard(conn)
        if conn.idle:
            conn.idle = False
            self._idle.remove(conn)
            self.free_slot()

    def _reap(self) -> None:
        """The idle timer: close what has been idle for ``idle_timeout``, re-arm for the rest."""
        self._reaper = None
        now = self.loop.time()
        while self._idle and now - self._idle[0].idle_since >= self.idle_timeout - _TIMER_SLACK_S:
            conn = self._idle.pop(0)
            conn.idle = False
            conn.close()
            self.free_slot()
        if self._idle and not self.closed:
            self._reaper = self.loop.call_later(self._idle[0].idle_since + self.idle_timeout - now, self._reap)
