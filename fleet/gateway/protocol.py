"""Open Inference Protocol (KServe v2) and KServe v1 bodies ↔ numpy, checked against the schema.

Pure functions: a parsed body and the version's input schema in, a float32 batch out, or
an error that says what was expected (400 for a body that is not the protocol, 422 for a
well-formed body with the wrong tensors).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from fleet.errors import FleetError, InvalidInput
from fleet.registry import TensorSpec

_NUMPY = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}  # fmt: skip
_NUMERIC = set(_NUMPY) - {"BOOL"}


class MalformedBody(FleetError):
    status = 400


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(f"request body is not valid JSON ({exc}); expected a JSON object") from None
    if not isinstance(data, dict):
        raise MalformedBody(f"request body is a JSON {type(data).__name__}; expected a JSON object")
    return data


def _shape_ok(shape: list[int], spec: TensorSpec) -> bool:
    return len(shape) == len(spec.shape) and all(s == -1 or s == d for s, d in zip(spec.shape, shape))


def _describe(spec: TensorSpec) -> str:
    return f"{spec.name}: {spec.datatype} {spec.shape}"


def v2_inputs(body: dict[str, Any], inputs: list[TensorSpec]) -> np.ndarray:
    """The single input tensor of an OIP v2 ``infer`` body, as the schema's dtype."""
    tensors = body.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise MalformedBody('OIP v2 body has no "inputs" list; expected {"inputs": [{"name", "shape", "datatype", "data"}]}')
    spec = inputs[0]
    by_name = {t.get("name"): t for t in tensors if isinstance(t, dict)}
    tensor = by_name.get(spec.name)
    if tensor is None:
        raise InvalidInput(f"input {spec.name!r} is missing (got {sorted(map(str, by_name))}); expected {_describe(spec)}")
    shape, datatype, data = tensor.get("shape"), tensor.get("datatype"), tensor.get("data")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise MalformedBody(f"input {spec.name!r} has shape {shape!r}; expected a list of non-negative integers")
    if datatype != spec.datatype and not (datatype in _NUMERIC and spec.datatype in _NUMERIC):
        raise InvalidInput(f"input {spec.name!r} has datatype {datatype!r}; expected {spec.datatype}")
    if not _shape_ok(shape, spec):
        raise InvalidInput(f"input {spec.name!r} has shape {shape}; expected {spec.shape} (-1: any size)")
    try:
        array = np.asarray(data, dtype=_NUMPY[spec.datatype])
    except (ValueError, TypeError, KeyError):
        raise InvalidInput(f"input {spec.name!r} data is not all numbers; expected {spec.datatype} values") from None
    if array.size != int(np.prod(shape)):
        raise InvalidInput(f"input {spec.name!r} has {array.size} values; shape {shape} needs {int(np.prod(shape))}")
    return array.reshape(shape)


def v1_instances(body: dict[str, Any], inputs: list[TensorSpec]) -> np.ndarray:
    """KServe v1 ``{"instances": [[...], ...]}`` as a batch of the schema's first input."""
    instances = body.get("instances")
    spec = inputs[0]
    if not isinstance(instances, list) or not instances:
        raise MalformedBody('KServe v1 body has no "instances" list; expected {"instances": [[...], ...]}')
    try:
        array = np.asarray(instances, dtype=_NUMPY.get(spec.datatype, np.float32))
    except (ValueError, TypeError):
        raise InvalidInput(f"instances are not a rectangular list of numbers; expected rows shaped {spec.shape[1:]}") from None
    if not _shape_ok(list(array.shape), spec):
        raise InvalidInput(f"instances have shape {list(array.shape)}; expected {spec.shape} (-1: any size)")
    return array


def v2_response(model: str, version: str, request_id: str, outputs: list[TensorSpec], result: np.ndarray) -> dict[str, Any]:
    spec = outputs[0]
    return {
        "model_name": model,
        "model_version": version,
        "id": request_id,
        "outputs": [
            {"name": spec.name, "datatype": spec.datatype, "shape": list(result.shape), "data": result.ravel().tolist()}
        ],
    }


def v1_response(result: np.ndarray) -> dict[str, Any]:
    return {"predictions": result.tolist()}
