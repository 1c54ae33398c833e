"""Tools on a real (tiny) engine: the prompt the chat template makes of tools and a tool-call
history, with a template that renders tools (Qwen2.5's own) and one that does not (the ingress
writes the tools into the messages); forced calls written by a random model under the grammar."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from serve_app.api import create_app
from serve_app.api.forced_tool_calls import forced_output
from serve_app.api.tool_calls import HERMES
from serve_app.async_engine import AsyncEngine
from serve_app.config import ServerSettings
from serve_app.tokenizing import template_info, template_renders_tools
from tests.conftest import make_tiny_engine, make_tiny_hf_model, make_tiny_tokenizer, pack_path
from tests.serve.test_api_tools import ASK, CALL, TIME_TOOL, TOOLS, WEATHER_TOOL

HISTORY = [
    {"role": "system", "content": "You are terse."},
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


@pytest.fixture(scope="module")
def tiny() -> Iterator[AsyncEngine]:
    """A tiny engine with a tokenizer of its own (the tests change its chat template)."""
    tokenizer = make_tiny_tokenizer()
    engine = make_tiny_engine(make_tiny_hf_model(len(tokenizer)), tokenizer, max_seq_len=1024)
    async_engine = AsyncEngine(engine, model_name="tiny")
    yield async_engine
    async_engine.shutdown()


def templated(engine: AsyncEngine, template: str, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt text the replica makes of a chat (through /tokenize, then /detokenize)."""
    engine.engine.tokenizer.chat_template = template
    http = TestClient(create_app(engine, ServerSettings()))  # a new app asks the engine's info anew
    body = {"messages": messages, **({"tools": tools} if tools else {})}
    tokens = http.post("/tokenize", json=body).json()["tokens"]
    return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_a_template_that_renders_tools_gets_them(tiny: AsyncEngine) -> None:
    template = (pack_path("qwen2.5-coder-0.5b-instruct") / "chat_template.jinja").read_text()
    assert template_renders_tools(type("T", (), {"chat_template": template})())
    prompt = templated(tiny, template, HISTORY, TOOLS)
    assert prompt.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert json.dumps(WEATHER_TOOL) in prompt  # the template lists the tools as JSON
    assert (
        (
            "<|im_start|>assistant\n"
            + CALL  # the earlier call as the model writes it: arguments an object, not quoted text
            + '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n'
            "<|im_start|>assistant\n"
        )
        in prompt
    )
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_them_written_into_the_messages(
    tiny: AsyncEngine, tiny_tokenizer: Any
) -> None:
    template = tiny_tokenizer.chat_template  # "role: content" lines, no notion of tools (as SmolLM2's)
    assert template_info(tiny_tokenizer) == {"template_tools": False, "added_tokens": ("<eos>",)}
    prompt = templated(tiny, template, HISTORY, TOOLS)
    system, rest = prompt.split("\nuser: ", 1)
    assert system == "system: You are terse.\n\n" + HERMES.describe(TOOLS)
    assert json.dumps(TIME_TOOL) in system
    assert rest == (
        "What is the weather in Paris?\n"
        f"assistant: {CALL}\n"
        'user: <tool_response>\n{"temp_c": 21}\n</tool_response>\n'
        "assistant: "
    )
    no_tools = templated(tiny, template, HISTORY[:2], None)
    assert no_tools == "system: You are terse.\nuser: What is the weather in Paris?\nassistant: "


def test_forced_calls_on_a_real_engine_follow_the_schemas(tiny: AsyncEngine) -> None:
    """The tiny random model writes what the grammar lets it: a named call's arguments are JSON of
    its schema; ``required`` gives a call of an offered tool. (Bounded schemas: a random model
    would write a free string until max_tokens.)"""
    forecast = {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "forecast", "parameters": forecast}},
        {
            "type": "function",
            "function": {"name": "now", "parameters": {"type": "object", "additionalProperties": False}},
        },
    ]
    http = TestClient(create_app(tiny, ServerSettings()))
    base = {"model": "tiny", "messages": ASK, "tools": tools, "max_tokens": 160, "temperature": 1.0}
    named = {"type": "function", "function": {"name": "forecast"}}
    for seed in range(3):
        body = {**base, "tool_choice": named, "seed": seed}
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "forecast" and arguments["city"] in {"Paris", "Rome"}
        assert 1 <= arguments["days"] <= 7
        body = {**base, "tool_choice": "required", "parallel_tool_calls": False, "seed": seed}
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in {"forecast", "now"} and isinstance(
            json.loads(call["function"]["arguments"]), dict
        )


def test_a_tag_that_is_a_token_of_its_own_is_named_as_that_token() -> None:
    """llguidance reads an added token (Qwen2.5's ``<tool_call>``) as a token, never as its text:
    the grammar names it (``<tool_call>``, unquoted), else it would force the token and then refuse it."""
    plain = forced_output(HERMES, TOOLS, "get_time", parallel=True).source
    assert plain.startswith('start: call\ncall: "<tool_call>" "\\n" %json {') and plain.endswith(
        '"\\n" "</tool_call>"\n'
    )
    tokens = forced_output(
        HERMES, TOOLS, "get_time", True, ("<tool_call>", "</tool_call>", "<|im_end|>")
    ).source
    assert tokens == plain.replace('"<tool_call>"', "<tool_call>").replace('"</tool_call>"', "</tool_call>")
    forced_output(HERMES, TOOLS, None, True, ("<tool_call>", "</tool_call>")).check()  # compiles
