"""``tool_choice`` ``required`` and a named function: the output forced into calls by a grammar.

The grammar (``SamplingParams.structured``: the engine's grammar library masks the target's tokens
to it at every position) is the tool format's own text, a Lark grammar around JSON schemas, so the
model writes what its chat template asked for and the answer is parsed as any other
(``tool_calls.ToolCallStream``):

    start: call ("\\n" call)*          (one call for a named function or parallel_tool_calls false)
    call: "<tool_call>" "\\n" %json {one of the tools' {"name", "arguments"} objects} "\\n" "</tool_call>"

Each call's JSON is ``{"name": <a tool's name>, "arguments": <that tool's parameters schema>}``
(any object when a tool has none), written compactly as the engine's JSON always is
(``JSON_OPTIONS``). A tag that is a token of its own (Qwen2.5's ``<tool_call>``:
``EngineInfo.added_tokens``) is written ``<tool_call>``, Lark's name of that token. Output cut by
``max_tokens`` (``finish_reason: "length"``) ends inside a call, which then comes back as content.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from serve_app.api.tool_calls import ToolFormat
from serve_app.engine.structured import JSON_OPTIONS, StructuredOutput

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call of any of ``tools`` (OpenAI tool dicts)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "arguments": t["function"].get("parameters") or ANY_OBJECT,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": JSON_OPTIONS}


def forced_output(
    fmt: ToolFormat,
    tools: list[dict[str, Any]],
    name: str | None,
    parallel: bool,
    added_tokens: Collection[str] = (),
) -> StructuredOutput:
    """The grammar that forces calls: of the function ``name`` (one call), or of ``tools``.

    A tag that is one of the tokenizer's ``added_tokens`` (Qwen2.5's ``<tool_call>``) is named as
    that token: llguidance reads an added token as a token, never as its text."""
    if name is not None:
        tools, parallel = [next(t for t in tools if t["function"]["name"] == name)], False

    def tag(text: str) -> str:
        return text if text in added_tokens else json.dumps(text)  # Lark takes JSON strings

    call = f'{tag(fmt.start)} "\\n" %json {json.dumps(call_schema(tools))} "\\n" {tag(fmt.end)}'
    start = 'call ("\\n" call)*' if parallel else "call"
    return StructuredOutput.lark(f"start: {start}\ncall: {call}\n")
