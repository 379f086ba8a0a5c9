"""Generation requests and answers in the protocols the gateway speaks, pure.

Parsed here, strictly (every field a tenant sends is checked for type and size, and an
unknown shape is refused with what was expected), into one ``GenRequest``:

* OpenAI ``POST /v1/completions`` and ``POST /v1/chat/completions``: the fields the
  ``openai`` client sends (``model``, ``prompt`` or ``messages``, ``max_tokens`` /
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``stream``,
  ``stream_options.include_usage``, ``n`` = 1, ``user``); ``model`` is ``name`` or
  ``name:version`` (a version the tenant may use, like ``/versions/<v>`` in OIP);
* the Open Inference Protocol's generate extension (``/v2/models/{m}/generate`` and
  ``generate_stream``): ``text_input`` and ``parameters``.

And the answers: ``Chunk`` builders for each protocol's stream and whole answers, from the
model service's events (``{"text", "completion_tokens"}`` …, then one with
``finish_reason`` and the counts).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import orjson

from fleet.gateway.inputs import MalformedBody

MAX_PROMPT_CHARS = 32_768
MAX_MESSAGES = 64
MAX_STOP, MAX_STOP_CHARS = 4, 64
ROLES = ("system", "user", "assistant")
CONTROLS = ("routing_key", "priority", "timeout_ms")  # the fleet's routing controls, in parameters


@dataclass(frozen=True)
class GenRequest:
    model: str
    version: str | None  # named by the caller
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None  # (role, content); the service applies the model's template
    max_tokens: int | None  # None: the policy's default
    min_tokens: int  # end-of-sequence held back before this many (vLLM's extra parameter)
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool = False
    parameters: dict[str, Any] | None = None  # routing controls (routing_key, priority, timeout_ms)

    @property
    def prompt_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(c) for _, c in self.messages or ())


def model_name(body: dict[str, Any]) -> tuple[str, str | None]:
    """(model, version or None) from OpenAI's ``model``: ``name`` or ``name:version``."""
    raw = body.get("model")
    if not isinstance(raw, str) or not raw or len(raw) > 200:
        raise MalformedBody(
            "model is missing or not a string of 1-200 characters; expected a served model's name, "
            "optionally name:version"
        )
    name, sep, version = raw.partition(":")
    if sep and not version:
        raise MalformedBody(f"model {raw[:64]!r} ends with ':'; expected name or name:version")
    return name, version or None


def _number(
    body: dict[str, Any], key: str, default: float, low: float, high: float, *, low_open: bool = False
) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MalformedBody(f"{key} is {_shown(value)}; expected a number")
    if value < low or value > high or (low_open and value == low):
        bound = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
        raise MalformedBody(f"{key} is {value:g}; expected a number {bound}")
    return float(value)


def _integer(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedBody(f"{key} is {_shown(value)}; expected an integer")
    if not low <= value <= high:
        raise MalformedBody(f"{key} is {value}; expected an integer from {low} to {high}")
    return value


def _shown(value: object) -> str:
    text = (
        orjson.dumps(value).decode()
        if isinstance(value, (str, int, float, bool, type(None)))
        else f"a JSON {type(value).__name__}"
    )
    return text if len(text) <= 40 else text[:37] + "..."


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > MAX_STOP
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items)
    ):
        raise MalformedBody(
            f"stop is {_shown(value)}; expected a string or a list of at most {MAX_STOP} strings "
            f"of 1-{MAX_STOP_CHARS} characters"
        )
    return tuple(items)


