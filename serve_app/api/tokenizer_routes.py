"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, as vLLM serves them.

The replica holds the tokenizer, so both calls go through the engine client
(``serve_app.tokenizing``). ``/tokenize`` takes a completion ``prompt`` or chat ``messages`` and
counts exactly what a request with them would (``usage.prompt_tokens``); ``/detokenize`` takes
``tokens``. ``model`` is optional; when given it must be the served one. ``tools`` go with
``messages`` as a chat request's would (``tool_prompt``), counted in the prompt.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from serve_app.api import protocol as p
from serve_app.api.errors import APIError
from serve_app.api.tool_prompt import template_inputs
from serve_app.api.tool_protocol import ChatTool
from serve_app.wire import EngineClient, TokenizeResult

_STRICT = ConfigDict(extra="forbid", strict=True)


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = Field(None, min_length=1)
    tools: list[ChatTool] | None = None  # with messages: as a chat request offering them


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def package_version() -> str:
    try:
        return version("specserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _checked(result: TokenizeResult) -> TokenizeResult:
    if result.error is not None:
        raise APIError.from_generate_error(result.error)
    return result


def add_tokenizer_routes(app: FastAPI, client: EngineClient, ingress: Any) -> None:
    """The routes; ``ingress`` gives the engine's info (``info()``) and checks a model name."""

    async def checked_info(model: str | None) -> Any:
        info = await ingress.info()
        if model is not None:
            ingress.check_model(info, model)
        return info

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        info = await checked_info(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give either a prompt or messages.", param="prompt")
        messages, tools = None, None
        if body.messages is not None:
            offered = [t.model_dump(exclude_none=True) for t in body.tools or ()]
            chat = p.template_messages(body.messages)
            messages, tools = template_inputs(chat, offered, info.template_tools, ingress.tool_format)
        result = _checked(await client.tokenize(body.prompt, messages, tools=tools))
        return TokenizeResponse(
            count=len(result.token_ids), max_model_len=info.max_seq_len, tokens=result.token_ids
        )

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        await checked_info(body.model)
        return DetokenizeResponse(prompt=_checked(await client.detokenize(body.tokens)).text)

    @app.get("/version", response_model=VersionResponse)
    async def get_version() -> VersionResponse:
        return VersionResponse(version=package_version())
