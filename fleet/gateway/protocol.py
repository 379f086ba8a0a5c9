"""Open Inference Protocol (KServe v2) and KServe v1 bodies ↔ numpy, checked against the schema.

Pure functions, so the gateway can run them inline for small bodies and off the event loop
for large ones (``fleet.gateway.body``). A body is decoded against the input schema of the
version it will most likely reach and the model's row limit; its input's header and every
value are checked as every protocol's are (``fleet.gateway.inputs``), and the body's own
shape here: 400 for a body that is not the protocol, 413 for more rows than the model
takes, 422 for a well-formed body with the wrong tensors.

Triton's binary tensor data extension (``decode_v2_binary``, ``v2_reply``) is the same OIP
v2 body split in two: a JSON header of ``Inference-Header-Content-Length`` bytes, then the
raw little-endian bytes of each input that says ``parameters.binary_data_size``, in input
order. The JSON header goes through the same checks as a JSON body; the bytes through
``inputs.from_raw``. An answer carries an output as raw bytes after its JSON header when the
request asks for it (``binary_data`` per output, or ``binary_data_output``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from fleet.catalog.registry import TensorSpec
from fleet.errors import InvalidInput
from fleet.gateway.inputs import (
    MAX_NAME,
    NUMPY_DTYPES,
    MalformedBody,
    check_header,
    check_rows,
    describe,
    from_raw,
    from_values,
    shape_fits,
    show,
    to_array,
    unsupported_input,
)

HEADER_LENGTH = "Inference-Header-Content-Length"  # the binary extension's header, both ways
MAX_OUTPUTS = 64  # outputs one request may name


@dataclass(frozen=True, slots=True)
class Output:
    """An output the request names, and whether it wants it as raw bytes after the JSON."""

    name: str
    binary: bool


@dataclass(frozen=True, slots=True)
class Decoded:
    """What an inference body asks: its id, its parameters, the model's input as numpy and
    how it wants the answer: the outputs it names (none: every output), and whether outputs
    it does not name come as raw bytes (``binary_data_output``)."""

    id: str | None
    parameters: dict[str, Any]
    features: np.ndarray
    outputs: tuple[Output, ...] = ()
    binary_output: bool = False


def parse_json(body: bytes | memoryview, what: str = "request body") -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedBody(f"{what} is not valid JSON ({exc}); expected a JSON object") from None
    if not isinstance(data, dict):
        raise MalformedBody(f"{what} is a JSON {type(data).__name__}; expected a JSON object")
    return data


def _common(body: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    rid, parameters = body.get("id"), body.get("parameters", {})
    if rid is not None and (not isinstance(rid, str) or len(rid) > MAX_NAME):
        raise MalformedBody(f'"id" is {show(rid)}; expected a string of at most {MAX_NAME} characters')
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise MalformedBody(f'"parameters" is {show(parameters)}; expected a JSON object')
    return rid, parameters


def decode_v2(body: bytes, inputs: list[TensorSpec], max_rows: int) -> Decoded:
    """An OIP v2 ``infer`` body → the schema's single input, as the schema's dtype."""
    return _decode_v2(parse_json(body), inputs, max_rows, None)


def decode_v2_binary(body: bytes, inputs: list[TensorSpec], max_rows: int, *, header_length: int) -> Decoded:
    """An OIP v2 ``infer`` body in Triton's binary tensor data extension: ``header_length``
    bytes of JSON, then the raw bytes of each input with ``binary_data_size``, in input order.

    Pure and module-level so that ``functools.partial(decode_v2_binary, header_length=n)``
    runs in the decode worker like ``decode_v2``. The tensor bytes are read through
    memoryview slices of ``body``: no copy of the body per input, nothing read past its end.
    """
    if header_length > len(body):
        raise MalformedBody(
            f"{HEADER_LENGTH} is {header_length}, but the body has only {len(body)} bytes; expected the "
            "length of the JSON part at the start of the body, at most the body's size"
        )
    view = memoryview(body)
    header = parse_json(
        view[:header_length], f"the JSON part of the body (the first {header_length} bytes, {HEADER_LENGTH})"
    )
    return _decode_v2(header, inputs, max_rows, view[header_length:])


def binary_header_length(given: list[str]) -> int | None:
    """The values of the ``Inference-Header-Content-Length`` header → the JSON part's length,
    or None when absent (a plain JSON body). Anything but one non-negative decimal integer
    is refused: where the JSON ends is the one thing the rest of the body is read by."""
    if not given:
        return None
    if len(given) > 1:
        raise MalformedBody(f"{HEADER_LENGTH} is given {len(given)} times; expected it once")
    text = given[0].strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise MalformedBody(
            f"{HEADER_LENGTH} is {show(given[0])}; expected the length of the request's JSON part "
            "in bytes, a non-negative integer"
        )
    return int(text)


def _decode_v2(data: dict[str, Any], inputs: list[TensorSpec], max_rows: int, payload: memoryview | None) -> Decoded:
    """A parsed OIP v2 body → ``Decoded``; ``payload``: the bytes after the JSON part of a
    binary-extension body (None for a plain JSON body)."""
    rid, parameters = _common(data)
    tensors = data.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise MalformedBody(
            'OIP v2 body has no "inputs" list; expected {"inputs": [{"name", "shape", "datatype", "data"}]}'
        )
    spec = inputs[0]
    found = None
    sizes: list[tuple[str, int | None]] = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, dict):
            raise MalformedBody(f"inputs[{i}] is {show(tensor)}; expected an object with name, shape, datatype, data")
        name = tensor.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise MalformedBody(f"inputs[{i}].name is {show(name)}; expected the input's name, e.g. {spec.name!r}")
        if name != spec.name:
            raise InvalidInput(f"input {name!r} is not an input of this model; expected {describe(spec)}")
        if found is not None:
            raise InvalidInput(f"input {name!r} is given twice; expected it once")
        found = tensor
        sizes.append((name, _binary_size(tensor, name, payload is not None)))
    chunks = split_binary(sizes, payload) if payload is not None else [None]
    outputs, binary_output = requested_outputs(data, parameters)
    return Decoded(rid, parameters, _tensor(found, spec, max_rows, chunks[0]), outputs, binary_output)


def _binary_size(tensor: dict[str, Any], name: str, binary_body: bool) -> int | None:
    """An input's ``parameters.binary_data_size``: its byte count in the binary part, or None
    when its values are JSON ``data``."""
    params = tensor.get("parameters")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise MalformedBody(f"input {name!r} has parameters {show(params)}; expected a JSON object")
    shared = next((k for k in params if isinstance(k, str) and k.startswith("shared_memory")), None)
    if shared is not None:
        raise MalformedBody(
            f"input {name!r} asks for shared memory ({shared}); this gateway takes tensors in the "
            "request body only: expected data or parameters.binary_data_size"
        )
    if "binary_data_size" not in params:
        return None
    size = params["binary_data_size"]
    if type(size) is not int or size < 0:
        raise MalformedBody(
            f"input {name!r} has binary_data_size {show(size)}; expected a non-negative integer, "
            "the input's byte count in the binary part"
        )
    if not binary_body:
        raise MalformedBody(
            f"input {name!r} has binary_data_size {size}, but the request has no {HEADER_LENGTH} "
            "header; expected that header with the length of the JSON part before the tensor bytes"
        )
    if "data" in tensor:
        raise MalformedBody(f"input {name!r} has both data and binary_data_size; expected one of them")
    return size


def split_binary(sizes: list[tuple[str, int | None]], payload: memoryview) -> list[memoryview | None]:
    """The binary part cut into each input's bytes, in input order: an input with a size takes
    the next that many bytes, one without (its values are JSON ``data``) takes none, so JSON
    and binary inputs mix freely. The sizes must account for every byte: too few bytes for
    an input, or bytes left over after the last, is an error naming the input. The pieces
    are views of ``payload``, never copies."""
    chunks: list[memoryview | None] = []
    offset = 0
    for name, size in sizes:
        if size is None:
            chunks.append(None)
            continue
        left = len(payload) - offset
        if size > left:
            raise MalformedBody(
                f"input {name!r} has binary_data_size {size}, but only {left} bytes of tensor data are "
                f"left after the JSON part{' and the inputs before it' if offset else ''}; "
                f"expected {size} bytes for it"
            )
        chunks.append(payload[offset : offset + size])
        offset += size
    extra = len(payload) - offset
    if extra:
        binary = [f"{n!r}: {s} bytes" for n, s in sizes if s is not None]
        if not binary:
            raise MalformedBody(
                f"the body has {extra} bytes after the JSON part, but no input has binary_data_size "
                f"(input {', '.join(repr(n) for n, _ in sizes)}: none); expected "
                "parameters.binary_data_size on each input sent as bytes"
            )
        raise MalformedBody(
            f"the body has {extra} bytes after the JSON part beyond the inputs' binary_data_size "
            f"({', '.join(binary)}); expected exactly {offset} bytes of tensor data after the JSON part"
        )
    return chunks


def _tensor(tensor: dict[str, Any], spec: TensorSpec, max_rows: int, raw: memoryview | None = None) -> np.ndarray:
    """One input's checked header, then its values: ``raw`` bytes (binary) or JSON ``data``."""
    shape = check_header(spec, tensor.get("shape"), tensor.get("datatype"), max_rows)
    if raw is not None:
        return from_raw(spec, shape, tensor["datatype"], raw)
    if "data" not in tensor:
        raise MalformedBody(
            f"input {spec.name!r} has no data; expected data (a list of {spec.datatype} values) or, "
            f"with the {HEADER_LENGTH} header, parameters.binary_data_size"
        )
    return from_values(spec, shape, tensor["data"])


