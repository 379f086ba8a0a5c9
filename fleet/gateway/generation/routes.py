"""Generation at the gateway: OpenAI completions and chat, and OIP's generate extension.

The same steps as a tensor request (``fleet.gateway.pipeline``), in the same order where the
protocol allows: the API key (401) before any byte of the body; for OIP the model and
version from the path, so entitlement, the early shed and the quota come before the body
too; for OpenAI the model is in the body, which is read first (at most ``MAX_BODY_BYTES``,
counted against the bodies in flight) and parsed inline — it is small and bounded. Then the
version (pins, the sticky canary split, ``name:version`` like ``/versions/<v>``), the
version's slots (fair across tenants, ``fleet.gateway.slots``) and a replica.

Streams pass through as they come: the service's server-sent events (``bentos/tiny_lm``'s
contract) are read as they arrive, turned into the caller's protocol one event at a time,
and written at once — nothing is buffered beyond one event (``MAX_EVENT_BYTES``).

The replica's stream is read with the gateway's own HTTP/1.1 client (``fleet.gateway.h1client``,
``ConnectionPool.stream``) on the replica's pooled keep-alive connections — the ones
tensor calls use — not httpx, whose call cost about a millisecond of the time to first
token; events are parsed by ``EventParser`` from whatever bytes arrive. The answer goes
out through ``EventStreamResponse``: Starlette's event stream without its task group, one
write per event. The routes are answered before Starlette's router (``app.InferRoutes``).

Two deadlines: the first token must come within the policy's ``first_token_timeout_ms``
(capped by the request's timeout), and the whole answer within the request's timeout
(``X-Fleet-Timeout-Ms`` or ``parameters.timeout_ms``, capped by the model's ``timeout_ms``).
The service is told the whole deadline too, so it drops a sequence nobody waits for.

Before the first token nothing has reached the caller, so a canary that fails (refused,
5xx, shed, no replica) is retried once on stable, and the failure counted against the
canary — as for tensors (``fleet.gateway.dispatch``). After the first token a failure ends
the stream with an error event (the status, 200, is already sent) and counts against the
version. A caller that leaves cancels its generation: the connection to the replica is
closed, and the service frees the sequence's place in the batch and its KV cache.

Per version: time to first token and per output token, prompt and completion tokens
(``fleet.gateway.telemetry``); the windowed stats canary analysis reads count a generation's
time to first token as its latency, so the rollout's p99 gate is a TTFT gate for these.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fleet.catalog.policies.generation import GenerationPolicy as GenerationSpec
from fleet.catalog.routes.table import choose_version, should_shadow
from fleet.errors import FleetError
from fleet.gateway import body as bodies
from fleet.gateway import h1client
from fleet.gateway.activate import Starting
from fleet.gateway.admin import json_response
from fleet.gateway.dispatch import fallback
from fleet.gateway.generation import protocol
from fleet.gateway.pipeline import Call, Pipeline
from fleet.gateway.protocol import MalformedBody, parse_json
from fleet.gateway.shadow import Generated, GenShadowJob
from fleet.gateway.slots import PRIORITIES
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import (
    CONNECT_TIMEOUT_S,
    NoReplica,
    Pool,
    Rejected,
    Replica,
    UpstreamError,
    Upstreams,
    UpstreamTimeout,
)
from fleet.logs.inference import GenSample, digest
from fleet.usage.meter import UsageMeter

MAX_BODY_BYTES = 256 * 1024  # a generation request: a prompt of at most 32 k characters and its settings
MAX_EVENT_BYTES = 64 * 1024  # one event from a model service; a longer one is a broken answer
STREAM_PATH = "/generate_stream"
DRAIN_S = 0.5  # how long the end of a stream is waited for after its final event
CHARGE_EVERY = 16  # tokens charged to a tenant's token quota at a time while an answer streams
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # and nginx in front must not buffer
_STREAM_HEADERS = ((b"Content-Type", b"application/json"), (b"Accept", b"text/event-stream"))
ERROR_HEAD_BYTES = 2048  # of an error answer's body, read for its message


class NotGenerative(FleetError):
    status = 400


@dataclass
class _Open:
    """One replica answering one generation: its events, and what is given back at the end."""

    pool: Pool
    replica: Replica
    response: h1client.StreamedResponse
    events: Events
    closed: bool = False

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.replica.in_flight -= 1
            self.pool.slots.release()
            # after the end: the connection goes back to the pool; before it: it is closed, so the service cancels
            self.response.close()


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

    def __init__(self, response: h1client.StreamedResponse, ref: str) -> None:
        self._response, self._parser = response, EventParser(ref)
        self._ready: list[dict[str, Any]] = []  # parsed, not yet handed out (reversed: popped from the end)

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while not self._ready:
            try:
                data = await self._response.read()
            except h1client.HTTPClientError as exc:  # cut off mid-answer, or not HTTP: the version's failure
                raise UpstreamError(f"{self._parser.ref} broke off: {type(exc).__name__}", "5xx") from None
            if not data:
                raise StopAsyncIteration
            self._ready = self._parser.feed(data)
            self._ready.reverse()
        return self._ready.pop()


@dataclass
class Stream:
    """A generation under way: the first event is in hand; ``events()`` yields it and the rest."""

    model: str
    version: str
    tenant: str
    opened: _Open
    first: dict[str, Any]
    asked: float  # when the version was asked (after its slot)
    first_at: float
    deadline: float
    telemetry: Telemetry
    usage: UsageMeter | None
    charge: Callable[[int], None]  # tokens spent of the tenant's token quota, as they stream
    payload: bytes = b""  # what the version was asked (a shadow is asked the same)
    final: dict[str, Any] = field(default_factory=dict)
    charged: int = 0
    seen: int = 0  # tokens the last event counted (prompt and completion)

    @property
    def ref(self) -> str:
        return f"{self.model}:{self.version}"

    def _spend(self, event: dict[str, Any], *, final: bool = False) -> None:
        """Charge the tenant's token quota as the answer streams: every ``CHARGE_EVERY``
        tokens (prompt and completion so far), and what is left at the end."""
        used = self.seen = _count(event, "prompt_tokens") + _count(event, "completion_tokens")
        if used - self.charged >= CHARGE_EVERY or (final and used > self.charged):
            self.charge(used - self.charged)
            self.charged = used

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event to the final one; ``UpstreamError`` / ``UpstreamTimeout`` if the answer
        breaks off. Closing the iterator early (the caller left) cancels the generation."""
        try:
            event = self.first
            while True:
                if event.get("finish_reason") is not None:
                    self._spend(event, final=True)
                    self._ended(event)  # raises for a generation that failed
                    yield event
                    await self._drain()
                    return
                self._spend(event)
                yield event
                try:
                    async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                        event = await anext(self.opened.events)
                except StopAsyncIteration:
                    raise self._failed(
                        UpstreamError(f"{self.ref} ended its stream before it finished", "5xx")
                    ) from None
                except TimeoutError:
                    raise self._failed(
                        UpstreamTimeout(f"{self.ref} did not finish within the request's timeout")
                    ) from None
                except UpstreamError as exc:
                    raise self._failed(exc) from None
                except h1client.HTTPClientError as exc:
                    raise self._failed(UpstreamError(f"{self.ref} broke off: {type(exc).__name__}", "5xx")) from None
        finally:
            if self.seen > self.charged:  # a caller that left pays for what was made for it
                self.charge(self.seen - self.charged)
                self.charged = self.seen
            await self.opened.close()

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

    def _ended(self, final: dict[str, Any]) -> None:
        self.final = final
        reason = final.get("finish_reason")
        if reason == "error":
            raise self._failed(UpstreamError(f"{self.ref} failed: {str(final.get('error'))[:200]}", "5xx"))
        if reason == "timeout":
            raise self._failed(UpstreamTimeout(f"{self.ref} did not finish within the request's timeout"))
        now = time.monotonic()
        completion = _count(final, "completion_tokens")
        tpot_ms = (now - self.first_at) * 1e3 / (completion - 1) if completion > 1 else None
        self.telemetry.generated(
            self.model,
            self.version,
            ttft_ms=(self.first_at - self.asked) * 1e3,
            tpot_ms=tpot_ms,
            prompt_tokens=_count(final, "prompt_tokens"),
            completion_tokens=completion,
            queue_s=_seconds(final, "queue_s"),
        )
        self.opened.replica.succeeded()
        if self.usage is not None:
            self.usage.served(
                self.tenant, self.model, self.version, 1, now - self.asked, _count(final, "prompt_tokens") + completion
            )


