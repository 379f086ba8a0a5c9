"""BentoML service for one tabular-mlp model version.

A thin shell: resources, traffic and batching come from ``fleet_build.json``, which
``fleet package`` writes into the build from the model's policy; the model is the
checksum-verified artifact in the node's cache (``weights.model_dir``: fetched from the store
at start when it is not there; the Bento and its image hold no weights).

Each phase of a start is marked in the log (``phases.mark``: imports, the weights' fetch, the files' check, the
model loaded, a warm-up inference before ready), which ``bench/coldstart.py`` reads. BentoML's
server process imports this module to learn the service's settings and then starts a worker
that imports it again: torch (``model``, about a second here) is imported by the worker alone,
in ``__init__``, which took about that much off every cold start.

The model's files are checked against the manifest's listing (``fleet_build.json``
``files``) when this module is imported, so a mismatch stops ``bentoml serve`` before any
worker starts (BentoML would otherwise respawn a failing worker forever), and again in
``__init__`` right before the weights load (unchanged files are not hashed twice).

Two routes predict, with the same model, faults and batching settings:

* ``POST /predict {"features": [[...], ...]}`` → a JSON list of probabilities;
* ``POST /predict_tensor``, the fleet's tensor contract (``fleet.gateway.tensors``): the
  features as raw little-endian FP32 bytes (``Content-Type: application/octet-stream``,
  ``X-Fleet-Datatype: FP32``, ``X-Fleet-Shape: rows,<inputs>``), answered the same way
  (``X-Fleet-Shape: rows,<classes>``). The gateway sends tensors here, so a request that
  reached it as bytes (binary HTTP, gRPC) is never turned into text on its way in.

BentoML's main server parses only JSON and multipart bodies (pickle is refused there), so
the tensor route is a ``bentoml.api`` of its own whose input and output types read and
write the bytes (``TensorFeatures``, ``TensorProbabilities``: BentoML 1.4's
``IODescriptor.from_http_request``/``to_http_response``). Being a real API rather than a
mounted ASGI app, it keeps what the server gives APIs — adaptive batching, the 503 its
batcher sheds with, metrics, tracing — but batches in its own queue: requests on the two
routes are not batched together (the gateway uses one route per replica). A body that does
not match its headers is refused with 400 before it joins a batch, another content type
with 415.
"""

from __future__ import annotations

from phases import mark  # noqa: I001 - first: the imports below are a phase of the start it measures

mark("import")

import json  # noqa: E402
import random
import time
from http import HTTPStatus
from pathlib import Path

import bentoml
import numpy as np
from bentoml.exceptions import BadInput, BentoMLException
from integrity import verify_folder
from starlette.requests import Request
from starlette.responses import Response
from weights import model_dir  # noqa: I001 - the Bento holds these files at its root

mark("imported")

BUILD = json.loads((Path(__file__).with_name("fleet_build.json")).read_text())
mark("fetch")
MODEL_DIR = model_dir(BUILD)  # the node cache's verified copy, fetched from the store if not there
mark("fetched")
REMEDY = (
    f"expected the files of {BUILD['model']}:{BUILD['version']} as registered; on a fleet machine "
    f"`fleet package {BUILD['model']} {BUILD['version']}` caches them again from the registry; in the "
    "cluster the replica fetches them again at its next start"
)
BATCHING = {
    "batchable": BUILD["batching"]["batchable"],
    "batch_dim": 0,
    "max_batch_size": BUILD["batching"]["max_batch_size"],
    "max_latency_ms": BUILD["batching"]["max_latency_ms"],
}
TENSOR_TYPE = "application/octet-stream"
FP32 = np.dtype("<f4")


def verify_model(path: str) -> None:
    """Raise ``integrity.ArtifactMismatch`` unless every file of the manifest is in ``path`` with its registered bytes."""
    verify_folder(path, BUILD["files"], BUILD["artifact_sha256"], remedy=REMEDY)


if MODEL_DIR is not None:  # None while `bentoml build` imports this module
    verify_model(MODEL_DIR)
INPUTS = 0  # features per row: set by the worker from the model's config (``__init__``), before any request
mark("verified")


