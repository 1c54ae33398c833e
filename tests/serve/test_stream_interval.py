"""``server.stream_interval``: chunks of at least that many tokens after the first, the same tokens
and text as chunks of one step each (tiny random model, no Ray)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from serve_app.async_engine import AsyncEngine
from serve_app.config import Settings
from serve_app.engine.params import SamplingParams
from tests.serve.test_async_engine import collect, make_async, make_engine, request, target_hf

__all__ = ["make_async", "target_hf"]  # fixtures used below

PLAIN = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("spec", [False, True])
def test_chunks_hold_the_interval_and_lose_nothing(make_async, target_hf, tiny_tokenizer, spec) -> None:
    every = make_async(make_engine(target_hf, tiny_tokenizer, spec=spec))
    held = make_async(make_engine(target_hf, tiny_tokenizer, spec=spec), stream_interval=4)
    prompt = "def add(a, b):"
    one = asyncio.run(collect(every, request("one", prompt, PLAIN)))
    four = asyncio.run(collect(held, request("four", prompt, PLAIN)))
    tokens = [len(c.token_ids) for c in four]
    assert tokens[0] >= 1  # the first output goes at once (time to first token)
    assert all(n >= 4 for n in tokens[1:-1]), tokens  # then chunks of at least 4 tokens
    assert len(four) <= 2 + (PLAIN.max_tokens - tokens[0]) // 4
    assert [t for c in four for t in c.token_ids] == [t for c in one for t in c.token_ids]
    assert "".join(c.text for c in four) == "".join(c.text for c in one)
    assert four[-1].finished and four[-1].finish_reason == "length" and four[-1].completion_tokens == 17
    if not spec:  # plain decoding makes a token a step: every step its own chunk at interval 1
        assert len(one) > len(four)
    assert held.stats()["streams"] == 0 and held.is_healthy()


def test_an_interval_below_one_is_refused(target_hf, tiny_tokenizer) -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncEngine(make_engine(target_hf, tiny_tokenizer), model_name="tiny", stream_interval=0)
    with pytest.raises(ValidationError, match="stream_interval"):
        Settings(server={"stream_interval": 0})
    assert Settings().server.stream_interval == 1  # every step's tokens at once by default
