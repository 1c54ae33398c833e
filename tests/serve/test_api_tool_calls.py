"""The tool-call parser (``serve_app.api.tool_calls``): whole outputs, and the same outputs streamed
in pieces cut anywhere, which must add up to exactly the whole output's answer."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from serve_app.api.tool_calls import HERMES, TOOL_FORMATS, ParsedOutput, tool_format
from serve_app.api.tool_protocol import ToolCallDelta

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def calls(out: ParsedOutput) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in out.calls]


def test_one_call_after_some_prose() -> None:
    out = HERMES.parse("Let me check.\n\n" + WEATHER)
    assert out.content == "Let me check."
    assert calls(out) == [("get_weather", {"city": "Paris", "unit": "°C"})]
    (call,) = out.calls
    assert call.arguments == '{"city": "Paris", "unit": "°C"}'  # JSON text, not ASCII-escaped
    assert call.id.startswith("call_") and call.tool_call().model_dump() == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": call.arguments},
    }


def test_several_calls_and_nothing_else_give_null_content() -> None:
    out = HERMES.parse(WEATHER + "\n" + TIME + "\n")
    assert out.content is None
    assert calls(out) == [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})]
    assert len({c.id for c in out.calls}) == 2
    assert calls(HERMES.parse(WEATHER + TIME, max_calls=1)) == calls(out)[:1]  # parallel_tool_calls false


def test_content_is_the_text_around_the_calls() -> None:
    out = HERMES.parse("I will call two tools.\n" + WEATHER + "\nthen\n" + TIME + "\nDone. ")
    assert out.content == "I will call two tools.\n\nthen\n\nDone. "  # blocks out, whitespace between kept
    assert calls(out) == [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})]


def test_text_without_calls_is_content_unchanged() -> None:
    for text in ["", "  Hello, world!\n", "a < b and <tool", "x <tool_call"[:-1], "</tool_call> hi"]:
        assert HERMES.parse(text) == ParsedOutput(text, [])


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # bad JSON
        '<tool_call>\n["get_weather"]\n</tool_call>',  # not an object
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "arguments": {"ci',  # cut off (max_tokens)
    ],
)
def test_a_block_that_is_no_call_is_content(block: str) -> None:
    out = HERMES.parse("Sure.\n" + block)
    assert out == ParsedOutput("Sure.\n" + block, [])
    out = HERMES.parse(WEATHER + "\n" + block)  # beside a good call: the good one is kept
    assert out.content == block and calls(out) == [("get_weather", {"city": "Paris", "unit": "°C"})]


def test_lenient_forms() -> None:
    unclosed = '<tool_call>\n{"name": "get_time", "arguments": {}}'  # the model stopped after the JSON
    assert calls(HERMES.parse(unclosed)) == [("get_time", {})]
    assert calls(HERMES.parse('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')) == [
        ("f", {"x": 1})
    ]
    out = HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert out.calls[0].arguments == '{"x": 1}'  # arguments already JSON text are kept as they are
    assert calls(HERMES.parse('<tool_call>{"name": "f"}</tool_call>')) == [("f", {})]


NAMES = ("get_weather", "get_time")
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_a_bare_call_naming_an_offered_tool_is_a_call() -> None:
    """Qwen2.5-Coder 0.5B answers a tool question with the call's JSON alone, no tags."""
    out = HERMES.parse(BARE + "\n", names=NAMES)
    assert out.content is None and calls(out) == [("get_weather", {"city": "Paris"})]
    both = HERMES.parse(f'[{BARE}, {{"name": "get_time", "arguments": {{}}}}]', names=NAMES)
    assert calls(both) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert calls(HERMES.parse(f"[{BARE}, {BARE}]", max_calls=1, names=NAMES)) == calls(out)
    for text in [
        BARE,  # no tools named: not a call
        '{"name": "send_mail", "arguments": {}}',  # not an offered tool
        '{"city": "Paris"}',  # JSON, but no call
        BARE + " and more",  # more than the call
        "[]",
    ]:
        names = () if text == BARE else NAMES
        assert HERMES.parse(text, names=names) == ParsedOutput(text, [])


