"""Penalties, logit_bias, ``n`` and prompt batches end to end: the real Ray Serve application on the
real SmolLM2-135M pack, the official ``openai`` client, real HTTP.

SmolLM2 drafts for itself (static policy: every "auto" request drafts 4 tokens) in float32, so
penalized positions inside accepted drafts are verified; every choice must be the one plain
decoding (``"speculation": {"mode": "off"}``) returns, streamed or not, and each choice of a
seeded ``n`` request or of a prompt batch must be what that prompt and seed give alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from ray import serve

from serve_app.app import build_app

APP = "specserve-penalties-e2e"
MODEL = "smollm2-penalties"
MESSAGES = [{"role": "user", "content": "List five fruits, one per line."}]
OFF = {"mode": "off"}
PENALTIES = {"presence_penalty": 0.6, "frequency_penalty": 0.8, "logit_bias": {"28": 2.5}}


@pytest.fixture(scope="module")
def client(smollm2_path, serve_http: str) -> Iterator[openai.OpenAI]:
    """The application, deployed once for the module (the pack first: no Ray when it is missing)."""
    pack = str(smollm2_path)
    args = {
        "model": {"target": pack, "draft": pack},
        "runtime": {"dtype": "float32", "threads": 2},
        "cache": {"max_slots": 4, "max_seq_len": 512},
        "speculation": {"method": "draft", "depth": 4, "policy": "static",
                        "proposers": {"draft": {"int8": False}}},
        "server": {"served_model_name": MODEL, "max_tokens_limit": 128},
        "autoscaling": {"replica_num_cpus": 1, "max_queued_requests": 8},
    }  # fmt: skip
    serve.run(build_app(args), name=APP, route_prefix="/")
    try:
        yield openai.OpenAI(base_url=f"{serve_http}/v1", api_key="unused", max_retries=0, timeout=180)
    finally:
        serve.delete(APP)


def chat(
    client: openai.OpenAI, speculation: dict, stream: bool, **kwargs: Any
) -> tuple[dict[int, str], dict]:
    """Each choice's text by index, and the speculation block."""
    extra = {"speculation": speculation, "repetition_penalty": 1.2}
    params = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "extra_body": extra, **kwargs}
    if not stream:
        response = client.chat.completions.create(**params)
        return {c.index: c.message.content for c in response.choices}, response.model_extra["speculation"]
    texts: dict[int, str] = {}
    block: dict = {}
    for chunk in client.chat.completions.create(stream=True, **params):
        block = (chunk.model_extra or {}).get("speculation") or block
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts, block


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_penalized_n_choices_are_identical_with_speculation_on_and_off(client: openai.OpenAI) -> None:
    sampling = {"temperature": 0.8, "seed": 21, "n": 2, **PENALTIES}
    plain, block = chat(client, OFF, False, **sampling)
    assert sorted(plain) == [0, 1] and block["drafted"] == 0
    for stream in (False, True):
        texts, block = chat(client, {"mode": "auto"}, stream, **sampling)
        assert texts == plain and block["accepted"] > 0, stream
    alone, _ = chat(client, OFF, False, **{**sampling, "n": 1, "seed": 22})
    assert alone == {0: plain[1]}  # choice 1 is the request seeded seed + 1
    greedy, _ = chat(client, {"mode": "auto"}, True, temperature=0.0, **PENALTIES)
    assert greedy == chat(client, OFF, False, temperature=0.0, **PENALTIES)[0]


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_a_prompt_batch_answers_each_prompt(client: openai.OpenAI) -> None:
    prompts = ["def fibonacci(n):", "The capital of France is"]
    params = {"model": MODEL, "max_tokens": 12, "temperature": 0.0, "frequency_penalty": 1.0}
    batch = client.completions.create(prompt=prompts, **params)
    assert [c.index for c in batch.choices] == [0, 1]
    for prompt, choice in zip(prompts, batch.choices, strict=True):
        alone = client.completions.create(prompt=prompt, **params, extra_body={"speculation": OFF})
        assert choice.text == alone.choices[0].text
