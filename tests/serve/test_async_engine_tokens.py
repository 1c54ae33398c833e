"""AsyncEngine's token accounting: requests without max_tokens fitted to the context, and the
tokenize / detokenize calls behind the API's /tokenize and /detokenize (tiny random model, no Ray)."""

from __future__ import annotations

import asyncio

from serve_app.engine.params import SamplingParams
from tests.serve.test_async_engine import MAX_SEQ_LEN, collect, make_async, make_engine, request, target_hf

__all__ = ["make_async", "target_hf"]  # fixtures used below


def test_a_request_without_max_tokens_runs_to_the_end_of_the_context(make_async, tiny_tokenizer) -> None:
    """vLLM's default: the ingress bounds it, the replica fits it to the prompt it tokenized."""
    engine = make_async(max_tokens_limit=None)
    prompt = "def add(a, b):"
    room = MAX_SEQ_LEN - len(tiny_tokenizer(prompt)["input_ids"])
    unbounded = SamplingParams(max_tokens=MAX_SEQ_LEN, temperature=0.0, ignore_eos=True)
    chunks = asyncio.run(collect(engine, request("fit", prompt, unbounded, fit_max_tokens=True)))
    assert chunks[-1].error is None and chunks[-1].finish_reason == "length"
    assert chunks[-1].completion_tokens == room
    bounded = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)  # sampling.max_tokens: 5
    chunks = asyncio.run(collect(engine, request("bounded", prompt, bounded, fit_max_tokens=True)))
    assert chunks[-1].completion_tokens == 5
    # a prompt that fills the context leaves no room: a 400 naming it, nothing leaked
    chunks = asyncio.run(collect(engine, request("full", list(range(1, MAX_SEQ_LEN + 1)), unbounded,
                                                 fit_max_tokens=True)))  # fmt: skip
    assert chunks[-1].error is not None and chunks[-1].error.status == 400
    assert "leaves no room" in chunks[-1].error.message
    assert engine.stats()["streams"] == 0 and engine.is_healthy()


def test_tokenize_and_detokenize_as_requests_count(make_async, target_hf, tiny_tokenizer) -> None:
    sync = make_engine(target_hf, tiny_tokenizer)
    engine = make_async(sync)
    messages = [{"role": "user", "content": "hi there"}]
    got = asyncio.run(engine.tokenize(prompt="def add(a, b):"))
    assert got.error is None and got.token_ids == sync.encode_prompt("def add(a, b):")
    got = asyncio.run(engine.tokenize(messages=messages))
    assert got.error is None and got.token_ids == sync.encode_messages(messages)
    text = asyncio.run(engine.detokenize(got.token_ids))
    assert text.error is None and "hi there" in text.text
    for bad in (asyncio.run(engine.tokenize()), asyncio.run(engine.tokenize("x", messages))):
        assert bad.error is not None and bad.error.status == 400 and "either" in bad.error.message
    bad = asyncio.run(engine.detokenize([len(tiny_tokenizer) + 5]))
    assert bad.error is not None and bad.error.status == 400 and bad.error.param == "tokens"
