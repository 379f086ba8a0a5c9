"""Open Inference Protocol (KServe v2) and KServe v1 bodies ↔ numpy, checked against the schema.

Pure functions, so the gateway can run them inline for small bodies and off the event loop
for large ones (``fleet.gateway.body``). A body is decoded against the input schema of the
version it will most likely reach and the model's row limit, and every value is checked on
the way: nulls, strings, booleans where numbers belong, numbers out of the datatype's range
(``1e39`` is not an FP32), non-integers for integer types, ragged lists, zero rows, shapes
whose product does not match the data or exceeds the limit. Each is an error that says which
input, what was wrong and what was expected: 400 for a body that is not the protocol, 413
for more rows than the model takes, 422 for a well-formed body with the wrong tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
_INTEGER = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"})
_FLOAT = frozenset({"FP16", "FP32", "FP64"})
_NUMERIC = _INTEGER | _FLOAT
OIP_DATATYPES = frozenset({*_NUMPY, "BF16", "BYTES"})
MAX_NAME = 128  # an input name or request id longer than this is refused
MAX_DIMS = 8


class MalformedBody(FleetError):
    status = 400


class TooManyRows(FleetError):
    status = 413


@dataclass(frozen=True, slots=True)
class Decoded:
    """What an inference body asks: its id, its parameters and the model's input as numpy."""

    id: str | None
    parameters: dict[str, Any]
    features: np.ndarray


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(f"request body is not valid JSON ({exc}); expected a JSON object") from None
    if not isinstance(data, dict):
        raise MalformedBody(f"request body is a JSON {type(data).__name__}; expected a JSON object")
    return data


def _describe(spec: TensorSpec) -> str:
    return f"{spec.name}: {spec.datatype} {spec.shape}"


def shape_fits(shape: tuple[int, ...] | list[int], spec: TensorSpec) -> bool:
    return len(shape) == len(spec.shape) and all(s == -1 or s == d for s, d in zip(spec.shape, shape))


def conforms(features: np.ndarray, inputs: list[TensorSpec]) -> bool:
    """Whether an already decoded input also fits another version's schema (a pin or canary
    whose schema differs from the one the body was decoded against)."""
    spec = inputs[0]
    return spec.datatype in _NUMPY and features.dtype == _NUMPY[spec.datatype] and shape_fits(features.shape, spec)


def _common(body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    rid, parameters = body.get("id"), body.get("parameters", {})
    if rid is not None and (not isinstance(rid, str) or len(rid) > MAX_NAME):
        raise MalformedBody(f'"id" is {_show(rid)}; expected a string of at most {MAX_NAME} characters')
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise MalformedBody(f'"parameters" is {_show(parameters)}; expected a JSON object')
    return rid, parameters


def decode_v2(body: bytes, inputs: list[TensorSpec], max_rows: int) -> Decoded:
    """An OIP v2 ``infer`` body → the schema's single input, as the schema's dtype."""
    data = parse_json(body)
    rid, parameters = _common(data)
    tensors = data.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise MalformedBody('OIP v2 body has no "inputs" list; expected {"inputs": [{"name", "shape", "datatype", "data"}]}')
    spec = inputs[0]
    found = None
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, dict):
            raise MalformedBody(f"inputs[{i}] is {_show(tensor)}; expected an object with name, shape, datatype, data")
        name = tensor.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise MalformedBody(f"inputs[{i}].name is {_show(name)}; expected the input's name, e.g. {spec.name!r}")
        if name != spec.name:
            raise InvalidInput(f"input {name!r} is not an input of this model; expected {_describe(spec)}")
        if found is not None:
            raise InvalidInput(f"input {name!r} is given twice; expected it once")
        found = tensor
    return Decoded(rid, parameters, _tensor(found, spec, max_rows))


def _tensor(tensor: dict[str, Any], spec: TensorSpec, max_rows: int) -> np.ndarray:
    shape, datatype, values = tensor.get("shape"), tensor.get("datatype"), tensor.get("data")
    return from_values(spec, check_header(spec, shape, datatype, max_rows), values)