def requested_outputs(data: dict[str, Any], parameters: dict[str, Any]) -> tuple[tuple[Output, ...], bool]:
    """The outputs the request names (``"outputs"``), each as binary or JSON, and the
    request's ``binary_data_output`` (the default for outputs it does not name)."""
    binary_output = parameters.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise MalformedBody(f"parameters.binary_data_output is {show(binary_output)}; expected true or false")
    wanted = data.get("outputs")
    if wanted is None:
        return (), binary_output
    if not isinstance(wanted, list) or len(wanted) > MAX_OUTPUTS:
        raise MalformedBody(
            f'"outputs" is {show(wanted)}; expected a list of at most {MAX_OUTPUTS} '
            '{"name": ..., "parameters": {"binary_data": true|false}}'
        )
    named: dict[str, Output] = {}
    for j, out in enumerate(wanted):
        name = out.get("name") if isinstance(out, dict) else None
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise MalformedBody(f"outputs[{j}] is {show(out)}; expected an object with the output's name")
        if name in named:
            raise MalformedBody(f"output {name!r} is requested twice; expected it once")
        named[name] = Output(name, _binary_wanted(name, out.get("parameters"), binary_output))
    return tuple(named.values()), binary_output


def _binary_wanted(name: str, params: Any, default: bool) -> bool:  # noqa: ANN401 - a JSON value
    """Whether a named output is wanted as raw bytes; what this gateway cannot do is refused."""
    if params is None:
        return default
    if not isinstance(params, dict):
        raise MalformedBody(f"output {name!r} has parameters {show(params)}; expected a JSON object")
    unsupported = next(
        (
            k
            for k in params
            if isinstance(k, str) and (k.startswith("shared_memory") or (k == "classification" and params[k]))
        ),
        None,
    )
    if unsupported is not None:
        raise MalformedBody(
            f"output {name!r} asks for {unsupported}, which this gateway does not support; expected "
            "the output's values in the answer (parameters.binary_data true or false)"
        )
    binary = params.get("binary_data", default)
    if not isinstance(binary, bool):
        raise MalformedBody(f"output {name!r} has binary_data {show(binary)}; expected true or false")
    return binary


