"""The OpenAI-compatible HTTP layer in isolation, over a fake engine (end to end with Ray: elsewhere)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from serve_app.api import create_app
from serve_app.config import ServerSettings
from serve_app.engine.params import SpecOverride
from serve_app.wire import EngineInfo, GenerateChunk, GenerateError, GenerateRequest, TokenizeResult

MODEL = "tiny-model"
SPEC = {
    "proposer": "draft", "steps": 2, "spec_steps": 2, "drafted": 8, "accepted": 6,
    "acceptance_rate": 0.75, "mean_accepted_length": 4.0, "accepted_per_position": [2, 2, 1, 1],
    "tree_steps": 0,
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


# --- happy paths through TestClient ------------------------------------------------------------------


def test_chat_completion_and_request_translation(http: TestClient, engine: FakeEngine) -> None:
    r = http.post("/v1/chat/completions", json=CHAT)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-") and r.headers["x-request-id"] == body["id"]
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello, world!"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert body["speculation"] == SPEC
    (req,) = engine.requests
    assert (
        req.request_id == body["id"]
        and req.messages == [{"role": "user", "content": "hi"}]
        and req.prompt is None
    )
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (100, 1.0, 1.0, 0, None, ())
    assert req.speculation == SpecOverride()
    assert engine.closed == [req.request_id] and engine.aborted == []  # closed once done, not aborted


def test_sampling_fields_reach_the_engine(http: TestClient, engine: FakeEngine) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "name": "u",
        },
        {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None},
    ]
    extra = {
        "temperature": 0, "top_p": 0.5, "top_k": 40, "seed": 7, "stop": "\n", "max_tokens": 9,
        "max_completion_tokens": 12, "stop_token_ids": [3], "ignore_eos": True, "user": "u1", "n": 1,
        "presence_penalty": 0, "speculation": {"mode": "ngram", "max_depth": 0},
    }  # fmt: skip
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": messages, **extra})
    assert r.status_code == 200
    req = engine.requests[-1]
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "u"},
        {"role": "assistant", "content": "ok"},
    ]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (12, 0.0, 0.5, 40, 7, ("\n",))
    assert s.stop_token_ids == (3,) and s.ignore_eos and req.speculation == SpecOverride("ngram", 0)


@pytest.mark.parametrize(
    ("prompt", "expected"), [("hi", "hi"), (["hi"], "hi"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])]
)
def test_completion_prompt_forms(http: TestClient, engine: FakeEngine, prompt: Any, expected: Any) -> None:
    r = http.post("/v1/completions", json={**COMPLETION, "prompt": prompt, "stop": ["x", "y"]})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": "Hello, world!", "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["speculation"]["acceptance_rate"] == 0.75
    assert engine.requests[-1].prompt == expected and engine.requests[-1].sampling.stop == ("x", "y")


def test_chat_stream(http: TestClient, engine: FakeEngine) -> None:
    req = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    events = sse(http.post("/v1/chat/completions", json=req))
    *chunks, usage_chunk, done = events
    assert done == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello, world!"
    final = chunks[-1]
    assert final["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert final["speculation"] == SPEC and all("speculation" not in c for c in chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 8
    assert len({c["id"] for c in events[:-1]}) == 1
    assert engine.closed == [engine.requests[0].request_id] and engine.aborted == []


def test_completion_stream_without_usage_or_speculation(http: TestClient, engine: FakeEngine) -> None:
    engine.chunks = script("Hello", ", world", "!", reason="length", spec=None)
    *chunks, _ = sse(http.post("/v1/completions", json={**COMPLETION, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world!"
    assert chunks[-1]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    assert all(
        c["object"] == "text_completion" and "usage" not in c and "speculation" not in c for c in chunks
    )
    body = http.post("/v1/completions", json=COMPLETION).json()
    assert "speculation" not in body and body["choices"][0]["finish_reason"] == "length"


def test_models_and_health(http: TestClient, engine: FakeEngine) -> None:
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(http.get("/v1/models/gpt-4"), 404, code="model_not_found")
    assert http.get("/health").status_code == 200
    engine.healthy = False
    assert http.get("/health").status_code == 503
    engine.healthy = RuntimeError("loop stuck")
    assert http.get("/health").status_code == 503


@pytest.mark.parametrize("exact", [True, False])
def test_models_and_health_say_whether_speculation_is_exact_here(
    http: TestClient, engine: FakeEngine, exact
) -> None:
    engine.info_ = dataclasses.replace(engine.info_, exact=exact)
    card = http.get("/v1/models").json()["data"][0]
    assert card["exact"] is exact and card["max_model_len"] == 512
    assert http.get("/health").json() == {"status": "ok", "exact": exact}


# --- errors --------------------------------------------------------------------------------------------

IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
# fmt: off
BAD_REQUESTS = [
    # (path, body changes, status, param, message text)
    ("chat", {"temperature": 2.5}, 400, "temperature", "temperature: Input should be less than or equal to 2"),  # noqa: E501
    ("chat", {"temperature": "hot"}, 400, "temperature", "valid number"),
    ("chat", {"max_tokens": "10"}, 400, "max_tokens", "valid integer"),
    ("chat", {"max_tokens": 1.5}, 400, "max_tokens", "valid integer"),
    ("chat", {"stream": "yes"}, 400, "stream", "valid boolean"),
    ("chat", {"messages": "hi"}, 400, "messages", "valid list"),
    ("chat", {"messages": []}, 400, "messages", "at least 1"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "input should be"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]", "needs the tool_call_id"),
    ("chat", {"messages": [{"role": "user"}]}, 400, "messages[0]", "content is required"),
    ("chat", {"messages": IMAGE}, 400, "messages[0].content", "'image_url' are not supported (text only)"),
    ("chat", {"model": 5}, 400, "model", "valid string"),
    ("chat", {"n": 0}, 400, "n", "greater than or equal to 1"),
    ("chat", {"n": 129}, 400, "n", "less than or equal to 128"),
    ("chat", {"presence_penalty": 2.5}, 400, "presence_penalty", "less than or equal to 2"),
    ("chat", {"frequency_penalty": -3}, 400, "frequency_penalty", "greater than or equal to -2"),
    ("chat", {"repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    ("chat", {"logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    ("chat", {"logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("chat", {"logit_bias": {"5": "1"}}, 400, "logit_bias.5", "valid number"),
    ("chat", {"top_logprobs": 2}, 400, "top_logprobs", "needs logprobs set to true"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "less than or equal to 20"),
    ("chat", {"logprobs": 1}, 400, "logprobs", "valid boolean"),
    ("chat", {"tools": [{"type": "function"}]}, 400, "tools[0].function", "Field required"),
    ("chat", {"tool_choice": "auto"}, 400, "tool_choice", "only allowed when tools are specified"),
    ("chat", {"stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed when stream"),
    ("chat", {"max_tokens": 101}, 400, "max_tokens", "max_tokens is too large"),
    ("chat", {"max_completion_tokens": 500}, 400, "max_completion_tokens", "too large"),
    ("chat", {"speculation": {"mode": "off", "depth": 3}}, 400, "speculation.depth", "Unrecognized"),
    ("chat", {"speculation": {"max_depth": -1}}, 400, "speculation.max_depth", "greater than or equal to 0"),
    ("chat", {"speculation": {"mode": 5}}, 400, "speculation.mode", "valid string"),
    ("chat", {"speculation": {"mode": "eagle"}}, 400, "speculation.mode", "'draft', 'ngram'"),
    ("chat", {"speculation": "off"}, 400, "speculation", ""),
    ("chat", {"model": "gpt-4"}, 404, "model", "does not exist"),
    ("completions", {"prompt": ["a", ""]}, 400, "prompt", "must not be empty"),
    ("completions", {"prompt": [[1], [-1]]}, 400, "prompt", "token ids must be >= 0"),
    ("completions", {"prompt": ["a"] * 257}, 400, "prompt", "at most 256 prompts"),
    ("completions", {"prompt": ["a", "b", "c"], "n": 100}, 400, "n", "at most 256 choices"),
    ("completions", {"prompt": ""}, 400, "prompt", "must not be empty"),
    ("completions", {"prompt": 5}, 400, "prompt", "a list of token ids"),
    ("completions", {"stop": [""]}, 400, "stop", "non-empty strings"),
    ("completions", {"stop": 3}, 400, "stop", "non-empty string or a list"),
    ("completions", {"logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("completions", {"logprobs": -1}, 400, "logprobs", "greater than or equal to 0"),
    ("completions", {"echo": "yes"}, 400, "echo", "valid boolean"),
    ("completions", {"seed": 2**70}, 400, "seed", "less than or equal"),
]
# fmt: on


@pytest.mark.parametrize(("path", "change", "status", "param", "text"), BAD_REQUESTS)
def test_bad_requests_then_a_good_one(
    http: TestClient, path: str, change: dict, status: int, param: str, text: str
) -> None:
    base, url = (CHAT, "/v1/chat/completions") if path == "chat" else (COMPLETION, "/v1/completions")
    body = {k: v for k, v in {**base, **change}.items() if v is not None}
    error = assert_error(http.post(url, json=body), status, param, text)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert http.post(url, json=base).status_code == 200


def test_malformed_bodies(http: TestClient) -> None:
    url = "/v1/chat/completions"
    assert_error(
        http.post(url, content=b'{"model": ', headers={"content-type": "application/json"}),
        400,
        text="invalid JSON",
    )
    assert_error(
        http.post(url, content=b"[1, 2]", headers={"content-type": "application/json"}),
        400,
        text="JSON object",
    )
    assert_error(
        http.post(url, content=b"", headers={"content-type": "application/json"}), 400, text="missing"
    )
    assert_error(
        http.post(url, content=json.dumps(CHAT), headers={"content-type": "text/plain"}),
        400,
        text="Content-Type",
    )
    assert_error(http.post(url, json={"messages": CHAT["messages"]}), 400, "model", "model: Field required")
    assert http.post(url, content=json.dumps(CHAT)).status_code == 200  # no content type: parsed as JSON


def test_unknown_route_and_method(http: TestClient) -> None:
    error = assert_error(http.post("/v1/nope", json={}), 404, text="Invalid URL (POST /v1/nope)")
    assert error["type"] == "not_found_error"
    r = http.get("/v1/chat/completions")
    assert_error(r, 405, text="not allowed") and "POST" in r.headers["allow"]
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_api_key(engine: FakeEngine) -> None:
    http = TestClient(create_app(engine, ServerSettings(api_key="sk-secret")))
    assert_error(http.post("/v1/chat/completions", json=CHAT), 401, text="didn't provide an API key")
    wrong = {"Authorization": "Bearer sk-wrong"}
    error = assert_error(
        http.post("/v1/chat/completions", json=CHAT, headers=wrong), 401, code="invalid_api_key"
    )
    assert error["type"] == "authentication_error" and "sk-wrong" not in error["message"]
    assert_error(http.get("/v1/models"), 401)
    assert_error(http.get("/v1/nope"), 401)  # the key is checked before the route
    good = {"Authorization": "Bearer sk-secret"}
    assert http.post("/v1/chat/completions", json=CHAT, headers=good).status_code == 200
    assert_error(http.get("/v1/nope", headers=good), 404)
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("status", "kind"), [(400, "invalid_request_error"), (429, "rate_limit_error"), (503, "overloaded_error")]
)
def test_engine_refusal_keeps_its_status(
    http: TestClient, engine: FakeEngine, stream: bool, status: int, kind: str
) -> None:
    engine.chunks = [
        GenerateChunk("", error=GenerateError("prompt too long", kind, "messages", "too_long", status))
    ]
    r = http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    error = assert_error(r, status, "messages", "prompt too long", "too_long")
    assert error["type"] == kind and r.headers["content-type"] == "application/json"
    assert (r.headers.get("retry-after") is not None) == (status != 400)
    assert engine.closed == [engine.requests[0].request_id]
    engine.chunks = script("ok")
    assert http.post("/v1/chat/completions", json={**CHAT, "stream": stream}).status_code == 200


def test_mid_stream_engine_error_becomes_an_error_event(http: TestClient, engine: FakeEngine) -> None:
    engine.chunks = [
        *script("a", "b")[:1],
        GenerateChunk("", error=GenerateError("engine overloaded", "overloaded_error", status=503)),
    ]
    events = sse(http.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert events[1]["choices"][0]["delta"] == {"content": "a"}
    assert events[-2] == {
        "error": {"message": "engine overloaded", "type": "overloaded_error", "param": None, "code": None}
    }


def test_engine_exceptions_are_500s_without_details(http: TestClient, engine: FakeEngine) -> None:
    engine.raise_after = 1
    assert_error(http.post("/v1/chat/completions", json=CHAT), 500, text="server had an error")
    events = sse(http.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert events[-2]["error"]["type"] == "server_error" and "secret" not in json.dumps(events)
    engine.raise_after = None
    engine.chunks = script("a", "b")[:1]  # ends without a final chunk
    assert_error(http.post("/v1/completions", json=COMPLETION), 500, text="ended before")
    engine.info_error, engine.chunks = RuntimeError("not ready"), script("ok")
    http2 = TestClient(create_app(engine, ServerSettings()))
    assert_error(http2.post("/v1/completions", json=COMPLETION), 503, code="engine_unavailable")
    engine.info_error = None
    assert http2.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_aborts_the_engine(engine: FakeEngine, stream: bool) -> None:
    http = TestClient(create_app(engine, ServerSettings(request_timeout_s=0.2)))
    engine.hang_after = 2
    r = http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    if stream:
        assert sse(r)[-2]["error"]["code"] == "timeout"
    else:
        assert_error(r, 504, code="timeout")
    assert engine.aborted == [engine.requests[-1].request_id]


# --- client disconnects: the engine stream is closed (which aborts the request) -------------------------


async def drive(
    engine: FakeEngine, body: dict, asgi_version: str, disconnect_after: int
) -> tuple[list, list]:
    """Run one request against the ASGI app; the client goes away after ``disconnect_after`` body sends."""
    app = create_app(engine, ServerSettings())
    sent: list[dict] = []
    gone = asyncio.Event()
    payload = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set() and asgi_version == "2.4":
            raise OSError("connection lost")  # an ASGI 2.4 server's word for a vanished client
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= disconnect_after:
            gone.set()

    path = "/v1/chat/completions"
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": asgi_version}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    if disconnect_after == 0:
        gone.set()
    async with asyncio.timeout(5):
        await app(scope, receive, send)
    # Checked before the event loop gets a chance to finalize abandoned generators by itself.
    return sent, list(engine.aborted)


@pytest.mark.parametrize("asgi_version", ["2.3", "2.4"])
def test_stream_disconnect_closes_the_engine_stream(engine: FakeEngine, asgi_version: str) -> None:
    engine.hang_after = 2  # the client leaves while the engine is still generating
    sent, aborted = asyncio.run(drive(engine, {**CHAT, "stream": True}, asgi_version, disconnect_after=2))
    assert sent[0]["status"] == 200
    assert aborted == [engine.requests[0].request_id]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_any_output_closes_the_engine_stream(engine: FakeEngine, stream: bool) -> None:
    engine.hang_after = 0  # e.g. queued in the engine when the client gives up
    _, aborted = asyncio.run(drive(engine, {**CHAT, "stream": stream}, "2.3", disconnect_after=0))
    assert aborted == [engine.requests[0].request_id]


def test_testclient_stream_closed_early(http: TestClient, engine: FakeEngine) -> None:
    engine.hang_after = 3
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    deadline = time.monotonic() + 5
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.aborted == [engine.requests[0].request_id]


# --- tracing -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_root_span_and_trace_context(engine: FakeEngine, stream: bool) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    http = TestClient(create_app(engine, ServerSettings(), tracer=provider.get_tracer("test")))
    r = http.post(
        "/v1/chat/completions", json={**CHAT, "stream": stream, "max_tokens": 7, "temperature": 0.5}
    )
    assert r.status_code == 200
    _ = r.text
    (span,) = exporter.get_finished_spans()
    a = span.attributes
    assert span.name == f"chat {MODEL}" and span.parent is None
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"], a["gen_ai.request.max_tokens"]) == (
        "chat",
        MODEL,
        7,
    )
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (0.5, 1.0)
    assert a["gen_ai.response.id"] == engine.requests[0].request_id
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (5, 3)
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
    assert (a["specserve.proposer"], a["specserve.drafted"], a["specserve.accepted"]) == ("draft", 8, 6)
    assert (a["specserve.acceptance_rate"], a["specserve.mean_accepted_length"]) == (0.75, 4.0)
    traceparent = engine.requests[0].trace_context["traceparent"]
    assert traceparent.split("-")[1:3] == [f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"]
    exporter.clear()
    assert http.post("/v1/completions", json={**COMPLETION, "model": "nope"}).status_code == 404
    (span,) = exporter.get_finished_spans()
    assert span.name == "text_completion nope" and span.status.status_code is StatusCode.ERROR


# --- the official openai client against a real server ---------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Any:
    engine = FakeEngine()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(engine, ServerSettings(api_key="sk-test"))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="sk-test", max_retries=0
    )
    yield engine, client
    srv.should_exit = True
    thread.join(10)
    sock.close()


def test_openai_chat(server: Any) -> None:
    engine, client = server
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert (
        response.choices[0].message.content == "Hello, world!" and response.choices[0].finish_reason == "stop"
    )
    assert response.usage.total_tokens == 8 and response.model_extra["speculation"]["accepted"] == 6
    assert engine.requests[-1].sampling.max_tokens == 5


def test_openai_chat_stream(server: Any) -> None:
    _, client = server
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world!"
    final = [c for c in chunks if c.choices][-1]
    assert (
        final.choices[0].finish_reason == "stop" and final.model_extra["speculation"]["proposer"] == "draft"
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_openai_completions(server: Any) -> None:
    engine, client = server
    response = client.completions.create(model=MODEL, prompt="x", extra_body={"speculation": {"mode": "off"}})
    assert response.choices[0].text == "Hello, world!" and response.model_extra["speculation"]["drafted"] == 8
    assert engine.requests[-1].speculation == SpecOverride(mode="off")
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2], stream=True, seed=3))
    assert "".join(c.choices[0].text for c in chunks) == "Hello, world!"
    assert chunks[-1].choices[0].finish_reason == "stop" and engine.requests[-1].sampling.seed == 3


def test_openai_stream_closed_early_aborts(server: Any) -> None:
    engine, client = server
    engine.hang_after = 2
    try:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert next(iter(stream)).choices[0].delta.role == "assistant"
        stream.close()
        deadline = time.monotonic() + 10
        while engine.requests[-1].request_id not in engine.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.requests[-1].request_id in engine.aborted
    finally:
        engine.hang_after = None


def test_openai_errors(server: Any) -> None:
    _, client = server
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=0)
    assert e.value.param == "n"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="sk-bad", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == [MODEL]
