"""OpenAI request/response models for /v1/completions and /v1/chat/completions, and the translation
of a request into the engine's `GenerateRequest`.

Types are strict, as OpenAI's: wrong JSON types are errors (no "5" for 5). An unknown top-level
field is kept in ``model_extra`` and ignored (one log line per field name), as vLLM and SGLang do, so
that client extras (LangChain, LiteLLM, ``chat_template_kwargs``) do not break requests; with
``server.strict_requests`` it is a 400 ("Unrecognized request argument supplied: ...", OpenAI's
answer; ``routes`` decides). Unknown keys inside our ``speculation`` block are always a 400.
Accepted and ignored by name: `user`, `metadata`, `store`,
`service_tier`, `stream_options.include_obfuscation`. OpenAI fields
not implemented here are accepted at their neutral value and otherwise refused with a 400 naming the
field: legacy `functions` / `function_call`, `suffix`, `best_of` != 1. Structured output
(``response_format``): `response_format` text / json_object / json_schema, on both endpoints.
Tools (``tool_protocol``, ``tool_prompt``,
``tool_calls``, ``forced_tool_calls``): `tools`, `tool_choice` none / auto / required / a named function
(those two through the grammar), `parallel_tool_calls`, assistant `tool_calls` and `tool` messages.
`n` choices (1..128), several completions prompts (a list of texts or of token-id lists), penalties
(`presence_penalty`, `frequency_penalty`; `repetition_penalty` is vLLM's extension) and `logit_bias`:
``fields``, ``fanout`` (one engine request per choice), ``engine.penalties``.
Logprobs (``logprobs_format``): chat `logprobs` + `top_logprobs` (0..20, needs
`logprobs: true`), completions `logprobs` (0..20: vLLM's bound, above OpenAI's 5) and `echo` (the
prompt first, with its logprobs when `logprobs` is set). Extensions: `top_k` (0 or -1 = off), `ignore_eos`,
`stop_token_ids`, `speculation: {"mode": "auto"|"off"|<proposer>, "max_depth": n >= 0,
"tree_nodes": n >= 0}` (no other keys). `model` is required, as in OpenAI's API. Chat messages:
roles system, developer (given to the template as system), user, assistant, tool; content a string
or text parts (joined with newlines), null for an assistant message with tool_calls; keys a client
echoes back from a previous response (`refusal`, `annotations`, ...) are ignored.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from serve_app.api import fields
from serve_app.api.errors import APIError
from serve_app.api.fields import MAX_N
from serve_app.api.logprobs_format import ChatLogprobs, CompletionLogprobs
from serve_app.api.response_format import ResponseFormat, structured_output
from serve_app.api.tool_prompt import check_message, tool_fields
from serve_app.api.tool_protocol import ChatTool, ToolCall, ToolCallDelta, ToolChoice
from serve_app.engine.params import MAX_STOP_STRINGS, SamplingParams, SpecOverride
from serve_app.engine.token_logprobs import MAX_LOGPROBS
from serve_app.wire import EngineInfo, GenerateRequest

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes

_STRICT = ConfigDict(extra="forbid", strict=True)


# Fields accepted only at a neutral value: name -> (is the value neutral?, why not otherwise).
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
    "suffix": (lambda v: not v, "suffix is not supported"),
    "functions": (lambda v: not v, "functions are not supported"),
    "function_call": (lambda v: v in (None, "none"), "functions are not supported"),
}


class SpeculationOptions(BaseModel):
    """Our extension: the request's own say on speculative decoding."""

    model_config = _STRICT
    mode: str = Field("auto", min_length=1, description="'auto' (server decides), 'off', or a proposer.")
    max_depth: int | None = Field(None, ge=0, description="Draft at most this many tokens per step.")
    tree_nodes: int | None = Field(
        None, ge=0, le=32,
        description="Alternatives a draft may add beside its chain, verified as a token tree in the same "
        "forward (0: chains only; unset: the server's policy decides).",
    )  # fmt: skip


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; nothing is obfuscated


