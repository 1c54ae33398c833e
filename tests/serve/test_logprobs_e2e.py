"""Logprobs end to end: the real Ray Serve application on the real SmolLM2-135M pack, the official
``openai`` client, real HTTP.

SmolLM2 drafts for itself (static policy: every "auto" request drafts 4 tokens, nearly all
accepted), in float32, so the verify forward scores several positions per step; the logprobs that
come back must be the very ones plain decoding returns (``"speculation": {"mode": "off"}``),
streamed or not, greedy or seeded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from ray import serve

from serve_app.app import build_app

APP = "specserve-logprobs-e2e"
MODEL = "smollm2-logprobs"
MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
OFF = {"speculation": {"mode": "off"}}


@pytest.fixture(scope="module")
def client(smollm2_path, serve_http: str) -> Iterator[openai.OpenAI]:
    """The application, deployed once for the module (the pack first: no Ray when it is missing)."""
    pack = str(smollm2_path)
    args = {
        "model": {"target": pack, "draft": pack},
        "runtime": {"dtype": "float32", "threads": 2},
        "cache": {"max_slots": 2, "max_seq_len": 512},
        "speculation": {
            "method": "draft",
            "depth": 4,
            "policy": "static",
            "proposers": {"draft": {"int8": False}},
        },
        "server": {"served_model_name": MODEL, "max_tokens_limit": 128},
        "autoscaling": {"replica_num_cpus": 1, "max_queued_requests": 8},
    }
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield openai.OpenAI(base_url=f"{serve_http}/v1", api_key="unused", max_retries=0, timeout=180)
    finally:
        serve.delete(APP)


def chat(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str, list[dict], dict]:
    """Text, logprobs content (as dicts) and speculation block of a chat asking for 5 alternatives."""
    params = {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, "logprobs": True, "top_logprobs": 5}
    params.update(kwargs)
    if not stream:
        response = client.chat.completions.create(**params)
        choice = response.choices[0]
        content = [e.model_dump() for e in choice.logprobs.content]
        return choice.message.content, content, response.model_extra["speculation"]
    text, content, block = "", [], {}
    for chunk in client.chat.completions.create(stream=True, **params):
        block = (chunk.model_extra or {}).get("speculation") or block
        for choice in chunk.choices:
            text += choice.delta.content or ""
            content.extend(e.model_dump() for e in (choice.logprobs.content if choice.logprobs else []))
    return text, content, block


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "seed": 5}],
    ids=["greedy", "seeded"],
)
def test_chat_logprobs_are_the_same_with_speculation_on_and_off(
    client: openai.OpenAI, sampling: dict
) -> None:
    text, plain, block = chat(client, False, extra_body=OFF, **sampling)
    assert block["drafted"] == 0 and plain and all(len(e["top_logprobs"]) == 5 for e in plain)
    joined = b"".join(bytes(e["bytes"]) for e in plain)
    assert joined.startswith(text.encode())  # the tokens' bytes spell the text (then EOS, if it ended so)
    if sampling["temperature"] == 0.0:  # greedy: each token is its position's most likely one
        assert all(e["top_logprobs"][0]["token"] == e["token"] for e in plain)
    for stream in (False, True):
        spec_text, content, block = chat(client, stream, **sampling)
        assert block["drafted"] > 0 and block["accepted"] > 0
        assert (spec_text, content) == (text, plain)  # floats through JSON: equal iff identical
    assert chat(client, True, extra_body=OFF, **sampling)[:2] == (text, plain)


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_completion_echo_with_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = "def fibonacci(n):"
    params = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0.0,
        "logprobs": 2,
        "echo": True,
    }
    plain = client.completions.create(**params, extra_body=OFF)
    choice = plain.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    n_prompt = plain.usage.prompt_tokens
    assert len(logprobs.tokens) == n_prompt + plain.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens[:n_prompt]) == prompt
    assert logprobs.text_offset[n_prompt] == len(prompt)
    spec = client.completions.create(**params)
    assert spec.model_extra["speculation"]["drafted"] > 0
    assert (spec.choices[0].text, spec.choices[0].logprobs) == (choice.text, logprobs)
    text, columns = "", {}
    for chunk in client.completions.create(**params, stream=True):
        text += chunk.choices[0].text
        for key, values in (
            chunk.choices[0].logprobs.model_dump() if chunk.choices[0].logprobs else {}
        ).items():
            columns.setdefault(key, []).extend(values)
    assert (text, columns) == (choice.text, logprobs.model_dump())
