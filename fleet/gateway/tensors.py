"""A tensor request on its way to a model service and back: the protocol part of its
dispatch (``fleet.gateway.dispatch``; the rest is every protocol's, ``fleet.gateway.upstream``).

Tensors go to the model as tensors where its service takes them: ``POST /predict_tensor``
with the features' raw little-endian bytes (``Content-Type: application/octet-stream``,
``X-Fleet-Datatype: FP32``, ``X-Fleet-Shape: 256,4``), answered the same way (read by
``answers.decode_answer``). A binary-HTTP or gRPC request is so never turned into text on
its way to the model, and a JSON request's numbers are parsed once, by the gateway. A
replica whose service lacks that route says so with 404, 405 or 415: the same request goes
to it again as JSON (``POST /predict {"features": ...}``), and it gets JSON for the next
``TENSOR_REPROBE_S``. That probe costs one round trip per replica every few minutes; it is
never a failure of the replica.

An answer is read whole (at most ``MAX_ANSWER_BYTES``) and checked by the answer parser the
gateway gives (``answers.decode_answer``, off the event loop for large answers): one finite
row per input row, bytes that match their headers — else ``BadAnswer``, the version's failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import ClassVar

import numpy as np
import orjson

from fleet.gateway.answers import DATATYPE_HEADER, SHAPE_HEADER, TENSOR_TYPE, BadAnswer, TensorAnswer
from fleet.gateway.h1client.connection import Response
from fleet.gateway.h1client.errors import BodyTooLarge
from fleet.gateway.inputs import NUMPY_DTYPES
from fleet.gateway.replicas import CONNECT_TIMEOUT_S, Pool, Replica

AnswerParser = Callable[[bytes | TensorAnswer, str, int], Awaitable[np.ndarray]]
log = logging.getLogger("fleet.gateway.tensors")

MAX_ANSWER_BYTES = 32 * 1024 * 1024
JSON_PATH, TENSOR_PATH = "/predict", "/predict_tensor"
# what a service without the tensor route answers it: no route, no POST there, not that body type
NO_TENSOR_ROUTE = frozenset({404, 405, 415})
TENSOR_REPROBE_S = 300.0  # a replica without the route is asked for it again this long after
_JSON = ((b"Content-Type", b"application/json"),)
_OIP_NAMES = {np.dtype(t): name.encode() for name, t in NUMPY_DTYPES.items()}  # native dtype → X-Fleet-Datatype
_TENSOR_TYPE = TENSOR_TYPE.encode()
_DATATYPE, _SHAPE = DATATYPE_HEADER.encode(), SHAPE_HEADER.encode()


class TensorExchange:
    """One request's features, sent to whichever replica the dispatch picks, in the encoding
    that replica takes (each encoding made at most once, and only when a replica needs it: a
    pool may hold replicas that take tensors and some that take JSON only, and a request may
    meet both when one replica fails over to the next); its answer, parsed.

    ``asked``/``took``/``tenant`` are written by the dispatch: when the version was asked
    (after its slot), the seconds it took to answer (before the answer was parsed), and
    whose slot it holds."""

    streams: ClassVar[bool] = False  # the answer is whole when the replica's exchange returns
    late: ClassVar[str] = (
        "{ref} did not answer within {ms:.0f} ms (X-Fleet-Timeout-Ms, capped by the model's timeout_ms)"
    )
    __slots__ = ("_json", "_tensor", "asked", "features", "parse", "tenant", "took")

    def __init__(self, features: np.ndarray, parse: AnswerParser) -> None:
        self.features, self.parse = features, parse
        self._json: bytes | None = None
        self._tensor: tuple[bytes, tuple[tuple[bytes, bytes], ...]] | None = None
        self.asked = self.took = 0.0

    @property
    def tensor_ok(self) -> bool:
        """Whether the features have a fixed-size OIP encoding (BYTES or object arrays do not)."""
        return self.features.dtype.isnative and self.features.dtype in _OIP_NAMES and self.features.ndim >= 1

    def json(self) -> bytes:
        if self._json is None:
            self._json = orjson.dumps({"features": self.features}, option=orjson.OPT_SERIALIZE_NUMPY)
        return self._json

    def tensor(self) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
        """(raw little-endian row-major bytes, the headers that describe them)."""
        if self._tensor is None:
            x = self.features
            raw = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<")).tobytes()
            shape = ",".join(map(str, x.shape)).encode()
            self._tensor = raw, ((b"Content-Type", _TENSOR_TYPE), (_DATATYPE, _OIP_NAMES[x.dtype]), (_SHAPE, shape))
        return self._tensor

    # -- the dispatch's plug-in (fleet.gateway.upstream.Exchange) --------------------------------
    async def send(self, pool: Pool, replica: Replica) -> Response:
        """Send the request to one replica: as a tensor unless the replica is known to lack
        the route. A 404, 405 or 415 there says it lacks it (no such route, no POST there, or
        not this body type): the same request goes to it at once as JSON, and JSON from then
        on. That is not a failure, so nothing is counted: the dispatch only sees the answer
        to the JSON request. h1's errors pass through to the dispatch, which classes them; an
        answer over ``MAX_ANSWER_BYTES`` is a ``BadAnswer`` (the replica is not blamed for it)."""
        try:
            if replica.takes_tensors and self.tensor_ok:
                body, headers = self.tensor()
                resp = await replica.session.request(
                    "POST", TENSOR_PATH, body, headers, max_body=MAX_ANSWER_BYTES, connect_timeout=CONNECT_TIMEOUT_S
                )
                if resp.status not in NO_TENSOR_ROUTE:
                    return resp
                # asked again later: a service redeployed at the same address may have gained the route
                replica.json_until = time.monotonic() + TENSOR_REPROBE_S
                log.info(
                    "%s at %s answered HTTP %d to POST %s: sending it JSON (POST %s) for the next %.0f s",
                    pool.ref,
                    replica.url,
                    resp.status,
                    TENSOR_PATH,
                    JSON_PATH,
                    TENSOR_REPROBE_S,
                )
            return await replica.session.request(
                "POST", JSON_PATH, self.json(), _JSON, max_body=MAX_ANSWER_BYTES, connect_timeout=CONNECT_TIMEOUT_S
            )
        except BodyTooLarge as exc:
            if exc.declared is not None:
                raise BadAnswer(
                    f"{pool.ref} answered {exc.declared} bytes; at most {MAX_ANSWER_BYTES} are read"
                ) from None
            raise BadAnswer(
                f"{pool.ref} answered more than {MAX_ANSWER_BYTES} bytes; that many are read at most"
            ) from None

    async def head(self, response: Response) -> bytes:
        return response.body

    def opened(self, pool: Pool, replica: Replica, response: Response) -> bytes | TensorAnswer:
        """An answer as its ``Content-Type`` says: the tensor contract's bytes with their headers
        (checked by the parser, not here: this runs on the event loop), else JSON."""
        content_type = response.header(b"content-type")
        if content_type is not None and content_type.split(b";", 1)[0].strip().lower() == _TENSOR_TYPE:
            return TensorAnswer(response.body, response.header(_DATATYPE), response.header(_SHAPE))
        return response.body

    def result(self, pool: Pool, answer: bytes | TensorAnswer) -> Awaitable[np.ndarray]:
        return self.parse(answer, pool.ref, len(self.features))  # its coroutine, awaited by the dispatch