def _seconds(event: dict[str, Any], key: str) -> float | None:
    """A duration the service reported, if it is one (a broken replica's garbage is left out)."""
    value = event.get(key)
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 86_400 else None
    )


def _count(event: dict[str, Any], key: str) -> int:
    value = event.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else 0


@dataclass
class _Kept:
    """A generation's part in the log sample and the shadow mirror, decided when it starts."""

    call: Call
    req: protocol.GenRequest
    stream: Stream
    sampled: bool
    shadow: bool

    @property
    def wanted(self) -> bool:
        return self.sampled or self.shadow


class GenerationRoutes:
    def __init__(
        self,
        pipeline: Pipeline,
        upstreams: Upstreams,
        telemetry: Telemetry,
        usage: UsageMeter | None,
        in_flight: bodies.BodyBudget,
        max_body_bytes: int,
    ) -> None:
        self.pipeline, self.upstreams, self.telemetry, self.usage = pipeline, upstreams, telemetry, usage
        self.in_flight, self.max_body_bytes = in_flight, min(max_body_bytes, MAX_BODY_BYTES)

    async def close(self) -> None:
        """Nothing of its own: a replica's streams use its connection pool (``Upstreams``'s)."""

    # -- the routes ------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._openai(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._openai(request, "chat")

    async def oip_generate(self, request: Request) -> Response:
        return await self._oip(request, stream=False)

    async def oip_generate_stream(self, request: Request) -> Response:
        return await self._oip(request, stream=True)

    async def _openai(self, request: Request, kind: str) -> Response:
        call = Call(model="", requested=None, headers=request.headers, state=request.scope["state"])
        call.state["model"] = "unknown"
        self.pipeline.authenticate(call)  # before a byte of the body is read
        body = parse_json(await self._read(request, call))
        call.model, call.requested = protocol.model_name(body)
        self.pipeline.entitle(call)
        gen = self._generation(call)
        req = (protocol.chat if kind == "chat" else protocol.completion)(body, gen.max_tokens)
        await self.pipeline.admit(call)
        await self.pipeline.quotas.check_tokens(call.tenant)  # type: ignore[arg-type]
        return await self._serve(call, req, gen, kind)

    async def _oip(self, request: Request, stream: bool) -> Response:
        call = Call(
            model=request.path_params["model"],
            requested=request.path_params.get("version"),
            headers=request.headers,
            state=request.scope["state"],
        )
        await self.pipeline.admit(self.pipeline.begin(call))  # all before the body, as for tensors
        await self.pipeline.quotas.check_tokens(call.tenant)  # type: ignore[arg-type]
        gen = self._generation(call)
        req = protocol.oip(
            parse_json(await self._read(request, call)), call.model, call.requested, gen.max_tokens, stream
        )
        return await self._serve(call, req, gen, "oip")

    async def _read(self, request: Request, call: Call) -> bytes:
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):
            raise MalformedBody(f"Content-Encoding {encoding[:40]!r} is not accepted; expected an uncompressed body")
        with self.in_flight.holding(call.tenant.name) as held:  # type: ignore[union-attr]
            return await bodies.read(request, self.max_body_bytes, held)

    def _generation(self, call: Call) -> GenerationSpec:
        gen = call.spec.generation
        if gen is None:
            raise NotGenerative(
                f"model {call.model} is not generative (its policy does not say generative: true); "
                f"expected tensors at /v2/models/{call.model}/infer"
            )
        return gen

    # -- one generation ------------------------------------------------------------------------------
    async def _serve(self, call: Call, req: protocol.GenRequest, gen: GenerationSpec, kind: str) -> Response:
        stream = await self._start(call, req, gen)
        answer = protocol.Answer(kind, call.request_id, call.model, stream.version, req.include_usage)
        rate = call.spec.inference_log.sample_rate
        table = call.table
        kept = _Kept(
            call,
            req,
            stream,
            sampled=bool(rate) and random.random() < rate,
            shadow=table is not None
            and table.shadow is not None
            and table.shadow.version != stream.version
            and should_shadow(table, call.routing_key),
        )
        if not req.stream:
            text, final = await stream.collect()
            self._kept(kept, text)
            return json_response(answer.whole(text, final))
        call.state["streaming"] = True  # a concurrency lease is held until the stream ends, not its first byte
        return EventStreamResponse(self._sse(answer, stream, kept), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _sse(self, answer: protocol.Answer, stream: Stream, kept: _Kept) -> AsyncIterator[bytes]:
        first = True
        parts: list[str] = []  # only for a sampled or mirrored generation: at most max_tokens pieces
        try:
            async for event in stream.events():
                if kept.wanted:
                    parts.append(event.get("text", ""))
                yield answer.chunk(event, first)
                first = False
        except FleetError as exc:
            yield answer.error(str(exc), exc.status)
            return
        self._kept(kept, "".join(parts))
        yield answer.done()

    def _kept(self, kept: _Kept, text: str) -> None:
        """What a finished generation leaves behind, off the caller's path: its log sample,
        and its mirror to the shadow version (the whole answer there, compared with this one)."""
        if kept.sampled:
            self._log(kept.call, kept.req, kept.stream, text)
        if kept.shadow:
            call, stream = kept.call, kept.stream
            self.pipeline.recorder.mirror.offer(
                GenShadowJob(
                    call.model,
                    call.table.shadow.version,
                    stream.version,
                    stream.payload,
                    text,  # type: ignore[union-attr]
                    (stream.first_at - stream.asked) * 1e3,
                    call.spec.timeout_ms / 1000,
                )
            )

    async def shadow(self, job: GenShadowJob, deadline: float) -> Generated:
        """The shadow version's whole answer to a mirrored generation (``fleet.gateway.shadow``):
        read from its stream, so its time to first token is measured as a caller's is."""
        pool = await self.upstreams.ready(job.model, job.version, deadline)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await pool.slots.acquire("batch", pool.ref, "", 1.0)
                asked = time.monotonic()
                opened = await self._open(pool, job.payload, last_resort=True)
                try:
                    parts, first_at, event = [], 0.0, {}
                    async for event in opened.events:
                        first_at = first_at or time.monotonic()
                        parts.append(event.get("text", ""))
                        if event.get("finish_reason") is not None:
                            break
                finally:
                    await opened.close()
        except TimeoutError:
            raise UpstreamTimeout(f"{pool.ref} did not finish a mirrored generation in time") from None
        reason = event.get("finish_reason")
        if reason in (None, "error", "timeout"):
            kind = "timeout" if reason == "timeout" else "5xx"
            raise (UpstreamTimeout if kind == "timeout" else UpstreamError)(
                f"{pool.ref} failed a mirrored generation: {reason or 'its stream ended early'}", kind
            )
        completion = _count(event, "completion_tokens")
        now = time.monotonic()
        return Generated(
            "".join(parts),
            (first_at - asked) * 1e3,
            (now - first_at) * 1e3 / (completion - 1) if completion > 1 else None,
            _count(event, "prompt_tokens"),
            completion,
        )

    def _log(self, call: Call, req: protocol.GenRequest, stream: Stream, text: str) -> None:
        """A finished, sampled generation into the inference log (lengths, times, the output's
        digest; its texts where the policy allows), and its id for exact-match feedback."""
        spec, final = call.spec, stream.final
        texts = spec.inference_log.texts  # type: ignore[union-attr]
        prompt = (
            req.prompt if req.prompt is not None else orjson.dumps([[r, c] for r, c in req.messages or ()]).decode()
        )
        sample = GenSample(
            time.time(),
            call.request_id,
            stream.model,
            stream.version,
            stream.tenant,
            (time.monotonic() - stream.asked) * 1e3,
            (stream.first_at - stream.asked) * 1e3,
            _count(final, "prompt_tokens"),
            _count(final, "completion_tokens"),
            str(final.get("finish_reason"))[:16],
            digest(text),
            prompt if texts else None,
            text if texts else None,
        )
        recorder = self.pipeline.recorder
        recorder.log.record(sample)
        recorder.logged.remember(
            stream.model, stream.tenant, call.request_id, 1, (stream.version, sample.output_digest)
        )

    def _payload(self, req: protocol.GenRequest, gen: GenerationSpec, priority: str, timeout_ms: float) -> bytes:
        max_tokens = req.max_tokens or gen.default_max_tokens
        payload: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": min(req.min_tokens, max_tokens),
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stop": list(req.stop),
            "seed": req.seed,
            "priority": priority,
            "timeout_s": round(timeout_ms / 1000, 3),
        }
        if req.prompt is not None:
            payload["prompt"] = req.prompt
        else:
            payload["messages"] = [{"role": r, "content": c} for r, c in req.messages or ()]
        return orjson.dumps(payload)

    async def _start(self, call: Call, req: protocol.GenRequest, gen: GenerationSpec) -> Stream:
        """The version chosen and asked, and its first event read; a canary that fails before
        its first token is retried on stable."""
        params = req.parameters or {}
        key = self.pipeline.control(call, params, "routing_key") or call.request_id
        priority = self.pipeline.control(call, params, "priority") or "interactive"
        if priority not in PRIORITIES:
            raise MalformedBody(f"priority {priority!r} is not known; expected one of {', '.join(PRIORITIES)}")
        timeout_ms = self.pipeline.timeout(call, params)
        first_ms = min(float(gen.first_token_timeout_ms), timeout_ms)
        call.routing_key = key
        choice = choose_version(call.table, call.tenant, key, call.requested)  # type: ignore[arg-type]
        call.state["model_version"] = choice.version
        second = fallback(call.table, choice)  # type: ignore[arg-type]
        order = [choice.version] if second is None else [choice.version, second]
        started = time.monotonic()
        payload = self._payload(req, gen, priority, timeout_ms)
        tenant = call.tenant
        failure: FleetError | None = None
        held = 0.0  # seconds spent waiting for cold versions to start
        for i, version in enumerate(order):
            before = time.monotonic()
            try:  # a cold lazy version is held while it starts, within the request's timeout
                pool = await self.upstreams.ready(call.model, version, started + timeout_ms / 1000)
            except Starting as exc:  # still starting: stable may answer a canary's request
                failure = exc
                held += time.monotonic() - before
                continue
            except NoReplica as exc:
                self.telemetry.failed(call.model, version, "unreachable")
                failure = exc
                continue
            held += time.monotonic() - before
            # the first token is due first_ms after the request, not counting a cold start's hold
            # (bounded by max_hold_ms); the whole answer stays within the request's timeout
            first_by = min(started + held + first_ms / 1000, started + timeout_ms / 1000)
            try:
                async with asyncio.timeout(max(0.0, first_by - time.monotonic())):
                    await pool.slots.acquire(priority, pool.ref, tenant.name, tenant.weight or 1.0)  # type: ignore[union-attr]
                    asked = time.monotonic()
                    opened = await self._open(pool, payload, last_resort=i == len(order) - 1)
                    try:
                        first = await anext(opened.events)
                    except BaseException:
                        await opened.close()
                        raise
            except TimeoutError:
                self.telemetry.failed(call.model, version, "timeout")
                raise UpstreamTimeout(
                    f"{call.model}:{version} sent no first token within {first_ms:.0f} ms (the policy's "
                    "first_token_timeout_ms, capped by the request's timeout)"
                ) from None
            except Rejected:
                self.telemetry.rejections.labels(call.model, version).inc()
                raise
            except StopAsyncIteration:
                self.telemetry.failed(call.model, version, "5xx")
                failure = UpstreamError(f"{call.model}:{version} ended its stream before its first event", "5xx")
                continue
            except UpstreamError as exc:
                self.telemetry.failed(call.model, version, exc.kind)
                failure = exc
                continue
            call.state["model_version"] = version
            stream = Stream(
                call.model,
                version,
                tenant.name,
                opened,
                first,
                asked,
                time.monotonic(),  # type: ignore[union-attr]
                started + timeout_ms / 1000,
                self.telemetry,
                self.usage,
                functools.partial(self.pipeline.quotas.charge, tenant),
                payload,
            )
            if first.get("finish_reason") in ("error", "timeout"):  # nothing reached the caller yet: say so now
                await stream.collect()
            return stream
        assert failure is not None
        raise failure

    async def _open(self, pool: Pool, payload: bytes, last_resort: bool) -> _Open:
        """A replica's stream, its status checked; the slot is the caller's until this returns."""
        replicas = pool.order(last_resort)
        if not replicas:
            pool.slots.release()
            raise UpstreamError(f"every replica of {pool.ref} is ejected after consecutive failures", "unreachable")
        failures, shed = [], ""
        for replica in replicas:
            replica.in_flight += 1
            try:
                response = await replica.session.stream(
                    "POST", STREAM_PATH, payload, _STREAM_HEADERS, connect_timeout=CONNECT_TIMEOUT_S
                )
            except h1client.Unreachable as exc:  # refused, connect timeout, closed before answering: not asked
                replica.in_flight -= 1
                replica.failed(time.monotonic())
                failures.append(f"{replica.url}: {type(exc).__name__}")
                continue
            except BaseException as exc:
                replica.in_flight -= 1
                pool.slots.release()
                if isinstance(exc, h1client.HTTPClientError):
                    replica.failed(time.monotonic())
                    raise UpstreamError(
                        f"{pool.ref} at {replica.url} failed: {type(exc).__name__}: {exc}", "5xx"
                    ) from None
                raise
            if response.status == 200:
                return _Open(pool, replica, response, Events(response, pool.ref))
            detail = await _head_of(response)
            replica.in_flight -= 1
            if response.status == 503:
                shed = f"{pool.ref} at {replica.url} shed the request: HTTP 503 {detail}"
                continue
            pool.slots.release()
            if response.status >= 500:
                replica.failed(time.monotonic())
                raise UpstreamError(f"{pool.ref} answered HTTP {response.status}: {detail}", "5xx")
            replica.succeeded()
            raise Rejected(f"{pool.ref} refused the input: HTTP {response.status} {detail}", response.status)
        pool.slots.release()
        if shed:
            raise UpstreamError(shed, "5xx")
        raise UpstreamError(f"no replica of {pool.ref} could be reached ({'; '.join(failures)})", "unreachable")


