"""The gateway's HTTP/1.1 client (fleet/gateway/h1client/) against real sockets on 127.0.0.1.

A scripted asyncio server sends exactly the bytes a test needs (chunked, close-delimited,
oversized, garbage, closing at a chosen moment); a real uvicorn + Starlette server shows
keep-alive reuse and the connection cap under concurrency. Every test runs on asyncio's
event loop and on uvloop's (the gateway's). Nothing waits by sleeping and hoping: tests
wait on events, or poll a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from fleet.gateway.h1client.connection import Response
from fleet.gateway.h1client.errors import (
    BodyTooLarge,
    ConnectError,
    ConnectTimeout,
    Disconnected,
    IncompleteResponse,
    PoolClosed,
    PoolTimeout,
    ProtocolError,
    Unreachable,
)
from fleet.gateway.h1client.pool import ConnectionPool

WITHIN_S = 10.0  # the most any test waits for something that should take milliseconds

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
JSON = {"Content-Type": "application/json"}


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` each loop millisecond; fail after WITHIN_S."""
    async with asyncio.timeout(WITHIN_S):
        while not condition():
            await asyncio.sleep(0.001)
    assert condition(), what


async def waited(event: asyncio.Event) -> None:
    async with asyncio.timeout(WITHIN_S):
        await event.wait()


