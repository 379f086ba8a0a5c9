"""A small HTTP/1.1 client for one origin: what the gateway needs to call a model service.

Why not aiohttp: on the gateway's hot path aiohttp's client was about 30 % of the CPU per
request, and on Python 3.11 it writes each request body from a task of its own (one more
event-loop turn per call). Here the calling task writes the request head and body with one
``transport.write``, and the answer is parsed by httptools (the parser uvicorn uses) inside
``data_received``: the caller resumes on the loop turn after the last response byte arrives.
It is an ``asyncio.Protocol``, so it runs on uvloop's transports as on asyncio's.

One ``ConnectionPool`` per origin (plain ``http://host:port``):

* at most ``limit`` connections open; a request that finds them all busy waits in a FIFO
  line for one, at most ``pool_timeout`` seconds;
* keep-alive: a connection goes back to the pool only after a complete response that
  allows keep-alive; idle connections are reused last-in first-out (the warm one first,
  so the cold ones age out) and closed after ``idle_timeout`` by one timer per pool;
* responses framed by Content-Length, chunked, or the end of the connection (HTTP/1.0 or
  ``Connection: close`` without a length); interim 1xx answers are skipped; a body larger
  than the caller's ``max_body`` is an error of its own and closes the connection;
* a stale keep-alive connection (the server closed it while idle, and the request met the
  close before any byte of an answer) is retried once on a new connection. Never after an
  answer began: a POST is not sent twice to a server that started answering it. A server
  that crashed while running the request, on a reused connection, looks the same as a
  stale close, so such a request may run twice; for inference (no side effects) that is
  the better trade than failing every request that meets a closing connection.

Errors say what the caller needs to know: ``Unreachable`` (refused, connect timeout, no
connection free in time, closed before any byte of an answer: the request got no answer
and another replica may be asked), ``ResponseError`` (the server began to answer and the
answer is broken: cut short or not HTTP), ``BodyTooLarge``.

Cancelling the awaiting task (a caller's ``asyncio.timeout``) closes the connection in
use: its state is unknown, so it is never reused. Nothing here starts tasks.

``ConnectionPool.stream`` reads an answer's body as it arrives instead (a model service's
server-sent events): it returns once the head is in, with a ``StreamedResponse`` whose
``read()`` gives the body's bytes as they come (chunked transfer-encoding decoded by the
same parser). Its connection goes back to the pool only once the body was read to its end
and allows keep-alive; ``close()`` before that drops the connection, so the server sees
the caller leave. While the reader falls behind by more than ``STREAM_HIGH_WATER`` bytes
the connection stops reading, so a slow reader never makes the body pile up here.

Not supported, because the gateway does not need them: TLS, proxies, redirects, HEAD,
request streaming, compression, ``Expect: 100-continue``, pipelining.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

import httptools

__all__ = [
    "BodyTooLarge",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionPool",
    "Disconnected",
    "HTTPClientError",
    "IncompleteResponse",
    "PoolClosed",
    "PoolTimeout",
    "ProtocolError",
    "Response",
    "ResponseError",
    "StreamedResponse",
    "Unreachable",
]

Headers = Mapping[str | bytes, str | bytes] | Iterable[tuple[str | bytes, str | bytes]]

_SET_BY_POOL = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection"})
_HEAD_CACHE_SIZE = 64  # request heads by (method, path, headers): a gateway sends a handful
_TIMER_SLACK_S = 0.001  # timers may fire up to a clock tick early
# An answer's head (status line and headers) is a few hundred bytes; llhttp joins a header
# split across reads by concatenation, so a huge one costs the event loop more than linearly.
MAX_HEAD_BYTES = 64 * 1024
MAX_INTERIM = 8  # 1xx answers before the real one
STREAM_HIGH_WATER = 256 * 1024  # a streamed body's bytes not yet read above which the connection pauses reading
_UNBOUNDED = 1 << 62  # a streamed body has no total bound here: its reader bounds what it keeps


class HTTPClientError(Exception):
    """Anything this client raises about a request (``ValueError`` is a caller's mistake)."""


class Unreachable(HTTPClientError):
    """No byte of an answer came back: the server is not there, too slow to accept, or
    closed the connection before answering. Another server may be asked."""


class ConnectError(Unreachable):
    """The connection could not be opened (refused, unknown host, no route)."""


class ConnectTimeout(Unreachable):
    """The connection was not open within the caller's ``connect_timeout``."""


class PoolTimeout(Unreachable):
    """Every connection stayed busy for ``pool_timeout``; the request was never sent."""


class PoolClosed(Unreachable):
    """The pool was closed before or while the request waited."""


class Disconnected(Unreachable):
    """The server closed or reset the connection before any byte of an answer (on a new
    connection, or on a reused one after the one retry)."""


class ResponseError(HTTPClientError):
    """The server began to answer and the answer is broken; the request may have run."""


class ProtocolError(ResponseError):
    """The answer is not HTTP/1.x the parser accepts."""


class IncompleteResponse(ResponseError):
    """The connection ended in the middle of the answer."""


class BodyTooLarge(HTTPClientError):
    """The answer's body is over the caller's ``max_body``. ``declared`` is its
    Content-Length when it had one (refused before reading), else None."""

    def __init__(self, message: str, declared: int | None, limit: int) -> None:
        super().__init__(message)
        self.declared = declared
        self.limit = limit


class _NoAnswer(Exception):
    """Internal: the connection ended before any response byte; ``ConnectionPool.request``
    decides between the one retry and ``Disconnected``."""


class Response:
    """A complete answer: status, headers as received (raw bytes, in order), body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (any case), or None."""
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def __repr__(self) -> str:
        return f"Response({self.status}, {len(self.headers)} headers, {len(self.body)} bytes)"


class StreamedResponse:
    """An answer whose head is in and whose body is read as it arrives (``ConnectionPool.stream``).

    ``read()`` returns the body's next bytes (whatever arrived since the last read, at least
    one byte), ``b""`` at its end; it raises ``IncompleteResponse`` if the connection ends
    mid-body and ``ProtocolError`` if the rest is not HTTP. ``close()`` (idempotent) gives
    the connection back to the pool after a complete keep-alive answer, and drops it
    otherwise. The caller must close it; ``async with`` does.
    """

    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._conn: _Connection | None = conn
        self._pool = conn._pool
        self.status = status
        self.headers = headers

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (any case), or None."""
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    async def read(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise ValueError("read() on a closed StreamedResponse")
        while True:
            if conn._chunks:
                data = conn._chunks[0] if len(conn._chunks) == 1 else b"".join(conn._chunks)
                conn._chunks.clear()
                conn._size_unread = 0
                if conn._paused:
                    conn._paused = False
                    if conn.transport is not None and not conn.closed:
                        conn.transport.resume_reading()
                return data
            if conn._error is not None:
                raise conn._error
            if conn._complete:
                return b""
            if conn.closed:  # lost without a word (connection_lost sets the error; this is a guard)
                raise IncompleteResponse(f"{self._pool.origin} closed the connection mid-answer")
            reader = conn._reader = self._pool.loop.create_future()
            try:
                await reader
            finally:
                conn._reader = None

    async def aread(self, limit: int) -> bytes:
        """The rest of the body, at most ``limit`` bytes of it (an error answer's start)."""
        data = b""
        while len(data) < limit:
            piece = await self.read()
            if not piece:
                break
            data += piece
        return data[:limit]

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn._streaming = False
        if conn._complete and conn._error is None and not conn._chunks and conn.reusable:
            self._pool._checkin(conn)
        else:  # before the end (the caller left), or broken: the server sees the connection go
            conn.abort()
            self._pool._free_slot()

    async def __aenter__(self) -> StreamedResponse:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StreamedResponse({self.status}, {len(self.headers)} headers)"


class _Connection(asyncio.Protocol):
    """One TCP connection and its response parser; one request at a time.

    The parser lives as long as the connection (llhttp starts the next message after one
    completes). A request's state is reset by ``send``; the response is handed over through
    a future the caller awaits, resolved from ``data_received``/``connection_lost``.
    """

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False  # has answered a request before: a closed one may be stale
        self.idle = False  # in the pool's idle list
        self.idle_since = 0.0
        self._waiter: asyncio.Future[Response] | None = None
        self._streaming = False  # the answer's body is handed over as it arrives (``ConnectionPool.stream``)
        self._reader: asyncio.Future[None] | None = None  # a StreamedResponse.read() waiting for bytes
        self._paused = False
        self._size_unread = 0
        self._begin_request(0)

    def _begin_request(self, max_body: int, streaming: bool = False) -> None:
        self._max_body = max_body
        self._streaming = streaming
        self._size_unread = 0
        self._paused = False
        self._answered = False  # a byte of this request's answer arrived
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._size = 0
        self._length: int | None = None
        self._chunked = False
        self._headers_done = False
        self._until_eof = False  # the body ends with the connection
        self._complete = False
        self._keep_alive = False
        self._error: HTTPClientError | None = None
        self._head_bytes = 0  # bytes read before the (final) answer's head ended
        self._interim = 0  # 1xx answers before it

    @property
    def reusable(self) -> bool:
        return self._keep_alive and not self.closed

    def send(self, data: bytes, max_body: int, streaming: bool = False) -> asyncio.Future[Response]:
        """Write the request; the future resolves with the response (streaming: a
        ``StreamedResponse`` once the head is in) or the error."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise _NoAnswer("the connection was already closed")
        self._begin_request(max_body, streaming)
        self._waiter = self._pool.loop.create_future()
        self.transport.write(data)
        return self._waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection without flushing: its state is unknown (cancelled, broken)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if (self._waiter is None and not self._streaming) or self._complete:
            # bytes no request asked for: the connection's framing can no longer be trusted
            self.abort()
            return
        self._answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._error = self._error or ProtocolError(f"{self._pool.origin} switched protocols (HTTP {self._status})")
        except httptools.HttpParserError as exc:
            if not self._complete:
                self._error = self._error or ProtocolError(f"{self._pool.origin} sent a malformed answer: {exc}")
            self._keep_alive = False  # bytes after the answer: not reusable
        if not self._headers_done:  # still in the head after this read: count it (one read is bounded)
            self._head_bytes += len(data)
        if (
            self._error is None
            and not self._headers_done
            and (self._head_bytes > MAX_HEAD_BYTES or self._interim > MAX_INTERIM)
        ):
            self._error = ProtocolError(
                f"{self._pool.origin} sent more than {MAX_HEAD_BYTES} bytes of headers or "
                f"{MAX_INTERIM} interim answers; expected an answer"
            )
        if self._error is not None:
            self._resolve(None, self._error)
            self._wake()
            self.abort()
        elif self._streaming:
            if self._headers_done and self._waiter is not None:
                self._resolve(StreamedResponse(self, self._status, self._headers), None)  # type: ignore[arg-type]
            self._wake()
            if self._size_unread > STREAM_HIGH_WATER and not self._paused and not self._complete:
                self._paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]
        elif self._complete:
            self._resolve(Response(self._status, self._headers, b"".join(self._chunks)), None)

    def _wake(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    def eof_received(self) -> bool:
        self.closed = True
        return False  # close the transport; connection_lost settles any pending request

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._streaming and self._waiter is None and not self._complete:  # mid-body of a streamed answer
            if self._until_eof and exc is None and self._error is None:
                self._keep_alive = False
                self._complete = True
            elif self._error is None:
                why = f": {exc!r}" if exc else ""
                self._error = IncompleteResponse(f"{self._pool.origin} closed the connection mid-answer{why}")
            self._wake()
        elif self._waiter is not None and not self._complete:
            if not self._answered:
                self._resolve(
                    None, _NoAnswer(f"closed before answering: {exc!r}" if exc else "closed before answering")
                )
            elif self._headers_done and self._until_eof and exc is None:
                self._keep_alive = False  # the end of the connection is the end of the body
                self._resolve(Response(self._status, self._headers, b"".join(self._chunks)), None)
            else:
                why = f": {exc!r}" if exc else ""
                self._resolve(None, IncompleteResponse(f"{self._pool.origin} closed the connection mid-answer{why}"))
        self._pool._lost(self)

    def _resolve(self, response: Response | None, error: BaseException | None) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.done():  # the caller was cancelled: nobody to tell
            return
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(response)  # type: ignore[arg-type]

    # -- httptools callbacks (errors are recorded, not raised: the parser would wrap them) ---
    # After the answer is complete, whatever follows in the same read is not part of it.
    def on_message_begin(self) -> None:
        if self._complete:
            self._keep_alive = False  # a second answer to one request: do not trust what follows

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._complete:
            return
        self._headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length":
            self._length = int(value)  # llhttp has checked it is a number
        elif lower == b"transfer-encoding":
            self._chunked = b"chunked" in value.lower()

    def on_headers_complete(self) -> None:
        if self._complete:
            return
        self._status = self._parser.get_status_code()
        if self._status < 200:
            return  # an interim answer (100 Continue, 103 Early Hints); the real one follows
        self._headers_done = True
        self._until_eof = self._length is None and not self._chunked and self._status not in (204, 304)
        if self._length is not None and self._length > self._max_body and self._error is None:
            self._error = BodyTooLarge(
                f"{self._pool.origin} announced {self._length} bytes; at most {self._max_body} are read",
                self._length,
                self._max_body,
            )

    def on_body(self, chunk: bytes) -> None:
        if self._error is not None or self._complete:
            return
        self._size += len(chunk)
        if self._size > self._max_body:
            self._error = BodyTooLarge(
                f"{self._pool.origin} sent more than {self._max_body} bytes", None, self._max_body
            )
            return
        self._chunks.append(chunk)
        self._size_unread += len(chunk)

    def on_message_complete(self) -> None:
        if self._complete:
            return
        if self._status < 200:
            self._headers, self._length, self._chunked = [], None, False
            self._interim += 1
            return
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()


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
        self._idle: list[_Connection] = []  # oldest first; reused from the end
        self._all: set[_Connection] = set()
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
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
            except _NoAnswer as exc:
                conn.abort()
                if conn.reused and not retried and not self._aborted:
                    # stale keep-alive: the server closed it while idle; the request met the
                    # close and no answer began, so it is sent again, once, on a new connection
                    retried = True
                    conn = await self._connect(connect_timeout)  # in the slot the stale one held
                    continue
                self._free_slot()
                raise Disconnected(f"{self.origin} closed the connection before answering ({exc})") from None
            except BaseException:  # an error, or the caller cancelled: the connection's state is unknown
                conn.abort()
                self._free_slot()
                raise
        if conn.reusable:
            self._checkin(conn)  # closed there if the pool is draining and nobody waits for it
        else:
            conn.close()
            self._free_slot()
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
            except _NoAnswer as exc:
                conn.abort()
                if conn.reused and not retried and not self._aborted:
                    retried = True
                    conn = await self._connect(connect_timeout)
                    continue
                self._free_slot()
                raise Disconnected(f"{self.origin} closed the connection before answering ({exc})") from None
            except BaseException:
                conn._streaming = False
                conn.abort()
                self._free_slot()
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
    async def _checkout(self, connect_timeout: float) -> _Connection:
        """A connection for one request: the newest idle one, a new one in a free slot, or
        the first one freed while waiting in line."""
        if self.closed:
            raise PoolClosed(f"the pool for {self.origin} is closed")
        while self._idle:
            conn = self._idle.pop()
            conn.idle = False
            if not conn.closed:
                return conn
            self._free_slot()  # closed, its connection_lost not yet delivered
        if self._open < self.limit and not self._waiters:
            self._open += 1
            return await self._connect(connect_timeout)
        handed = await self._wait()
        return handed if handed is not None else await self._connect(connect_timeout)

    async def _wait(self) -> _Connection | None:
        """Wait in line: a connection handed over, or None for a slot to connect in."""
        waiter: asyncio.Future[_Connection | None] = self.loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.pool_timeout):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                handed = waiter.result()  # handed over just as this one gave up: pass it on
                if handed is not None and handed.reusable:
                    self._checkin(handed)
                else:
                    if handed is not None:
                        handed.close()
                    self._free_slot()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise PoolTimeout(f"no connection to {self.origin} was free within {self.pool_timeout} s") from None
            raise

    async def _connect(self, connect_timeout: float) -> _Connection:
        """Open a connection in a slot the caller holds; on failure the slot is freed."""
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except TimeoutError:
            self._free_slot()
            raise ConnectTimeout(f"{self.origin} did not accept a connection within {connect_timeout} s") from None
        except OSError as exc:
            self._free_slot()
            raise ConnectError(f"cannot connect to {self.origin}: {exc}") from exc
        except BaseException:
            self._free_slot()
            raise
        if self._aborted:  # closed while connecting (a draining pool still serves its line)
            conn.close()
            self._free_slot()
            raise PoolClosed(f"the pool for {self.origin} was closed")
        self._all.add(conn)
        return conn

    def _checkin(self, conn: _Connection) -> None:
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

    def _free_slot(self) -> None:
        """A connection is gone: its slot goes to the first waiter (who connects), else is freed
        (always, while the pool holds more than its cap)."""
        while self._waiters and self._open <= self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._open -= 1

    def _lost(self, conn: _Connection) -> None:
        """connection_lost: an idle connection the server closed leaves the pool here; a busy
        one is settled by the request that holds it."""
        self._all.discard(conn)
        if conn.idle:
            conn.idle = False
            self._idle.remove(conn)
            self._free_slot()

    def _reap(self) -> None:
        """The idle timer: close what has been idle for ``idle_timeout``, re-arm for the rest."""
        self._reaper = None
        now = self.loop.time()
        while self._idle and now - self._idle[0].idle_since >= self.idle_timeout - _TIMER_SLACK_S:
            conn = self._idle.pop(0)
            conn.idle = False
            conn.close()
            self._free_slot()
        if self._idle and not self.closed:
            self._reaper = self.loop.call_later(self._idle[0].idle_since + self.idle_timeout - now, self._reap)
