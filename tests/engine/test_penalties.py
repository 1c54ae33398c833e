"""Penalties and logit_bias (``engine.penalties``) on tiny models.

Three levels: ``penalize`` against a naive per-position reference (every verified position counts
the draft tokens before it); plain decoding against a Python loop over transformers' forward with
the penalties applied by hand; and speculation (n-gram, self, draft; depths 1 and 4; greedy and
seeded) against plain decoding, token for token. Logprobs stay the raw distribution.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.penalties import PenaltyState, penalize
from tests.conftest import make_tiny_engine, make_tiny_hf_model

PROMPTS = ["def add(a, b):", "for i in range(10):", "The quick brown fox"]
PENALTIES = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 2.0},
    "negative_frequency": {"frequency_penalty": -1.0},  # rewards repeats: long accepted runs
    "repetition": {"repetition_penalty": 1.8},
    "logit_bias": {"logit_bias": {5: 8.0, 17: -100.0, 40: 3.5}},
    "all": {"presence_penalty": -0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3,
            "logit_bias": {12: 2.0}},
}  # fmt: skip


def reference_penalize(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:  # [V] float32
    """The penalized logits of one position after ``prompt`` and ``output``, written plainly (vLLM)."""
    x = logits.float().clone()
    for token, bias in params.logit_bias:
        x[token] += bias
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.shape[0]).float()
    seen = counts > 0
    if params.repetition_penalty != 1.0:
        seen_any = seen.clone()
        seen_any[torch.tensor(prompt)] = True
        r = params.repetition_penalty
        x = torch.where(seen_any, torch.where(x > 0, x / r, x * r), x)
    x = x - params.frequency_penalty * counts
    return x - params.presence_penalty * seen.float()


def fake_request(params: SamplingParams, prompt: list[int], output: list[int], vocab: int) -> SimpleNamespace:
    state = PenaltyState.for_request(params, prompt, vocab, "cpu")
    return SimpleNamespace(penalties=state, output_ids=output, prompt_ids=prompt, params=params)


@pytest.mark.parametrize("name", list(PENALTIES))
def test_each_position_is_penalized_after_its_own_prefix(name: str) -> None:
    vocab = 50
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, vocab, generator=gen).to(torch.bfloat16)  # [B, 1 + K, V]
    params = SamplingParams(**PENALTIES[name])
    prompts, outputs = [[1, 2, 3], [4, 4], [7]], [[3, 9, 9], [], [1]]
    drafts = [[9, 3, 9, 11], [4], []]
    requests = [fake_request(params, p, o, vocab) for p, o in zip(prompts, outputs, strict=True)]
    requests[2] = SimpleNamespace(penalties=None, output_ids=[1])  # an unpenalized row beside them
    scored = penalize(logits, requests, drafts)
    assert scored.dtype == torch.float32 and logits.dtype == torch.bfloat16  # raw logits untouched
    for b in range(2):
        for j in range(len(drafts[b]) + 1):
            expected = reference_penalize(logits[b, j], params, prompts[b], outputs[b] + drafts[b][:j])
            assert torch.equal(scored[b, j], expected), (b, j)
    assert torch.equal(scored[2], logits[2].float())
    # counts catch up with new output tokens; the next call counts them
    outputs[0].extend([5, 5])
    again = penalize(logits, requests, [[], [], []])
    expected = reference_penalize(logits[0, 0], params, prompts[0], outputs[0])
    assert torch.equal(again[0, 0], expected)


def test_requests_without_penalties_pay_nothing() -> None:
    logits = torch.randn(2, 3, 10)
    assert PenaltyState.for_request(SamplingParams(), [1, 2], 10, "cpu") is None
    requests = [SimpleNamespace(penalties=None, output_ids=[]) for _ in range(2)]
    assert penalize(logits, requests, [[1], [2, 3]]) is logits


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        PenaltyState.for_request(SamplingParams(logit_bias={10: 1.0}), [1], 10, "cpu")
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repetition_penalty": 0.0},
                {"logit_bias": {3: 101.0}}, {"logit_bias": {-1: 1.0}}):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.fixture(scope="module")
def target_hf(tiny_tokenizer):
    return make_tiny_hf_model(len(tiny_tokenizer), seed=0, layers=4)


@pytest.fixture(scope="module")
def engine(target_hf, tiny_tokenizer):
    proposers = {"ngram": {"max_ngram": 3, "min_ngram": 1}, "self": {}, "draft": {}}
    return make_tiny_engine(target_hf, tiny_tokenizer, proposers=proposers, max_depth=8, self_skip=[1])


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.mark.parametrize("name", ["presence", "frequency", "repetition", "logit_bias", "all"])
def test_plain_decoding_equals_a_reference_loop_over_transformers(engine, target_hf, prompts, name) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **PENALTIES[name])
    (result,) = engine.generate(prompts[:1], params, SpecOverride("off"))
    output: list[int] = []
    with torch.no_grad():
        for _ in range(8):
            logits = target_hf(torch.tensor([prompts[0] + output])).logits[0, -1]
            output.append(int(reference_penalize(logits, params, prompts[0], output).argmax()))
    assert result.token_ids == output
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (unpenalized,) = engine.generate(prompts[:1], plain)
    assert unpenalized.token_ids != output  # the penalty changed something


@pytest.mark.parametrize("name", list(PENALTIES))
def test_speculation_equals_plain_decoding(engine, prompts, name) -> None:
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **PENALTIES[name]),
        SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True, **PENALTIES[name]),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),  # unpenalized, same batch
    ]
    plain = [r.token_ids for r in engine.generate(prompts, params, SpecOverride("off"))]
    accepted = 0
    for mode in ("ngram", "self", "draft"):
        for depth in (1, 4):
            results = engine.generate(prompts, params, SpecOverride(mode, depth))
            assert [r.token_ids for r in results] == plain, (mode, depth)
            accepted += sum(r.spec_stats.accepted for r in results[:2])
    assert accepted > 0  # penalized positions inside accepted drafts were verified


def test_speculation_equals_plain_decoding_in_bfloat16(target_hf, tiny_tokenizer, prompts) -> None:
    proposers = {"ngram": {"max_ngram": 3, "min_ngram": 1}, "self": {}}
    engine = make_tiny_engine(target_hf, tiny_tokenizer, proposers=proposers, max_depth=8, self_skip=[1],
                              dtype=torch.bfloat16)  # fmt: skip
    assert engine.exact
    params = [SamplingParams(max_tokens=16, temperature=t, seed=5, ignore_eos=True, **PENALTIES["all"])
              for t in (0.0, 0.8)]  # fmt: skip
    plain = [r.token_ids for r in engine.generate(prompts[:2], params, SpecOverride("off"))]
    for mode in ("ngram", "self"):
        for depth in (1, 4):
            results = engine.generate(prompts[:2], params, SpecOverride(mode, depth))
            assert [r.token_ids for r in results] == plain, (mode, depth)


def test_a_huge_bias_forces_a_token_and_logprobs_stay_raw(engine, target_hf, prompts) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={7: 100.0}, logprobs=1)
    (result,) = engine.generate(prompts[:1], params, SpecOverride("ngram", 4))
    assert result.token_ids == [7] * 6
    with torch.no_grad():
        logits = target_hf(torch.tensor([prompts[0] + result.token_ids])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)[len(prompts[0]) - 1 : -1, 7]  # unbiased log p(7)
    torch.testing.assert_close(torch.tensor(result.logprobs.logprobs), raw, atol=1e-4, rtol=0)
    assert max(result.logprobs.logprobs) < -0.1  # far from the biased distribution's ~0
