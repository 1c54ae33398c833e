"""Structured output end to end: the real Ray Serve application on the real SmolLM2-135M pack, the
official ``openai`` client, real HTTP.

Twenty generated JSON schemas (``json_schemas``): every answer parses and validates against its
schema, streamed or not, and is the same text with speculation on (SmolLM2 drafting for itself,
depth 4, static policy) and off; a bad schema is a 400 in OpenAI's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from ray import serve

from serve_app.app import build_app
from tests.serve.json_schemas import generated_schemas

APP = "specserve-structured-e2e"
MODEL = "smollm2-structured"
OFF = {"speculation": {"mode": "off"}}
SCHEMAS = generated_schemas(20)


@pytest.fixture(scope="module")
def client(smollm2_path, serve_http: str) -> Iterator[openai.OpenAI]:
    """The application, deployed once for the module (the pack first: no Ray when it is missing)."""
    pack = str(smollm2_path)
    args = {
        "model": {"target": pack, "draft": pack},
        "runtime": {"dtype": "float32", "threads": 2},
        "cache": {"max_slots": 2, "max_seq_len": 1024},
        "speculation": {
            "method": "draft",
            "depth": 4,
            "policy": "static",
            "proposers": {"draft": {"int8": False}},
        },
        "server": {"served_model_name": MODEL, "max_tokens_limit": 256},
        "autoscaling": {"replica_num_cpus": 1, "max_queued_requests": 8},
    }
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield openai.OpenAI(base_url=f"{serve_http}/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        serve.delete(APP)


def answer(client: openai.OpenAI, index: int, stream: bool, **kwargs: Any) -> tuple[str, str, dict]:
    """Text, finish reason and speculation block of schema ``index``'s chat."""
    schema = SCHEMAS[index]
    params = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": f"Reply with JSON following this schema: {json.dumps(schema)}"}
        ],
        "max_tokens": 256,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema}},
        **kwargs,
    }
    if not stream:
        response = client.chat.completions.create(**params)
        choice = response.choices[0]
        return choice.message.content, choice.finish_reason, response.model_extra["speculation"]
    text, reason, block = "", "", {}
    for chunk in client.chat.completions.create(stream=True, **params):
        block = (chunk.model_extra or {}).get("speculation") or block
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason, block


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_twenty_schemas_validate_with_speculation_on_and_off(client: openai.OpenAI) -> None:
    drafted = 0
    for index, schema in enumerate(SCHEMAS):
        text, reason, block = answer(client, index, stream=index % 2 == 1)
        assert reason == "stop", (index, text)
        jsonschema.validate(json.loads(text), schema)
        drafted += block["drafted"]
        if index % 4 == 0:  # the same answer without speculation, streamed and not
            assert answer(client, index, stream=False, extra_body=OFF)[:2] == (text, reason)
            assert answer(client, index, stream=True, extra_body=OFF)[:2] == (text, reason)
    assert drafted > 0


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_json_object_and_a_bad_schema(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}], max_tokens=200,
        temperature=0.0, response_format={"type": "json_object"},
    )  # fmt: skip
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, response_format=bad
        )
    assert caught.value.status_code == 400 and caught.value.body["param"] == "response_format"
