"""What a model must answer, and the errors that blame a version for its own failures.

``decode_answer`` is pure (the gateway runs it inline for small answers and in its decode
worker for large ones, ``fleet.gateway.body``): a model's answer must be a JSON list of
finite numbers, one row per input row. Anything else — not JSON, the wrong number of rows,
NaN or infinity — is the version's failure (``BadAnswer``: 502, counted as ``5xx``), never
a crash of the gateway.
"""

from __future__ import annotations

import json

import numpy as np
import orjson

from fleet.errors import FleetError


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


def decode_answer(body: bytes, ref: str, rows: int) -> np.ndarray:
    """A model's answer as float32 [rows, outputs]; anything else raises ``BadAnswer``."""
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
    if result.ndim != 2 or len(result) != rows:
        raise BadAnswer(f"{ref} answered shape {list(result.shape)} for {rows} input rows; expected one row per input row")
    if not np.isfinite(result).all():
        raise BadAnswer(f"{ref} answered non-finite values (NaN or infinity) for {rows} input rows; the model failed on them")
    return result
