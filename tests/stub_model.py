"""A model service test double that speaks the Bento's HTTP contract, with faults on demand.

    python tests/stub_model.py --port 8123 [--delay-ms 50] [--fail-rate 0.1] [--flip] [--json-only]

``POST /predict {"features": [[...], ...]}`` answers class probabilities from the demo
rule (the same rule bentos/tabular_mlp was trained on) as JSON; ``POST /predict_tensor``
answers them in the tensor contract (``fleet.gateway.tensors``): a body of raw
little-endian FP32 bytes described by ``X-Fleet-Datatype: FP32`` and ``X-Fleet-Shape:
rows,4``, answered as ``application/octet-stream`` with ``X-Fleet-Datatype`` and
``X-Fleet-Shape: rows,2``; a body that does not match its headers is refused with 400 and
another content type with 415, as the Bento does. ``--json-only`` leaves that route out (a
service from before it: 404). Both routes compute from the FP32 features, so they answer the
same to the bit. ``--flip`` inverts the probabilities (a shadow that disagrees).

``POST /generate_stream`` answers the generation contract (``bentos/tiny_lm/service.py``)
as a character-level model would: the prompt (or the messages' contents, joined) is its
tokens, and the answer is ``max_tokens`` (default 16) tokens — the prompt's characters
reversed, then ``.`` — one server-sent event per token, ``token_ms`` apart (``/_control``),
then the final event with ``finish_reason`` ``length``; a body it cannot read is 400.
``GET /readyz`` is its health check. ``POST /_control`` changes delay, fail rate, flip or
``nan`` (answer NaN probabilities: a broken model) while it runs, sheds the next N requests
with 503 (``shed_next``) or refuses them with 400 (``reject_next``) — on both routes — or
makes the tensor route's answers lose their last 4 bytes (``truncate``: a broken encoder).
``GET /_stats`` counts the predictions it was asked for (``requests``, either route) and
every POST by path (``routes``, answered or not: a probe of a missing route shows there).
Real HTTP on 127.0.0.1, for the faults a real Bento cannot be made to have on cue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import numpy as np

TENSOR_TYPE = "application/octet-stream"
INPUTS = 4


def probabilities(features: list[list[float]] | np.ndarray, flip: bool) -> np.ndarray:
    """[n, 2] probabilities, from the features as FP32 (what the model takes, whatever the route carried)."""
    x = np.asarray(features, dtype=np.float32).astype(np.float64).reshape(len(features), -1)
    logit = 1.5 * x[:, 0] - 2.0 * x[:, 1] + 0.8 * x[:, 2] * x[:, 3] - 0.25
    p1 = 1.0 / (1.0 + np.exp(-4 * logit))
    if flip:
        p1 = 1.0 - p1
    return np.stack([1.0 - p1, p1], axis=1).round(6)


class BadTensor(Exception):
    """A tensor request that does not match its headers: (status, what was wrong and what was expected)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def read_tensor(body: bytes, headers) -> np.ndarray:  # noqa: ANN001 - Starlette's Headers
    """The features of a ``/predict_tensor`` request, or ``BadTensor`` saying what was expected."""
    content_type = headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != TENSOR_TYPE:
        raise BadTensor(415, f"Content-Type is {content_type!r}; expected {TENSOR_TYPE}")
    datatype = headers.get("x-fleet-datatype", "")
    if datatype != "FP32":
        raise BadTensor(400, f"X-Fleet-Datatype is {datatype!r}; this model takes FP32")
    shape = headers.get("x-fleet-shape", "").split(",")
    if len(shape) != 2 or not all(s.isascii() and s.isdigit() for s in shape) or int(shape[1]) != INPUTS:
        raise BadTensor(400, f"X-Fleet-Shape is {headers.get('x-fleet-shape')!r}; expected rows,{INPUTS}")
    rows = int(shape[0])
    if len(body) != rows * INPUTS * 4:
        raise BadTensor(400, f"body has {len(body)} bytes; shape {rows},{INPUTS} of FP32 needs {rows * INPUTS * 4}")
    return np.frombuffer(body, dtype="<f4").reshape(rows, INPUTS)


