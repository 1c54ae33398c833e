"""One HTTP request, several engine requests: ``n`` choices per prompt, and completions' batches.

A request with ``n`` > 1 or several prompts runs as one engine request per choice (``expand``),
in OpenAI's order: prompt-major, choice ``index = prompt * n + j``. Each has its own id
(``<id>-<index>``) and, when the request names a ``seed``, choice ``j`` of every prompt samples
with ``seed + j`` (vLLM's rule; wrapped into the seed range), so a seeded request is reproducible
and each prompt of a batch gets what it would get alone. Unseeded choices draw their own seeds
(independent samples); greedy choices are all the same.

``FanOutStream`` runs the engine streams side by side and yields their chunks as they come;
``first`` waits until every choice has sent its first chunk (or a refusal), so that a refused
choice (a prompt too long, a bad token id) answers the whole request with its error before a
response starts. Closing it closes every engine stream (which aborts what is still running): on
an error, a time-out or a client gone, no choice is left behind. ``Choices`` adds each chunk to its
choice's ``Outcome``; usage counts each prompt once and sums the completion tokens; the
speculation block sums the choices'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from serve_app.api import fields
from serve_app.api import protocol as p
from serve_app.api.errors import APIError
from serve_app.api.outcome import Outcome, echo_text
from serve_app.wire import EngineClient, GenerateChunk, GenerateRequest

log = logging.getLogger(__name__)

_SEED_MIN, _SEED_SPAN = -(2**63), 2**64 + 2**63  # the seeds protocol accepts: [-2^63, 2^64)


def derived_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` (0-based) of a request seeded ``seed``: ``seed + choice``,
    wrapped into the accepted range."""
    return (seed + choice - _SEED_MIN) % _SEED_SPAN + _SEED_MIN


def expand(
    greq: GenerateRequest, body: p.CompletionRequest | p.ChatCompletionRequest
) -> list[GenerateRequest]:
    """The engine requests of ``body``'s choices, by index (``greq`` itself when there is one)."""
    chat = isinstance(body, p.ChatCompletionRequest)
    prompts: list[Any] = [None] if chat else fields.prompts(body.prompt)  # type: ignore[union-attr]
    n = body.n or 1
    if len(prompts) * n > fields.MAX_CHOICES:
        why = f"at most {fields.MAX_CHOICES} choices (prompts x n) per request, got {len(prompts) * n}"
        raise APIError(400, why, param="n")
    if len(prompts) * n == 1:
        return [greq]
    seed, out = greq.sampling.seed, []
    for prompt in prompts:
        for j in range(n):
            sampling = greq.sampling if seed is None else replace(greq.sampling, seed=derived_seed(seed, j))
            changes: dict[str, Any] = {"request_id": f"{greq.request_id}-{len(out)}", "sampling": sampling}
            if prompt is not None:
                changes["prompt"] = prompt
            out.append(replace(greq, **changes))
    return out


def merge_speculation(blocks: list[p.SpeculationInfo | None]) -> p.SpeculationInfo | None:
    """The speculation blocks of several choices as one: counts summed, rates recomputed."""
    known = [b for b in blocks if b is not None]
    if len(known) <= 1:
        return known[0] if known else None
    total = {k: sum(getattr(b, k) for b in known) for k in ("steps", "spec_steps", "drafted", "accepted",
                                                              "tree_steps")}  # fmt: skip
    positions = max(len(b.accepted_per_position) for b in known)
    per_position = [sum(b.accepted_per_position[i] for b in known if i < len(b.accepted_per_position))
                    for i in range(positions)]  # fmt: skip
    drafted, accepted, spec_steps = total["drafted"], total["accepted"], total["spec_steps"]
    by_proposer: dict[str, int] = {}
    for b in known:
        for name, steps in b.steps_by_proposer.items():
            by_proposer[name] = by_proposer.get(name, 0) + steps
    return p.SpeculationInfo(
        proposer=next((b.proposer for b in reversed(known) if b.proposer), None),
        acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
        mean_accepted_length=round((accepted + spec_steps) / spec_steps, 4) if spec_steps else 0.0,
        accepted_per_position=per_position,
        steps_by_proposer=by_proposer,
        **total,
    )