def check_header(spec: TensorSpec, shape: Any, datatype: Any, max_rows: int) -> list[int]:  # noqa: ANN401
    """An input's declared shape and datatype checked against the schema and the row limit,
    before any of its data is looked at; returns the shape. Every protocol (JSON, binary
    HTTP, gRPC) goes through here, so each refuses the same inputs with the same words."""
    name = spec.name
    if not isinstance(shape, list) or not 0 < len(shape) <= MAX_DIMS or not all(
        type(d) is int and d >= 0 for d in shape
    ):
        raise MalformedBody(f"input {name!r} has shape {_show(shape)}; expected a list of 1 to {MAX_DIMS} non-negative integers")
    if not isinstance(datatype, str) or datatype not in OIP_DATATYPES:
        raise MalformedBody(f"input {name!r} has datatype {_show(datatype)}; expected an OIP datatype such as {spec.datatype}")
    if datatype != spec.datatype and not (datatype in _NUMERIC and spec.datatype in _NUMERIC):
        raise InvalidInput(f"input {name!r} has datatype {datatype!r}; expected {spec.datatype}")
    if spec.datatype not in _NUMPY:
        raise InvalidInput(f"input {name!r} is {spec.datatype}, which this gateway cannot pass on; "
                           "expected a numeric or BOOL input")  # fmt: skip
    if not shape_fits(shape, spec):
        raise InvalidInput(f"input {name!r} has shape {shape}; expected {spec.shape} (-1: any size)")
    _check_rows(name, shape[0], max_rows)
    return shape


def from_values(spec: TensorSpec, shape: list[int], values: Any) -> np.ndarray:  # noqa: ANN401 - a JSON value
    """JSON ``data`` (flat row-major, or one nested list per row) of a checked header → numpy."""
    name = spec.name
    if not isinstance(values, list):
        raise MalformedBody(f"input {name!r} has data {_show(values)}; expected a list of {spec.datatype} values")
    count = math.prod(shape)  # Python ints: a shape like [2**62, 4] cannot overflow to 0
    flat = len(values) == count and not (values and isinstance(values[0], list))
    if not flat and len(values) != shape[0]:
        raise InvalidInput(f"input {name!r} has {len(values)} values; shape {shape} needs {count} "
                           "(flat, row-major) or one nested list per row")  # fmt: skip
    array = _array(name, values, spec.datatype)
    if array.size != count:
        raise InvalidInput(f"input {name!r} has {array.size} values; shape {shape} needs {count}")
    return array.reshape(shape)


def from_raw(spec: TensorSpec, shape: list[int], datatype: str, raw: bytes | memoryview) -> np.ndarray:
    """Raw little-endian tensor bytes (Triton's binary extension, gRPC ``raw_input_contents``)
    of a checked header → numpy as the schema's dtype; the byte count must match the shape.

    The values are checked like JSON ones: a float that is not finite where the schema's
    type cannot hold it, an integer out of the schema's range after conversion, a BOOL byte
    other than 0 or 1.
    """
    name = spec.name
    if datatype not in _NUMPY:
        raise InvalidInput(f"input {name!r} is {datatype}; raw bytes are taken for numeric and BOOL inputs")
    given = np.dtype(_NUMPY[datatype]).newbyteorder("<")
    count = math.prod(shape)
    expected = count * given.itemsize
    if len(raw) != expected:
        raise InvalidInput(f"input {name!r} has {len(raw)} bytes; shape {shape} of {datatype} needs {expected} "
                           f"({count} values × {given.itemsize} bytes, little-endian)")  # fmt: skip
    array = np.frombuffer(raw, dtype=given, count=count).reshape(shape)
    if datatype == "BOOL":
        if array.view(np.uint8).max(initial=0) > 1:
            raise InvalidInput(f"input {name!r} holds a BOOL byte other than 0 or 1")
        return array.copy()
    target = _NUMPY[spec.datatype]
    if datatype in _FLOAT and spec.datatype in _FLOAT:
        if array.size and not np.isfinite(array).all():
            bad = array.ravel()[~np.isfinite(array.ravel())][0]
            raise InvalidInput(f"input {name!r} holds {bad:g}; expected finite {spec.datatype} values")
    converted = _array(name, array.tolist(), spec.datatype) if datatype != spec.datatype else array
    return np.ascontiguousarray(converted, dtype=target).reshape(shape)


