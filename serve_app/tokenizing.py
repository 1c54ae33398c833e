"""Tokenizer work the API exposes beside generation (``/tokenize``, ``/detokenize``).

The replica owns the tokenizer (the ingress never loads one), so the ingress asks it through the
engine client; the answers travel as data (``wire.TokenizeResult``), errors included, as generation
chunks do. A prompt is tokenized exactly as a completion request's would be, messages exactly as a
chat request's (the chat template with the generation prompt), so ``count`` is the request's
``usage.prompt_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from serve_app.wire import GenerateError, TokenizeResult

if TYPE_CHECKING:
    from serve_app.engine.engine import SpecEngine

NOT_READY = GenerateError("The engine is not ready; retry shortly.", "server_error", status=503)


def tokenize(
    engine: SpecEngine | None,
    prompt: str | None = None,
    messages: Sequence[dict[str, Any]] | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> TokenizeResult:
    """Token ids of a completion prompt or of chat messages (exactly one of them; ``tools`` go to
    the chat template with the messages)."""
    if engine is None:
        return TokenizeResult(error=NOT_READY)
    if (prompt is None) == (messages is None):
        return TokenizeResult(error=GenerateError("give either a prompt or messages", param="prompt"))
    try:
        if messages is not None:
            ids = engine.encode_messages(messages, tools=tools)
        else:
            ids = engine.encode_prompt(prompt or "")
    except Exception as exc:  # a template that fails on these messages, a tokenizer error
        return TokenizeResult(error=GenerateError(f"could not tokenize: {exc}"))
    return TokenizeResult(token_ids=ids)


def detokenize(engine: SpecEngine | None, token_ids: Sequence[int]) -> TokenizeResult:
    """The text of token ids (special tokens kept, as vLLM's ``/detokenize``)."""
    if engine is None:
        return TokenizeResult(error=NOT_READY)
    vocab = engine.model.cfg.vocab_size
    if any(t < 0 or t >= vocab for t in token_ids):
        return TokenizeResult(error=GenerateError(f"token ids must be in [0, {vocab})", param="tokens"))
    return TokenizeResult(token_ids=list(token_ids), text=engine.tokenizer.decode(list(token_ids)))


def template_info(tokenizer: Any) -> dict[str, Any]:
    """What the ingress needs to know of the tokenizer for tools (``EngineInfo`` fields)."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    return {"template_tools": template_renders_tools(tokenizer), "added_tokens": tuple(sorted(added))}


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads a ``tools`` variable (Qwen2.5's does, SmolLM2's
    does not); the ingress writes the tools into the messages for one that does not."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):  # none, or several named ones (the default is not "tools")
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False
