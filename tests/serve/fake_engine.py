"""The fake engine the HTTP-layer tests run on: canned chunks, recorded requests, failures on cue;
with the fixtures and assertions those tests share."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from serve_app.api import create_app
from serve_app.config import ServerSettings
from serve_app.wire import EngineInfo, GenerateChunk, GenerateError, GenerateRequest, TokenizeResult

MODEL = "tiny-model"
SPEC = {
    "proposer": "draft", "steps": 2, "spec_steps": 2, "drafted": 8, "accepted": 6,
    "acceptance_rate": 0.75, "mean_accepted_length": 4.0, "accepted_per_position": [2, 2, 1, 1],
    "tree_steps": 0, "steps_by_proposer": {"draft": 2},
}  # fmt: skip
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "def add(a, b):"}


def script(*texts: str, reason: str = "stop", spec: dict | None = SPEC) -> list[GenerateChunk]:
    """Chunks streaming ``texts``; the last one finishes with the totals and the speculation block."""
    chunks = [
        GenerateChunk("", text=t, token_ids=[i], prompt_tokens=5, completion_tokens=i + 1)
        for i, t in enumerate(texts)
    ]
    last = chunks[-1]
    chunks[-1] = GenerateChunk("", last.text, last.token_ids, True, reason, 5, len(texts), spec)
    return chunks


class FakeEngine:
    """Streams canned chunks, records requests, can fail or hang, and tracks how each stream ended."""

    def __init__(self) -> None:
        self.info_ = EngineInfo(
            MODEL, max_seq_len=512, max_tokens_limit=100, proposers=["draft", "ngram"], default_method="draft"
        )
        self.chunks = script("Hello", ", world", "!")
        self.hang_after: int | None = None  # block forever after this many chunks
        self.raise_after: int | None = None  # raise RuntimeError after this many chunks
        self.healthy: bool | Exception = True
        self.info_error: Exception | None = None
        self.requests: list[GenerateRequest] = []
        self.closed: list[str] = []  # request ids whose stream was closed (or ran out)
        self.aborted: list[str] = []  # ... closed before the final chunk was handed out
        self.tokenized: list[tuple] = []  # (prompt, messages) of each tokenize call

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        return self._stream(request)

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        handed_final = False
        try:
            for i, chunk in enumerate(self.chunks):
                if i == self.hang_after:
                    await asyncio.Event().wait()
                if i == self.raise_after:
                    raise RuntimeError("secret internal detail")
                handed_final = chunk.finished or chunk.error is not None
                yield dataclasses.replace(chunk, request_id=request.request_id)
                await asyncio.sleep(0)
            if self.hang_after == len(self.chunks):
                await asyncio.Event().wait()
        finally:
            self.closed.append(request.request_id)
            if not handed_final:
                self.aborted.append(request.request_id)

    async def info(self) -> EngineInfo:
        if self.info_error is not None:
            raise self.info_error
        return self.info_

    async def health(self) -> bool:
        if isinstance(self.healthy, Exception):
            raise self.healthy
        return self.healthy

    async def tokenize(
        self, prompt: str | None = None, messages: list | None = None, tools: list | None = None
    ) -> TokenizeResult:
        """One token per character; messages as ``role: content`` lines."""
        self.tokenized.append((prompt, messages))
        text = prompt if prompt is not None else "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return TokenizeResult(token_ids=[ord(c) for c in text])

    async def detokenize(self, token_ids: list[int]) -> TokenizeResult:
        if any(t < 0 for t in token_ids):
            return TokenizeResult(error=GenerateError("token ids must be in [0, 100)", param="tokens"))
        return TokenizeResult(token_ids=token_ids, text="".join(map(chr, token_ids)))


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def http(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine, ServerSettings()), raise_server_exceptions=False)


def sse(response: Any) -> list[Any]:
    """The JSON payloads of an SSE body; the final ``[DONE]`` as the string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [block.removeprefix("data: ") for block in response.text.split("\n\n") if block]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]] + ["[DONE]"]


def assert_error(
    response: Any, status: int, param: str | None = None, text: str = "", code: str | None = None
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert text.lower() in error["message"].lower(), error
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert "Traceback" not in response.text and "secret" not in response.text
    return error


@contextlib.contextmanager
def serving(app: Any, api_key: str = "x") -> Iterator[openai.OpenAI]:
    """``app`` under a real uvicorn server on a free loopback port, in a thread; the official
    client pointed at it (no retries). The server stops when the block ends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started
    try:
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key=api_key, max_retries=0
        )
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()
