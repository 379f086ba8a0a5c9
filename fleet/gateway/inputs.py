"""A model input as every protocol gives it — a declared shape and datatype, then values as
JSON or as raw little-endian bytes — checked against the version's schema and the model's
row limit, and turned into numpy. JSON and Triton's binary extension (``protocol``) and
gRPC (``grpc_codec``) all go through here, so each refuses the same inputs with the same
words.

Every value is checked on the way: nulls, strings, booleans where numbers belong, numbers
out of the datatype's range (``1e39`` is not an FP32), non-integers for integer types,
ragged lists, zero rows, shapes whose product does not match the data or exceeds the limit.
Each is an error that says which input, what was wrong and what was expected: 400 for a
body that is not the protocol (``MalformedBody``), 413 for more rows than the model takes
(``TooManyRows``), 422 for a well-formed body with the wrong tensors (``InvalidInput``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fleet.catalog.registry import TensorSpec
from fleet.errors import FleetError, InvalidInput

_NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
_INTEGER = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"})
_FLOAT = frozenset({"FP16", "FP32", "FP64"})
_NUMERIC = _INTEGER | _FLOAT
NUMPY_DTYPES = _NUMPY  # the public name of the one OIP datatype → numpy type map (for every protocol's adapters)
OIP_DATATYPES = frozenset({*_NUMPY, "BF16", "BYTES"})
MAX_NAME = 128  # an input name or request id longer than this is refused
MAX_DIMS = 8


class MalformedBody(FleetError):
    status = 400


class TooManyRows(FleetError):
    status = 413


def describe(spec: TensorSpec) -> str:
    """An input of the schema as an error message names what was expected."""
    return f"{spec.name}: {spec.datatype} {spec.shape}"


def shape_fits(shape: tuple[int, ...] | list[int], spec: TensorSpec) -> bool:
    return len(shape) == len(spec.shape) and all(s == -1 or s == d for s, d in zip(spec.shape, shape))


def conforms(features: np.ndarray, inputs: list[TensorSpec]) -> bool:
    """Whether an already decoded input also fits another version's schema (a pin or canary
    whose schema differs from the one the body was decoded against)."""
    spec = inputs[0]
    return spec.datatype in _NUMPY and features.dtype == _NUMPY[spec.datatype] and shape_fits(features.shape, spec)


def check_header(spec: TensorSpec, shape: Any, datatype: Any, max_rows: int) -> list[int]:  # noqa: ANN401
    """An input's declared shape and datatype checked against the schema and the row limit,
    before any of its data is looked at; returns the shape. Every protocol (JSON, binary
    HTTP, gRPC) goes through here, so each refuses the same inputs with the same words."""
    name = spec.name
    if (
        not isinstance(shape, list)
        or not 0 < len(shape) <= MAX_DIMS
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise MalformedBody(
            f"input {name!r} has shape {show(shape)}; expected a list of 1 to {MAX_DIMS} non-negative integers"
        )
    if not isinstance(datatype, str) or datatype not in OIP_DATATYPES:
        raise MalformedBody(
            f"input {name!r} has datatype {show(datatype)}; expected an OIP datatype such as {spec.datatype}"
        )
    if spec.datatype not in _NUMPY:
        raise InvalidInput(unsupported_input(spec))
    if datatype != spec.datatype and not (datatype in _NUMERIC and spec.datatype in _NUMERIC):
        raise InvalidInput(f"input {name!r} has datatype {datatype!r}; expected {spec.datatype}")
    if not shape_fits(shape, spec):
        raise InvalidInput(f"input {name!r} has shape {shape}; expected {spec.shape} (-1: any size)")
    check_rows(name, shape[0], max_rows)
    return shape


def unsupported_input(spec: TensorSpec) -> str:
    """Why an input of a type the gateway cannot forward (BYTES, BF16) is refused, whatever its
    encoding: the model is sent one numeric array (``Decoded.features``, JSON to the model
    service, also the cache key and the inference log's row), which cannot hold strings."""
    return (
        f"input {spec.name!r} is {spec.datatype} in this model's schema; this gateway passes numeric and BOOL "
        f"tensors to models, not {spec.datatype}, in any encoding: expected a model whose input is "
        "numeric (FP16/32/64, INT8-64, UINT8-64) or BOOL"
    )


def from_values(spec: TensorSpec, shape: list[int], values: Any) -> np.ndarray:  # noqa: ANN401 - a JSON value
    """JSON ``data`` (flat row-major, or one nested list per row) of a checked header → numpy."""
    name = spec.name
    if not isinstance(values, list):
        raise MalformedBody(f"input {name!r} has data {show(values)}; expected a list of {spec.datatype} values")
    count = math.prod(shape)  # Python ints: a shape like [2**62, 4] cannot overflow to 0
    flat = len(values) == count and not (values and isinstance(values[0], list))
    if not flat and len(values) != shape[0]:
        raise InvalidInput(
            f"input {name!r} has {len(values)} values; shape {shape} needs {count} "
            "(flat, row-major) or one nested list per row"
        )
    array = to_array(name, values, spec.datatype)
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
        raise InvalidInput(
            f"input {name!r} has {len(raw)} bytes; shape {shape} of {datatype} needs {expected} "
            f"({count} values × {given.itemsize} bytes, little-endian)"
        )
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
    converted = to_array(name, array.tolist(), spec.datatype) if datatype != spec.datatype else array
    return np.ascontiguousarray(converted, dtype=target).reshape(shape)


def check_rows(name: str, rows: int, max_rows: int) -> None:
    """An input's rows: at least one, at most the model's ``max_rows``."""
    if rows == 0:
        raise InvalidInput(f"input {name!r} has no rows; expected at least one")
    if rows > max_rows:
        raise TooManyRows(
            f"input {name!r} has {rows} rows; this model takes at most {max_rows} per request "
            "(policy max_rows): split the batch"
        )


def to_array(name: str, values: list, datatype: str, root: str = "data") -> np.ndarray:
    """``values`` (nested lists of JSON scalars) as ``datatype``, every value checked."""
    try:
        raw = np.asarray(values)  # numpy infers: bool, int64/uint64, float64, else str or object
    except (ValueError, OverflowError):
        raise InvalidInput(
            f"input {name!r} is not a rectangular list of values; expected every row the same length"
        ) from None
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
        raise InvalidInput(
            f"input {name!r} holds {bad:g}, out of range for {datatype} (±{float(np.finfo(target).max):.4g})"
        )
    return array


def _first_bad(values: list, ok: type | tuple[type, ...], root: str) -> str:
    """The first scalar in nested ``values`` that is not of type ``ok``, described (error path only)."""
    stack: list[tuple[str, Any]] = [(root, values)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))
        elif type(value) not in (ok if isinstance(ok, tuple) else (ok,)):
            return f"{show(value)} at {where}"
    return "a value numpy cannot hold"


def show(value: Any) -> str:  # noqa: ANN401 - any JSON value
    """A JSON value as an error message names it: short, and never a whole object or list."""
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'list'}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
