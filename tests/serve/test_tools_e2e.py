"""Tools end to end: the real Ray Serve application on the Qwen2.5-Coder 0.5B pack (its own chat
template renders tools) and on SmolLM2-135M (its template ignores them: the ingress writes them
into the messages), the official ``openai`` client, real HTTP.

What is asserted is the mechanics, not the model's judgment: a call forced by naming the function
(or by ``required``) comes back as ``tool_calls`` whose arguments follow the schema; the call and
the tool's answer sent back are templated and answered; with ``tool_choice: auto`` the streamed
answer (content and ``delta.tool_calls``) adds up to the non-streamed one (greedy: the same tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from ray import serve

from serve_app.app import build_app
from tests.conftest import pack_path

APP = "specserve-tools-e2e"
MODEL = "qwen-tools"
PACK = "qwen2.5-coder-0.5b-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(serve_http: str) -> Iterator[openai.OpenAI]:
    """The application on the 0.5B pack with prompt lookup (no draft model), deployed once."""
    pack = str(pack_path(PACK))
    args = {
        "model": {"target": pack, "draft": None},
        "runtime": {"threads": 2},
        "cache": {"max_slots": 2, "max_seq_len": 1024},
        "speculation": {"method": "ngram", "depth": 4, "policy": "static"},
        "server": {"served_model_name": MODEL, "max_tokens_limit": 128},
        "autoscaling": {"replica_num_cpus": 1, "max_queued_requests": 8},
    }
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield openai.OpenAI(base_url=f"{serve_http}/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        serve.delete(APP)


def streamed(client: openai.OpenAI, **params: object) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, calls (name, arguments) and finish reason of a streamed chat, rebuilt from deltas."""
    content, calls, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **params):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                if d.index == len(calls):
                    calls.append([d.function.name, ""])
                calls[d.index][1] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [tuple(c) for c in calls], reason


@pytest.mark.slow
@pytest.mark.pack(PACK)
def test_a_tool_call_round_trip(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=named, max_tokens=48, temperature=0.0
    ).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments)["city"], str
    )
    # the forced call is the same with speculation off (prompt lookup drafts inside the grammar)
    off = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice=named,
        max_tokens=48,
        temperature=0.0,
        extra_body={"speculation": {"mode": "off"}},
    )
    assert off.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert off.model_extra["speculation"]["drafted"] == 0

    history = [
        *ASK,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "temp_c": 21})},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=48, temperature=0.0
    )
    choice = final.choices[0]
    assert choice.finish_reason in {"stop", "length", "tool_calls"}
    assert choice.message.content or choice.message.tool_calls
    assert final.usage.prompt_tokens > 100  # the tools, the call and its answer were all templated

    # required: the grammar writes <tool_call> blocks, Qwen's own tags (tokens of their own); one
    # block, as greedy 0.5B goes on calling for other cities when it may
    forced = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=48,
        temperature=0.0,
    ).choices[0]
    assert forced.finish_reason == "tool_calls" and forced.message.content is None
    ((name, arguments),) = [(c.function.name, c.function.arguments) for c in forced.message.tool_calls]
    assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str)

    params = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 64, "temperature": 0.0}
    whole = client.chat.completions.create(**params).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert streamed(client, **params) == (whole.message.content or "", calls, whole.finish_reason)
    if calls:  # the model chose to call (as Qwen2.5 does here): the call is well formed
        assert whole.finish_reason == "tool_calls" and calls[0][0] == "get_weather"
        assert isinstance(json.loads(calls[0][1]), dict)


@pytest.fixture(scope="module")
def smol_client(smollm2_path: Path, serve_http: str) -> Iterator[openai.OpenAI]:
    """SmolLM2-135M, whose chat template ignores tools: the ingress writes them into the messages."""
    pack = str(smollm2_path)
    args = {
        "model": {"target": pack, "draft": None},
        "runtime": {"dtype": "float32", "threads": 2},
        "cache": {"max_slots": 2, "max_seq_len": 1024},
        "speculation": {"method": "ngram", "depth": 4, "policy": "static"},
        "server": {"served_model_name": SMOL, "max_tokens_limit": 128},
        "autoscaling": {"replica_num_cpus": 1, "max_queued_requests": 8},
    }
    serve.run(build_app(args), name=f"{APP}-smol", route_prefix="/smol")
    try:
        yield openai.OpenAI(base_url=f"{serve_http}/smol/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        serve.delete(f"{APP}-smol")


SMOL = "smollm2-tools"


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_a_round_trip_on_a_template_without_tools(smol_client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    params = {"model": SMOL, "tools": [WEATHER], "max_tokens": 48, "temperature": 0.0}
    first = smol_client.chat.completions.create(messages=ASK, tool_choice=named, **params)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments)["city"], str
    )
    assert first.usage.prompt_tokens > 150  # the tools were written into the system message
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    final = smol_client.chat.completions.create(messages=history, **params)
    assert final.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and the result templated