async def _head_of(response: h1client.StreamedResponse, limit: int = ERROR_HEAD_BYTES) -> str:
    """The start of an error answer, for the message; its connection is given back after
    (kept when the answer was read to its end)."""
    data = b""
    try:
        with contextlib.suppress(h1client.HTTPClientError):
            data = await response.aread(limit)
    finally:
        response.close()
    return data[:200].decode(errors="replace")


class EventStreamResponse(StreamingResponse):
    """A server-sent event stream to the caller, as Starlette's ``StreamingResponse`` sends
    it (the same head and body messages), without its task group: the events are sent from
    the request's own task, and one small task listens for the caller leaving — which
    cancels the stream where it waits (for the replica's next event), so the replica's
    connection is closed and the generation cancelled, as before."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"left": False, "done": False}

        def on_left(listener: asyncio.Task[None]) -> None:
            if state["done"] or listener.cancelled() or listener.exception() is not None:
                return
            state["left"] = True
            task.cancel()

        listener = asyncio.ensure_future(_until_disconnect(receive))
        listener.add_done_callback(on_left)
        iterator = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            state["done"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["left"] or task.uncancel() > 0:
                raise  # cancelled from outside: the server's shutdown
        finally:
            state["done"] = True
            listener.cancel()
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()  # left between two events: the generation's own cleanup runs now
        if self.background is not None:
            await self.background()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


__all__ = ["EventParser", "EventStreamResponse", "Events", "GenerationRoutes", "NotGenerative", "Stream"]