def read_tensor(body: bytes, content_type: str, datatype: str, shape: str) -> np.ndarray:
    """A ``/predict_tensor`` body as FP32 [rows, INPUTS]; what does not match its headers is
    refused (415 for another content type, 400 otherwise) saying what was expected."""
    media = content_type.split(";")[0].strip().lower()
    if media != TENSOR_TYPE:
        raise BentoMLException(
            f"Content-Type is {media!r}; /predict_tensor takes {TENSOR_TYPE} (JSON goes to /predict)",
            error_code=HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        )
    if datatype.strip() != "FP32":
        raise BadInput(f"X-Fleet-Datatype is {datatype[:40]!r}; this model takes FP32")
    dims = [d.strip() for d in shape.split(",")]
    if len(dims) != 2 or not all(d.isascii() and d.isdigit() and len(d) <= 12 for d in dims) or int(dims[1]) != INPUTS:
        raise BadInput(f"X-Fleet-Shape is {shape[:40]!r}; expected rows,{INPUTS} (e.g. 256,{INPUTS})")
    rows = int(dims[0])
    if rows == 0:
        raise BadInput(f"X-Fleet-Shape is {shape!r}; expected at least one row")
    needed = rows * INPUTS * FP32.itemsize
    if len(body) != needed:
        raise BadInput(f"body has {len(body)} bytes; shape {rows},{INPUTS} of FP32 needs {needed} (little-endian)")
    return np.frombuffer(body, dtype=FP32).reshape(rows, INPUTS)


class TensorFeatures(bentoml.IODescriptor):
    """The input of ``/predict_tensor``: raw FP32 bytes, not JSON (see the module's docstring)."""

    features: np.ndarray
    media_type = TENSOR_TYPE

    @classmethod
    async def from_http_request(cls, request: Request, serde: object) -> TensorFeatures:
        h = request.headers
        features = read_tensor(
            await request.body(), h.get("content-type", ""), h.get("x-fleet-datatype", ""), h.get("x-fleet-shape", "")
        )
        return cls(features=features)


class TensorProbabilities(bentoml.IODescriptor):
    """The answer of ``/predict_tensor``: the probabilities as raw FP32 bytes and their shape."""

    probabilities: np.ndarray
    media_type = TENSOR_TYPE

    @classmethod
    async def to_http_response(cls, obj: np.ndarray, serde: object) -> Response:
        result = np.ascontiguousarray(obj, dtype=FP32)
        headers = {"X-Fleet-Datatype": "FP32", "X-Fleet-Shape": ",".join(map(str, result.shape))}
        return Response(result.tobytes(), media_type=TENSOR_TYPE, headers=headers)


@bentoml.service(
    name=BUILD["service_name"],
    resources=BUILD["resources"],
    traffic=BUILD["traffic"],
)
class TabularClassifier:
    def __init__(self) -> None:
        global INPUTS
        mark("worker")
        from model import Predictor  # torch: imported by the worker only (the server process never needs it)

        verify_model(MODEL_DIR)
        self.predictor = Predictor(MODEL_DIR, quantize=BUILD["quantize"])
        INPUTS = int(self.predictor.config["inputs"])
        self.faults = self.predictor.faults  # built into a version on purpose, to rehearse rollbacks
        mark("loaded")
        # one inference before the worker takes traffic: torch's first call (its kernels chosen,
        # its allocator warmed) is paid here, before /readyz, not by the first held request
        self.predictor.predict_proba(np.zeros((1, INPUTS), np.float32))
        mark("warm")

    def _predict(self, features: np.ndarray) -> np.ndarray:
        """The model on one batch, with the faults built into this version (both routes)."""
        if self.faults:
            time.sleep(self.faults.get("latency_ms", 0.0) / 1000)
            if random.random() < self.faults.get("error_rate", 0.0):
                raise RuntimeError("fault built into this version: a share of requests fails")
        return self.predictor.predict_proba(features)

    @bentoml.api(**BATCHING)
    def predict(self, features: np.ndarray) -> np.ndarray:
        """features [n, 4] float32 → class probabilities [n, 2]."""
        return self._predict(features)

    @bentoml.api(route="/predict_tensor", input_spec=TensorFeatures, output_spec=TensorProbabilities, **BATCHING)
    def predict_tensor(self, features: np.ndarray) -> np.ndarray:
        """``predict`` over the tensor contract: raw FP32 bytes in and out."""
        return self._predict(features)

    @bentoml.api
    def metadata(self) -> dict:
        return {k: BUILD[k] for k in ("model", "version", "artifact_sha256", "quantize")} | {
            "device": str(self.predictor.device),
            "faults": self.faults,
        }
