"""Structured output (``response_format``) through the HTTP layer, with the official ``openai``
client against a real local server over a real (tiny) engine (``test_api_logprobs.tiny_client``).

Twenty generated schemas: every answer parses and validates, streamed or not, and is the same
with speculation on and off; ``json_object`` on chat and (vLLM's extension) completions; a schema
the grammar cannot compile, or a malformed ``response_format``, is a 400 in OpenAI's shape.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.serve.json_schemas import generated_schemas
from tests.serve.test_api_logprobs import tiny_client

__all__ = ["tiny_client"]  # the fixture used below

SCHEMAS = generated_schemas(20)
OFF = {"mode": "off"}
SPECULATION = [
    {"mode": "ngram", "max_depth": 4},
    {"mode": "self", "max_depth": 1},
    {"mode": "draft", "max_depth": 4},
]


def schema_format(schema: dict, index: int) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": f"schema_{index}", "schema": schema, "strict": True},
    }


def chat(
    client: openai.OpenAI, response_format: dict, speculation: dict, stream: bool, **kwargs: Any
) -> tuple[str, str]:
    """The answer's text and finish reason."""
    params = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Describe yourself as JSON."}],
        "max_tokens": 200,
        "temperature": 0.0,
        "response_format": response_format,
        "extra_body": {"speculation": speculation},
        **kwargs,
    }
    if not stream:
        choice = client.chat.completions.create(**params).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **params):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_answer_validates_against_its_schema(tiny_client: openai.OpenAI, index: int) -> None:
    schema, fmt = SCHEMAS[index], schema_format(SCHEMAS[index], index)
    text, reason = chat(tiny_client, fmt, OFF, stream=False)
    assert reason == "stop", text  # the grammar closed the object and allowed EOS
    jsonschema.validate(json.loads(text), schema)
    speculation = SPECULATION[index % len(SPECULATION)]
    assert chat(tiny_client, fmt, speculation, stream=True) == (text, reason)  # streamed, speculating
    assert chat(tiny_client, fmt, speculation, stream=False) == (text, reason)


def test_seeded_sampling_is_the_same_with_speculation_on_and_off(tiny_client: openai.OpenAI) -> None:
    fmt = schema_format(SCHEMAS[3], 3)
    plain = chat(tiny_client, fmt, OFF, stream=False, temperature=0.9, seed=7)
    jsonschema.validate(json.loads(plain[0]), SCHEMAS[3])
    for speculation in SPECULATION:
        assert chat(tiny_client, fmt, speculation, stream=True, temperature=0.9, seed=7) == plain


def test_json_object_on_chat_and_completions(tiny_client: openai.OpenAI) -> None:
    text, reason = chat(tiny_client, {"type": "json_object"}, OFF, stream=False, max_tokens=120, seed=1,
                        temperature=0.8)  # fmt: skip
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")
    completion = tiny_client.completions.create(
        model="tiny", prompt="def add(a, b):", max_tokens=120, temperature=0.0,
        extra_body={"response_format": schema_format(SCHEMAS[0], 0)},
    )  # fmt: skip
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS[0])
    plain = tiny_client.completions.create(
        model="tiny", prompt="def add(a, b):", max_tokens=5, temperature=0.0,
        extra_body={"response_format": {"type": "text"}},
    )  # fmt: skip
    assert plain.choices[0].text  # text: free, as before


@pytest.mark.parametrize(
    "fmt, match",
    [
        (schema_format({"type": "objekt"}, 0), "invalid JSON schema"),
        (schema_format({"type": "string", "pattern": "(unclosed"}, 0), "invalid JSON schema"),
        ({"type": "json_schema"}, "json_schema"),
        ({"type": "xml"}, "type"),
        ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_format_is_a_400_in_openais_shape(
    tiny_client: openai.OpenAI, fmt: dict, match: str, stream: bool
):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(tiny_client, fmt, OFF, stream=stream)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert match in error["message"] and "response_format" in (error.get("param") or error["message"])
