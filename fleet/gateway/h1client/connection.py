"""One TCP connection to a model service and what it answers: the response parser (httptools,
the parser uvicorn uses, fed from ``data_received``), a whole ``Response``, or a
``StreamedResponse`` whose body is read as it arrives. The pool a connection belongs to
(``fleet.gateway.h1client.pool``) hands it out and takes it back."""

from __future__ import annotations

import asyncio
from typing import Protocol

import httptools

from fleet.gateway.h1client.errors import (
    BodyTooLarge,
    HTTPClientError,
    IncompleteResponse,
    NoAnswer,
    ProtocolError,
)

# An answer's head (status line and headers) is a few hundred bytes; llhttp joins a header
# split across reads by concatenation, so a huge one costs the event loop more than linearly.
MAX_HEAD_BYTES = 64 * 1024
MAX_INTERIM = 8  # 1xx answers before the real one
STREAM_HIGH_WATER = 256 * 1024  # a streamed body's bytes not yet read above which the connection pauses reading


class Owner(Protocol):
    """What a connection needs of its pool (``fleet.gateway.h1client.pool.ConnectionPool``)."""

    origin: str

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def checkin(self, conn: Connection) -> None:
        """A connection after a complete keep-alive answer: reused."""

    def free_slot(self) -> None:
        """A connection is gone: its slot is free."""

    def lost(self, conn: Connection) -> None:
        """A connection closed (``connection_lost``)."""


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

    def __init__(self, conn: Connection, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._conn: Connection | None = conn
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
        conn.streaming = False
        if conn._complete and conn._error is None and not conn._chunks and conn.reusable:
            self._pool.checkin(conn)
        else:  # before the end (the caller left), or broken: the server sees the connection go
            conn.abort()
            self._pool.free_slot()

    async def __aenter__(self) -> StreamedResponse:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StreamedResponse({self.status}, {len(self.headers)} headers)"


class Connection(asyncio.Protocol):
    """One TCP connection and its response parser; one request at a time.

    The parser lives as long as the connection (llhttp starts the next message after one
    completes). A request's state is reset by ``send``; the response is handed over through
    a future the caller awaits, resolved from ``data_received``/``connection_lost``.
    """

    def __init__(self, pool: Owner) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False  # has answered a request before: a closed one may be stale
        self.idle = False  # in the pool's idle list
        self.idle_since = 0.0
        self._waiter: asyncio.Future[Response] | None = None
        self.streaming = False  # the answer's body is handed over as it arrives (``ConnectionPool.stream``)
        self._reader: asyncio.Future[None] | None = None  # a StreamedResponse.read() waiting for bytes
        self._paused = False
        self._size_unread = 0
        self._begin_request(0)

    def _begin_request(self, max_body: int, streaming: bool = False) -> None:
        self._max_body = max_body
        self.streaming = streaming
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
            raise NoAnswer("the connection was already closed")
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
        if (self._waiter is None and not self.streaming) or self._complete:
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
        elif self.streaming:
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
        if self.streaming and self._waiter is None and not self._complete:  # mid-body of a streamed answer
            if self._until_eof and exc is None and self._error is None:
                self._keep_alive = False
                self._complete = True
            elif self._error is None:
                why = f": {exc!r}" if exc else ""
                self._error = IncompleteResponse(f"{self._pool.origin} closed the connection mid-answer{why}")
            self._wake()
        elif self._waiter is not None and not self._complete:
            if not self._answered:
                self._resolve(None, NoAnswer(f"closed before answering: {exc!r}" if exc else "closed before answering"))
            elif self._headers_done and self._until_eof and exc is None:
                self._keep_alive = False  # the end of the connection is the end of the body
                self._resolve(Response(self._status, self._headers, b"".join(self._chunks)), None)
            else:
                why = f": {exc!r}" if exc else ""
                self._resolve(None, IncompleteResponse(f"{self._pool.origin} closed the connection mid-answer{why}"))
        self._pool.lost(self)

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