# -- a server that plays a script per connection ------------------------------------------------
class Peer:
    """The server's end of one accepted connection."""

    def __init__(
        self, server: Scripted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int
    ) -> None:
        self.server, self.reader, self.writer, self.index = server, reader, writer, index

    async def request(self) -> bytes | None:
        """The next request's body (its head kept in ``server.heads``), or None at EOF."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        body = await self.reader.readexactly(length)
        self.server.heads.append(head)
        self.server.seen.append((self.index, body))
        return body

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def trickle(self, data: bytes) -> None:
        """One byte per write, each flushed, with a loop turn between: a slow answer."""
        for i in range(len(data)):
            await self.send(data[i : i + 1])
            await asyncio.sleep(0)

    async def until_closed(self) -> None:
        """Wait for the client to close its end (whatever it still sends is read and dropped)."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(65536):
                pass
        self.server.closed_by_client.append(self.index)

    def reset(self) -> None:
        """Close with a TCP RST instead of a FIN."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


class Scripted:
    """``async with Scripted(script) as srv``: a server on a free port of 127.0.0.1 whose
    ``script(peer)`` plays each connection; stopped (connections too) on exit."""

    def __init__(self, script: Callable[[Peer], Awaitable[None]]) -> None:
        self.script = script
        self.accepted = 0
        self.heads: list[bytes] = []
        self.seen: list[tuple[int, bytes]] = []  # (connection, request body), in arrival order
        self.closed_by_client: list[int] = []
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.script(Peer(self, reader, writer, self.accepted))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # stopped by __aexit__; ending normally spares 3.11's streams an error log
        finally:
            writer.close()
            self._tasks.discard(task)

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def pool(self, **options: float | int | None) -> ConnectionPool:
        return ConnectionPool("127.0.0.1", self.port, **options)  # type: ignore[arg-type]


async def post(pool: ConnectionPool, body: bytes = b'{"features": [[1, 2]]}', max_body: int = 1024) -> Response:
    return await pool.request("POST", "/predict", body, JSON, max_body=max_body, connect_timeout=2.0)


async def answer_all(peer: Peer) -> None:
    """Answer every request with OK until the client closes the connection."""
    while await peer.request() is not None:
        await peer.send(OK)
    peer.server.closed_by_client.append(peer.index)


@contextlib.asynccontextmanager
async def pooled(server: Scripted, **options: float | int | None) -> AsyncIterator[ConnectionPool]:
    pool = server.pool(**options)
    try:
        yield pool
    finally:
        pool.close()


# -- keep-alive and framing -----------------------------------------------------------------------
def test_keep_alive_reuses_one_connection_for_well_formed_requests(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Scripted(answer_all) as srv, pooled(srv) as pool:
            bodies = [b'{"n": %d}' % i for i in range(3)]
            answers = [await post(pool, b) for b in bodies]
            assert [(a.status, a.body, a.header(b"content-type")) for a in answers] == [
                (200, b"{}", b"application/json")
            ] * 3
            assert srv.accepted == 1 and [b for _, b in srv.seen] == bodies
            assert srv.heads[0] == (
                b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                b"Content-Length: 8\r\n\r\n" % srv.port
            )
            assert pool.stats() == {"open": 1, "idle": 1, "waiting": 0}

    run(scenario)


def test_a_slow_chunked_answer_is_read_whole_and_the_connection_reused(run) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.trickle(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            )

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            assert [(await post(pool)).body for _ in range(2)] == [b"hello world"] * 2
            assert srv.accepted == 1

    run(scenario)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.0 200 OK\r\n\r\nuntil the end",  # HTTP/1.0: the body ends with the connection
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    ],
)
def test_a_close_delimited_answer_ends_with_the_connection_and_is_not_reused(run, answer: bytes) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(answer)  # then the script ends: the server closes

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            assert [(await post(pool)).body for _ in range(2)] == [b"until the end"] * 2
            assert srv.accepted == 2 and pool.stats() == {"open": 0, "idle": 0, "waiting": 0}

    run(scenario)


def test_connection_close_with_a_length_is_closed_by_the_client(run) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
        await peer.until_closed()  # the server leaves it open: the client must close it

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            assert (await post(pool)).body == b"{}"
            assert pool.stats()["open"] == 0
            await until(lambda: srv.closed_by_client == [1], "the client closed the connection")

    run(scenario)


def test_error_statuses_and_interim_answers_are_answers_on_a_kept_connection(run) -> None:  # noqa: ANN001
    answers = [
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops",
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 204 No Content\r\n\r\n",
    ]

    async def script(peer: Peer) -> None:
        for answer in answers:
            await peer.request()
            await peer.send(answer)
        await peer.until_closed()

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            got = [await post(pool) for _ in answers]
            assert [(r.status, r.body) for r in got] == [(500, b"oops"), (503, b""), (200, b"{}"), (204, b"")]
            assert [k for k, _ in got[2].headers] == [b"Content-Length"]  # the 100's headers are not the answer's
            assert srv.accepted == 1

    run(scenario)


@pytest.mark.parametrize("framing", ["declared", "chunked", "close-delimited"])
def test_a_body_over_max_body_is_refused_and_its_connection_closed(run, framing: str) -> None:  # noqa: ANN001
    big = b"x" * 5000
    chunks = b"".join(b"3e8\r\n" + big[:1000] + b"\r\n" for _ in range(5))  # 5 x 1000 bytes, no last chunk
    answer = {
        "declared": b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n",  # refused before the body is sent
        "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks,
        "close-delimited": b"HTTP/1.0 200 OK\r\n\r\n" + big,
    }[framing]

    async def script(peer: Peer) -> None:
        if peer.index == 1:
            await peer.request()
            await peer.send(answer)
            await peer.until_closed()
        else:
            await answer_all(peer)

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            with pytest.raises(BodyTooLarge) as caught:
                await post(pool, max_body=1024)
            assert caught.value.declared == (5000 if framing == "declared" else None) and caught.value.limit == 1024
            await until(lambda: srv.closed_by_client == [1], "the client closed the oversized answer's connection")
            assert pool.stats()["open"] == 0
            assert (await post(pool)).body == b"{}" and srv.accepted == 2

    run(scenario)


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH_9.2\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n"])
def test_an_answer_that_is_not_http_is_a_protocol_error_and_drops_the_connection(run, answer: bytes) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(answer)
        await peer.until_closed()

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            with pytest.raises(ProtocolError):
                await post(pool)
            await until(lambda: srv.closed_by_client == [1], "the client dropped the connection")
            assert pool.stats()["open"] == 0

    run(scenario)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 16384,  # an endless header, sent in pieces
        b"HTTP/1.1 100 Continue\r\n\r\n" * 12,  # interim answers without end
    ],
)
def test_an_answer_head_without_end_is_refused_before_it_costs_the_loop(run, head: bytes) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        await peer.request()
        for _ in range(8):  # 128 KiB of header in 16 KiB writes (or the interim answers, 8 times)
            await peer.send(head)
        await peer.until_closed()

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            with pytest.raises(ProtocolError, match="bytes of headers or .* interim answers"):
                await post(pool)
            await until(lambda: srv.closed_by_client == [1], "the client dropped the connection")
            assert pool.stats()["open"] == 0

    run(scenario)


def test_a_large_answer_in_the_same_read_as_its_head_is_not_mistaken_for_a_long_head(run) -> None:  # noqa: ANN001
    body = b"x" * 200_000  # one write: the head and far more than MAX_HEAD_BYTES of body together

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await peer.until_closed()

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            answer = await post(pool, max_body=1_000_000)
            assert answer.status == 200 and answer.body == body

    run(scenario)


def test_bytes_after_a_complete_answer_keep_the_connection_out_of_the_pool(run) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(OK + OK)  # two answers to one request: the framing cannot be trusted
        await peer.until_closed()

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            assert (await post(pool)).body == b"{}"
            await until(lambda: srv.closed_by_client == [1], "the client closed it")
            assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}

    run(scenario)


# -- stale keep-alive connections and what is never retried ------------------------------------
@pytest.mark.parametrize("close", ["fin", "rst"])
def test_a_stale_keep_alive_connection_is_retried_once_on_a_new_one(run, close: str) -> None:  # noqa: ANN001
    """The race a keep-alive client must survive: the server closes an idle connection just
    as the next request goes out on it. The request met the close before any answer, so
    it is sent once more on a new connection."""

    async def script(peer: Peer) -> None:
        if peer.index == 1:
            await peer.request()
            await peer.send(OK)
            await peer.request()  # the next request arrives, and the server closes instead of answering
            if close == "rst":
                peer.reset()
        else:
            await answer_all(peer)

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            assert (await post(pool, b"first")).body == b"{}"
            assert (await post(pool, b"second")).body == b"{}"
            assert srv.seen == [(1, b"first"), (1, b"second"), (2, b"second")]
            assert pool.stats() == {"open": 1, "idle": 1, "waiting": 0}

    run(scenario)


def test_a_connection_the_server_closed_while_idle_leaves_the_pool(run) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        if peer.index == 1:
            await peer.request()
            await peer.send(OK)  # and closes: uvicorn's keep-alive timeout, a restart
        else:
            await answer_all(peer)

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            await post(pool, b"first")
            await until(lambda: pool.stats()["idle"] == 0, "the closed connection left the idle list")
            assert pool.stats()["open"] == 0
            await post(pool, b"second")
            assert srv.seen == [(1, b"first"), (2, b"second")]  # sent once: nothing to retry

    run(scenario)


@pytest.mark.parametrize("case", ["mid-answer", "new-connection", "stale-twice"])
def test_no_second_try_once_an_answer_began_or_after_the_one_retry(run, case: str) -> None:  # noqa: ANN001
    async def script(peer: Peer) -> None:
        if case != "new-connection" and peer.index == 1:
            await peer.request()
            await peer.send(OK)
        await peer.request()
        if case == "mid-answer":
            await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")  # then closes

    async def scenario() -> None:
        async with Scripted(script) as srv, pooled(srv) as pool:
            if case != "new-connection":
                await post(pool, b"first")
            expected = IncompleteResponse if case == "mid-answer" else Disconnected
            with pytest.raises(expected):
                await post(pool, b"second")
            assert srv.accepted == (2 if case == "stale-twice" else 1)
            assert [b for _, b in srv.seen].count(b"second") == srv.accepted
            assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}

    run(scenario)


# -- connecting ------------------------------------------------------------------------------------
def test_a_refused_connection_is_unreachable_and_frees_its_slot(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        with socket.socket() as taken:  # bound, never listening: connecting is refused
            taken.bind(("127.0.0.1", 0))
            pool = ConnectionPool("127.0.0.1", taken.getsockname()[1], limit=1)
            try:
                for _ in range(2):  # the slot came back: the second try is refused too, not stuck
                    with pytest.raises(ConnectError) as caught:
                        await post(pool)
                    assert isinstance(caught.value, Unreachable)
                assert pool.stats()["open"] == 0
            finally:
                pool.close()

    run(scenario)


def test_a_server_that_does_not_accept_in_time_is_a_connect_timeout(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        with socket.socket() as listener, contextlib.ExitStack() as stack:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)  # a full accept queue: Linux drops further SYNs
            port = listener.getsockname()[1]
            for _ in range(3):
                filler = stack.enter_context(socket.socket())
                filler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    filler.connect(("127.0.0.1", port))
            pool = ConnectionPool("127.0.0.1", port, limit=1)
            try:
                with pytest.raises(ConnectTimeout):
                    await pool.request("POST", "/predict", b"{}", JSON, max_body=10, connect_timeout=0.2)
                assert pool.stats()["open"] == 0
            finally:
                pool.close()

    run(scenario)


# -- the cap, the line, cancellation, idle timeout, close ---------------------------------------
def held_server(
    record_close: bool = False, answer: bytes = OK
) -> tuple[Callable[[Peer], Awaitable[None]], asyncio.Event, asyncio.Event]:
    """A script whose connections answer ``answer`` only after ``release`` is set; ``arrived``
    is set when the first request is in; ``record_close``: a connection the client closes is
    noted in ``closed_by_client``."""
    arrived, release = asyncio.Event(), asyncio.Event()

    async def script(peer: Peer) -> None:
        while await peer.request() is not None:
            arrived.set()
            await release.wait()
            await peer.send(answer)
        if record_close:
            peer.server.closed_by_client.append(peer.index)

    return script, arrived, release


def test_requests_past_the_cap_wait_in_line_first_come_first_served(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        script, arrived, release = held_server()
        async with Scripted(script) as srv, pooled(srv, limit=1) as pool:
            first = asyncio.create_task(post(pool, b"0"))
            await waited(arrived)
            rest = []
            for i in range(1, 5):
                rest.append(asyncio.create_task(post(pool, b"%d" % i)))
                await until(lambda i=i: pool.stats()["waiting"] == i, "the request is in line")
            release.set()
            await asyncio.gather(first, *rest)
            assert srv.seen == [(1, b"%d" % i) for i in range(5)]  # in order, on the one connection

    run(scenario)


def test_the_wait_for_a_connection_is_bounded_and_a_waiter_that_gives_up_loses_no_slot(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        script, arrived, release = held_server()
        async with Scripted(script) as srv, pooled(srv, limit=1, pool_timeout=0.05) as pool:
            first = asyncio.create_task(post(pool, b"held"))
            await waited(arrived)
            with pytest.raises(PoolTimeout):
                await post(pool)
            cancelled = asyncio.create_task(post(pool))
            await until(lambda: pool.stats()["waiting"] == 1, "a waiter in line")
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert pool.stats() == {"open": 1, "idle": 0, "waiting": 0}
            release.set()
            await first
            assert (await post(pool, b"after")).status == 200
            assert srv.accepted == 1 and pool.stats() == {"open": 1, "idle": 1, "waiting": 0}

    run(scenario)


def test_cancelling_the_caller_closes_its_connection_and_frees_the_slot(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        arrived = asyncio.Event()

        async def script(peer: Peer) -> None:
            if peer.index <= 2:
                await peer.request()
                arrived.set()
                await peer.until_closed()  # never answers
            else:
                await answer_all(peer)

        async with Scripted(script) as srv, pooled(srv, limit=1) as pool:
            task = asyncio.create_task(post(pool))
            await waited(arrived)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: srv.closed_by_client == [1], "the client closed the cancelled request's connection")
            assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}
            with pytest.raises(TimeoutError):  # the gateway's way: a deadline around the call
                async with asyncio.timeout(0.05):
                    await post(pool, b"slow")
            await until(lambda: srv.closed_by_client == [1, 2], "the timed-out request's connection closed too")
            assert (await post(pool)).status == 200  # a fresh connection, nothing mixed up
            assert srv.accepted == 3

    run(scenario)


def test_idle_connections_are_reused_newest_first_and_closed_after_the_idle_timeout(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        both_in = asyncio.Event()
        turn = [asyncio.Event(), asyncio.Event()]

        async def script(peer: Peer) -> None:
            await peer.request()
            if peer.index == 2:
                both_in.set()
            await turn[peer.index - 1].wait()  # answered in a chosen order
            await peer.send(OK)
            await answer_all(peer)

        async with Scripted(script) as srv, pooled(srv, limit=2, idle_timeout=3600) as pool:
            calls = [asyncio.create_task(post(pool, b"a")), asyncio.create_task(post(pool, b"b"))]
            await waited(both_in)
            turn[0].set()
            await until(lambda: pool.stats()["idle"] == 1, "the first connection is idle")
            turn[1].set()
            await asyncio.gather(*calls)
            await post(pool, b"c")
            assert srv.seen[-1] == (2, b"c")  # the connection idle the shortest time
        async with Scripted(answer_all) as srv, pooled(srv, limit=2, idle_timeout=0.05) as pool:
            await asyncio.gather(post(pool), post(pool))
            await until(
                lambda: sorted(srv.closed_by_client) == list(range(1, srv.accepted + 1)),
                "every idle connection closed by the idle timer",
            )
            assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}
            assert (await post(pool)).status == 200

    run(scenario)


async def in_flight_and_in_line(pool: ConnectionPool, arrived: asyncio.Event) -> tuple[asyncio.Task, asyncio.Task]:
    """With ``limit=1`` and a held server: one request answering, one waiting for its connection."""
    in_flight = asyncio.create_task(post(pool))
    await waited(arrived)
    in_line = asyncio.create_task(post(pool))
    await until(lambda: pool.stats()["waiting"] == 1, "a request in line")
    return in_flight, in_line


def test_close_fails_requests_in_flight_and_in_line_and_refuses_new_ones(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        script, arrived, release = held_server()
        async with Scripted(script) as srv:
            pool = srv.pool(limit=1)
            in_flight, in_line = await in_flight_and_in_line(pool, arrived)
            pool.close()
            pool.close()  # idempotent
            with pytest.raises(Disconnected):
                await in_flight
            with pytest.raises(PoolClosed):
                await in_line
            with pytest.raises(PoolClosed):
                await post(pool)
            assert pool.stats()["idle"] == 0
            release.set()

    run(scenario)


def test_drain_lets_requests_in_flight_and_in_line_finish_and_refuses_new_ones(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        script, arrived, release = held_server(record_close=True)

        async with Scripted(script) as srv:
            pool = srv.pool(limit=1)
            in_flight, in_line = await in_flight_and_in_line(pool, arrived)
            pool.drain()
            with pytest.raises(PoolClosed):
                await post(pool)  # a new request is refused
            assert not in_flight.done() and not in_line.done()
            release.set()
            assert (await in_flight).status == 200  # answered, not failed
            assert (await in_line).status == 200  # the line got the connection that came back
            assert srv.accepted == 1
            await until(lambda: srv.closed_by_client == [1], "the connection closed once nobody needed it")
            assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}

    run(scenario)


def test_drain_closes_idle_connections_at_once(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Scripted(answer_all) as srv:
            pool = srv.pool(limit=2, idle_timeout=3600)
            await asyncio.gather(post(pool), post(pool))
            assert pool.stats() == {"open": 2, "idle": 2, "waiting": 0}
            pool.drain()
            await until(lambda: sorted(srv.closed_by_client) == [1, 2], "both idle connections closed")
            assert pool.stats() == {"open": 0, "idle": 0, "waiting": 0}

    run(scenario)


def test_a_larger_cap_lets_the_line_connect_and_a_smaller_one_closes_connections_as_they_return(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        script, arrived, release = held_server(record_close=True)

        async with Scripted(script) as srv, pooled(srv, limit=1, idle_timeout=3600) as pool:
            first = asyncio.create_task(post(pool, b"0"))
            await waited(arrived)
            rest = [asyncio.create_task(post(pool, b"%d" % i)) for i in (1, 2)]
            await until(lambda: pool.stats()["waiting"] == 2, "two requests in line")
            pool.resize(3)
            await until(lambda: srv.accepted == 3, "the two in line connected under the larger cap")
            assert pool.stats() == {"open": 3, "idle": 0, "waiting": 0}
            pool.resize(1)
            release.set()
            await asyncio.gather(first, *rest)  # every request in flight is answered
            await until(lambda: len(srv.closed_by_client) == 2, "two connections closed as they came back")
            assert pool.stats() == {"open": 1, "idle": 1, "waiting": 0}
            assert (await post(pool, b"after")).status == 200 and srv.accepted == 3
            with pytest.raises(ValueError, match="at least 1"):
                pool.resize(0)

    run(scenario)


def test_a_smaller_cap_serves_the_line_only_once_the_pool_fits(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        script, arrived, release = held_server()
        async with Scripted(script) as srv, pooled(srv, limit=2, idle_timeout=3600) as pool:
            held = [asyncio.create_task(post(pool, b"%d" % i)) for i in (0, 1)]
            await until(lambda: srv.accepted == 2 and len(srv.seen) == 2, "both connections busy")
            pool.resize(1)
            waiting = asyncio.create_task(post(pool, b"2"))
            await until(lambda: pool.stats()["waiting"] == 1, "a request in line")
            release.set()
            await asyncio.gather(*held, waiting)
            assert srv.accepted == 2 and pool.stats()["open"] == 1  # the line reused what fit, nothing new

    run(scenario)


def test_upstreams_sync_applies_a_new_concurrency_and_drains_a_replica_it_drops(run) -> None:  # noqa: ANN001
    import time

    import numpy as np

    from fleet.gateway.upstream import Upstreams

    script, arrived, release = held_server(answer=ANSWER)

    async def scenario() -> None:
        async with Scripted(script) as srv:
            upstreams = Upstreams()
            url = f"http://127.0.0.1:{srv.port}"
            upstreams.sync({("m", "1"): (url,)}, {"m": (4, 16, 2.0)})
            try:
                replica = upstreams.pool("m", "1").replicas[0]  # type: ignore[union-attr]
                assert replica.session.limit == 4
                upstreams.sync({("m", "1"): (url,)}, {"m": (9, 16, 2.0)})  # the policy changed
                assert replica.session.limit == 9 and upstreams.pool("m", "1").slots.limit == 9  # type: ignore[union-attr]
                features = np.zeros((1, 4), dtype=np.float32)
                call = asyncio.create_task(upstreams.predict("m", "1", features, time.monotonic() + 5, "interactive"))
                await waited(arrived)
                upstreams.sync({}, {})  # the version left the list while answering
                assert replica.session.closed
                release.set()
                assert (await call).shape == (1, 2)  # answered, not failed for the routing change
                assert replica.failures == 0
            finally:
                await upstreams.close()

    run(scenario)


def test_headers_that_would_break_the_request_are_refused_before_connecting(run) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Scripted(answer_all) as srv, pooled(srv) as pool:
            for method, path, headers in [
                ("POST", "/predict", {"X-Evil": "a\r\nInjected: yes"}),
                ("POST", "/predict", {"Host": "elsewhere"}),
                ("POST", "/predict", [(b"Content-Length", b"1")]),
                ("POST", "/pre dict", {}),
                ("HEAD", "/", {}),
            ]:
                with pytest.raises(ValueError):
                    await pool.request(method, path, b"{}", headers, max_body=10, connect_timeout=1)
            assert srv.accepted == 0
            assert ConnectionPool.from_url("http://model-a:3000/ignored").origin == "http://model-a:3000"
            with pytest.raises(ValueError):
                ConnectionPool.from_url("https://model-a:3000")

    run(scenario)


# -- a real server under concurrency -------------------------------------------------------------
@contextlib.asynccontextmanager
async def uvicorn_server(app: object) -> AsyncIterator[int]:
    """uvicorn (httptools) on a socket bound and listening before it starts, so connections
    queue at once; stopped and awaited on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", http="httptools")
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