def decode_v1(body: bytes, inputs: list[TensorSpec], max_rows: int) -> Decoded:
    """KServe v1 ``{"instances": [[...], ...]}`` → a batch of the schema's first input."""
    data = parse_json(body)
    rid, parameters = _common(data)
    instances = data.get("instances")
    spec = inputs[0]
    if not isinstance(instances, list) or not instances:
        raise MalformedBody('KServe v1 body has no "instances" list; expected {"instances": [[...], ...]}')
    check_rows("instances", len(instances), max_rows)
    if spec.datatype not in NUMPY_DTYPES:
        raise InvalidInput(unsupported_input(spec))
    array = to_array("instances", instances, spec.datatype, "instances")
    if not shape_fits(array.shape, spec):
        raise InvalidInput(f"instances have shape {list(array.shape)}; expected {spec.shape} (-1: any size)")
    return Decoded(rid, parameters, array)


def decode_feedback(body: bytes) -> tuple[str, list]:
    """A ``POST /v1/feedback`` body → (model, labels) (``fleet.logs.feedback.parse``), pure so that a
    large one is decoded off the event loop like an inference body."""
    from fleet.logs.feedback import parse

    return parse(parse_json(body))


def check_outputs(wanted: tuple[Output, ...], outputs: list[TensorSpec]) -> None:
    """The outputs a request names must be ones it can get: the gateway answers with a
    model's first output (the one array its model services return). Checked before the
    request reaches a model, and again against the version that answered."""
    served = outputs[0].name
    unknown = [o.name for o in wanted if o.name != served]
    if not unknown:
        return
    declared = {s.name for s in outputs}
    shown = ", ".join(show(n) for n in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
    why = " (the gateway answers with a model's first output only)" if declared & set(unknown) else ""
    raise InvalidInput(
        f"requested output {shown} {'is' if len(unknown) == 1 else 'are'} not an output of this "
        f"model{why}; expected {served!r}"
    )


def v2_reply(
    model: str, version: str, request_id: str, outputs: list[TensorSpec], result: np.ndarray, decoded: Decoded
) -> tuple[bytes, int | None]:
    """The OIP v2 answer the request asked for: (body, None) for plain JSON, or, when an
    output is wanted as raw bytes, (JSON part + the bytes, the JSON part's length) for the
    ``Inference-Header-Content-Length`` header. The bytes are the output as its declared
    datatype, little-endian, in one ``tobytes`` (no per-value work on the event loop); an
    output whose datatype has no fixed-size encoding here (BYTES, BF16) stays JSON."""
    check_outputs(decoded.outputs, outputs)
    spec = outputs[0]
    binary = decoded.outputs[0].binary if decoded.outputs else decoded.binary_output
    output: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype, "shape": list(result.shape)}
    raw = b""
    if binary and spec.datatype in NUMPY_DTYPES:
        raw = np.ascontiguousarray(result, dtype=np.dtype(NUMPY_DTYPES[spec.datatype]).newbyteorder("<")).tobytes()
        output["parameters"] = {"binary_data_size": len(raw)}
    else:
        output["data"] = result.ravel()
    body = {"model_name": model, "model_version": version, "id": request_id, "outputs": [output]}
    header = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    if "data" in output:
        return header, None
    return header + raw, len(header)


def v1_response(result: np.ndarray) -> bytes:
    return orjson.dumps({"predictions": result}, option=orjson.OPT_SERIALIZE_NUMPY)
