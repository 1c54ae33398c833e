"""The HTTP layer beside generation, on the fake engine of ``test_api``: unknown request fields,
max_tokens left to the replica, and the tokenizer routes (/tokenize, /detokenize, /version)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from serve_app.api import create_app
from serve_app.config import ServerSettings
from tests.serve.fake_engine import CHAT, COMPLETION, MODEL, FakeEngine, assert_error, engine, http

__all__ = ["engine", "http"]  # fixtures used below


def test_unknown_fields_are_ignored_and_logged_once_per_name(
    http: TestClient, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """As vLLM and SGLang: client extras (LangChain, LiteLLM, chat_template_kwargs) do not break a
    request; each field name is logged once."""
    extras = {"chat_template_kwargs": {"enable_thinking": False}, "foo": 1}
    with caplog.at_level("WARNING", logger="serve_app.api.routes"):
        for _ in range(2):
            r = http.post("/v1/chat/completions", json={**CHAT, **extras})
            assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={**COMPLETION, "foo": 2})
        assert r.status_code == 200, r.text
    logged = [rec.getMessage() for rec in caplog.records if "unknown request field" in rec.getMessage()]
    assert sorted(logged) == sorted(
        f"ignoring unknown request field {n!r} (server.strict_requests refuses them)" for n in sorted(extras)
    )
    assert len(engine.requests) == 3
    # our own extension block stays strict
    r = http.post("/v1/chat/completions", json={**CHAT, "speculation": {"mode": "off", "depth": 3}})
    assert_error(r, 400, "speculation.depth", "Unrecognized")


def test_strict_requests_refuse_unknown_fields(engine: FakeEngine) -> None:
    http = TestClient(create_app(engine, ServerSettings(strict_requests=True)), raise_server_exceptions=False)
    r = http.post("/v1/chat/completions", json={**CHAT, "foo": 1, "bar": 2})
    assert_error(r, 400, "bar", "Unrecognized request argument supplied: bar")
    assert engine.requests == []
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_max_tokens_absent_is_fitted_by_the_replica(http: TestClient, engine: FakeEngine) -> None:
    """No max_tokens: bounded by sampling.max_tokens (info.default_max_tokens) or the limit, then
    fitted to the context left after the prompt by the replica (``fit_max_tokens``)."""
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    greq = engine.requests[-1]
    assert greq.fit_max_tokens and greq.sampling.max_tokens == 100  # FakeEngine's limit
    assert http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 7}).status_code == 200
    assert not engine.requests[-1].fit_max_tokens and engine.requests[-1].sampling.max_tokens == 7
    engine.info_ = replace(engine.info_, default_max_tokens=30)
    fresh = TestClient(create_app(engine, ServerSettings(max_tokens_limit=20)))  # info is asked once
    assert fresh.post("/v1/completions", json=COMPLETION).status_code == 200
    assert engine.requests[-1].fit_max_tokens and engine.requests[-1].sampling.max_tokens == 20
    assert fresh.post("/v1/completions", json={**COMPLETION, "max_tokens": 21}).status_code == 400


def test_tokenize_detokenize_and_version(http: TestClient, engine: FakeEngine) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "abc"})
    assert r.status_code == 200 and r.json() == {"count": 3, "max_model_len": 512, "tokens": [97, 98, 99]}
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    r = http.post("/tokenize", json={"messages": messages})  # model is optional
    assert r.status_code == 200 and r.json()["count"] == len("system: be brief\nuser: hi\n")
    assert engine.tokenized[-1] == (
        None,
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    )
    assert_error(http.post("/tokenize", json={"prompt": "a", "messages": messages}), 400, "prompt", "either")
    assert_error(http.post("/tokenize", json={}), 400, "prompt", "either")
    assert_error(http.post("/tokenize", json={"prompt": "a", "bogus": 1}), 400, "bogus", "Unrecognized")
    assert_error(
        http.post("/tokenize", json={"model": "gpt-4", "prompt": "a"}), 404, "model", "does not exist"
    )
    r = http.post("/detokenize", json={"model": MODEL, "tokens": [104, 105]})
    assert r.status_code == 200 and r.json() == {"prompt": "hi"}
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens", "token ids must be in")
    assert_error(http.post("/detokenize", json={"tokens": "hi"}), 400, "tokens", "valid list")
    version = http.get("/version").json()["version"]
    assert isinstance(version, str) and version