def test_a_real_server_under_concurrency_sees_connections_reused_and_capped(run) -> None:  # noqa: ANN001
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response as StarletteResponse
    from starlette.routing import Route

    limit, requests = 3, 60
    clients: set[tuple[str, int]] = set()
    load = {"in_flight": 0, "max": 0}

    async def scenario() -> None:
        full = asyncio.Event()  # the first requests wait until the cap is reached: all its connections get used

        async def echo(request: Request) -> StarletteResponse:
            clients.add(request.scope["client"])
            load["in_flight"] += 1
            load["max"] = max(load["max"], load["in_flight"])
            if load["in_flight"] == limit:
                full.set()
            try:
                await full.wait()
                body = await request.body()
                return StarletteResponse(body[::-1], media_type="application/octet-stream")
            finally:
                load["in_flight"] -= 1

        app = Starlette(routes=[Route("/predict", echo, methods=["POST"])])
        async with uvicorn_server(app) as port:
            pool = ConnectionPool("127.0.0.1", port, limit=limit)
            try:
                bodies = [b"request-%03d" % i for i in range(requests)]
                answers = await asyncio.gather(*(post(pool, b) for b in bodies))
                assert [a.body for a in answers] == [b[::-1] for b in bodies]
                assert pool.stats() == {"open": limit, "idle": limit, "waiting": 0}
            finally:
                pool.close()
        assert len(clients) == limit and load["max"] == limit  # 60 requests over exactly 3 connections

    run(scenario)


