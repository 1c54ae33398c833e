"""OpenAI's tool-calling shapes: the ``tools`` a chat request offers, its ``tool_choice``, the
``tool_calls`` of assistant messages (sent back by clients and returned by us) and their streamed
deltas.

Types are strict, as the rest of the request. Keys a client echoes back from a previous response
inside a tool call are ignored; a tool's ``function.name`` follows OpenAI's rule (letters, digits,
``_`` and ``-``, at most 64).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_LENIENT = ConfigDict(extra="ignore", strict=True)


def _omit_none() -> Any:
    return Field(None, exclude_if=lambda v: v is None)


class FunctionDefinition(BaseModel):
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    model_config = _LENIENT
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; "required" and named choices are what constrain output


class ChatTool(BaseModel):
    """One entry of ``tools``."""

    model_config = _LENIENT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _LENIENT
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this function."""

    model_config = _LENIENT
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    """A call's function: its name and its arguments as a JSON string (OpenAI's shape)."""

    model_config = _LENIENT
    name: str
    arguments: str


class ToolCall(BaseModel):
    """One of an assistant message's ``tool_calls`` (in a request's history, or in our answer)."""

    model_config = _LENIENT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = _omit_none()
    arguments: str | None = _omit_none()


class ToolCallDelta(BaseModel):
    """A streamed piece of a tool call: the first carries ``id``, ``type`` and the name, the next
    ones the arguments; ``index`` says which call of the message it belongs to."""

    index: int
    id: str | None = _omit_none()
    type: Literal["function"] | None = _omit_none()
    function: FunctionCallDelta