class Choices:
    """A request's choices, one ``Outcome`` each, in index order (see the module docstring)."""

    def __init__(self, outcomes: list[Outcome], requests: list[GenerateRequest], per_prompt: int) -> None:
        self.outcomes, self.requests, self.per_prompt = outcomes, requests, per_prompt
        self._index = {r.request_id: i for i, r in enumerate(requests)}

    def add(self, chunk: GenerateChunk) -> tuple[int, Outcome]:
        """Add ``chunk`` to its choice's outcome; returns the choice's index and outcome."""
        index = self._index.get(chunk.request_id, 0)
        self.outcomes[index].add(chunk)
        return index, self.outcomes[index]

    @property
    def finished(self) -> bool:
        """Every choice has its final chunk."""
        return all(o.finish_reason is not None for o in self.outcomes)

    @property
    def prompt_tokens(self) -> int:  # each prompt once, as OpenAI and vLLM count
        return sum(o.prompt_tokens for o in self.outcomes[:: self.per_prompt])

    @property
    def completion_tokens(self) -> int:
        return sum(o.completion_tokens for o in self.outcomes)

    @property
    def finish_reason(self) -> str | None:  # the first choice's (a span records one)
        return self.outcomes[0].finish_reason

    @property
    def speculation(self) -> p.SpeculationInfo | None:
        return merge_speculation([o.speculation for o in self.outcomes])

    def usage(self) -> p.Usage:
        n_in, n_out = self.prompt_tokens, self.completion_tokens
        return p.Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)

    def choices(self) -> list[Any]:
        """Every choice's whole result, with its index."""
        return [o.choice().model_copy(update={"index": i}) for i, o in enumerate(self.outcomes)]


async def choices(
    client: EngineClient,
    body: p.CompletionRequest | p.ChatCompletionRequest,
    requests: list[GenerateRequest],
    make: Callable[[str | None], Outcome],
) -> Choices:
    """``Choices`` for ``requests``: ``make(echo)`` makes each choice's outcome (``echo``: the prompt's
    text when a completion asks for it, worked out once per prompt)."""
    per_prompt = body.n or 1
    echoes: list[str | None] = []
    for r in requests[::per_prompt]:
        if isinstance(body, p.ChatCompletionRequest):
            echoes.append(None)
        else:
            echoes.append(await echo_text(client, body.model_copy(update={"prompt": r.prompt})))
    outcomes = [make(echoes[i // per_prompt]) for i in range(len(requests))]
    return Choices(outcomes, requests, per_prompt)


_DONE = object()  # a stream's end in the queue


class FanOutStream:
    """Engine streams side by side, their chunks as they come (module docstring); one stream is
    passed through as it is."""

    def __init__(self, client: EngineClient, requests: list[GenerateRequest]) -> None:
        self._streams: list[AsyncIterator[GenerateChunk]] = [client.generate(r) for r in requests]
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffer: deque[GenerateChunk] = deque()
        self._live = len(self._streams)
        self._last = 0  # the stream of the chunk handed out last
        self._ended: set[int] = set()  # streams that have ended

    def __aiter__(self) -> FanOutStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        if self._buffer:
            return self._buffer.popleft()
        if len(self._streams) == 1:
            return await anext(self._streams[0])
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self._streams)]
        while self._live:
            self._last, item = await self._queue.get()
            if item is _DONE:
                self._live -= 1
                self._ended.add(self._last)
            elif isinstance(item, BaseException):
                raise item
            else:
                return item
        raise StopAsyncIteration

    async def _pump(self, index: int, stream: AsyncIterator[GenerateChunk]) -> None:
        try:
            async for chunk in stream:
                self._queue.put_nowait((index, chunk))
        except Exception as e:  # handed to the consumer, which fails the request as one stream would
            self._queue.put_nowait((index, e))
        finally:
            self._queue.put_nowait((index, _DONE))

    async def first(self) -> GenerateChunk | None:
        """The first chunk, once every stream has sent one or ended; a refusal among them comes
        first (None: no stream sent anything)."""
        if len(self._streams) == 1:
            return await anext(self, None)
        waiting, got = set(range(len(self._streams))), []
        while waiting:
            chunk = await anext(self, None)
            if chunk is None:  # every stream ended
                break
            if chunk.error is not None:
                return chunk
            got.append(chunk)
            waiting -= {self._last} | self._ended  # it sent its first chunk, or ended without one
        self._buffer.extend(got[1:])
        return got[0] if got else None

    async def aclose(self) -> None:
        """Close every engine stream (aborting what still runs there); waits for them to end."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        for stream in self._streams:  # each one, even when closing another failed
            close = getattr(stream, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:
                    log.exception("closing an engine stream failed")
