"""Tool calls in a model's output, parsed into OpenAI's ``tool_calls`` (vLLM's "tool parsers").

A ``ToolFormat`` says how a model family writes a call and reads one back. ``TOOL_FORMATS`` is the
registry, keyed by the name the ``server.tool_call_parser`` setting takes:

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, as Qwen2.5's
  chat template asks for them (and NousResearch's Hermes models, and many fine-tunes write them).

One parser serves both response modes, so a streamed answer adds up to the non-streamed one:
``ToolCallStream.feed`` takes the output's text as it comes and returns what can be shown now, text
(content) and ``ToolCallDelta``s. Its rules:

- Text outside the blocks is content; a piece of text that may be the start of a block (``<tool_``)
  waits for the next text. Whitespace that touches a block at the start or the end of the content
  is dropped (the newlines a model puts between its prose and its calls), so content is the text
  around the calls or, with calls and nothing else, null. Output with no block is content unchanged.
- A block is shown once it closes (a call is never shown and then taken back): a first delta with
  ``id``, ``type`` and the name (arguments ""), then one with all its arguments. OpenAI streams the
  arguments in several pieces; a client joins them, so one piece is the same call.
- A block that is not a call (JSON that does not parse, no ``name``) is content, tags included, as
  vLLM returns it. A block still open when the output ends is a call if its JSON is complete (a
  model that stops right after the JSON), else content.
- ``max_calls`` (``parallel_tool_calls: false``: 1) keeps the first calls; later ones are dropped.
- Given the offered tools' ``names``, an output that is nothing but a call's JSON object (or a list
  of them) naming one is a call too: Qwen2.5-Coder's small models write their calls without the
  tags. Such an output (one that starts with ``{`` or ``[``) is held until it ends, then shown as
  calls or as content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve_app.api.tool_protocol import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

StreamEvent = str | ToolCallDelta  # content text, or a piece of a tool call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    """One call read from the output: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def tool_call(self) -> ToolCall:
        return ToolCall(id=self.id, function=FunctionCall(name=self.name, arguments=self.arguments))

    def deltas(self, index: int) -> list[ToolCallDelta]:
        """The call as a stream shows it: id, type and name first, then the arguments."""
        head = ToolCallDelta(
            index=index, id=self.id, type="function", function=FunctionCallDelta(name=self.name, arguments="")
        )
        return [head, ToolCallDelta(index=index, function=FunctionCallDelta(arguments=self.arguments))]


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output: its content (None when calls were all it held) and its calls."""

    content: str | None
    calls: list[ParsedCall]


class CallParser(Protocol):
    """What reads a chat's output for calls: ``ToolCallStream``, or one of ``forced_tool_calls``."""

    calls: list[ParsedCall]  # the calls read so far

    def feed(self, text: str) -> list[StreamEvent]:
        """What the output's next piece lets a stream show now."""

    def finish(self) -> list[StreamEvent]:
        """What is left to show once the output ended."""

    def result(self) -> ParsedOutput:
        """The whole output's content and calls."""


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes tool calls: JSON objects ``{"name", "arguments"}`` between
    ``start`` and ``end``; also how to write them into a prompt whose chat template has no notion of
    tools (``serve_app.api.tool_prompt``)."""

    name: str
    description: str
    start: str
    end: str

    def read_call(self, body: str) -> ParsedCall | None:
        """The call a block's body holds, or None when it holds none."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))  # some fine-tunes say "parameters"
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return ParsedCall(name=obj["name"], arguments=text)

    def write_call(self, name: str, arguments: Any) -> str:
        """A call as the model writes it (``arguments``: an object, or JSON text kept as it is)."""
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        call = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}'
        return f"{self.start}\n{call}\n{self.end}"

    def write_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def describe(self, tools: Sequence[dict[str, Any]]) -> str:
        """The tools for a system prompt, in the words of Qwen2.5's own template."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{self.start}{self.end} XML tags:\n{self.start}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{self.end}"
        )

    def stream(self, max_calls: int | None = None, names: Collection[str] = ()) -> ToolCallStream:
        return ToolCallStream(self, max_calls, names)

    def parse(self, text: str, max_calls: int | None = None, names: Collection[str] = ()) -> ParsedOutput:
        """A whole output at once (exactly what its stream adds up to)."""
        stream = self.stream(max_calls, names)
        stream.feed(text)
        stream.finish()
        return stream.result()


HERMES = ToolFormat(
    name="hermes",
    description='<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Qwen2.5, Hermes)',
    start="<tool_call>",
    end="</tool_call>",
)
TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES,)}
DEFAULT_TOOL_FORMAT = HERMES.name


def tool_format(name: str) -> ToolFormat:
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_FORMATS))}")
    return TOOL_FORMATS[name]


class ToolCallStream:
    """An output read as it streams (see the module docstring for the rules)."""

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None, names: Collection[str] = ()) -> None:
        self.fmt, self.max_calls, self.names = fmt, max_calls, frozenset(names)
        self._bare: bool | None = None if self.names else False  # output that may be a bare call
        self._bare_text = ""
        self.calls: list[ParsedCall] = []
        self._content: list[str] = []  # what was shown as content
        self._pending = ""  # text not yet classified: a possible start tag, or an open block's body
        self._in_block = False
        self._held_ws = ""  # whitespace not shown yet: it shows when content follows it
        self._ws_by_block = False  # ... and it touches a block: it is dropped at content's edges
        self._events: list[StreamEvent] = []

    def feed(self, text: str) -> list[StreamEvent]:
        """What ``text`` (the output's next piece) lets the stream show now."""
        if self._bare is not False:  # undecided, or held until the end
            self._bare_text += text
            head = self._bare_text.lstrip()
            if self._bare is None and head:
                self._bare = head[0] in "{["
            if self._bare is not False:
                return []
            text, self._bare_text = self._bare_text, ""
        self._pending += text
        while True:
            if self._in_block:
                end = self._pending.find(self.fmt.end)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(self.fmt.end) :]
                self._in_block = False
                self._close_block(body, closed=True)
            else:
                start = self._pending.find(self.fmt.start)
                if start < 0:
                    keep = _partial_prefix(self._pending, self.fmt.start)
                    self._outside(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                self._outside(self._pending[:start])
                self._pending = self._pending[start + len(self.fmt.start) :]
                self._in_block, self._ws_by_block = True, True
        return self._take()

    def finish(self) -> list[StreamEvent]:
        """The output ended: what is still held back is shown."""
        shown: list[StreamEvent] = []
        if self._bare is not False:
            text, self._bare_text, self._bare = self._bare_text, "", False
            calls = self._bare_calls(text)
            if calls is not None:
                for call in calls[: self.max_calls]:
                    self._events.extend(call.deltas(len(self.calls)))
                    self.calls.append(call)
                return self._take()
            shown = self.feed(text)  # not a call: read as any other output
        if self._in_block:
            self._in_block = False
            self._close_block(self._pending, closed=False)
        else:
            self._outside(self._pending)
        self._pending = ""
        if not self._ws_by_block:  # trailing whitespace away from blocks: output unchanged
            self._show(self._held_ws)
        self._held_ws = ""
        return shown + self._take()

    def result(self) -> ParsedOutput:
        content = "".join(self._content)
        return ParsedOutput(None if self.calls and not content else content, list(self.calls))

    # --------------------------------------------------------------------------------- internals
    def _bare_calls(self, text: str) -> list[ParsedCall] | None:
        """The calls of an output that is nothing but a call's JSON object, or a list of them, each
        naming an offered tool; None for any other output."""
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [self.fmt.read_call(json.dumps(item)) for item in items if isinstance(item, dict)]
        if not items or len(calls) != len(items) or any(c is None or c.name not in self.names for c in calls):
            return None
        return calls  # type: ignore[return-value]

    def _close_block(self, body: str, closed: bool) -> None:
        call = self.fmt.read_call(body.strip())
        if call is None:  # not a call: the block is text, tags included
            self._outside(self.fmt.start + body + (self.fmt.end if closed else ""))
            return
        if self.max_calls is None or len(self.calls) < self.max_calls:
            self._events.extend(call.deltas(len(self.calls)))
            self.calls.append(call)

    def _outside(self, text: str) -> None:
        """Content text. Whitespace waits for the content after it: shown between two pieces of
        content, dropped before the first when it touches a block (and, at the end, after a block)."""
        text = self._held_ws + text
        core = text.rstrip()
        if not core:
            self._held_ws = text
            return
        if self._ws_by_block and not self._content:
            core = core.lstrip()
        self._held_ws, self._ws_by_block = text[len(text.rstrip()) :], False
        self._show(core)

    def _show(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._events.append(text)

    def _take(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        return events


def _partial_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and may be cut in its middle)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
