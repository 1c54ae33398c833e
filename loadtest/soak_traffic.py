"""The soak's client side: many short streamed requests, some closed by the client mid-flight.

Every request is planned from ``(seed, phase, index)`` alone (:func:`plan_request`), so a soak sends
the same requests in the same order whatever the timing: a prompt of varied length, half through
``/v1/completions`` and half through ``/v1/chat/completions``, greedy or seeded sampling, exactly
``max_tokens`` tokens (``ignore_eos``: an answered request must carry all of them). A fraction is
*cancelled*: the client closes the connection after a random delay, uniform up to about one
request's latency, so some close before the first token and some mid-stream (a delay longer than
the request is a cancel that came too late: the request counts as answered).

:func:`send_all` runs ``concurrency`` workers over aiohttp (installed with Ray Serve) and returns one
:class:`Outcome` per request; a non-200 answer or an error event in the stream is a failure with
its HTTP status and OpenAI error code.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

TOPICS = (
    "the moon", "a red bicycle", "prime numbers", "green tea", "rivers", "an old lighthouse",
    "sorting algorithms", "autumn leaves", "a chess opening", "sourdough bread", "volcanoes", "jazz",
)  # fmt: skip
TAIL_WORDS = (
    "please", "briefly", "with", "care", "and", "an", "example", "in", "easy", "words", "for",
    "a", "beginner", "using", "simple", "terms", "today", "again", "short", "clear",
)  # fmt: skip
FORMS = (
    "Write one sentence about {topic}.",
    "List three facts about {topic}.",
    "Explain {topic} to a child.",
    "def describe_{word}(x):\n    # {topic}\n",
    "Translate into French: I think about {topic} every day.",
)


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the soak, decided before anything is sent."""

    index: int
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    cancel_after_s: float | None  # the client closes the stream after this long; None: never


@dataclass
class Outcome:
    """What happened to one request."""

    index: int
    status: str  # answered | cancelled | failed
    tokens: int = 0  # text chunks seen (completion_tokens from usage when answered)
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None  # "HTTP <status> <code>" of a failure
    cancel_planned: bool = False  # True for an answered request whose cancel came too late


@dataclass
class Tally:
    """Running counts over outcomes (the live progress line reads it)."""

    done: int = 0
    answered: int = 0
    cancelled: int = 0
    failed: int = 0
    tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: Outcome) -> None:
        self.done += 1
        setattr(self, outcome.status, getattr(self, outcome.status) + 1)
        self.tokens += outcome.tokens if outcome.status == "answered" else 0
        if outcome.error:
            self.errors[outcome.error] = self.errors.get(outcome.error, 0) + 1


def plan_request(
    model: str,
    index: int,
    seed: int,
    phase: str,
    max_tokens: int,
    cancel_fraction: float,
    cancel_window_s: float,
) -> PlannedRequest:
    """Request ``index`` of ``phase``: its prompt, endpoint, sampling and whether (when) it is cancelled."""
    rng = random.Random(f"{seed}:{phase}:{index}")
    topic = rng.choice(TOPICS)
    prompt = rng.choice(FORMS).format(topic=topic, word=topic.split()[-1])
    # A tail of words makes prompts of ~10 to ~60 tokens: short requests, prefills of many lengths
    # (a prefill is one forward per request, and long prompts would make it the soak's whole cost).
    words = rng.choices(TAIL_WORDS, k=rng.choice((0, 0, 4, 12, 30)))
    prompt = " ".join([prompt, *words]).strip()
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    if rng.random() < 0.5:
        body |= {"temperature": 0.0}
    else:
        body |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**31)}
    chat = rng.random() < 0.5
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    cancel = rng.uniform(0.0, cancel_window_s) if rng.random() < cancel_fraction else None
    return PlannedRequest(index, "/v1/chat/completions" if chat else "/v1/completions", body, cancel)


def _error_code(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    return str((error or {}).get("code") or (error or {}).get("type") or "unknown")


async def send_one(session: aiohttp.ClientSession, url: str, request: PlannedRequest) -> Outcome:
    """Send one request and read its stream (or close it when its cancel delay runs out)."""
    outcome = Outcome(request.index, "failed", cancel_planned=request.cancel_after_s is not None)
    start = time.perf_counter()
    done = False
    try:
        async with asyncio.timeout(request.cancel_after_s) as deadline:
            async with session.post(url + request.path, json=request.body) as response:
                if response.status != 200:
                    text = await response.text()
                    try:
                        code = _error_code(json.loads(text))
                    except ValueError:
                        code = text[:60]
                    outcome.error = f"HTTP {response.status} {code}"
                    return outcome
                async for raw in response.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        outcome.error = f"HTTP 200 stream error {_error_code(event)}"
                        return outcome
                    if event.get("usage"):
                        outcome.tokens = int(event["usage"]["completion_tokens"])
                    elif any(_text(choice) for choice in event.get("choices", ())):
                        outcome.ttft_s = outcome.ttft_s or time.perf_counter() - start
                        outcome.tokens += 1  # chunks until usage says the count
    except TimeoutError:
        if not deadline.expired():  # aiohttp's own time-out, not our cancel
            outcome.error = "client timeout"
            return outcome
        # Leaving both `async with` blocks released the response mid-body: aiohttp closes the
        # connection, and the server sees the client go. (A cancel that fired after [DONE] came too
        # late: the request was answered.)
        outcome.status = "answered" if done else "cancelled"
    except (aiohttp.ClientError, ValueError) as exc:
        outcome.error = f"client error {type(exc).__name__}"
    else:
        outcome.status = "answered" if done else "failed"
        outcome.error = None if done else "stream ended without [DONE]"
    outcome.latency_s = time.perf_counter() - start
    return outcome


def _text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_all(
    url: str,
    requests: list[PlannedRequest],
    concurrency: int,
    tally: Tally,
    on_tick: Callable[[Tally], None] | None = None,
    timeout_s: float = 600.0,
) -> list[Outcome]:
    """Send ``requests`` in order with ``concurrency`` in flight; call ``on_tick`` about every second."""
    outcomes: list[Outcome] = []
    queue = iter(requests)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def worker(session: aiohttp.ClientSession) -> None:
        for request in queue:  # one shared iterator: each request goes to exactly one worker
            outcome = await send_one(session, url, request)
            outcomes.append(outcome)
            tally.add(outcome)

    async def ticker() -> None:
        while on_tick is not None:
            await asyncio.sleep(1.0)
            on_tick(tally)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        ticking = asyncio.create_task(ticker())
        try:
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        finally:
            ticking.cancel()
    return sorted(outcomes, key=lambda o: o.index)
