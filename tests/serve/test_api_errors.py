"""The HTTP layer's errors over the fake engine: bad requests, malformed bodies, the API key, engine
refusals and failures (the OpenAI error shape, nothing internal leaked), timeouts."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from serve_app.api import create_app
from serve_app.config import ServerSettings
from serve_app.wire import GenerateChunk, GenerateError
from tests.serve.fake_engine import (
    CHAT,
    COMPLETION,
    FakeEngine,
    assert_error,
    engine,
    http,
    script,
    sse,
)

__all__ = ["engine", "http"]  # fixtures used below


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
