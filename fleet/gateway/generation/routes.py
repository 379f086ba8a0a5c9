"""Generation at the gateway: OpenAI completions and chat, and OIP's generate extension.

The same steps as a tensor request (``fleet.gateway.pipeline``), in the same order where the
protocol allows: the API key (401) before any byte of the body; for OIP the model and
version from the path, so entitlement, the early shed and the quota come before the body
too; for OpenAI the model is in the body, which is read first (at most ``MAX_BODY_BYTES``,
counted against the bodies in flight) and parsed inline — it is small and bounded. Then the
version (pins, the sticky canary split, ``name:version`` like ``/versions/<v>``), and the
same dispatch as a tensor request's (``fleet.gateway.dispatch``: the version's slots, fair
across tenants, a replica, the retry of a version that sheds, blame), whose protocol part is
``generation.stream.GenerateExchange``.

Streams pass through as they come: the service's server-sent events (``bentos/tiny_lm``'s
contract) are read as they arrive (``generation.sse``), turned into the caller's protocol one
event at a time, and written at once — nothing is buffered beyond one event. The routes are
answered before Starlette's router (``infer_routes.InferRoutes``).

Two deadlines: the first token must come within the policy's ``first_token_timeout_ms``
(capped by the request's timeout), and the whole answer within the request's timeout
(``X-Fleet-Timeout-Ms`` or ``parameters.timeout_ms``, capped by the model's ``timeout_ms``).
The service is told the whole deadline too, so it drops a sequence nobody waits for.

Before the first token nothing has reached the caller, so a canary that fails (refused,
5xx, shed past the retries, no replica) is retried once on stable, and the failure counted
against the canary — as for tensors. After the first token a failure ends the stream with
an error event (the status, 200, is already sent) and counts against the version. A caller
that leaves cancels its generation: the connection to the replica is closed, and the
service frees the sequence's place in the batch and its KV cache.

Per version: time to first token and per output token, prompt and completion tokens
(``fleet.gateway.telemetry``); the windowed stats canary analysis reads count a generation's
time to first token as its latency, so the rollout's p99 gate is a TTFT gate for these.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from fleet.catalog.policies.generation import GenerationPolicy as GenerationSpec
from fleet.catalog.routes.table import choose_version, should_shadow
from fleet.errors import FleetError
from fleet.gateway import body as bodies
from fleet.gateway.admin import json_response
from fleet.gateway.answers import UpstreamError
from fleet.gateway.fairqueue import PRIORITIES
from fleet.gateway.generation import protocol
from fleet.gateway.generation.sse import SSE_HEADERS, WRITE_S, EventStreamResponse
from fleet.gateway.generation.stream import GenerateExchange, Stream, count, prompt_bound
from fleet.gateway.inputs import MalformedBody
from fleet.gateway.pipeline import Call, Pipeline
from fleet.gateway.protocol import parse_json
from fleet.gateway.shadow import Generated, GenShadowJob
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import Upstreams, UpstreamTimeout
from fleet.logs.inference import GenSample, digest
from fleet.usage.meter import UsageMeter

MAX_BODY_BYTES = 256 * 1024  # a generation request: a prompt of at most 32 k characters and its settings


class NotGenerative(FleetError):
    status = 400


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
        body_read_s: float = bodies.BODY_READ_S,
        stream_write_s: float = WRITE_S,
    ) -> None:
        self.pipeline, self.upstreams, self.telemetry, self.usage = pipeline, upstreams, telemetry, usage
        self.in_flight, self.max_body_bytes = in_flight, min(max_body_bytes, MAX_BODY_BYTES)
        self.body_read_s, self.stream_write_s = body_read_s, stream_write_s

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
            return await bodies.read(request, self.max_body_bytes, held, self.body_read_s)

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
        return EventStreamResponse(
            self._sse(answer, stream, kept),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
            write_s=self.stream_write_s,
        )

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
        exchange = GenerateExchange(job.payload)
        try:
            opened = await self.upstreams.ask(pool, exchange, deadline, "batch")
            try:
                first_at, event = time.monotonic(), opened.first
                parts = [event.get("text", "")]
                if event.get("finish_reason") is None:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        async for event in opened.events:
                            parts.append(event.get("text", ""))
                            if event.get("finish_reason") is not None:
                                break
            finally:
                await opened.close()
        except (TimeoutError, UpstreamTimeout):
            raise UpstreamTimeout(f"{pool.ref} did not finish a mirrored generation in time") from None
        reason = event.get("finish_reason")
        if reason in (None, "error", "timeout"):
            kind = "timeout" if reason == "timeout" else "5xx"
            raise (UpstreamTimeout if kind == "timeout" else UpstreamError)(
                f"{pool.ref} failed a mirrored generation: {reason or 'its stream ended early'}", kind
            )
        completion = count(event, "completion_tokens")
        now = time.monotonic()
        return Generated(
            "".join(parts),
            (first_at - exchange.asked) * 1e3,
            (now - first_at) * 1e3 / (completion - 1) if completion > 1 else None,
            count(event, "prompt_tokens"),
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
            count(final, "prompt_tokens"),
            count(final, "completion_tokens"),
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
        """The version chosen and asked (``fleet.gateway.dispatch``, as for tensors), and its
        first event read; a canary that fails before its first token is retried on stable."""
        params = req.parameters or {}
        key = self.pipeline.control(call, params, "routing_key") or call.request_id
        priority = self.pipeline.control(call, params, "priority") or "interactive"
        if priority not in PRIORITIES:
            raise MalformedBody(f"priority {priority!r} is not known; expected one of {', '.join(PRIORITIES)}")
        timeout_ms = self.pipeline.timeout(call, params)
        own_ms = float(call.spec.timeout_ms)  # type: ignore[union-attr]
        call.routing_key = key
        choice = choose_version(call.table, call.tenant, key, call.requested)  # type: ignore[arg-type]
        call.state["model_version"] = choice.version
        deadline = time.monotonic() + timeout_ms / 1000
        exchange = GenerateExchange(self._payload(req, gen, priority, timeout_ms))
        tenant = call.tenant
        quotas = self.pipeline.quotas
        max_tokens = req.max_tokens or gen.default_max_tokens
        reserved = await quotas.reserve_tokens(tenant, max_tokens)  # type: ignore[arg-type]
        try:
            version, opened = await self.pipeline.ask(
                call, choice, exchange, timeout_ms, priority, float(gen.first_token_timeout_ms)
            )
        except BaseException:
            quotas.charge(tenant, -reserved)  # type: ignore[arg-type] # nothing was made: all given back
            raise
        call.state["model_version"] = version
        stream = Stream(
            call.model,
            version,
            tenant.name,  # type: ignore[union-attr]
            opened,
            opened.first,
            exchange.asked,
            time.monotonic(),
            deadline,
            self.telemetry,
            self.usage,
            functools.partial(quotas.charge, tenant),
            exchange.payload,
            charged=reserved,
            callers=timeout_ms < own_ms,
            max_prompt=prompt_bound(req.prompt, req.messages),
            max_completion=max_tokens,
        )
        if opened.first.get("finish_reason") in ("error", "timeout"):  # nothing reached the caller yet: say so now
            await stream.collect()
        return stream


__all__ = ["GenerationRoutes", "NotGenerative"]
