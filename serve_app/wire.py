"""What the HTTP ingress asks of an engine replica, and what streams back.

These plain dataclasses cross the Ray Serve handle (they pickle), so the ingress never imports the
engine and the replica never imports FastAPI. Errors travel as data too: a replica that cannot take
a request yields one chunk whose ``error`` says why, and the ingress turns it into an OpenAI-style
error response with the right status code (400 bad input, 429 overloaded, 503 not ready).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.token_logprobs import LogprobRun


@dataclass(frozen=True)
class GenerateRequest:
    """One completion or chat request, validated by the ingress, tokenized by the replica."""

    request_id: str
    sampling: SamplingParams
    prompt: str | list[int] | None = None  # /v1/completions: text or token ids
    messages: list[dict[str, Any]] | None = None  # /v1/chat/completions: through the chat template
    tools: list[dict[str, Any]] | None = None  # given to the chat template as ``tools`` (api.tool_prompt)
    speculation: SpecOverride = field(default_factory=SpecOverride)
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C trace context carrier
    # The request named no max_tokens: ``sampling.max_tokens`` is an upper bound that the replica
    # lowers to the context left after the prompt, once it has tokenized it.
    fit_max_tokens: bool = False


@dataclass(frozen=True)
class GenerateError:
    """Why a request was refused; ``status`` is the HTTP status the ingress answers with."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    status: int = 400


@dataclass(frozen=True)
class GenerateChunk:
    """New text of one request since the last chunk; the last chunk has ``finished`` set."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    speculation: dict[str, Any] | None = None  # SpecStats.as_dict() on the final chunk
    error: GenerateError | None = None
    logprobs: LogprobRun | None = None  # of token_ids, when the request asked (sampling.logprobs)
    prompt_logprobs: LogprobRun | None = None  # on the first chunk (sampling.prompt_logprobs)


@dataclass(frozen=True)
class EngineInfo:
    """What the ingress needs to validate requests and list models."""

    model: str  # the served model's name (what clients put in "model")
    max_seq_len: int
    max_tokens_limit: int  # the largest max_tokens a request may name (<= max_seq_len)
    proposers: list[str]
    default_method: str | None
    # Speculation is bit-exact here: the replica made its rows independent of the batch
    # (serve_app.engine.exactness). False on a device where it could not, or with it turned off.
    exact: bool = False
    sampling: str = "coupled"  # how sampled tokens are drawn and verified (EngineConfig.sampling)
    default_max_tokens: int | None = None  # a request without max_tokens: at most this (None: the context)
    # The chat template renders a ``tools`` list; else the ingress writes the tools into the messages.
    template_tools: bool = False
    # The texts of the tokenizer's added tokens (``<tool_call>`` in Qwen2.5's): a grammar names them
    # as tokens, not text (``api.forced_tool_calls``).
    added_tokens: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenizeResult:
    """The replica's answer to a tokenize or detokenize call (``serve_app.tokenizing``)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: GenerateError | None = None


class EngineClient(Protocol):
    """The replica as the ingress sees it: a Ray Serve handle in production, in-process in tests."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's chunks; closing the iterator early aborts the request."""

    async def info(self) -> EngineInfo:
        """The served model and its limits."""

    async def health(self) -> bool:
        """True while the engine loop is alive (not stuck)."""

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> TokenizeResult:
        """Token ids of a prompt or of chat messages (and the tools offered), as a request would have them."""

    async def detokenize(self, token_ids: list[int]) -> TokenizeResult:
        """The text of token ids."""
