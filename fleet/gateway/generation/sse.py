"""Server-sent events, both ways: a model service's event stream read as its events
(``EventParser``, ``Events``), and the caller's written one event at a time
(``EventStreamResponse``).

The service's stream (``bentos/tiny_lm``'s contract) is read with the gateway's own HTTP/1.1
client (``fleet.gateway.h1client``, ``ConnectionPool.stream``) on the replica's pooled
keep-alive connections; events are parsed from whatever bytes arrive, and nothing is
buffered beyond one event (``MAX_EVENT_BYTES``). The answer goes out through
``EventStreamResponse``: Starlette's event stream without its task group, one write per event.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from fleet.gateway.answers import UpstreamError
from fleet.gateway.h1client.connection import StreamedResponse
from fleet.gateway.h1client.errors import HTTPClientError

MAX_EVENT_BYTES = 64 * 1024  # one event from a model service; a longer one is a broken answer
WRITE_S = 10.0  # the default write deadline of one event to the caller (the gateway policy's stream_write_s)
log = logging.getLogger("fleet.gateway.sse")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # and nginx in front must not buffer


class EventParser:
    """Server-sent events' ``data:`` fields as JSON objects, from a body that arrives in
    pieces of any size: ``feed`` returns the events a piece completes. An event is its
    ``data:`` lines joined (each without the prefix and the spaces after it), up to the
    blank line (``\\n\\n``) that ends it; an event without ``data:`` (a comment, a keep-alive)
    is skipped. An unfinished event over ``MAX_EVENT_BYTES`` is a broken answer, and so is
    data that is not a JSON object with a string ``text`` (if any): ``UpstreamError``, raised
    after the events before it were handed out."""

    __slots__ = ("_error", "_pending", "ref")

    def __init__(self, ref: str) -> None:
        self.ref = ref
        self._pending = b""
        self._error: UpstreamError | None = None

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        if self._error is not None:
            raise self._error
        scan = max(0, len(self._pending) - 1)  # a blank line may straddle the pieces
        pending = self._pending + data if self._pending else data
        events: list[dict[str, Any]] = []
        start = 0
        while (end := pending.find(b"\n\n", scan)) >= 0:
            raw = pending[start:end]
            start = scan = end + 2
            try:
                event = self._event(raw)
            except UpstreamError as exc:
                if not events:
                    raise
                self._error, self._pending = exc, b""
                return events  # the events before the broken one first, as they came
            if event is not None:
                events.append(event)
        self._pending = pending[start:] if start else pending
        if len(self._pending) > MAX_EVENT_BYTES:
            exc = UpstreamError(f"{self.ref} sent an event over {MAX_EVENT_BYTES} bytes", "5xx")
            if not events:
                raise exc
            self._error = exc
        return events

    def _event(self, raw: bytes) -> dict[str, Any] | None:
        if raw.startswith(b"data:") and b"\n" not in raw:  # the usual event: one data line
            data = raw[5:].lstrip()
        else:
            data = b"".join(line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:"))
        if not data:
            return None  # a comment or keep-alive
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"{self.ref} sent an event that is not JSON: {data[:80]!r}", "5xx") from None
        if not isinstance(event, dict) or not isinstance(event.get("text", ""), str):
            raise UpstreamError(f'{self.ref} sent an event that is not {{"text": ...}}: {data[:80]!r}', "5xx")
        return event


class Events:
    """A replica's stream as its events (``EventParser``), read as they arrive. Raises
    ``UpstreamError`` for a broken event or an answer that breaks off (before the first
    event too, so a canary cut off then is retried on stable); ends where the stream does."""

    __slots__ = ("_parser", "_ready", "_response")

    def __init__(self, response: StreamedResponse, ref: str) -> None:
        self._response, self._parser = response, EventParser(ref)
        self._ready: list[dict[str, Any]] = []  # parsed, not yet handed out (reversed: popped from the end)

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while not self._ready:
            try:
                data = await self._response.read()
            except HTTPClientError as exc:  # cut off mid-answer, or not HTTP: the version's failure
                raise UpstreamError(f"{self._parser.ref} broke off: {type(exc).__name__}", "5xx") from None
            if not data:
                raise StopAsyncIteration
            self._ready = self._parser.feed(data)
            self._ready.reverse()
        return self._ready.pop()


class EventStreamResponse(StreamingResponse):
    """A server-sent event stream to the caller, as Starlette's ``StreamingResponse`` sends
    it (the same head and body messages), without its task group: the events are sent from
    the request's own task, and one small task listens for the caller leaving — which
    cancels the stream where it waits (for the replica's next event), so the replica's
    connection is closed and the generation cancelled, as before.

    A caller that stays but stops reading is cut off too: each event must be taken within
    ``write_s`` (once the socket's buffers are full, a write waits for the caller), else the
    stream ends as if the caller had left — the generation cancelled, its slot, replica
    connection and concurrency lease released — and the connection is closed (with it any
    requests pipelined behind). Without it one such connection held a version's slot for as
    long as it stayed open."""

    def __init__(self, *args: Any, write_s: float = WRITE_S, **kwargs: Any) -> None:  # noqa: ANN401
        super().__init__(*args, **kwargs)
        self.write_s = write_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"left": False, "done": False}
        write_s = self.write_s

        async def send_within(message: Message) -> None:
            try:
                async with asyncio.timeout(write_s):
                    await send(message)
            except TimeoutError:
                scope.setdefault("state", {})["stalled"] = True
                raise CallerStalled(f"the caller took no event for {write_s:g} s") from None

        def on_left(listener: asyncio.Task[None]) -> None:
            if state["done"] or listener.cancelled() or listener.exception() is not None:
                return
            state["left"] = True
            task.cancel()

        listener = asyncio.ensure_future(_until_disconnect(receive))
        listener.add_done_callback(on_left)
        iterator = self.body_iterator
        try:
            await send_within({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in iterator:
                await send_within({"type": "http.response.body", "body": chunk, "more_body": True})
            state["done"] = True
            await send_within({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["left"] or task.uncancel() > 0:
                raise  # cancelled from outside: the server's shutdown
        except CallerStalled as exc:  # returning unfinished: the server closes the connection
            log.info("stream cut: %s", exc)
        finally:
            state["done"] = True
            listener.cancel()
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # left between two events: the generation's own cleanup runs now
        if self.background is not None:
            await self.background()


class CallerStalled(Exception):  # noqa: N818 - not an error of anyone's request: the caller stopped reading
    """An answer's bytes (a stream's event) were not taken by the caller within the write deadline."""


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
