"""The REST adapters: Open Inference Protocol v2 and KServe v1 over HTTP, model metadata and
readiness, and feedback. Each only parses, calls the pipeline's steps in order and
serializes; every decision is in ``fleet.gateway.pipeline`` and the modules it names.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from fleet.errors import FleetError, NotFound
from fleet.gateway import body as bodies
from fleet.gateway import protocol
from fleet.gateway.admin import json_response
from fleet.gateway.pipeline import Call, Pipeline
from fleet.logs import feedback as labels
from fleet.logs.inference import digest
from fleet.types import ObjectStore

JSON = "application/json"


class UnsupportedEncoding(FleetError):
    status = 415


BINARY = "application/octet-stream"  # what Triton answers binary outputs with


class Rest:
    def __init__(
        self,
        pipeline: Pipeline,
        store: ObjectStore,
        gateway_id: str,
        max_body_bytes: int,
        logged: labels.LoggedRequests,
        bodies_in_flight: bodies.BodyBudget,
        feedback_rate: tuple[float | None, int | None] = (None, None),
        body_read_s: float = bodies.BODY_READ_S,
    ) -> None:
        """``feedback_rate``: (calls a second, burst) of ``POST /v1/feedback`` per tenant; None:
        the tenant's own quota's."""
        self.pipeline, self.store, self.gateway_id = pipeline, store, gateway_id
        self.max_body_bytes, self.logged, self.in_flight = max_body_bytes, logged, bodies_in_flight
        self.feedback_rate, self.body_read_s = feedback_rate, body_read_s

    async def _decoded(self, request: Request, call: Call, decode: Callable[..., protocol.Decoded]) -> protocol.Decoded:
        """The body read and decoded, its bytes counted against the bodies in flight until then."""
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("identity", ""):  # a compressed body would otherwise read as "not valid JSON"
            raise UnsupportedEncoding(
                f"Content-Encoding {encoding[:40]!r} is not accepted; expected an uncompressed body (identity)"
            )
        with self.in_flight.holding(call.tenant.name) as held:  # type: ignore[union-attr]
            raw = await bodies.read(request, self.max_body_bytes, held, self.body_read_s)
            return await self.pipeline.decode(call, raw, decode)

    def _call(self, request: Request, model: str, version: str | None = None) -> Call:
        return Call(model=model, requested=version, headers=request.headers, state=request.scope["state"])

    async def infer_v2(self, request: Request) -> Response:
        """OIP v2 infer, as JSON or in Triton's binary tensor data extension (request and answer)."""
        call = await self.pipeline.admit(
            self.pipeline.begin(self._call(request, request.path_params["model"], request.path_params.get("version")))
        )
        decoded = await self._decoded(request, call, _v2_decoder(request))
        protocol.check_outputs(decoded.outputs, self.pipeline.expected(call).outputs)  # before a model is asked
        version, result, manifest = await self.pipeline.answer(call, decoded)
        body, header_length = protocol.v2_reply(
            call.model, version, decoded.id or call.request_id, manifest.outputs, result, decoded
        )
        if header_length is None:
            return Response(body, media_type=JSON)
        return Response(body, media_type=BINARY, headers={protocol.HEADER_LENGTH: str(header_length)})

    async def predict_v1(self, request: Request) -> Response:
        model, sep, verb = request.path_params["target"].rpartition(":")
        if not sep or verb != "predict":
            raise NotFound("no such route; expected POST /v1/models/<model>:predict")
        call = await self.pipeline.admit(self.pipeline.begin(self._call(request, model)))
        decoded = await self._decoded(request, call, protocol.decode_v1)
        _, result, _ = await self.pipeline.answer(call, decoded)
        return Response(protocol.v1_response(result), media_type=JSON)

    async def model_metadata(self, request: Request) -> Response:
        call = self.pipeline.begin(
            self._call(request, request.path_params["model"], request.path_params.get("version"))
        )
        info = self.pipeline.metadata(call)
        return json_response(
            {
                "name": info.name,
                "versions": info.versions,
                "platform": info.platform,
                "inputs": [s.model_dump() for s in info.inputs],
                "outputs": [s.model_dump() for s in info.outputs],
            }
        )

    async def model_ready(self, request: Request) -> Response:
        call = self.pipeline.begin(
            self._call(request, request.path_params["model"], request.path_params.get("version"))
        )
        version, ready = self.pipeline.readiness(call)
        return json_response({"name": call.model, "version": version, "ready": ready}, 200 if ready else 503)

    async def feedback(self, request: Request) -> Response:
        """Labels for earlier (sampled) requests of this tenant; unknown ones are reported. An
        id given twice in one call counts once (its last item)."""
        call = self._call(request, "")
        call.state["model"] = "unknown"
        tenant = self.pipeline.authenticate(call)  # before a byte of the body is read
        rps, burst = self.feedback_rate
        quota = tenant.quota
        if rps is None and quota is not None:
            rps, burst = quota.rps, burst or quota.burst
        if rps is not None:
            await self.pipeline.quotas.take_feedback(tenant.name, rps, burst or max(1, math.ceil(rps)))
        with self.in_flight.holding(tenant.name) as held:
            raw = await bodies.read(request, self.max_body_bytes, held, self.body_read_s)
            model, given = await self.pipeline.decoder.run(tenant.name, protocol.decode_feedback, raw)
        given = list({(x.request_id, x.row): x for x in given}.values())
        call.model = model
        self.pipeline.entitle(call)  # a model the tenant may not use looks like one that does not exist
        if call.spec is not None and call.spec.generative:
            return await self._exact_match(call, tenant.name, given)
        outputs = call.expected.outputs[0].shape if call.expected else [-1]
        labels.check_classes(given, outputs[-1] if outputs[-1] > 0 else 2**31)
        labels.check_outcomes(given, model, call.spec.outcomes if call.spec else {})
        wanted = {(x.request_id, x.row) for x in given}
        owned = await asyncio.to_thread(self.logged.owned, model, tenant.name, wanted)
        accepted = [x for x in given if (x.request_id, x.row) in owned]
        unknown = [{"request_id": x.request_id, "row": x.row} for x in given if (x.request_id, x.row) not in owned]
        await asyncio.to_thread(self._write, model, tenant.name, accepted)
        return self._answered(model, given, accepted, unknown)

    def _write(
        self, model: str, tenant: str, accepted: list[labels.Label], matched: list[tuple[str, bool]] | None = None
    ) -> None:
        """Accepted items: labels to ``logs/feedback/``, outcomes to ``logs/outcomes/`` (a thread)."""
        labelled = [x for x in accepted if x.label is not None]
        if labelled:
            labels.write(self.store, model, tenant, labelled, self.gateway_id, matched)
        labels.write_outcomes(self.store, model, tenant, accepted, self.gateway_id)

    async def _exact_match(self, call: Call, tenant: str, given: list[labels.Label]) -> Response:
        """A generative model's labels: each the text its answer should have been, compared
        with the logged output's digest and counted for the version that answered."""
        labels.check_texts(given, call.model)
        labels.check_outcomes(given, call.model, call.spec.outcomes if call.spec else {})
        answers = await asyncio.to_thread(self.logged.answers, call.model, tenant, {x.request_id for x in given})
        accepted = [x for x in given if x.request_id in answers]
        unknown = [{"request_id": x.request_id, "row": 0} for x in given if x.request_id not in answers]
        matched = [
            (answers[x.request_id][0], digest(str(x.label)) == answers[x.request_id][1])
            for x in accepted
            if x.label is not None
        ]
        await asyncio.to_thread(self._write, call.model, tenant, accepted, matched)
        # the exact-match gate counts an answer once: a label sent again (in a later call) is
        # stored (the last one wins offline) but not counted again
        first = self.logged.first_labels(call.model, tenant, [x.request_id for x in accepted if x.label is not None])
        for (version, match), new in zip(matched, first, strict=True):
            if new:
                self.pipeline.telemetry.labelled(call.model, version, match)
        return self._answered(call.model, given, accepted, unknown, matched=sum(m for _, m in matched))

    @staticmethod
    def _answered(model: str, given: list, accepted: list, unknown: list[dict], **extra: int) -> Response:
        body = {
            "model": model,
            "accepted": len(accepted),
            **extra,
            "unknown": unknown,
            "note": "labels join requests the inference log sampled, of your tenant, from the last 24 h",
        }
        if not accepted:  # a 404 reads like every other error, with the details beside it
            body = {
                "error": f"none of the {len(given)} label(s) matched a request the inference log sampled for "
                "your tenant in the last 24 h; see unknown",
                **body,
            }
        return json_response(body, 200 if accepted else 404)


def _v2_decoder(request: Request) -> Callable[..., protocol.Decoded]:
    """The decode function for this body: plain JSON, or, with ``Inference-Header-Content-Length``,
    the binary extension told where its JSON part ends (a partial of a module-level function:
    it pickles, so a large body is decoded in the worker like a JSON one)."""
    header_length = protocol.binary_header_length(request.headers.getlist(protocol.HEADER_LENGTH))
    if header_length is None:
        return protocol.decode_v2
    return functools.partial(protocol.decode_v2_binary, header_length=header_length)