# -- the gateway's use: Upstreams maps the client's errors to its own classes --------------------
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n[[0.3,0.7]]"


def status(code: int, body: bytes = b"{}") -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (code, len(body), body)


@pytest.mark.parametrize(
    "answer, error, kind, blamed",
    [
        (ANSWER, None, None, 0),
        (status(500, b"boom"), "UpstreamError", "5xx", 1),
        (status(503, b"overloaded"), "UpstreamError", "5xx", 0),  # shed: asked again, never blamed
        (status(400, b"bad input"), "Rejected", None, 0),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 33554433\r\n\r\n", "BadAnswer", "5xx", 0),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n[[0.3", "UpstreamError", "5xx", 1),  # cut short
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "UpstreamError", "5xx", 1),
        (b"", "UpstreamError", "unreachable", 1),  # closed without a byte of an answer
    ],
)
def test_upstreams_turn_each_client_outcome_into_the_gateways_error_class(
    run, answer: bytes, error: str | None, kind: str | None, blamed: int
) -> None:  # noqa: ANN001
    import time

    import numpy as np

    from fleet.gateway.upstream import Upstreams

    async def script(peer: Peer) -> None:
        while await peer.request() is not None:
            if not answer:
                return
            await peer.send(answer)
            if answer.endswith(b"[[0.3"):
                return

    async def scenario() -> None:
        async with Scripted(script) as srv:
            upstreams = Upstreams()
            url = f"http://127.0.0.1:{srv.port}"
            upstreams.sync({("m", "1"): (url,)}, {"m": (4, 16, 2.0)})
            try:
                features = np.zeros((1, 4), dtype=np.float32)
                try:
                    got = await upstreams.predict("m", "1", features, time.monotonic() + 5, "interactive")
                except Exception as exc:  # noqa: BLE001 - the class is the assertion
                    assert type(exc).__name__ == error, exc
                    assert getattr(exc, "kind", None) == kind
                else:
                    assert error is None and got.tolist() == [[pytest.approx(0.3), pytest.approx(0.7)]]
                replica = upstreams.pool("m", "1").replicas[0]  # type: ignore[union-attr]
                assert replica.failures == blamed and replica.in_flight == 0
            finally:
                await upstreams.close()

    run(scenario)