def make_app(delay_ms: float, fail_rate: float, flip: bool, json_only: bool = False):  # noqa: ANN201 - an ASGI app
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    state = {
        "delay_ms": delay_ms,
        "fail_rate": fail_rate,
        "flip": flip,
        "shed_next": 0,
        "reject_next": 0,
        "nan": False,
        "truncate": False,
        "token_ms": 0.0,
        "requests": 0,
        "failed": 0,
        "routes": {},
    }
    rng = random.Random(0)

    async def faults() -> JSONResponse | None:
        """The faults asked for, played the same on every route: an error answer, or None to
        answer normally."""
        if state["shed_next"]:  # what BentoML's batcher does when overloaded: 503 before any work
            state["shed_next"] -= 1
            return JSONResponse({"error": "process is overloaded"}, status_code=503)
        if state["reject_next"]:  # what a model server says of an input it cannot take
            state["reject_next"] -= 1
            return JSONResponse({"error": "input rejected by the model"}, status_code=400)
        if state["delay_ms"]:
            await asyncio.sleep(state["delay_ms"] / 1000)
        if state["fail_rate"] and rng.random() < state["fail_rate"]:
            state["failed"] += 1
            return JSONResponse({"error": "injected failure"}, status_code=500)
        return None

    def answer(features: np.ndarray | list) -> np.ndarray:
        result = probabilities(features, state["flip"])
        return np.full_like(result, np.nan) if state["nan"] else result

    async def predict(request: Request) -> Response:
        state["requests"] += 1
        body = json.loads(await request.body())
        if (failed := await faults()) is not None:
            return failed
        result = answer(body["features"])
        if state["nan"]:  # Python's json writes NaN, as a broken model's server would
            return Response(json.dumps(result.tolist()).encode(), media_type="application/json")
        return JSONResponse(result.tolist())

    async def predict_tensor(request: Request) -> Response:
        state["requests"] += 1
        body = await request.body()
        try:
            features = read_tensor(body, request.headers)
        except BadTensor as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        if (failed := await faults()) is not None:
            return failed
        result = answer(features)
        raw = result.astype("<f4").tobytes()
        if state["truncate"]:
            raw = raw[:-4]
        headers = {"X-Fleet-Datatype": "FP32", "X-Fleet-Shape": f"{len(result)},{result.shape[1]}"}
        return Response(raw, media_type=TENSOR_TYPE, headers=headers)

    async def generate_stream(request: Request) -> Response:
        from starlette.responses import StreamingResponse

        state["requests"] += 1
        try:
            body = json.loads(await request.body())
            prompt = body.get("prompt")
            if prompt is None:
                prompt = "".join(m["content"] for m in body["messages"])
            n = int(body.get("max_tokens") or 16)
            if not isinstance(prompt, str) or not 1 <= n <= 4096:
                raise ValueError("prompt or max_tokens")
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": f"cannot read the request: {exc}"}, status_code=400)
        if (failed := await faults()) is not None:
            return failed
        text = (prompt[::-1] + ".") * (n // (len(prompt) + 1) + 1)

        async def events():  # noqa: ANN202 - SSE chunks
            for i in range(n):
                if state["token_ms"]:
                    await asyncio.sleep(state["token_ms"] / 1000)
                event = {"text": text[i], "completion_tokens": i + 1, "prompt_tokens": len(prompt)}
                yield f"data: {json.dumps(event)}\n\n"
            final = {"text": "", "completion_tokens": n, "prompt_tokens": len(prompt), "finish_reason": "length"}
            yield f"data: {json.dumps(final | {'queue_s': 0.0, 'ttft_s': 0.0, 'tpot_s': 0.0})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def readyz(_: Request) -> JSONResponse:
        return JSONResponse({"ready": True})

    async def control(request: Request) -> JSONResponse:
        changes = json.loads(await request.body())
        known = ("delay_ms", "fail_rate", "flip", "shed_next", "reject_next", "nan", "truncate", "token_ms")
        state.update({k: v for k, v in changes.items() if k in known})
        return JSONResponse(state)

    async def stats(_: Request) -> JSONResponse:
        return JSONResponse(state)

    routes = [
        Route("/predict", predict, methods=["POST"]),
        Route("/generate_stream", generate_stream, methods=["POST"]),
        Route("/readyz", readyz),
        Route("/_control", control, methods=["POST"]),
        Route("/_stats", stats),
    ]
    if not json_only:
        routes.append(Route("/predict_tensor", predict_tensor, methods=["POST"]))
    app = Starlette(routes=routes)

    async def counted(scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        """Every POST counted by path before routing, so a request to a missing route counts too."""
        if scope["type"] == "http" and scope["method"] == "POST":
            state["routes"][scope["path"]] = state["routes"].get(scope["path"], 0) + 1
        await app(scope, receive, send)

    return counted


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--flip", action="store_true")
    parser.add_argument(
        "--json-only", action="store_true", help="no /predict_tensor: a service from before the tensor contract"
    )
    args = parser.parse_args()
    app = make_app(args.delay_ms, args.fail_rate, args.flip, args.json_only)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
