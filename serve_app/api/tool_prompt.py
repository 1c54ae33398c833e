"""A chat request's tools on their way to the chat template, and its ``tool_choice``.

The prompt is built by the model's own chat template on the replica, which is given ``tools=``
(``GenerateRequest.tools``) and the history as OpenAI sends it: assistant messages with
``tool_calls``, ``tool`` messages with ``tool_call_id``. Two adjustments, made here:

- A template that renders tools (it reads the ``tools`` variable: Qwen2.5's does,
  ``EngineInfo.template_tools``) gets each call's ``arguments`` as an object, not OpenAI's JSON text
  (Qwen's template writes them with ``tojson``: text would be quoted twice; vLLM does the same).
- A template that does not (SmolLM2's) would silently drop the tools, so the ingress writes them
  itself, as the tool format's own words: the tools described in the system message (Qwen2.5's
  wording), earlier calls as ``<tool_call>`` text in the assistant's content, tool results as a user
  message of ``<tool_response>`` blocks. The output is parsed the same way either way.

``tool_choice``: ``auto`` (the default with tools) offers them and parses what comes; ``none``
offers none (the history is still rendered) and parses nothing, so the answer is plain text.
``required`` and a named function offer them all and force the output into calls, in the format's
own text, through the engine's grammar (``forced_tool_calls``); they cannot be combined with a
``response_format``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any, Protocol

from serve_app.api import forced_tool_calls as forced
from serve_app.api.errors import APIError
from serve_app.api.tool_calls import CallParser, ToolFormat
from serve_app.api.tool_protocol import ChatTool, NamedToolChoice, ToolCall
from serve_app.wire import EngineInfo, GenerateRequest


class _Message(Protocol):  # protocol.ChatMessage, as far as tools go
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None
    tool_call_id: str | None


class _ChatRequest(Protocol):  # protocol.ChatCompletionRequest, as far as tools go
    tools: list[ChatTool] | None
    tool_choice: Any
    parallel_tool_calls: bool | None


def check_message(m: _Message) -> None:
    """OpenAI's rules for the tool fields of one message (a ValueError names the problem)."""
    if m.tool_calls and m.role != "assistant":
        raise ValueError("only assistant messages may have tool_calls")
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
    if m.role == "tool" and not m.tool_call_id:
        raise ValueError("a tool message needs the tool_call_id it answers")


def tool_fields(m: _Message) -> dict[str, Any]:
    """A message's tool keys for the chat template, in OpenAI's shape (arguments as JSON text)."""
    fields: dict[str, Any] = {}
    if m.tool_calls:
        fields["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id:
        fields["tool_call_id"] = m.tool_call_id
    return fields


def prepare_tools(
    body: object, greq: GenerateRequest, info: EngineInfo, fmt: ToolFormat
) -> tuple[GenerateRequest, Callable[[], CallParser] | None]:
    """``greq`` with the tools and history as the template takes them (and the grammar a forced
    choice needs), and the parser of its output (None: the output is plain text). A request that is
    not a chat passes through."""
    if greq.messages is None or not hasattr(body, "tool_choice"):
        return greq, None
    req: _ChatRequest = body  # type: ignore[assignment]
    offered = _offered(req)
    messages, tools = template_inputs(greq.messages, offered, info.template_tools, fmt)
    greq = dataclasses.replace(greq, messages=messages, tools=tools)
    if not offered:
        return greq, None
    parallel, choice = req.parallel_tool_calls is not False, req.tool_choice
    names = [t["function"]["name"] for t in offered]
    parser = functools.partial(fmt.stream, None if parallel else 1, names)
    if choice is None or choice == "auto":
        return greq, parser
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    output = forced.forced_output(fmt, offered, named, parallel, info.added_tokens)
    if greq.sampling.structured is not None:
        why = "response_format cannot be combined with tool_choice 'required' or a named function"
        raise APIError(400, why, param="response_format")
    try:
        output.check()
    except ValueError as e:
        why = f"a tool's parameters are not a JSON schema the server supports: {e}"
        raise APIError(400, why, param="tools") from None
    return dataclasses.replace(greq, sampling=dataclasses.replace(greq.sampling, structured=output)), parser


def _offered(req: _ChatRequest) -> list[dict[str, Any]] | None:
    """The tools the template is given (as dicts), after checking ``tool_choice`` against them."""
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise APIError(400, "tool_choice is only allowed when tools are specified", param="tool_choice")
    names = [t.function.name for t in req.tools or ()]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        why = f"tool_choice names {choice.function.name!r}, which is not one of the tools"
        raise APIError(400, why, param="tool_choice")
    if not req.tools or choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def template_inputs(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_tools: bool, fmt: ToolFormat
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: see the module docstring."""
    if template_tools:
        return [_with_argument_objects(m) for m in messages], tools or None
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                fmt.write_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]
            ]
            text = "\n".join([m["content"], *calls] if m.get("content") else calls)
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": text})
        elif m["role"] == "tool":
            result = fmt.write_result(m["content"])
            if out and out[-1].get("_tool_results"):  # consecutive results: one user turn, as Qwen's
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append(dict(m))
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools:
        described = fmt.describe(tools)
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, None


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        with contextlib.suppress(TypeError, ValueError):  # not JSON: the template gets the text as sent
            function["arguments"] = json.loads(function["arguments"])
        calls.append(call | {"function": function})
    return message | {"tool_calls": calls}