def test_upstreams_skip_a_replica_that_refuses_for_the_next_one(run) -> None:  # noqa: ANN001
    import time

    import numpy as np

    from fleet.gateway.upstream import Upstreams

    async def script(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.send(ANSWER)

    async def scenario() -> None:
        with socket.socket() as dead:
            dead.bind(("127.0.0.1", 0))
            async with Scripted(script) as srv:
                upstreams = Upstreams()
                urls = (f"http://127.0.0.1:{dead.getsockname()[1]}", f"http://127.0.0.1:{srv.port}")
                upstreams.sync({("m", "1"): urls}, {"m": (4, 16, 2.0)})
                try:
                    features = np.zeros((1, 4), dtype=np.float32)
                    for _ in range(4):  # the rotation puts the dead one first at least once
                        got = await upstreams.predict("m", "1", features, time.monotonic() + 5, "interactive")
                        assert got.shape == (1, 2)
                    dead_replica, live = upstreams.pool("m", "1").replicas  # type: ignore[union-attr]
                    assert dead_replica.failures >= 1 and live.failures == 0 and srv.accepted == 1
                    upstreams.sync(
                        {("m", "1"): urls[1:]}, {"m": (4, 16, 2.0)}
                    )  # the dead one leaves: its pool is closed
                    assert dead_replica.session.closed and not live.session.closed
                finally:
                    await upstreams.close()
                assert live.session.closed

    run(scenario)
