"""A generation under way: its replica's event stream opened by the dispatch, and what the
stream gives back as it goes and when it ends.

``GenerateExchange`` is a generation's part of the dispatch (``fleet.gateway.dispatch``; the
rest — versions in order, the hold for a cold start, slots, replicas, the retry of a
version that sheds, blame before the first event — is every protocol's): a replica is sent
the generation's settings at ``POST /generate_stream`` and its first event is read within
the first-token deadline. The stream then stays open, holding the replica and the
version's slot, until ``Stream.events`` ends or its caller leaves (``Opened.close``).

``Stream`` reads the rest: each event as it comes, within the request's timeout, up to
``READ_AHEAD`` events ahead of the caller, so the version is given back when the model has
answered, not when a slow caller has read it. The
tenant's token quota, from which the generation reserved its ``max_tokens`` when admitted,
is charged as the answer streams (every ``CHARGE_EVERY`` tokens past the reservation; at the
end, or when the caller leaves, the difference: what was not used is given back). The final event decides: a
``finish_reason`` of ``error`` or ``timeout``, or a stream that breaks off, is the version's
failure (blamed, and held against its replica); else its time to first token, per output
token and token counts go to telemetry, and what it served to the usage meter. Every
generation is metered: one the caller left, or that failed part-way, with the tokens it
produced (as its tokens are charged to the quota).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fleet.errors import FleetError
from fleet.gateway.answers import UpstreamError
from fleet.gateway.generation.sse import Events
from fleet.gateway.h1client.connection import StreamedResponse
from fleet.gateway.h1client.errors import HTTPClientError
from fleet.gateway.replicas import CONNECT_TIMEOUT_S, Pool, Replica
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import CallerTimeout, UpstreamTimeout
from fleet.usage.meter import UsageMeter

STREAM_PATH = "/generate_stream"
DRAIN_S = 0.5  # how long the end of a stream is waited for after its final event
CHARGE_EVERY = 16  # tokens charged to a tenant's token quota at a time while an answer streams
# A prompt is at most one token per byte sent (byte-level and character tokenizers; fewer for
# the rest) plus what the model's chat template adds: this many per message, and once more
TEMPLATE_TOKENS = 16
ERROR_HEAD_BYTES = 2048  # of an error answer's body, read for its message
# events read from a replica ahead of the caller: a whole tiny-lm answer, and about 64 KiB of
# parsed events at most per stream (bounded in all by the version's slots and tenant_share)
READ_AHEAD = 128
_STREAM_HEADERS = ((b"Content-Type", b"application/json"), (b"Accept", b"text/event-stream"))


@dataclass
class Opened:
    """One replica answering one generation: its events, the first one read, and what is
    given back at the end (the replica's place in flight, the version's slot, the connection)."""

    pool: Pool
    replica: Replica
    response: StreamedResponse
    events: Events
    first: dict[str, Any] = field(default_factory=dict)
    closed: bool = False
    tenant: str = ""  # whose slot it holds (``Slots``' share per tenant)

    def give_up(self) -> bool:
        """The replica and the connection given back (the slot is not: ``close`` or the
        dispatch does that); False if that was done already."""
        if self.closed:
            return False
        self.closed = True
        self.replica.in_flight -= 1
        # after the end: the connection goes back to the pool; before it: it is closed, so the service cancels
        self.response.close()
        return True

    async def close(self) -> None:
        if self.give_up():
            self.pool.slots.release(self.tenant)


class GenerateExchange:
    """A generation's part of asking a version (``fleet.gateway.upstream.Exchange``): the
    settings ``payload`` sent, the replica's stream opened and its first event read."""

    streams: ClassVar[bool] = True
    late: ClassVar[str] = (
        "{ref} sent no first token within {ms:.0f} ms (the policy's first_token_timeout_ms, capped by the request's timeout)"
    )
    __slots__ = ("asked", "payload", "tenant", "took")

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.asked = self.took = 0.0
        self.tenant = ""

    def send(self, pool: Pool, replica: Replica) -> Any:  # noqa: ANN401 - the stream's coroutine, awaited by the dispatch
        return replica.session.stream(
            "POST", STREAM_PATH, self.payload, _STREAM_HEADERS, connect_timeout=CONNECT_TIMEOUT_S
        )

    def head(self, response: StreamedResponse) -> Any:  # noqa: ANN401 - a coroutine, as send's
        return _head_of(response)

    def opened(self, pool: Pool, replica: Replica, response: StreamedResponse) -> Opened:
        return Opened(pool, replica, response, Events(response, pool.ref), tenant=self.tenant)

    async def result(self, pool: Pool, opened: Opened) -> Opened:
        """The stream with its first event read; given up if none comes (the dispatch then
        blames the version, and a canary's request is asked again on stable)."""
        try:
            opened.first = await anext(opened.events)
        except StopAsyncIteration:
            opened.give_up()
            raise UpstreamError(f"{pool.ref} ended its stream before its first event", "5xx") from None
        except BaseException:
            opened.give_up()
            raise
        return opened


