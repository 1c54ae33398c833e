"""Penalties, logit_bias, ``n`` and prompt batches with the official ``openai`` client against a real
local server over a real (tiny) engine: penalized output is identical with speculation on and off
(greedy and seeded, streamed and not), a huge bias forces its token, ``n`` seeded choices are
reproducible (choice j is the request seeded ``seed + j``), and a batch's choices are its prompts'
own answers in OpenAI's order."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.serve.test_api_logprobs import SPECULATION, tiny_client

__all__ = ["tiny_client"]  # the fixture used below

PENALTIES = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"extra_body": {"repetition_penalty": 1.8}},
    {"logit_bias": {"40": 6.0, "41": -100}, "presence_penalty": -0.5},
]
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def chat(client: openai.OpenAI, speculation: dict, stream: bool, **kwargs: Any) -> dict[int, str]:
    """Each choice's text (by index), streamed or not."""
    extra = {"speculation": speculation, "ignore_eos": True, **kwargs.pop("extra_body", {})}
    params = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "extra_body": extra, **kwargs}
    if not stream:
        response = client.chat.completions.create(**params)
        return {c.index: c.message.content for c in response.choices}
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **params):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts


@pytest.mark.parametrize("penalty", PENALTIES, ids=["presence", "frequency", "repetition", "logit_bias"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 11}],
                         ids=["greedy", "seeded"])  # fmt: skip
def test_penalized_output_is_identical_with_speculation_on_and_off(
    tiny_client: openai.OpenAI, penalty: dict, sampling: dict
) -> None:
    plain = chat(tiny_client, SPECULATION[0], False, **sampling, **penalty)
    if "temperature" in sampling and sampling["temperature"] == 0.0:
        assert plain != chat(tiny_client, SPECULATION[0], False, **sampling)  # the penalty did something
    for speculation in SPECULATION:
        for stream in (False, True):
            assert chat(tiny_client, speculation, stream, **sampling, **penalty) == plain, (
                speculation,
                stream,
            )


def test_a_huge_logit_bias_forces_a_token(tiny_client: openai.OpenAI, tiny_tokenizer) -> None:
    token = tiny_tokenizer("fox")["input_ids"][-1]
    for speculation in ({"mode": "off"}, {"mode": "ngram", "max_depth": 4}):
        response = tiny_client.completions.create(
            model="tiny", prompt="The quick brown", max_tokens=8, temperature=0.0,
            logit_bias={str(token): 100}, extra_body={"speculation": speculation, "ignore_eos": True},
        )  # fmt: skip
        assert response.choices[0].text == tiny_tokenizer.decode([token] * 8)
    with pytest.raises(openai.BadRequestError) as e:  # outside the vocabulary: the replica refuses
        tiny_client.completions.create(model="tiny", prompt="x", max_tokens=2, logit_bias={"100000": 1})
    assert "logit_bias" in str(e.value)


@pytest.mark.parametrize("stream", [False, True])
def test_n_seeded_choices_are_reproducible(tiny_client: openai.OpenAI, stream: bool) -> None:
    sampling = {"temperature": 1.0, "seed": 7}
    three = chat(tiny_client, {"mode": "self", "max_depth": 4}, stream, n=3, **sampling)
    assert sorted(three) == [0, 1, 2] and len(set(three.values())) > 1  # independent samples
    assert chat(tiny_client, {"mode": "off"}, not stream, n=3, **sampling) == three  # reproducible
    for j in range(3):  # choice j is the request seeded seed + j
        assert chat(tiny_client, {"mode": "off"}, False, temperature=1.0, seed=7 + j) == {0: three[j]}
    response = tiny_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, n=3, extra_body={"ignore_eos": True}, **sampling
    )
    assert response.usage.completion_tokens == 48 and response.usage.prompt_tokens < 48  # prompt once


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_batch_answers_each_prompt_in_order(
    tiny_client: openai.OpenAI, tiny_tokenizer, stream: bool
) -> None:
    prompts = ["for i in range(10):", tiny_tokenizer("The quick brown fox")["input_ids"]]
    extra = {"ignore_eos": True, "speculation": {"mode": "ngram", "max_depth": 4}}
    params = {"model": "tiny", "max_tokens": 8, "temperature": 0.8, "seed": 3, "extra_body": extra}
    texts: dict[int, str] = {}
    if stream:
        for chunk in tiny_client.completions.create(prompt=prompts, n=2, stream=True, **params):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
    else:
        response = tiny_client.completions.create(prompt=prompts, n=2, **params)
        texts = {c.index: c.text for c in response.choices}
        assert response.usage.completion_tokens == 32
    alone = []
    for prompt in prompts:
        for j in range(2):
            one = tiny_client.completions.create(prompt=prompt, **{**params, "seed": 3 + j})
            alone.append(one.choices[0].text)
    assert [texts[i] for i in range(4)] == alone  # prompt-major: index = prompt * n + j
