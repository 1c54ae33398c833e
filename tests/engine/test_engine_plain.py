"""Plain decoding through the engine: batching never changes a request's output."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.engine import SpecEngine
from serve_app.engine.params import SamplingParams
from serve_app.engine.scheduler import QueueFullError
from tests.conftest import make_tiny_engine, make_tiny_hf_model

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    '{"name": "specserve", "tags": [',
    "for i in range(10):\n    print(i",
    "The dog",
    "x",
]


@pytest.fixture(scope="module")
def hf_model(tiny_tokenizer):
    return make_tiny_hf_model(len(tiny_tokenizer))


def make_engine(hf_model, tokenizer, slots: int = 8, max_waiting: int = 64) -> SpecEngine:
    return make_tiny_engine(hf_model, tokenizer, slots=slots, max_seq_len=256, max_waiting=max_waiting)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def test_greedy_batch_equals_single_and_transformers(hf_model, tiny_tokenizer) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    batched = make_engine(hf_model, tiny_tokenizer).generate(prompts, params)
    for prompt, result in zip(prompts, batched, strict=True):
        alone = make_engine(hf_model, tiny_tokenizer).generate([prompt], params)[0]
        assert result.token_ids == alone.token_ids
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert result.token_ids == ref[0, len(prompt) :].tolist()
        assert result.finish_reason == "length"
        assert len(result.token_ids) == 24


def test_requests_joining_and_finishing_mid_batch(hf_model, tiny_tokenizer) -> None:
    """Two slots, six requests of different lengths: queued ones join as others finish."""
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=4 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    engine = make_engine(hf_model, tiny_tokenizer, slots=2)
    results = engine.generate(prompts, params)
    assert engine.cache.num_free == 2
    for prompt, p, result in zip(prompts, params, results, strict=True):
        alone = make_engine(hf_model, tiny_tokenizer).generate([prompt], p)[0]
        assert result.token_ids == alone.token_ids
        assert len(result.token_ids) == p.max_tokens


def test_seeded_sampling_is_reproducible_and_batch_invariant(hf_model, tiny_tokenizer) -> None:
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS[:4]]
    params = [
        SamplingParams(max_tokens=16, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
        for t, k, p, s in [(1.0, 0, 1.0, 1), (0.7, 20, 1.0, 2), (1.3, 0, 0.9, 3), (0.0, 0, 1.0, None)]
    ]
    together = make_engine(hf_model, tiny_tokenizer).generate(prompts, params)
    again = make_engine(hf_model, tiny_tokenizer).generate(prompts, params)
    assert [r.token_ids for r in together] == [r.token_ids for r in again]
    for prompt, p, result in zip(prompts, params, together, strict=True):
        assert make_engine(hf_model, tiny_tokenizer).generate([prompt], p)[0].token_ids == result.token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    assert make_engine(hf_model, tiny_tokenizer).generate([prompts[0]], other_seed)[0].token_ids != (
        together[0].token_ids
    )


def test_stop_string_eos_and_text(hf_model, tiny_tokenizer) -> None:
    engine = make_engine(hf_model, tiny_tokenizer)
    prompt = encode(tiny_tokenizer, PROMPTS[0])
    full = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert full.text == tiny_tokenizer.decode(full.token_ids, skip_special_tokens=True)
    # Choose a stop string from the middle of the output: the text is cut right before it and the
    # tokens end with the one that completed it.
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), full.text
    cut = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert stop in tiny_tokenizer.decode(cut.token_ids)
    assert stop not in tiny_tokenizer.decode(cut.token_ids[:-1])
    # A stop token id ends the request on that token.
    third = full.token_ids[2]
    ended = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(third,)))
    assert ended[0].token_ids == full.token_ids[: full.token_ids.index(third) + 1]
    assert ended[0].finish_reason == "stop"


def test_chat_prompt_uses_template(hf_model, tiny_tokenizer) -> None:
    engine = make_engine(hf_model, tiny_tokenizer)
    ids = engine.encode_prompt("hello", chat=True)
    assert tiny_tokenizer.decode(ids) == "user: hello\nassistant: "


def test_bad_input_is_refused_and_leaks_nothing(hf_model, tiny_tokenizer) -> None:
    engine = make_engine(hf_model, tiny_tokenizer, slots=1, max_waiting=1)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([10**6], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the maximum sequence length"):
        engine.add_request([1] * 200, SamplingParams(max_tokens=100))
    engine.add_request([1, 2], SamplingParams(max_tokens=50), request_id="a")
    with pytest.raises(QueueFullError):
        engine.add_request([1, 2], SamplingParams(max_tokens=5))
    engine.step()  # "a" is admitted and running
    engine.add_request([1, 2], SamplingParams(max_tokens=5), request_id="b")  # waits
    engine.abort("a")
    engine.abort("b")
    assert engine.cache.num_free == 1 and not engine.has_work()


def test_stream_aborts_when_consumer_stops(hf_model, tiny_tokenizer) -> None:
    engine = make_engine(hf_model, tiny_tokenizer, slots=1)
    stream = engine.stream([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()  # the client went away
    assert engine.cache.num_free == 1 and not engine.has_work()
