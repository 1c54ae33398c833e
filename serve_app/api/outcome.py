"""What one request produced, chunk by chunk, and how it shows in a response's choice.

The ingress adds every ``GenerateChunk`` of a request to its ``Outcome``: text, token counts (running
totals in chunks: the last wins), finish reason, the speculation block, and the logprobs when the
request asked. ``choice`` gives the whole result (non-streamed); ``streamed`` what one chunk adds to
a stream (the echoed prompt goes with the first), ``stream_events`` the same as the stream's events.
Logprobs take the endpoint's shape (``logprobs_format``). A chat that offered tools reads its text
through a ``CallParser`` (``tool_calls``, ``forced_tool_calls``): content and ``tool_calls``, finish reason
``tool_calls`` when the model called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serve_app.api import protocol as p
from serve_app.api.errors import APIError
from serve_app.api.logprobs_format import CompletionLogprobsWriter, chat_logprobs
from serve_app.api.tool_calls import CallParser, StreamEvent
from serve_app.api.tool_protocol import ToolCallDelta
from serve_app.engine.token_logprobs import LogprobRun
from serve_app.wire import EngineClient, GenerateChunk


async def echo_text(client: EngineClient, body: p.CompletionRequest) -> str | None:
    """The prompt as text when a completion asks for ``echo`` (token ids are decoded by the
    replica, which holds the tokenizer); None otherwise."""
    if not body.echo:
        return None
    if isinstance(body.prompt, str):
        return body.prompt
    result = await client.detokenize(list(body.prompt))
    if result.error is not None:
        raise APIError.from_generate_error(result.error)
    return result.text


class Outcome:
    """A request's result so far; ``echo`` is the prompt text a completion returns first;
    ``tool_calls`` makes the parser of a chat's tool calls (None: the text is all content)."""

    def __init__(
        self,
        chat: bool = False,
        echo: str | None = None,
        tool_calls: Callable[[], CallParser] | None = None,
    ) -> None:
        self.chat, self.echo = chat, echo
        self.text: list[str] = []
        self.prompt_tokens = self.completion_tokens = self._ids = 0
        self.finish_reason: str | None = None
        self.speculation: p.SpeculationInfo | None = None
        self.logprobs: list[LogprobRun | None] = []
        self.prompt_logprobs: LogprobRun | None = None
        self._echo_pending = echo is not None  # a stream has not shown the prompt yet
        self._writer = CompletionLogprobsWriter()  # a stream's running text offsets
        self._tools = tool_calls() if tool_calls is not None else None
        self._tool_events: list[StreamEvent] = []  # what the parser lets a stream show, not shown yet

    def add(self, chunk: GenerateChunk) -> None:
        self.text.append(chunk.text)
        self._ids += len(chunk.token_ids)
        self.prompt_tokens = max(self.prompt_tokens, chunk.prompt_tokens)
        self.completion_tokens = max(self.completion_tokens, chunk.completion_tokens, self._ids)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason or "stop"
        if chunk.speculation is not None:
            self.speculation = p.SpeculationInfo.model_validate(chunk.speculation)
        self.logprobs.append(chunk.logprobs)
        if chunk.prompt_logprobs is not None:  # the first chunk's
            self.prompt_logprobs = chunk.prompt_logprobs
        if self._tools is not None:
            self._tool_events += self._tools.feed(chunk.text)
            if chunk.finished:
                self._tool_events += self._tools.finish()
                if self._tools.calls and self.finish_reason == "stop":  # a cut-off call stays "length"
                    self.finish_reason = "tool_calls"

    def usage(self) -> p.Usage:
        n_in, n_out = self.prompt_tokens, self.completion_tokens
        return p.Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)

    def choice(self) -> p.ChatChoice | p.CompletionChoice:
        """The whole result as the response's choice."""
        text, run = "".join(self.text), LogprobRun.concat(self.logprobs)
        if self.chat:
            message = p.AssistantMessage(content=text)
            if self._tools is not None:
                parsed = self._tools.result()
                calls = [c.tool_call() for c in parsed.calls] or None
                message = p.AssistantMessage(content=parsed.content, tool_calls=calls)
            return p.ChatChoice(
                message=message, logprobs=chat_logprobs(run), finish_reason=self.finish_reason
            )
        if self.echo is not None:
            text, run = self.echo + text, LogprobRun.concat([self.prompt_logprobs, run])
        logprobs = CompletionLogprobsWriter()(run)
        return p.CompletionChoice(text=text, logprobs=logprobs, finish_reason=self.finish_reason)

    def streamed(self, chunk: GenerateChunk) -> tuple[str, Any]:
        """What ``chunk`` (already added) shows in a stream: its text and its tokens' logprobs (in
        the endpoint's shape, None when not asked); the first one leads with the echoed prompt."""
        text, run = chunk.text, chunk.logprobs
        if self._echo_pending:
            self._echo_pending = False
            text, run = (self.echo or "") + text, LogprobRun.concat([self.prompt_logprobs, run])
        return text, chat_logprobs(run) if self.chat else self._writer(run)

    def stream_events(self, chunk: GenerateChunk) -> list[tuple[str | None, Any, list[ToolCallDelta] | None]]:
        """What ``chunk`` (already added) shows in a stream, as (content, logprobs, tool call deltas)
        events: ``streamed``'s one (none when it shows nothing), or with tools the parser's content
        and call pieces, the chunk's logprobs on the first (on an empty content when none shows)."""
        text, logprobs = self.streamed(chunk)
        if self._tools is None:
            return [(text, logprobs, None)] if text or logprobs is not None else []
        shown, self._tool_events = self._tool_events, []
        events = [(e, None, None) if isinstance(e, str) else (None, None, [e]) for e in shown]
        if logprobs is not None:
            content, _, calls = events[0] if events else ("", None, None)
            events[:1] = [(content, logprobs, calls)]
        return events
