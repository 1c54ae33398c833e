"""The official ``openai`` client against a real uvicorn server over the fake engine."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from serve_app.api import create_app
from serve_app.config import ServerSettings
from serve_app.engine.params import SpecOverride
from tests.serve.fake_engine import MODEL, FakeEngine, serving

# --- the official openai client against a real server ---------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Any:
    engine = FakeEngine()
    with serving(create_app(engine, ServerSettings(api_key="sk-test")), api_key="sk-test") as client:
        yield engine, client


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
