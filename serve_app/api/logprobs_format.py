"""Logprobs in OpenAI's two shapes, from the engine's ``LogprobRun`` (``engine.token_logprobs``).

- Chat (``logprobs: true``, ``top_logprobs: k``): ``choices[i].logprobs.content``, one entry per
  token: ``token``, ``logprob``, ``bytes`` and ``top_logprobs`` (the k most likely tokens there,
  each with ``token``, ``logprob``, ``bytes``).
- Completions (``logprobs: k``): the legacy columns ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (per token a dict text -> logprob of the k most likely tokens and the chosen one,
  so up to k + 1 entries, as OpenAI and vLLM answer) and ``text_offset`` (where each token starts in
  the returned text, counted in the tokens' own texts; with ``echo`` the prompt's tokens come first,
  the first of them with a null logprob and null alternatives).

A token's ``token`` is its text decoded alone (a piece of a character shows as U+FFFD, as vLLM
shows it); ``bytes`` are its exact bytes, which join into the text. JSON has no -inf: a logprob
below -9999 is sent as -9999.0 (vLLM's floor).
"""

from __future__ import annotations

from pydantic import BaseModel

from serve_app.engine.token_logprobs import LogprobRun

LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)  # also turns -inf (a token the model rules out) into a number


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat completion (and of each streamed chunk's choice)."""

    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """``choices[i].logprobs`` of a completion: the legacy columns, one entry per token."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


def _top(run: LogprobRun, token_id: int, logprob: float) -> TopLogprob:
    text, raw = run.piece(token_id)
    return TopLogprob(token=text, logprob=_value(logprob), bytes=list(raw))


def chat_logprobs(run: LogprobRun | None) -> ChatLogprobs | None:
    """The chat shape of ``run``; None when the request asked for no logprobs."""
    if run is None:
        return None
    content = []
    for token_id, logprob, ids, values in zip(
        run.token_ids, run.logprobs, run.top_ids, run.top_logprobs, strict=True
    ):
        text, raw = run.piece(token_id)
        alternatives = [_top(run, t, v) for t, v in zip(ids, values, strict=True)]
        value = _value(logprob) if logprob is not None else LOGPROB_FLOOR  # generated tokens always have one
        content.append(
            ChatTokenLogprob(token=text, logprob=value, bytes=list(raw), top_logprobs=alternatives)
        )
    return ChatLogprobs(content=content)


class CompletionLogprobsWriter:
    """The legacy shape, run after run: ``text_offset`` goes on across a stream's chunks."""

    def __init__(self) -> None:
        self.offset = 0  # where the next token starts in the text returned so far

    def __call__(self, run: LogprobRun | None) -> CompletionLogprobs | None:
        if run is None:
            return None
        out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for token_id, logprob, ids, values in zip(
            run.token_ids, run.logprobs, run.top_ids, run.top_logprobs, strict=True
        ):
            text = run.piece(token_id)[0]
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if logprob is None:  # a prompt's first token: nothing to condition on
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_value(logprob))
            top = {run.piece(t)[0]: _value(v) for t, v in zip(ids, values, strict=True)}
            top.setdefault(text, _value(logprob))  # the chosen token is always there
            out.top_logprobs.append(top)
        return out
