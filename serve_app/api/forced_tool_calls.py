"""``tool_choice`` ``required`` and a named function: the output forced into calls by a grammar.

As vLLM does it, the grammar (``SamplingParams.structured``, a JSON schema the engine's grammar
library turns into a mask over the target's tokens) makes the output bare JSON, not the model's own
``<tool_call>`` text (a JSON schema cannot say the tags):

- a named function: the output is that function's arguments (its ``parameters`` schema; any object
  when it has none), streamed as the arguments of one call whose name comes first;
- ``required``: the output is a list of ``{"name", "arguments"}`` objects, each a tool's name and
  arguments matching its schema, at least one (exactly one with ``parallel_tool_calls: false``),
  shown when the output ends.

Output the grammar could not finish (``max_tokens`` reached: ``finish_reason`` ``length``) is still
one named call with the arguments written so far; an unfinished list is content.
"""

from __future__ import annotations

import json
from typing import Any

from serve_app.api.tool_calls import ParsedCall, ParsedOutput, StreamEvent, new_call_id
from serve_app.api.tool_protocol import FunctionCallDelta, ToolCallDelta
from serve_app.engine.structured import StructuredOutput

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def named_output(tool: dict[str, Any]) -> StructuredOutput:
    """The grammar of a named function's call: its arguments."""
    return StructuredOutput.json_schema(tool["function"].get("parameters") or ANY_OBJECT)


def required_output(tools: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
    """The grammar of ``required``: a list of calls of the tools, one at least (and at most)."""
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
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput.json_schema(schema)


class NamedCallStream:
    """The output is one call's arguments: the call's head at once, then each piece as it comes."""

    def __init__(self, name: str) -> None:
        self.name, self.id = name, new_call_id()
        self._arguments: list[str] = []
        self.calls = [ParsedCall(name=name, arguments="", id=self.id)]

    def feed(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not self._arguments:
            head = FunctionCallDelta(name=self.name, arguments="")
            events.append(ToolCallDelta(index=0, id=self.id, type="function", function=head))
        self._arguments.append(text)
        if text:
            events.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text)))
        return events

    def finish(self) -> list[StreamEvent]:
        return self.feed("") if not self._arguments else []

    def result(self) -> ParsedOutput:
        return ParsedOutput(
            None, [ParsedCall(name=self.name, arguments="".join(self._arguments), id=self.id)]
        )


class RequiredCallsStream:
    """The output is a JSON list of calls, read when it ends."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self._text: list[str] = []
        self._content: str | None = None

    def feed(self, text: str) -> list[StreamEvent]:
        self._text.append(text)
        return []

    def finish(self) -> list[StreamEvent]:
        text = "".join(self._text)
        try:
            items = json.loads(text)
            self.calls = [
                ParsedCall(name=c["name"], arguments=json.dumps(c["arguments"], ensure_ascii=False))
                for c in items
            ]
        except (ValueError, TypeError, KeyError):  # cut off before the list closed
            self._content = text
            return [text] if text else []
        return [d for i, c in enumerate(self.calls) for d in c.deltas(i)]

    def result(self) -> ParsedOutput:
        return ParsedOutput(self._content, list(self.calls))