def _check_rows(name: str, rows: int, max_rows: int) -> None:
    if rows == 0:
        raise InvalidInput(f"input {name!r} has no rows; expected at least one")
    if rows > max_rows:
        raise TooManyRows(f"input {name!r} has {rows} rows; this model takes at most {max_rows} per request "
                          "(policy max_rows): split the batch")  # fmt: skip


def decode_v1(body: bytes, inputs: list[TensorSpec], max_rows: int) -> Decoded:
    """KServe v1 ``{"instances": [[...], ...]}`` → a batch of the schema's first input."""
    data = parse_json(body)
    rid, parameters = _common(data)
    instances = data.get("instances")
    spec = inputs[0]
    if not isinstance(instances, list) or not instances:
        raise MalformedBody('KServe v1 body has no "instances" list; expected {"instances": [[...], ...]}')
    _check_rows("instances", len(instances), max_rows)
    if spec.datatype not in _NUMPY:
        raise InvalidInput(f"input {spec.name!r} is {spec.datatype}; expected a numeric or BOOL input for KServe v1")
    array = _array("instances", instances, spec.datatype, "instances")
    if not shape_fits(array.shape, spec):
        raise InvalidInput(f"instances have shape {list(array.shape)}; expected {spec.shape} (-1: any size)")
    return Decoded(rid, parameters, array)


def _array(name: str, values: list, datatype: str, root: str = "data") -> np.ndarray:
    """``values`` (nested lists of JSON scalars) as ``datatype``, every value checked."""
    try:
        raw = np.asarray(values)  # numpy infers: bool, int64/uint64, float64, else str or object
    except (ValueError, OverflowError):
        raise InvalidInput(f"input {name!r} is not a rectangular list of values; expected every row the same length") from None
    kind = raw.dtype.kind
    target = _NUMPY[datatype]
    if datatype == "BOOL":
        if kind != "b":
            raise InvalidInput(f"input {name!r} holds {_first_bad(values, bool, root)}; expected true or false (BOOL)")
        return raw
    allowed = "iu" if datatype in _INTEGER else "iuf"
    if kind not in allowed:
        kinds = int if datatype in _INTEGER else (int, float)
        raise InvalidInput(f"input {name!r} holds {_first_bad(values, kinds, root)}; expected {datatype} values")
    if datatype in _INTEGER:
        info = np.iinfo(target)
        if raw.size and (raw.min() < info.min or raw.max() > info.max):
            bad = raw.min() if raw.min() < info.min else raw.max()
            raise InvalidInput(f"input {name!r} holds {bad}, out of range for {datatype} ({info.min}..{info.max})")
        return raw.astype(target, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        array = raw.astype(target, copy=False)
    if datatype != "FP64" and array.size and not np.isfinite(array).all():
        bad = raw.ravel()[~np.isfinite(array.ravel())][0]
        raise InvalidInput(f"input {name!r} holds {bad:g}, out of range for {datatype} "
                           f"(±{float(np.finfo(target).max):.4g})")  # fmt: skip
    return array


def _first_bad(values: list, ok: type | tuple[type, ...], root: str) -> str:
    """The first scalar in nested ``values`` that is not of type ``ok``, described (error path only)."""
    stack: list[tuple[str, Any]] = [(root, values)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))
        elif type(value) not in (ok if isinstance(ok, tuple) else (ok,)):
            return f"{_show(value)} at {where}"
    return "a value numpy cannot hold"


def _show(value: Any) -> str:  # noqa: ANN401 - any JSON value
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'list'}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def decode_feedback(body: bytes) -> tuple[str, list]:
    """A ``POST /v1/feedback`` body → (model, labels) (``fleet.feedback.parse``), pure so that a
    large one is decoded off the event loop like an inference body."""
    from fleet.feedback import parse

    return parse(parse_json(body))


def v2_response(model: str, version: str, request_id: str, outputs: list[TensorSpec], result: np.ndarray) -> bytes:
    spec = outputs[0]
    body = {"model_name": model, "model_version": version, "id": request_id,
            "outputs": [{"name": spec.name, "datatype": spec.datatype, "shape": list(result.shape), "data": result.ravel()}]}  # fmt: skip
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def v1_response(result: np.ndarray) -> bytes:
    return orjson.dumps({"predictions": result}, option=orjson.OPT_SERIALIZE_NUMPY)