@dataclass
class Stream:
    """A generation under way: the first event is in hand; ``events()`` yields it and the rest."""

    model: str
    version: str
    tenant: str
    opened: Opened
    first: dict[str, Any]
    asked: float  # when the version was asked (after its slot)
    first_at: float
    deadline: float
    telemetry: Telemetry
    usage: UsageMeter | None
    charge: Callable[[int], None]  # tokens spent of the tenant's token quota, as they stream
    payload: bytes = b""  # what the version was asked (a shadow is asked the same)
    # the deadline is the caller's, shorter than the model's timeout_ms: its running out, here
    # or at the replica (finish_reason "timeout"), is not the version's failure (CallerTimeout)
    callers: bool = False
    # the most tokens this request can have made (``prompt_bound``, the payload's max_tokens):
    # a replica reporting more is a broken answer, never a bill or a quota charge
    max_prompt: int = 2**31 - 1
    max_completion: int = 2**31 - 1
    final: dict[str, Any] = field(default_factory=dict)
    charged: int = 0  # tokens charged to the quota so far: the reservation made at admission, at first
    metered: bool = False
    seen: int = 0  # tokens the last event counted (prompt and completion)
    # the deadline's end, judged once: the replica's "timeout" event and the caller's own clock
    # can both see it (the read-ahead and the caller run apart), and it is counted once
    late: FleetError | None = field(default=None, init=False, repr=False)

    @property
    def ref(self) -> str:
        return f"{self.model}:{self.version}"

    def _spend(self, event: dict[str, Any], *, final: bool = False) -> None:
        """Charge the tenant's token quota as the answer streams: every ``CHARGE_EVERY``
        tokens (prompt and completion so far) past what was charged (at first, the
        reservation made at admission: ``charged``), and the difference at the end — below
        0, the reservation's unused part given back."""
        prompt, completion = count(event, "prompt_tokens"), count(event, "completion_tokens")
        if prompt > self.max_prompt or completion > self.max_completion:
            raise self._failed(
                UpstreamError(
                    f"{self.ref} reported {prompt} prompt and {completion} completion tokens; expected at most "
                    f"{self.max_prompt} and {self.max_completion} for this request (a broken answer)",
                    "5xx",
                )
            )
        used = self.seen = prompt + completion
        if used - self.charged >= CHARGE_EVERY or (final and used != self.charged):
            self.charge(used - self.charged)
            self.charged = used

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event to the final one; ``UpstreamError`` / ``UpstreamTimeout`` if the answer
        breaks off. Closing the iterator early (the caller left) cancels the generation.

        The replica's events are read ahead of the caller, up to ``READ_AHEAD`` (``_read``):
        once the model has answered, its replica, connection and slot are given back, however
        slowly the caller takes what is left (one that stops reading is cut at the write
        deadline, holding only the events read for it). The request's deadline applies while
        the caller waits for the model."""
        ahead: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue(READ_AHEAD)
        reader = asyncio.create_task(self._read(ahead))
        try:
            while True:
                try:
                    async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                        item = await ahead.get()
                except TimeoutError:
                    raise self._late() from None
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.get("finish_reason") is not None:
                    return
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            if self.seen != self.charged:  # a caller that left pays for what was made for it, no more
                self.charge(self.seen - self.charged)
                self.charged = self.seen
            if not self.metered and self.seen:  # ended early: what it made is metered all the same
                self._meter(self.seen)
            await self.opened.close()

    async def _read(self, ahead: asyncio.Queue[dict[str, Any] | BaseException]) -> None:
        """The replica's events into ``ahead`` (waiting while it is full), charged as they come;
        at the final one, the generation judged and everything of the version's given back
        before the event is handed on; a broken answer handed on as its error."""
        try:
            event = self.first
            while True:
                if event.get("finish_reason") is not None:
                    self._spend(event, final=True)
                    self._ended(event)  # raises for a generation that failed
                    await self._drain()
                    await self.opened.close()  # the model has answered: its replica, connection and slot
                    await ahead.put(event)
                    return
                self._spend(event)
                await ahead.put(event)
                try:
                    event = await anext(self.opened.events)
                except StopAsyncIteration:
                    raise self._failed(
                        UpstreamError(f"{self.ref} ended its stream before it finished", "5xx")
                    ) from None
                except UpstreamError as exc:
                    raise self._failed(exc) from None
                except HTTPClientError as exc:
                    raise self._failed(UpstreamError(f"{self.ref} broke off: {type(exc).__name__}", "5xx")) from None
        except Exception as exc:  # noqa: BLE001 - the version's failure or the caller's deadline (or a bug), in its place
            await ahead.put(exc)

    async def _drain(self) -> None:
        """Read the replica's stream to its end after the final event, so its connection goes
        back to the pool: closed before the end, it is dropped, and every generation would pay
        for a new connection. A replica that sends on is not waited for."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(DRAIN_S):
                async for _ in self.opened.events:
                    break  # nothing may follow the final event: closing drops this connection

    async def collect(self) -> tuple[str, dict[str, Any]]:
        parts = [e.get("text", "") async for e in self.events()]
        return "".join(parts), self.final

    def _failed(self, exc: UpstreamError) -> UpstreamError:
        self.telemetry.failed(self.model, self.version, exc.kind)
        self.opened.replica.failed(time.monotonic())
        return exc

    def _late(self) -> FleetError:
        """The request's deadline passed mid-answer: the version's failure only if it was the
        model's own. Once per generation, however many of its readers see the deadline pass."""
        if self.late is not None:
            return self.late
        if self.callers:
            self.telemetry.caller_timeout(self.model, self.version)
            self.late = CallerTimeout(
                f"{self.ref} did not finish within the timeout this request allowed (shorter than the "
                "model's own); not counted against the version"
            )
        else:
            self.late = self._failed(UpstreamTimeout(f"{self.ref} did not finish within the request's timeout"))
        return self.late

    def _ended(self, final: dict[str, Any]) -> None:
        self.final = final
        reason = final.get("finish_reason")
        if reason == "error":
            raise self._failed(UpstreamError(f"{self.ref} failed: {str(final.get('error'))[:200]}", "5xx"))
        if reason == "timeout":
            raise self._late()
        now = time.monotonic()
        completion = count(final, "completion_tokens")
        tpot_ms = (now - self.first_at) * 1e3 / (completion - 1) if completion > 1 else None
        self.telemetry.generated(
            self.model,
            self.version,
            ttft_ms=(self.first_at - self.asked) * 1e3,
            tpot_ms=tpot_ms,
            prompt_tokens=count(final, "prompt_tokens"),
            completion_tokens=completion,
            queue_s=_seconds(final, "queue_s"),
        )
        self.opened.replica.succeeded()
        self._meter(count(final, "prompt_tokens") + completion)

    def _meter(self, tokens: int) -> None:
        """The generation into the usage meter, once."""
        self.metered = True
        if self.usage is not None:
            self.usage.served(self.tenant, self.model, self.version, 1, time.monotonic() - self.asked, tokens)


def prompt_bound(prompt: str | None, messages: tuple[tuple[str, str], ...] | None) -> int:
    """The most prompt tokens a request can make (``TEMPLATE_TOKENS``)."""
    if prompt is not None:
        return len(prompt.encode()) + TEMPLATE_TOKENS
    parts = messages or ()
    return sum(len(r.encode()) + len(c.encode()) for r, c in parts) + TEMPLATE_TOKENS * (len(parts) + 1)


def _seconds(event: dict[str, Any], key: str) -> float | None:
    """A duration the service reported, if it is one (a broken replica's garbage is left out)."""
    value = event.get(key)
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 86_400 else None
    )


def count(event: dict[str, Any], key: str) -> int:
    """A token count the service reported, if it is one (else 0)."""
    value = event.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else 0


async def _head_of(response: StreamedResponse, limit: int = ERROR_HEAD_BYTES) -> bytes:
    """The start of an error answer, for the message; its connection is given back after
    (kept when the answer was read to its end)."""
    data = b""
    try:
        with contextlib.suppress(HTTPClientError):
            data = await response.aread(limit)
    finally:
        response.close()
    return data
