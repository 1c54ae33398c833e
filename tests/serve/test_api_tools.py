"""Tools through the HTTP layer: the official ``openai`` client against a real local server over
the fake engine of ``test_api`` (scripted ``<tool_call>`` output), streamed and not, forced choices
and their grammars, then a round trip: the assistant's calls and the tool's answer sent back. The
prompt a real chat template makes of them: ``test_api_tool_templates``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from serve_app.api import create_app
from serve_app.api.forced_tool_calls import call_schema, forced_output
from serve_app.api.tool_calls import HERMES
from serve_app.config import ServerSettings
from serve_app.wire import EngineInfo
from tests.serve.fake_engine import MODEL, FakeEngine, script, serving
from tests.serve.test_api_logprobs import CHAT_CONTENT, logprob_chunks

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def calling_script() -> list:
    """Prose, then a call cut over three chunks, then a second call; the model's EOS ends it."""
    return script(
        "Let me check.\n", CALL[:20], CALL[20:] + "\n<tool_", 'call>{"name": "get_time"}</tool_call>'
    )


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeEngine, openai.OpenAI]]:
    engine = FakeEngine()
    engine.info_ = EngineInfo(MODEL, 512, 100, ["draft"], "draft", template_tools=True)
    with serving(create_app(engine, ServerSettings())) as client:
        yield engine, client


def test_tool_calls_in_the_message(server: tuple[FakeEngine, openai.OpenAI]) -> None:
    engine, client = server
    engine.chunks = calling_script()
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    weather, clock = choice.message.tool_calls
    assert (weather.type, weather.function.name, json.loads(weather.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )
    assert (clock.function.name, clock.function.arguments) == ("get_time", "{}")
    assert weather.id.startswith("call_") and weather.id != clock.id
    request = engine.requests[-1]
    assert request.tools == TOOLS and request.messages == ASK  # the template gets them as sent

    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False
    )
    assert [c.function.name for c in response.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_calls_streamed_as_deltas(server: tuple[FakeEngine, openai.OpenAI]) -> None:
    engine, client = server
    engine.chunks = calling_script()
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert content == "Let me check."
    # as OpenAI streams them: per call id, type and name first, then the arguments
    assert [(d.index, d.id is not None, d.type, d.function.name) for d in deltas] == [
        (0, True, "function", "get_weather"),
        (0, False, None, None),
        (1, True, "function", "get_time"),
        (1, False, None, None),
    ]
    assert [d.function.arguments for d in deltas] == ["", '{"city": "Paris"}', "", "{}"]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    # the prose streamed before the first call's text was complete
    first_call = next(i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:first_call]) == "Let me check."


def test_no_call_and_tool_choice_none_leave_the_text_alone(server: tuple[FakeEngine, openai.OpenAI]) -> None:
    engine, client = server
    engine.chunks = script("It is ", "sunny.")
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto")
    assert (
        response.choices[0].message.content == "It is sunny."
        and response.choices[0].message.tool_calls is None
    )
    assert response.choices[0].finish_reason == "stop"
    engine.chunks = script(CALL)
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
    assert response.choices[0].message.content == CALL and response.choices[0].finish_reason == "stop"
    assert engine.requests[-1].tools is None  # not offered to the template


