"""One request between the engine's loop thread and its consumer: the stream, and its chunks.

The loop thread hands each request's ``RequestOutput`` (as a ``StepOutput``) or a final
``GenerateError`` to the request's ``RequestStream``; the consumer (an asyncio task) merges what
piled up into ``GenerateChunk``s (``merge_chunks``) and feeds the request's spans.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from serve_app.engine.request import RequestOutput
from serve_app.engine.token_logprobs import LogprobRun
from serve_app.observability.metrics import RequestTimings
from serve_app.observability.request_spans import RequestSpans
from serve_app.wire import GenerateChunk, GenerateError, GenerateRequest


def overloaded_error(message: str) -> GenerateError:
    return GenerateError(message=message, type="overloaded_error", code="overloaded", status=503)


def unavailable_error(message: str) -> GenerateError:
    return GenerateError(message=message, type="server_error", code="engine_unavailable", status=503)


@dataclass(frozen=True)
class StepOutput:
    """A RequestOutput and the loop thread's clock when the step that made it ended."""

    output: RequestOutput
    time: float  # time.perf_counter()
    first: bool  # the request's first output (its prefill)


@dataclass(eq=False)
class RequestStream:
    """One request as both sides see it: the consumer's loop and queue, and timing."""

    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None  # loop thread: when the request got its KV slot
    first_output: float | None = None  # loop thread: when the first output was made
    last_output: float | None = None  # loop thread: when the latest output was made
    cancelled: bool = False  # consumer: gone; the loop thread skips or aborts it
    held: list[StepOutput | GenerateError] = field(default_factory=list)  # consumer: for stream_interval
    sent: bool = False  # consumer: a chunk went out

    async def receive(self, deadline: float, interval: int = 1) -> list[StepOutput | GenerateError]:
        """The consumer's next items for a chunk: what piled up in the queue, held until they make
        ``interval`` tokens (``server.stream_interval``) unless they end the stream or are the first.
        ``TimeoutError`` at ``deadline`` (the loop's clock); ``held`` then keeps what was held."""
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation that
            # races with the item arriving, and the consumer would then not abort.
            async with asyncio.timeout_at(deadline):
                self.held.append(await self.queue.get())
            while not self.queue.empty():  # coalesce what piled up while the consumer was busy
                self.held.append(self.queue.get_nowait())
            if interval <= 1 or not self.sent or _makes_a_chunk(self.held, interval):
                items, self.held, self.sent = self.held, [], True
                return items

    def timings(self, completion_tokens: int, now: float) -> RequestTimings:
        """The request's latencies, finishing at ``now`` (perf_counter seconds), where known."""
        scheduled, first = self.scheduled, self.first_output
        last = self.last_output if self.last_output is not None else now
        decode = last - first if first is not None else None
        return RequestTimings(
            e2e=now - self.arrival,
            queue=scheduled - self.arrival if scheduled is not None else None,
            prefill=first - scheduled if first is not None and scheduled is not None else None,
            decode=decode,
            inference=last - scheduled if first is not None and scheduled is not None else None,
            ttft=first - self.arrival if first is not None else None,
            tpot=decode / (completion_tokens - 1) if decode is not None and completion_tokens > 1 else None,
        )

    def deliver(self, item: StepOutput | GenerateError) -> None:
        """Hand an item to the consumer's event loop (any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            self.cancelled = True


def _makes_a_chunk(items: list[StepOutput | GenerateError], interval: int) -> bool:
    """``interval`` tokens, or the stream's end (an error, the last output)."""
    tokens = 0
    for item in items:
        if isinstance(item, GenerateError) or item.output.finished:
            return True
        tokens += len(item.output.new_token_ids)
    return tokens >= interval


def merge_chunks(
    request_id: str, items: list[StepOutput | GenerateError], trace: RequestSpans
) -> list[GenerateChunk]:
    """Turn queued items into chunks: outputs merge into one; an error ends the stream."""
    chunks: list[GenerateChunk] = []
    outputs: list[RequestOutput] = []
    for item in items:
        if isinstance(item, GenerateError):
            if outputs:
                chunks.append(_chunk(request_id, outputs))
            trace.close("error", item)
            chunks.append(GenerateChunk(request_id, finished=True, error=item))
            return chunks
        trace.on_output(item.output, item.time, item.first)
        outputs.append(item.output)
        if item.output.finished:
            break
    if outputs:
        chunks.append(_chunk(request_id, outputs))
    return chunks


def _chunk(request_id: str, outputs: list[RequestOutput]) -> GenerateChunk:
    """One chunk of consecutive outputs: their text, tokens and logprobs joined, the last one's state."""
    last = outputs[-1]
    return GenerateChunk(
        request_id=request_id,
        text="".join(o.new_text for o in outputs),
        token_ids=[t for o in outputs for t in o.new_token_ids],
        finished=last.finished,
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        speculation=last.spec_stats.as_dict() if last.finished and last.spec_stats else None,
        logprobs=LogprobRun.concat(o.logprobs for o in outputs),
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
    )
