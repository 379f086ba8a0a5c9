"""What a model must answer, and the errors that blame a version for its own failures.

``decode_answer`` is pure (the gateway runs it inline for small answers and in its decode
worker for large ones, ``fleet.gateway.body``). A model answers in one of two encodings,
told apart by the answer's ``Content-Type``:

* JSON (``POST /predict``): a list of finite numbers, one row per input row;
* the tensor contract (``POST /predict_tensor``, ``TensorAnswer``): ``application/octet-stream``
  whose bytes are the array, little-endian, row-major, described by ``X-Fleet-Datatype``
  (a numeric OIP datatype: FP32, FP64, INT64, ...) and ``X-Fleet-Shape`` (``rows,columns``).

Both get the same checks, and the same words when they fail: the right number of rows,
finite values (after conversion to FP32, so an FP64 1e39 fails as the JSON 1e39 does), and
for tensors bytes that match the shape and datatype they claim. Anything else is the
version's failure (``BadAnswer``: 502, counted as ``5xx``), never a crash of the gateway.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import orjson

from fleet.errors import FleetError
from fleet.gateway.inputs import NUMPY_DTYPES

TENSOR_TYPE = "application/octet-stream"
DATATYPE_HEADER = "X-Fleet-Datatype"
SHAPE_HEADER = "X-Fleet-Shape"
# datatypes a model may answer in: numbers (BOOL is not a score, BYTES and BF16 have no numpy twin here)
ANSWER_DTYPES = {name: np.dtype(t).newbyteorder("<") for name, t in NUMPY_DTYPES.items() if name != "BOOL"}
MAX_ANSWER_DIMS = 2  # [rows] or [rows, columns]


class UpstreamError(FleetError):
    """A version could not answer; ``kind`` is its ERROR_CLASSES class."""

    status = 503

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):  # noqa: ANN204 - crosses to and from the decode worker intact
        return (type(self), (str(self), self.kind))


class BadAnswer(UpstreamError):
    """The version answered, but not with what a model must answer: its failure (class 5xx)."""

    status = 502

    def __init__(self, message: str, kind: str = "5xx") -> None:
        super().__init__(message, kind)


@dataclass(frozen=True, slots=True)
class TensorAnswer:
    """An answer in the tensor contract, as received: its bytes and the two headers that
    describe them (None when absent), unchecked — ``decode_answer`` checks them, possibly in
    the decode worker, so this is plain data that pickles as is. ``len`` is the byte count,
    which is what the decoder weighs to run a decode inline or in its worker."""

    raw: bytes
    datatype: bytes | None
    shape: bytes | None

    def __len__(self) -> int:
        return len(self.raw)


def decode_answer(body: bytes | TensorAnswer, ref: str, rows: int) -> np.ndarray:
    """A model's answer (JSON bytes or a ``TensorAnswer``) as float32 [rows, outputs];
    anything else raises ``BadAnswer``."""
    if isinstance(body, TensorAnswer):
        return _checked(_tensor(body, ref, rows), ref, rows)
    try:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = json.loads(body)  # Python's json writes NaN and Infinity, which orjson refuses
        result = np.asarray(parsed, dtype=np.float32)
    except (ValueError, TypeError):
        raise BadAnswer(f"{ref} answered something that is not a JSON list of numbers: {bytes(body[:120])!r}") from None
    if result.ndim == 1:
        result = result.reshape(rows, -1) if rows and result.size % rows == 0 else result
    return _checked(result, ref, rows)


def _checked(result: np.ndarray, ref: str, rows: int) -> np.ndarray:
    """The checks every answer gets, whatever its encoding: one row per input row, finite."""
    if result.ndim != 2 or len(result) != rows:
        raise BadAnswer(
            f"{ref} answered shape {list(result.shape)} for {rows} input rows; expected one row per input row"
        )
    if not np.isfinite(result).all():
        raise BadAnswer(
            f"{ref} answered non-finite values (NaN or infinity) for {rows} input rows; the model failed on them"
        )
    return result


def _tensor(answer: TensorAnswer, ref: str, rows: int) -> np.ndarray:
    """A ``TensorAnswer``'s bytes as float32 of the shape its headers claim; a [rows] answer
    is one column, as a flat JSON list of ``rows`` numbers is."""
    if answer.datatype is None or answer.shape is None:
        missing = " and ".join(
            h for h, v in ((DATATYPE_HEADER, answer.datatype), (SHAPE_HEADER, answer.shape)) if v is None
        )
        raise BadAnswer(
            f"{ref} answered {TENSOR_TYPE} without {missing}; expected both "
            f"(e.g. {DATATYPE_HEADER}: FP32, {SHAPE_HEADER}: {rows},2)"
        )
    datatype = answer.datatype.decode("latin-1").strip()
    dtype = ANSWER_DTYPES.get(datatype)
    if dtype is None:
        raise BadAnswer(
            f"{ref} answered {DATATYPE_HEADER}: {datatype[:40]!r}; expected a numeric OIP datatype "
            f"({', '.join(ANSWER_DTYPES)})"
        )
    shape = _shape(answer.shape, ref)
    needed = math.prod(shape) * dtype.itemsize  # Python ints: no overflow for absurd shapes
    if len(answer.raw) != needed:
        raise BadAnswer(
            f"{ref} answered {len(answer.raw)} bytes; its shape {list(shape)} of {datatype} needs {needed} "
            f"({math.prod(shape)} values × {dtype.itemsize} bytes, little-endian)"
        )
    array = np.frombuffer(answer.raw, dtype=dtype).reshape(shape)
    with np.errstate(over="ignore", invalid="ignore"):  # out of FP32's range → inf, refused by the finite check
        result = array.astype(np.float32)  # a native-order copy: the answer's bytes are not kept alive
    return result.reshape(rows, 1) if result.ndim == 1 and len(result) == rows else result


def _shape(value: bytes, ref: str) -> tuple[int, ...]:
    """``X-Fleet-Shape`` (``"256,2"``) as non-negative ints, at most ``MAX_ANSWER_DIMS`` of them."""
    text = value.decode("latin-1").strip()
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > MAX_ANSWER_DIMS or not all(p.isascii() and p.isdigit() and len(p) <= 18 for p in parts):
        raise BadAnswer(
            f"{ref} answered {SHAPE_HEADER}: {text[:40]!r}; expected [rows] or [rows, columns] as "
            "comma-separated non-negative integers, e.g. 256,2"
        )
    return tuple(int(p) for p in parts)