class _Request(BaseModel):
    """Fields both endpoints share; unknown ones land in ``model_extra`` (see the module docstring)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)  # choices per prompt (api.fanout)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id -> -100..100 (engine.penalties)
    repetition_penalty: float | None = Field(None, gt=0)  # extension (vLLM): 1 = off
    user: str | None = None  # ignored
    metadata: dict[str, str] | None = None  # ignored
    store: bool | None = None  # ignored: nothing is stored
    service_tier: str | None = None  # ignored
    top_k: int | None = Field(None, ge=-1)  # extension: keep the k most likely tokens (0 or -1: off)
    ignore_eos: bool = False  # extension: keep generating past the end-of-text token
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=64)
    speculation: SpeculationOptions | None = None
    response_format: ResponseFormat | None = None  # structured output (api.response_format)

    @field_validator(*_NEUTRAL, check_fields=False)
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        is_neutral, why = _NEUTRAL[info.field_name or ""]
        if not is_neutral(v):
            raise ValueError(why)
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return [v] if v else None
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return v or None

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str | list[int]] = Field(description="One prompt or a batch (fields).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # this many alternatives per token
    echo: bool | None = None  # the prompt before the text (and its logprobs, with logprobs)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        return fields.check_prompt(v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # null: an assistant message that only calls tools
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any = None

    @field_validator("function_call")
    @classmethod
    def _no_functions(cls, v: Any) -> Any:
        if v:
            raise ValueError("function_call is not supported (use tool_calls)")
        return v

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        check_message(self)
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v  # strings pass; other types fail the str check
        texts = []
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call is returned

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):  # OpenAI's and vLLM's rule
            raise ValueError("top_logprobs needs logprobs set to true")
        return v


def new_request_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def to_generate_request(
    req: CompletionRequest | ChatCompletionRequest,
    info: EngineInfo,
    *,
    request_id: str,
    max_tokens_limit: int | None = None,
    trace_context: dict[str, str] | None = None,
) -> GenerateRequest:
    """Translate a validated request for the engine; refusals the schema can't see raise `APIError`.

    A ``max_tokens`` over ``info.max_tokens_limit`` (or ``max_tokens_limit``, if lower) is a 400; none
    means up to the context left after the prompt (the replica fits it once it has tokenized the
    prompt), at most ``info.default_max_tokens`` (``sampling.max_tokens``) and the limit."""
    limit = min(info.max_tokens_limit, max_tokens_limit or info.max_tokens_limit)
    param, max_tokens = "max_tokens", req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        param, max_tokens = "max_completion_tokens", req.max_completion_tokens
    fit = max_tokens is None
    if fit:
        max_tokens = min(info.default_max_tokens or limit, limit)
    elif max_tokens > limit:
        why = f"{param} is too large: {max_tokens}. This model supports at most {limit} completion tokens."
        raise APIError(400, why, param=param, code="max_tokens_too_large")
    top_p = 1.0 if req.top_p is None else max(req.top_p, 1e-9)  # 0: only the most likely token
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=max(req.top_k or 0, 0),
            top_p=top_p,
            seed=req.seed,
            stop=tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            **_logprobs(req),
            **fields.penalties(req),
            structured=structured_output(req.response_format),  # a 400 for a bad schema
        )
    except ValueError as e:  # SamplingParams names the field first
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
    spec = req.speculation or SpeculationOptions()
    if spec.mode not in (modes := ("auto", "off", *info.proposers)):
        why = f"speculation.mode must be one of {', '.join(map(repr, modes))}, got {spec.mode!r}"
        raise APIError(400, why, param="speculation.mode")
    common = dict(
        request_id=request_id,
        sampling=sampling,
        speculation=SpecOverride(mode=spec.mode, max_depth=spec.max_depth, tree_nodes=spec.tree_nodes),
        trace_context=dict(trace_context or {}),
        fit_max_tokens=fit,
    )
    if isinstance(req, CompletionRequest):
        first = fields.prompts(req.prompt)[0]  # a batch's others: api.fanout
        return GenerateRequest(prompt=first, **common)  # type: ignore[arg-type]
    return GenerateRequest(messages=template_messages(req.messages), **common)  # type: ignore[arg-type]


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> dict[str, int | None]:
    """The engine's ``logprobs`` / ``prompt_logprobs`` (alternatives per token; None: none asked)."""
    if isinstance(req, ChatCompletionRequest):
        return {"logprobs": (req.top_logprobs or 0) if req.logprobs else None}
    return {"logprobs": req.logprobs, "prompt_logprobs": req.logprobs if req.echo else None}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them (``developer`` is the template's ``system``)."""
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.content}
        | ({"name": m.name} if m.name else {})
        | tool_fields(m)
        for m in messages
    ]


# Responses. Optional extras (``speculation``, chunk ``usage``, unset delta keys) are left out when
# empty so that every object is exactly OpenAI's shape plus, where there is one, our block.
def _omit_none() -> Any:
    return Field(None, exclude_if=lambda v: v is None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculationInfo(BaseModel):
    """Our extension: what speculation did for this request (`SpecStats.as_dict()`)."""

    model_config = ConfigDict(extra="ignore")
    proposer: str | None = None
    steps: int = 0
    spec_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    accepted_per_position: list[int] = Field(default_factory=list)
    tree_steps: int = 0  # steps that verified a token tree (drafted then counts its nodes)
    # speculative steps of each proposer ("auto" may switch between them within a request)
    steps_by_proposer: dict[str, int] = Field(default_factory=dict)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A ``text_completion`` object; streamed chunks have the same shape."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _omit_none()
    speculation: SpeculationInfo | None = _omit_none()


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _omit_none()


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpeculationInfo | None = _omit_none()


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _omit_none()
    content: str | None = _omit_none()
    tool_calls: list[ToolCallDelta] | None = _omit_none()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omit_none()
    speculation: SpeculationInfo | None = _omit_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int | None = None  # the longest sequence (prompt + output) a request may reach
    # Ours: speculative output is bit-identical to plain decoding on this replica (see the README).
    exact: bool | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