def _common(body: dict[str, Any], max_tokens_limit: int) -> dict[str, Any]:
    n = _integer(body, "n", 1, 1)  # one choice per request: ask again for more
    del n
    max_tokens = _integer(body, "max_completion_tokens", 1, max_tokens_limit)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, max_tokens_limit)
    min_tokens = _integer(body, "min_tokens", 0, max_tokens or max_tokens_limit) or 0
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise MalformedBody(f"stream is {_shown(stream)}; expected true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise MalformedBody('stream_options is not {"include_usage": true|false}')
        include_usage = bool(options.get("include_usage", False))
    parameters = body.get("parameters")  # the fleet's routing controls, as in OIP
    if parameters is not None and not isinstance(parameters, dict):
        raise MalformedBody(f"parameters is {_shown(parameters)}; expected a JSON object")
    return {
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "temperature": _number(body, "temperature", 0.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        "stop": _stop(body),
        "seed": _integer(body, "seed", 0, 2**63 - 1),
        "stream": stream,
        "include_usage": include_usage,
        "parameters": parameters,
    }


def _prompt(value: object) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # the openai client sends a list of one as often as a string
    if not isinstance(value, str) or not value:
        raise MalformedBody(f"prompt is {_shown(value)}; expected a non-empty string (one prompt per request)")
    if len(value) > MAX_PROMPT_CHARS:
        raise MalformedBody(f"prompt is {len(value)} characters; expected at most {MAX_PROMPT_CHARS}")
    return value


def completion(body: dict[str, Any], max_tokens_limit: int) -> GenRequest:
    model, version = model_name(body)
    return GenRequest(model, version, _prompt(body.get("prompt")), None, **_common(body, max_tokens_limit))


def chat(body: dict[str, Any], max_tokens_limit: int) -> GenRequest:
    model, version = model_name(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_MESSAGES:
        raise MalformedBody(f"messages is {_shown(raw)}; expected a list of 1-{MAX_MESSAGES} messages")
    messages, total = [], 0
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # [{"type": "text", "text": "..."}]: text parts only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise MalformedBody(f"messages[{i}].content has a part that is not text; expected text parts only")
            content = "".join(p["text"] for p in content)
        if role not in ROLES or not isinstance(content, str):
            raise MalformedBody(f'messages[{i}] is not {{"role": {"|".join(ROLES)}, "content": string}}')
        total += len(content)
        messages.append((role, content))
    if total > MAX_PROMPT_CHARS:
        raise MalformedBody(f"messages hold {total} characters; expected at most {MAX_PROMPT_CHARS}")
    return GenRequest(model, version, None, tuple(messages), **_common(body, max_tokens_limit))


def oip(body: dict[str, Any], model: str, version: str | None, max_tokens_limit: int, stream: bool) -> GenRequest:
    """OIP generate: ``{"text_input": "...", "parameters": {"max_tokens": 16, ...}}`` (generation
    parameters may also be top-level, as Triton accepts them)."""
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise MalformedBody(f"parameters is {_shown(params)}; expected a JSON object")
    if "text_input" not in body:
        raise MalformedBody('text_input is missing; expected {"text_input": "...", "parameters": {...}}')
    given = {**{k: v for k, v in body.items() if k not in ("text_input", "parameters", "id")}, **params}
    common = _common({k: v for k, v in given.items() if k not in CONTROLS} | {"stream": stream}, max_tokens_limit)
    common["parameters"] = {k: params[k] for k in CONTROLS if k in params}
    return GenRequest(model, version, _prompt(body["text_input"]), None, **common)


# -- answers -------------------------------------------------------------------------------------
def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


@dataclass
class Answer:
    """What each protocol says about one generation, built from the service's events."""

    kind: str  # "completion", "chat", "oip"
    request_id: str
    model: str
    version: str
    include_usage: bool = False
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    def _usage(self, final: dict[str, Any]) -> dict[str, int]:
        p, c = int(final.get("prompt_tokens", 0)), int(final.get("completion_tokens", 0))
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def chunk(self, event: dict[str, Any], first: bool) -> bytes:
        """One server-sent event for one of the service's events."""
        text, reason = event.get("text", ""), event.get("finish_reason")
        if self.kind == "oip":
            out: dict[str, Any] = {"model_name": self.model, "model_version": self.version, "text_output": text}
            if reason is not None:
                out |= {"finish_reason": reason, **self._usage(event)}
            return sse(out)
        base = {
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"{self.model}:{self.version}",
        }
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text or not reason else {}
            if first:
                delta = {"role": "assistant", **delta, "content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            body = sse({**base, "object": "chat.completion.chunk", "choices": [choice]})
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = sse({**base, "object": "text_completion", "choices": [choice]})
        if reason is not None and self.include_usage:
            kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            body += sse({**base, "object": kind, "choices": [], "usage": self._usage(event)})
        return body

    def done(self) -> bytes:
        """What ends the stream: OpenAI's ``[DONE]``; OIP's stream just ends."""
        return b"" if self.kind == "oip" else sse("[DONE]")

    def error(self, message: str, status: int) -> bytes:
        """An error after the stream began (its status is already sent): one event, then the end."""
        return sse(
            {
                "error": {
                    "message": message,
                    "type": "server_error" if status >= 500 else "invalid_request_error",
                    "code": status,
                }
            }
        )

    def whole(self, text: str, final: dict[str, Any]) -> dict[str, Any]:
        reason = final.get("finish_reason")
        if self.kind == "oip":
            return {
                "model_name": self.model,
                "model_version": self.version,
                "text_output": text,
                "finish_reason": reason,
                **self._usage(final),
            }
        base = {
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"{self.model}:{self.version}",
            "usage": self._usage(final),
        }
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            return {
                **base,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
            }
        return {
            **base,
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
        }