@pytest.mark.parametrize(
    ("change", "text"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of the tools"),
        ({"tools": None, "tool_choice": "auto"}, "only allowed when tools are specified"),
        ({"tools": None, "tool_choice": "required"}, "only allowed when tools are specified"),
    ],
)
def test_tool_choice_refusals(server: tuple[FakeEngine, openai.OpenAI], change: dict, text: str) -> None:
    _, client = server
    params = {"model": MODEL, "messages": ASK, "tools": TOOLS, **change}
    with pytest.raises(openai.BadRequestError, match=text) as info:
        client.chat.completions.create(**{k: v for k, v in params.items() if v is not None})
    assert info.value.body["param"] == "tool_choice"


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_function_is_forced_by_the_grammar(server: tuple[FakeEngine, openai.OpenAI]) -> None:
    engine, client = server
    engine.chunks = script(CALL[:30], CALL[30:])
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED)
    # one <tool_call> block whose JSON names the function, its arguments held to its schema
    structured = engine.requests[-1].sampling.structured
    assert structured == forced_output(HERMES, TOOLS, "get_weather", parallel=True)
    assert structured.kind == "lark" and structured.source.startswith("start: call\n")
    schema = call_schema([WEATHER_TOOL])
    assert schema["properties"]["name"]["enum"] == ["get_weather"]
    assert schema["properties"]["arguments"] == WEATHER_TOOL["function"]["parameters"]
    assert json.dumps(schema) in structured.source
    assert engine.requests[-1].tools == TOOLS  # all offered, as vLLM does
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, stream=True)
    )
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", ""),
        (0, None, '{"city": "Paris"}'),
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_forces_calls_of_the_offered_tools(server: tuple[FakeEngine, openai.OpenAI]) -> None:
    engine, client = server
    engine.chunks = script(CALL + "\n", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required")
    structured = engine.requests[-1].sampling.structured
    assert structured == forced_output(HERMES, TOOLS, None, parallel=True)
    assert structured.source.startswith('start: call ("\\n" call)*\n')  # one call or more
    schema = call_schema(TOOLS)
    assert [c["properties"]["name"]["enum"] for c in schema["anyOf"]] == [["get_weather"], ["get_time"]]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # no parameters: any object
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]
    engine.chunks = script(CALL)
    params = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    chunks = list(client.chat.completions.create(**params, parallel_tool_calls=False, stream=True))
    assert engine.requests[-1].sampling.structured.source.startswith("start: call\n")  # exactly one
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        ("get_weather", ""),
        (None, '{"city": "Paris"}'),
    ]
    engine.chunks = script(CALL[:30], reason="length")  # cut off inside the call: content, as written
    choice = client.chat.completions.create(**params).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        CALL[:30],
        None,
        "length",
    )


def test_round_trip_sends_the_calls_and_the_answer_back(server: tuple[FakeEngine, openai.OpenAI]) -> None:
    engine, client = server
    engine.chunks = script(CALL)
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS).choices[0].message
    assert first.content is None  # calls and nothing else
    call = first.tool_calls[0]
    answer = {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}
    history = [*ASK, first.model_dump(exclude_none=True), answer]
    engine.chunks = script("It is 21 °C in Paris.")
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS).choices[0]
    assert final.message.content == "It is 21 °C in Paris." and final.finish_reason == "stop"
    sent = engine.requests[-1].messages
    assert sent[1] == {  # arguments as an object: the template writes them with tojson
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert sent[2] == answer


def test_a_schema_the_grammar_cannot_compile_is_a_400_naming_tools(
    server: tuple[FakeEngine, openai.OpenAI],
) -> None:
    _, client = server
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}},
        },
    }
    with pytest.raises(openai.BadRequestError, match="Invalid type: nonsense") as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[bad], tool_choice="required")
    assert info.value.body["param"] == "tools"


def test_a_forced_choice_and_a_response_format_do_not_mix(server: tuple[FakeEngine, openai.OpenAI]) -> None:
    _, client = server
    with pytest.raises(openai.BadRequestError, match="cannot be combined") as info:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert info.value.body["param"] == "response_format"


def test_logprobs_stream_beside_tool_calls(server: tuple[FakeEngine, openai.OpenAI]) -> None:
    """Every token's logprob is streamed once, whatever the parser shows or holds back."""
    engine, client = server
    engine.chunks = logprob_chunks()
    params = {"model": MODEL, "messages": ASK, "tools": TOOLS, "logprobs": True, "top_logprobs": 2}
    chunks = list(client.chat.completions.create(**params, stream=True))
    entries = [
        e.model_dump()
        for c in chunks
        for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])
    ]
    assert entries == CHAT_CONTENT
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello€!"
    whole = client.chat.completions.create(**params).choices[0]
    assert (
        whole.message.content == "Hello€!"
        and [e.model_dump() for e in whole.logprobs.content] == CHAT_CONTENT
    )
