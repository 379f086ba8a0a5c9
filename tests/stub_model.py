"""A model service test double that speaks the Bento's HTTP contract, with faults on demand.

    python tests/stub_model.py --port 8123 [--delay-ms 50] [--fail-rate 0.1] [--flip]

``POST /predict {"features": [[...], ...]}`` answers class probabilities from the demo
rule (the same rule bentos/tabular_mlp was trained on), ``--flip`` inverts them (a shadow
that disagrees). ``GET /readyz`` is its health check. ``POST /_control`` changes delay,
fail rate, flip or ``nan`` (answer NaN probabilities: a broken model) while it runs, sheds
the next N requests with 503 (``shed_next``) or refuses them with 400 (``reject_next``);
``GET /_stats`` counts the predictions it was asked for.
Real HTTP on 127.0.0.1, for the faults a real Bento cannot be made to have on cue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import numpy as np


def probabilities(features: list[list[float]], flip: bool) -> list[list[float]]:
    x = np.asarray(features, dtype=np.float64).reshape(len(features), -1)
    logit = 1.5 * x[:, 0] - 2.0 * x[:, 1] + 0.8 * x[:, 2] * x[:, 3] - 0.25
    p1 = 1.0 / (1.0 + np.exp(-4 * logit))
    if flip:
        p1 = 1.0 - p1
    return np.stack([1.0 - p1, p1], axis=1).round(6).tolist()


def make_app(delay_ms: float, fail_rate: float, flip: bool):  # noqa: ANN201 - an ASGI app
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    state = {"delay_ms": delay_ms, "fail_rate": fail_rate, "flip": flip, "shed_next": 0, "reject_next": 0, "nan": False,
             "requests": 0, "failed": 0}  # fmt: skip
    rng = random.Random(0)

    async def predict(request: Request) -> JSONResponse:
        state["requests"] += 1
        body = json.loads(await request.body())
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
        if state["nan"]:
            return Response(b"[" + b",".join(b"[NaN,NaN]" for _ in body["features"]) + b"]", media_type="application/json")
        return JSONResponse(probabilities(body["features"], state["flip"]))

    async def readyz(_: Request) -> JSONResponse:
        return JSONResponse({"ready": True})

    async def control(request: Request) -> JSONResponse:
        changes = json.loads(await request.body())
        state.update({k: v for k, v in changes.items() if k in ("delay_ms", "fail_rate", "flip", "shed_next", "reject_next", "nan")})
        return JSONResponse(state)

    async def stats(_: Request) -> JSONResponse:
        return JSONResponse(state)

    return Starlette(routes=[
        Route("/predict", predict, methods=["POST"]), Route("/readyz", readyz),
        Route("/_control", control, methods=["POST"]), Route("/_stats", stats),
    ])  # fmt: skip


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--flip", action="store_true")
    args = parser.parse_args()
    app = make_app(args.delay_ms, args.fail_rate, args.flip)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
