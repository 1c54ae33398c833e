"""The OpenAI-compatible HTTP layer in isolation, over a fake engine (end to end with Ray: elsewhere):
the happy paths (errors, disconnects, tracing and the official client: the ``test_api_*`` files)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from fastapi.testclient import TestClient

from serve_app.engine.params import SpecOverride
from tests.serve.fake_engine import (
    CHAT,
    COMPLETION,
    MODEL,
    SPEC,
    FakeEngine,
    assert_error,
    engine,
    http,
    script,
    sse,
)

__all__ = ["engine", "http"]  # fixtures used below


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