def test_the_registry() -> None:
    assert tool_format("hermes") is HERMES and set(TOOL_FORMATS) == {"hermes"}
    with pytest.raises(ValueError, match="known: hermes"):
        tool_format("mistral")


def test_written_calls_read_back() -> None:
    text = HERMES.write_call("get_weather", {"city": "Paris", "unit": "°C"})
    assert text == WEATHER
    assert calls(HERMES.parse(HERMES.write_call("f", '{"x": 1}'))) == [("f", {"x": 1})]


# --- streaming -------------------------------------------------------------------------------------------

OUTPUTS = [
    "Let me check.\n\n" + WEATHER,
    WEATHER + "\n" + TIME + "\n",
    "I will call two tools.\n" + WEATHER + "\nthen\n" + TIME + "\nDone. ",
    "No tools needed: 2 < 3 and <tool is not a tag.\n",
    "Sure.\n" + '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>' + "\n" + TIME,
    WEATHER + '\n<tool_call>\n{"name": "get_time", "arguments": {}}',
    "",
    BARE,
    " " + BARE + "\n",
    f'[{BARE}, {{"name": "get_time", "arguments": {{}}}}]',
    '{"answer": 42}',
]


def replay(text: str, cuts: list[int], names: tuple[str, ...] = ()) -> tuple[str, list[dict], list]:
    """Stream ``text`` cut at ``cuts``: the content shown, the calls the deltas add up to, the deltas."""
    stream = HERMES.stream(None, names)
    bounds = [0, *sorted(cuts), len(text)]
    events = [e for a, b in itertools.pairwise(bounds) for e in stream.feed(text[a:b])]
    events += stream.finish()
    content = "".join(e for e in events if isinstance(e, str))
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    built: list[dict] = []
    for d in deltas:
        if d.index == len(built):  # a new call starts with its id, type and name, no arguments yet
            assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
            built.append({"id": d.id, "name": d.function.name, "arguments": ""})
        else:
            assert d.index == len(built) - 1 and d.id is None and d.function.name is None
            built[-1]["arguments"] += d.function.arguments or ""
    assert all(isinstance(e, ToolCallDelta) or e for e in events)  # no empty content events
    return content, built, deltas


@pytest.mark.parametrize("names", [(), NAMES], ids=["tags", "bare"])
@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_in_any_pieces_adds_up_to_the_whole(text: str, names: tuple[str, ...]) -> None:
    whole = HERMES.parse(text, names=names)
    expected = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in whole.calls]
    cases = [[], [*range(1, len(text))]]  # one piece, one character at a time
    rng = random.Random(len(text))
    if len(text) > 1:
        cases += [rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))) for _ in range(40)]
    for cuts in cases:
        content, built, _ = replay(text, cuts, names)
        assert content == (whole.content or ""), cuts
        assert [{**b, "id": None} for b in built] == [{**e, "id": None} for e in expected], cuts


def test_a_stream_shows_text_before_a_call_at_once_and_the_call_when_it_closes() -> None:
    stream = HERMES.stream()
    assert stream.feed("Checking the weather") == ["Checking the weather"]
    assert stream.feed(" now.\n<tool") == [" now."]  # the newline and the tag's start wait
    assert stream.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}') == []
    head, args = stream.feed("\n</tool_call>")
    assert (head.index, head.type, head.function.name, head.function.arguments) == (
        0,
        "function",
        "get_weather",
        "",
    )
    assert (args.index, args.id, args.function.arguments) == (0, None, '{"city": "Paris"}')
    assert stream.feed("\n") == [] and stream.finish() == []
    assert stream.result().content == "Checking the weather now." and stream.result().calls[0].id == head.id
