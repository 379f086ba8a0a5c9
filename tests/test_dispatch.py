"""The one dispatch (``fleet.gateway.dispatch`` over ``Upstreams.ask``) for both protocols,
against scripted replicas on 127.0.0.1 (``tests/test_h1client.py``'s ``Scripted``): a tensor
request's exchange and a generation's take the same path — versions in order, the retry of
a version that sheds (HTTP 503), blame, the fallback of a canary's request to stable, and
the slot and the replica's place in flight given back on every path. Every test runs on
asyncio's event loop and on uvloop's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from fleet.catalog.routes.table import Canary, Choice, RouteTable
from fleet.gateway.answers import UpstreamError
from fleet.gateway.dispatch import Dispatcher
from fleet.gateway.generation.stream import GenerateExchange, Opened
from fleet.gateway.replicas import Pool
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.tensors import TensorExchange
from fleet.gateway.upstream import CallerTimeout, Rejected, Upstreams, UpstreamTimeout
from tests.test_gateway_sse import BODY, EVENTS, SSE_HEAD, chunked
from tests.test_h1client import ANSWER, Peer, Scripted, status

STABLE, CANARY = "1.0.0", "1.1.0"
TABLE = RouteTable(model="m", stable=STABLE, canary=Canary(version=CANARY, weight=50))
SHED = status(503, b'{"error": "process is overloaded"}')
STREAM = SSE_HEAD + chunked(BODY, [7])
GOOD = {"tensor": ANSWER, "generation": STREAM}
KINDS = list(GOOD)


def exchange(kind: str, upstreams: Upstreams) -> TensorExchange | GenerateExchange:
    if kind == "tensor":
        return TensorExchange(np.zeros((1, 4), dtype=np.float32), upstreams.parse)
    return GenerateExchange(b'{"prompt": "hi", "max_tokens": 2}')


def replica(*answers: bytes, close: bool = False, first_after_s: float = 0.0) -> Callable[[Peer], object]:
    """A replica that answers its requests with ``answers`` in turn, the last one from then on
    (``b""``: nothing, the connection closed); with ``close`` it closes the connection after
    each answer, and it waits ``first_after_s`` before its first answer."""
    plan = list(answers)

    async def script(peer: Peer) -> None:
        while await peer.request() is not None:
            if first_after_s and len(peer.server.seen) == 1:
                await asyncio.sleep(first_after_s)
            answer = plan.pop(0) if len(plan) > 1 else plan[0]
            if not answer:
                return
            await peer.send(answer)
            if close:
                return

    return script


async def dispatch(
    kind: str, servers: dict[str, Scripted], choice: Choice, timeout_ms: float = 5000, own_ms: float | None = None
) -> tuple[dict[str, Pool], Telemetry, tuple[str, object] | Exception]:
    """Dispatch one request to replicas ``servers`` (version → server); the version's pools,
    the telemetry, and (the version, its result) or the error. A stream is closed once its
    first event is checked, as a caller that read it would. ``own_ms``: the model's own
    timeout (and a generation's first-token deadline), when the request's is shorter."""
    upstreams, telemetry = Upstreams(), Telemetry(lambda: iter(()))
    upstreams.sync({("m", v): (f"http://127.0.0.1:{s.port}",) for v, s in servers.items()}, {"m": (4, 16, 2.0)})
    first_ms = None if kind == "tensor" else (own_ms or timeout_ms)
    try:
        got: tuple[str, object] | Exception = await Dispatcher(upstreams, telemetry)(
            "m", TABLE, choice, exchange(kind, upstreams), timeout_ms, "interactive", first_ms=first_ms, own_ms=own_ms
        )
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        got = exc
    if not isinstance(got, Exception) and isinstance(got[1], Opened):
        opened = got[1]
        assert opened.first == EVENTS[0]
        assert upstreams.pool("m", got[0]).slots.in_use == 1  # type: ignore[union-attr] # the stream holds it
        await opened.close()
    pools = {v: p for (_, v), p in upstreams.pools().items()}
    await upstreams.close()
    return pools, telemetry, got


def errors(telemetry: Telemetry, version: str) -> dict[str, int]:
    _, _, versions = telemetry.stats.window("m", 60)
    return {k: n for k, n in versions.get(version, {}).get("errors", {}).items() if n}


def settled(pools: dict[str, Pool], servers: dict[str, Scripted]) -> None:
    """Every slot released and no replica left in flight, whatever the outcome."""
    for version in servers:
        pool = pools[version]
        assert pool.slots.in_use == 0, version
        assert all(r.in_flight == 0 for r in pool.replicas), version


@pytest.mark.parametrize("kind", KINDS)
def test_a_version_that_sheds_is_asked_again_and_not_blamed_when_it_then_answers(run, kind: str) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Scripted(replica(SHED, GOOD[kind])) as srv:
            pools, telemetry, got = await dispatch(kind, {STABLE: srv}, Choice(STABLE, "stable"))
            assert not isinstance(got, Exception), got
            assert got[0] == STABLE and len(srv.seen) == 2  # shed once, answered the second time
            assert errors(telemetry, STABLE) == {}
            assert pools[STABLE].replicas[0].failures == 0
            settled(pools, {STABLE: srv})

    run(scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_a_version_that_still_sheds_after_the_back_offs_is_its_failure_once(run, kind: str) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Scripted(replica(SHED)) as srv:
            pools, telemetry, got = await dispatch(kind, {STABLE: srv}, Choice(STABLE, "stable"))
            assert isinstance(got, UpstreamError) and got.kind == "5xx", got
            assert "shed the request: HTTP 503" in str(got)
            assert len(srv.seen) == 3  # asked, then again after 10 ms and after 50 ms
            assert errors(telemetry, STABLE) == {"5xx": 1}  # one request, one failure
            assert pools[STABLE].replicas[0].failures == 0  # not a fault
            settled(pools, {STABLE: srv})

    run(scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_a_shed_is_asked_again_only_while_the_deadline_leaves_room_for_the_back_off(run, kind: str) -> None:  # noqa: ANN001
    """The first shed comes 80 ms before the deadline: room for the 10 ms back-off (it must
    leave 20 ms), none for the 50 ms one (100 ms): asked twice, not three times."""

    async def scenario() -> None:
        async with Scripted(replica(SHED, first_after_s=0.42)) as srv:
            pools, telemetry, got = await dispatch(kind, {STABLE: srv}, Choice(STABLE, "stable"), timeout_ms=500)
            assert isinstance(got, UpstreamError) and "shed the request" in str(got), got
            assert len(srv.seen) == 2 and errors(telemetry, STABLE) == {"5xx": 1}
            settled(pools, {STABLE: srv})

    run(scenario)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("own_ms", [1000, 100, None], ids=["callers-shorter", "the-models-own", "none-asked"])
def test_only_the_models_own_deadline_running_out_is_the_versions_failure(run, kind: str, own_ms: float | None) -> None:  # noqa: ANN001
    """A canary answering after 300 ms, asked with a 100 ms timeout: shorter than the
    model's own (1000 ms), the caller's (``CallerTimeout``, counted apart, not retried on
    stable, the replica not held responsible); equal to it, or none asked, the canary's."""

    async def scenario() -> None:
        async with Scripted(replica(GOOD[kind], first_after_s=0.3)) as canary, Scripted(replica(GOOD[kind])) as stable:
            servers = {CANARY: canary, STABLE: stable}
            pools, telemetry, got = await dispatch(kind, servers, Choice(CANARY, "canary"), 100, own_ms)
            callers = own_ms == 1000
            assert isinstance(got, CallerTimeout if callers else UpstreamTimeout), got
            assert ("not counted against the version" in str(got)) == callers
            assert errors(telemetry, CANARY) == ({} if callers else {"timeout": 1})
            assert telemetry.caller_timeouts.labels("m", CANARY)._value.get() == int(callers)
            assert len(stable.seen) == 0  # a spent deadline is never retried
            settled(pools, servers)

    run(scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_a_canary_that_still_sheds_is_blamed_and_stable_answers(run, kind: str) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Scripted(replica(SHED)) as canary, Scripted(replica(GOOD[kind])) as stable:
            servers = {CANARY: canary, STABLE: stable}
            pools, telemetry, got = await dispatch(kind, servers, Choice(CANARY, "canary"))
            assert not isinstance(got, Exception) and got[0] == STABLE, got
            assert len(canary.seen) == 3 and len(stable.seen) == 1
            assert errors(telemetry, CANARY) == {"5xx": 1} and errors(telemetry, STABLE) == {}
            settled(pools, servers)

    run(scenario)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "answer, blamed",
    [
        (status(500, b"boom"), "5xx"),
        (status(400, b"bad input"), None),  # the caller's error: passed on, nobody blamed
        (b"", "unreachable"),  # closed without a byte of an answer
    ],
)
def test_slots_and_replicas_are_given_back_on_every_failure(run, kind: str, answer: bytes, blamed: str | None) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Scripted(replica(answer)) as srv:
            pools, telemetry, got = await dispatch(kind, {STABLE: srv}, Choice(STABLE, "stable"))
            assert isinstance(got, UpstreamError if blamed else Rejected), got
            assert errors(telemetry, STABLE) == ({blamed: 1} if blamed else {})
            settled(pools, {STABLE: srv})

    run(scenario)


@pytest.mark.parametrize(
    "answer, message",
    [
        (SSE_HEAD + b"0\r\n\r\n", "ended its stream before its first event"),
        (SSE_HEAD + b"5\r\n: hi\n", "broke off"),  # cut off before an event
    ],
)
def test_a_canary_stream_without_a_first_event_falls_back_to_stable(run, answer: bytes, message: str) -> None:  # noqa: ANN001
    async def scenario() -> None:
        async with Scripted(replica(answer, close=True)) as canary, Scripted(replica(STREAM)) as stable:
            servers = {CANARY: canary, STABLE: stable}
            pools, telemetry, got = await dispatch("generation", servers, Choice(CANARY, "canary"))
            assert not isinstance(got, Exception) and got[0] == STABLE, got
            assert errors(telemetry, CANARY) == {"5xx": 1}
            settled(pools, servers)

    async def alone() -> None:
        async with Scripted(replica(answer, close=True)) as canary:
            pools, _, got = await dispatch("generation", {STABLE: canary}, Choice(STABLE, "stable"))
            assert isinstance(got, UpstreamError) and message in str(got), got
            settled(pools, {STABLE: canary})

    run(scenario)
    run(alone)


@pytest.mark.parametrize("head", [b"", SSE_HEAD], ids=["before-the-head", "before-the-first-event"])
def test_a_caller_that_leaves_before_the_first_event_gives_everything_back(run, head: bytes) -> None:  # noqa: ANN001
    arrived = asyncio.Event()

    async def silent(peer: Peer) -> None:
        await peer.request()
        if head:
            await peer.send(head)
        arrived.set()
        await peer.until_closed()

    async def scenario() -> None:
        async with Scripted(silent) as srv:
            upstreams, telemetry = Upstreams(), Telemetry(lambda: iter(()))
            upstreams.sync({("m", STABLE): (f"http://127.0.0.1:{srv.port}",)}, {"m": (4, 16, 2.0)})
            try:
                call = asyncio.create_task(
                    Dispatcher(upstreams, telemetry)(
                        "m", TABLE, Choice(STABLE, "stable"), exchange("generation", upstreams), 5000, "interactive"
                    )
                )
                async with asyncio.timeout(5):
                    await arrived.wait()
                    await asyncio.sleep(0.01)  # the head, if any, read: waiting for the first event
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                settled({STABLE: upstreams.pool("m", STABLE)}, {STABLE: srv})  # type: ignore[dict-item]
                assert errors(telemetry, STABLE) == {}  # the caller left: not the version's failure
                async with asyncio.timeout(5):
                    while not srv.closed_by_client:  # the replica sees its caller go
                        await asyncio.sleep(0.001)
            finally:
                await upstreams.close()

    run(scenario)


@pytest.mark.parametrize("bound", ["completion", "prompt", "none"])
def test_token_counts_a_replica_reports_past_what_the_request_could_make_are_a_broken_answer(run, bound: str) -> None:  # noqa: ANN001
    """The stream's final event says 3 prompt and 2 completion tokens: with either bound below
    that, the version failed (5xx, blamed) and the tenant is charged nothing more than what
    was checked; within both, every token is charged once."""
    from fleet.gateway.generation.stream import Stream

    async def scenario() -> None:
        async with Scripted(replica(STREAM)) as srv:
            upstreams, telemetry = Upstreams(), Telemetry(lambda: iter(()))
            upstreams.sync({("m", STABLE): (f"http://127.0.0.1:{srv.port}",)}, {"m": (4, 16, 2.0)})
            charged: list[int] = []
            try:
                ex = exchange("generation", upstreams)
                version, opened = await Dispatcher(upstreams, telemetry)(
                    "m", TABLE, Choice(STABLE, "stable"), ex, 5000, "interactive"
                )
                limits = {"completion": (3, 1), "prompt": (2, 2), "none": (3, 2)}[bound]
                stream = Stream(
                    "m",
                    version,
                    "t",
                    opened,
                    opened.first,
                    ex.asked,
                    ex.asked,
                    ex.asked + 5,
                    telemetry,
                    None,
                    charged.append,
                    max_prompt=limits[0],
                    max_completion=limits[1],
                )
                if bound == "none":
                    assert "".join([e.get("text", "") async for e in stream.events()]) == "aé\n"
                    assert sum(charged) == 5 and errors(telemetry, STABLE) == {}
                else:
                    with pytest.raises(UpstreamError, match="expected at most .* for this request"):
                        async for _ in stream.events():
                            pass
                    assert sum(charged) <= 2 and errors(telemetry, STABLE) == {"5xx": 1}
                settled({STABLE: upstreams.pool("m", STABLE)}, {STABLE: srv})  # type: ignore[dict-item]
            finally:
                await upstreams.close()

    run(scenario)


def test_the_slot_and_replica_are_given_back_once_the_model_has_answered_however_slow_the_caller(run) -> None:  # noqa: ANN001
    """A caller that has taken one event of an answer the model has finished holds nothing of
    the version's: the rest is read ahead for it, and the slot, the replica's place and its
    connection are back before it takes the next."""
    from fleet.gateway.generation.stream import Stream

    async def scenario() -> None:
        async with Scripted(replica(STREAM)) as srv:
            upstreams, telemetry = Upstreams(), Telemetry(lambda: iter(()))
            upstreams.sync({("m", STABLE): (f"http://127.0.0.1:{srv.port}",)}, {"m": (4, 16, 2.0)})
            try:
                ex = exchange("generation", upstreams)
                version, opened = await Dispatcher(upstreams, telemetry)(
                    "m", TABLE, Choice(STABLE, "stable"), ex, 5000, "interactive"
                )
                pool = upstreams.pool("m", STABLE)
                assert pool is not None and pool.slots.in_use == 1
                stream = Stream(
                    "m", version, "t", opened, opened.first, ex.asked, ex.asked, ex.asked + 5, telemetry, None, int
                )
                events = stream.events()
                assert await anext(events) == EVENTS[0]
                for _ in range(200):  # the replica sends the rest at once: read ahead, not by the caller
                    if pool.slots.in_use == 0:
                        break
                    await asyncio.sleep(0.01)
                assert (pool.slots.in_use, pool.replicas[0].in_flight, opened.closed) == (0, 0, True)
                rest = [event async for event in events]
                assert [EVENTS[0], *rest] == EVENTS and rest[-1]["finish_reason"] == "length"
            finally:
                await upstreams.close()

    run(scenario)
