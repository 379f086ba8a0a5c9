"""A model service's server-sent events read by the gateway: ``h1.ConnectionPool.stream`` (an
answer's body as it arrives, on a pooled keep-alive connection) and ``generation.sse.EventParser``
/ ``Events`` (its ``data:`` events, bounded per event), against scripted servers on
127.0.0.1 (``tests/test_h1client.py``'s), on asyncio's event loop and uvloop's."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from fleet.gateway.answers import UpstreamError
from fleet.gateway.generation.sse import MAX_EVENT_BYTES, EventParser, Events
from fleet.gateway.h1client.connection import STREAM_HIGH_WATER, StreamedResponse
from fleet.gateway.h1client.errors import IncompleteResponse
from fleet.gateway.h1client.pool import ConnectionPool
from tests.test_h1client import JSON, Peer, Scripted, pooled, until, waited

EVENTS = [
    {"text": "a", "completion_tokens": 1},
    {"text": "é\n", "completion_tokens": 2},
    {"text": "", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2},
]
# one data line each, a comment, a keep-alive, and an event split over two data lines
BODY = (
    b"data: " + orjson.dumps(EVENTS[0]) + b"\n\n: a comment\n\n\n\ndata:" + orjson.dumps(EVENTS[1]) + b"\n\n"
    b'data: {"text": "", "finish_reason": "length",\ndata: "prompt_tokens": 3, "completion_tokens": 2}\n\n'
)


def chunked(body: bytes, pieces: list[int]) -> bytes:
    """``body`` in chunks cut at ``pieces`` (offsets), chunked transfer-encoding."""
    out, start = b"", 0
    for end in [*pieces, len(body)]:
        if end > start:
            out += b"%x\r\n" % (end - start) + body[start:end] + b"\r\n"
        start = end
    return out + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


# -- the parser ------------------------------------------------------------------------------------
def parse(pieces: list[bytes]) -> list[dict]:
    parser = EventParser("m:1")
    return [e for piece in pieces for e in parser.feed(piece)]


def test_events_split_at_every_byte_boundary_parse_the_same() -> None:
    assert parse([BODY]) == EVENTS
    for cut in range(1, len(BODY)):
        assert parse([BODY[:cut], BODY[cut:]]) == EVENTS, cut
    assert parse([BODY[i : i + 1] for i in range(len(BODY))]) == EVENTS


def test_an_unfinished_event_over_the_bound_is_refused_and_a_whole_one_is_not() -> None:
    big = b'data: {"text": "' + b"x" * MAX_EVENT_BYTES + b'"}'
    parser = EventParser("m:1")
    with pytest.raises(UpstreamError, match="over 65536 bytes"):
        for i in range(0, len(big), 4096):
            parser.feed(big[i : i + 4096])
    assert parse([big + b"\n\n"]) == [{"text": "x" * MAX_EVENT_BYTES}]  # complete when it came: not held, not refused


def test_a_broken_event_comes_after_the_good_ones_before_it() -> None:
    parser = EventParser("m:1")
    assert parser.feed(b'data: {"text": "a"}\n\ndata: not json\n\n') == [{"text": "a"}]
    with pytest.raises(UpstreamError, match="not JSON") as raised:
        parser.feed(b'data: {"text": "b"}\n\n')
    assert raised.value.kind == "5xx"
    with pytest.raises(UpstreamError, match="is not"):
        EventParser("m:1").feed(b'data: {"text": 3}\n\n')
    with pytest.raises(UpstreamError, match="is not"):
        EventParser("m:1").feed(b"data: [1]\n\n")


# -- streamed answers over h1 ------------------------------------------------------------------------
async def read_events(pool: ConnectionPool) -> tuple[StreamedResponse, list[dict]]:
    response = await pool.stream("POST", "/generate_stream", b"{}", JSON, connect_timeout=2.0)
    async with response:
        return response, [e async for e in Events(response, "m:1")]


def test_a_chunked_event_stream_cut_anywhere_is_read_whole_on_a_reused_connection(run) -> None:  # noqa: ANN001
    cuts = list(range(1, len(BODY)))

    async def script(peer: Peer) -> None:
        while await peer.request() is not None:
            cut = cuts[len(peer.server.seen) - 1]
            await peer.send(SSE_HEAD)
            await peer.send(chunked(BODY, [cut]))

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            for _ in cuts:
                response, events = await read_events(pool)
                assert response.status == 200 and response.header(b"content-type") == b"text/event-stream"
                assert events == EVENTS
            assert srv.accepted == 1  # every stream read to its end: one connection throughout
            assert pool.stats() == {"open": 1, "idle": 1, "waiting": 0}

    run(scenario)


def test_a_stream_sent_one_byte_at_a_time_and_framed_by_length_or_close(run) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.trickle(SSE_HEAD + chunked(BODY, list(range(1, len(BODY), 7))))
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + BODY)

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            for _ in range(3):
                assert (await read_events(pool))[1] == EVENTS
            assert srv.accepted == 1
            await until(lambda: pool.stats()["open"] == 0, "the close-delimited answer's connection is not kept")

    run(scenario)


def test_a_reader_that_leaves_early_closes_the_connection_so_the_server_sees_it(run) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(SSE_HEAD + chunked(b'data: {"text": "a"}\n\n', []).removesuffix(b"0\r\n\r\n"))
        await peer.until_closed()  # the rest never comes: the caller leaves first

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            response = await pool.stream("POST", "/generate_stream", b"{}", JSON, connect_timeout=2.0)
            events = Events(response, "m:1")
            assert await anext(events) == {"text": "a"}
            response.close()
            response.close()  # idempotent
            assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}
            await until(lambda: srv.closed_by_client == [1], "the server did not see the connection close")

    run(scenario)


def test_a_stream_cut_off_mid_body_is_an_incomplete_answer_and_not_reused(run) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(
            SSE_HEAD + chunked(b'data: {"text": "a"}\n\n', []).removesuffix(b"0\r\n\r\n") + b"20\r\ndata: {"
        )

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            response = await pool.stream("POST", "/generate_stream", b"{}", JSON, connect_timeout=2.0)
            events = Events(response, "m:1")
            assert await anext(events) == {"text": "a"}
            with pytest.raises(UpstreamError, match="m:1 broke off: IncompleteResponse"):
                await anext(events)
            with pytest.raises(IncompleteResponse):
                await response.read()
            response.close()
            assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}
            assert srv.accepted == 1

    run(scenario)


def test_a_reader_that_falls_behind_pauses_the_connection_and_loses_nothing(run) -> None:  # noqa: ANN001
    body = b"".join(b'data: {"text": "%s"}\n\n' % (b"%05d" % i * 100) for i in range(2000))  # ~1.1 MB
    assert len(body) > 3 * STREAM_HIGH_WATER
    sent = asyncio.Event()

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(SSE_HEAD + chunked(body, list(range(4096, len(body), 4096))))
        sent.set()
        await peer.until_closed()

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            response = await pool.stream("POST", "/generate_stream", b"{}", JSON, connect_timeout=2.0)
            async with response:
                await asyncio.sleep(0.05)  # the server writes; this reader takes nothing for a while
                events = [e async for e in Events(response, "m:1")]
            assert [e["text"][:5] for e in events] == [b"%05d".decode() % i for i in range(2000)]
            await waited(sent)
            assert srv.accepted == 1 and pool.stats()["idle"] == 1

    run(scenario)


# -- the caller's side: EventStreamResponse --------------------------------------------------------
def test_a_caller_that_stops_reading_is_cut_off_at_the_write_deadline_and_the_stream_closed(run) -> None:  # noqa: ANN001
    """``send`` blocks from the third message on, as a socket whose buffers a caller no longer
    empties does: the response gives up 0.2 s later, closes the event iterator (where the
    generation's slot, replica connection and lease are given back) and marks the request."""
    from fleet.gateway.generation.sse import EventStreamResponse

    async def scenario() -> None:
        closed = asyncio.Event()

        async def events():  # noqa: ANN202 - an async generator of SSE chunks
            try:
                for i in range(1000):
                    yield b"data: {}\n\n" + str(i).encode()
            finally:
                closed.set()

        sent: list[dict] = []
        stuck = asyncio.Event()

        async def send(message: dict) -> None:
            if len(sent) >= 2:
                stuck.set()
                await asyncio.Event().wait()  # never taken
            sent.append(message)

        async def receive() -> dict:
            await asyncio.Event().wait()  # the caller never hangs up
            return {"type": "http.disconnect"}

        scope: dict = {"type": "http", "state": {}}
        started = asyncio.get_running_loop().time()
        await EventStreamResponse(events(), media_type="text/event-stream", write_s=0.2)(scope, receive, send)
        took = asyncio.get_running_loop().time() - started
        assert stuck.is_set() and closed.is_set() and scope["state"]["stalled"] is True
        assert 0.15 <= took < 2.0 and len(sent) == 2  # the head and one event, then nothing more (uvloop: ms timers)

    run(scenario)
