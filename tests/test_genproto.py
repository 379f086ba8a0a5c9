"""Generation requests as tenants send them (OpenAI and OIP generate), parsed strictly, and
the answers in each protocol's shape — pure."""

from __future__ import annotations

import json

import pytest

from fleet.gateway.generation import protocol
from fleet.gateway.inputs import MalformedBody
from fleet.gateway.protocol import parse_json


def test_a_completion_as_the_openai_client_sends_it() -> None:
    req = protocol.completion(
        {
            "model": "demo-lm",
            "prompt": ["reverse abc>"],
            "max_tokens": 8,
            "temperature": 0.5,
            "top_p": 0.9,
            "stop": "\n",
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u1",
            "n": 1,
        },
        64,
    )
    assert (req.model, req.version, req.prompt, req.max_tokens, req.temperature, req.top_p) == (
        "demo-lm",
        None,
        "reverse abc>",
        8,
        0.5,
        0.9,
    )
    assert req.stop == ("\n",) and req.seed == 3 and req.stream and req.include_usage


def test_model_may_name_a_version_and_chat_messages_are_kept_in_order() -> None:
    req = protocol.chat(
        {
            "model": "demo-lm:1.1.0",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "reverse "}, {"type": "text", "text": "ab>"}]},
            ],
            "max_completion_tokens": 4,
        },
        64,
    )
    assert (
        req.version == "1.1.0"
        and req.messages == (("system", "be brief"), ("user", "reverse ab>"))
        and req.max_tokens == 4
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": "x"}, "model is missing"),
        ({"model": "m:", "prompt": "x"}, "ends with ':'"),
        ({"model": "m", "prompt": ""}, "non-empty string"),
        ({"model": "m", "prompt": ["a", "b"]}, "one prompt per request"),
        ({"model": "m", "prompt": "x" * 40_000}, "at most 32768"),
        ({"model": "m", "prompt": "x", "max_tokens": 65}, "from 1 to 64"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "expected an integer"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "<= 2"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "> 0"),
        ({"model": "m", "prompt": "x", "stop": ["a"] * 5}, "at most 4 strings"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "1-64 characters"),
        ({"model": "m", "prompt": "x", "n": 2}, "from 1 to 1"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "true or false"),
        ({"model": "m", "prompt": "x", "seed": -1}, "from 0"),
    ],
)
def test_hostile_or_malformed_completions_say_what_was_expected(body: dict, expected: str) -> None:
    with pytest.raises(MalformedBody, match=expected):
        protocol.completion(body, 64)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        [{"role": "tool", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": "x"}] * 65,
    ],
)
def test_bad_chat_messages_are_refused(messages: object) -> None:
    with pytest.raises(MalformedBody, match="messages"):
        protocol.chat({"model": "m", "messages": messages}, 64)


def test_oip_generate_takes_parameters_and_keeps_routing_controls_apart() -> None:
    req = protocol.oip(
        {
            "text_input": "reverse ab>",
            "parameters": {"max_tokens": 3, "temperature": 0, "priority": "batch", "routing_key": "user-1"},
        },
        "demo-lm",
        "1.0.0",
        64,
        True,
    )
    assert req.prompt == "reverse ab>" and req.max_tokens == 3 and req.stream and req.version == "1.0.0"
    assert req.parameters == {"priority": "batch", "routing_key": "user-1"}
    with pytest.raises(MalformedBody, match="text_input is missing"):
        protocol.oip({"parameters": {}}, "m", None, 64, False)
    with pytest.raises(MalformedBody, match="expected a JSON object"):
        parse_json(b"[1]")


def events(raw: bytes) -> list[object]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            assert block.startswith("data: ")
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_openai_stream_chunks_carry_the_role_first_then_text_then_the_reason_and_usage() -> None:
    answer = protocol.Answer("chat", "r1", "demo-lm", "1.0.0", include_usage=True)
    first = events(answer.chunk({"text": "cb", "completion_tokens": 2}, True))[0]
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-r1"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "cb"}
    end = events(answer.chunk({"text": "", "completion_tokens": 3, "finish_reason": "stop", "prompt_tokens": 5}, False))
    assert end[0]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert end[1]["choices"] == [] and end[1]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
    }
    assert events(answer.done()) == ["[DONE]"]


def test_whole_answers_in_each_protocol() -> None:
    final = {"finish_reason": "length", "prompt_tokens": 4, "completion_tokens": 2}
    done = protocol.Answer("completion", "r", "m", "1.0.0").whole("ab", final)
    assert (
        done["choices"][0]["text"] == "ab"
        and done["usage"]["total_tokens"] == 6
        and done["object"] == "text_completion"
    )
    oip = protocol.Answer("oip", "r", "m", "1.0.0").whole("ab", final)
    assert oip["text_output"] == "ab" and oip["model_version"] == "1.0.0" and oip["finish_reason"] == "length"
    assert protocol.Answer("oip", "r", "m", "1.0.0").done() == b""
