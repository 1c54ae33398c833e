"""Logprobs (OpenAI's ``logprobs`` / ``top_logprobs`` / ``echo``) on tiny models.

The values must be the target's: ``log_softmax`` of its raw logits (checked against transformers'
forward of the whole sequence), and with speculation on they must be IDENTICAL to speculation off,
bit for bit, for every proposer and depth (the verify forward's rows are plain decoding's rows).
"""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.logprobs import TokenPieces
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.token_logprobs import MAX_LOGPROBS, LogprobRun
from tests.conftest import make_tiny_engine, make_tiny_hf_model
from tests.engine.quantized_helpers import require_built_kernels

PROMPTS = ["def add(a, b):", "for i in range(10):", "The quick brown fox"]
NGRAM = {"max_ngram": 3, "min_ngram": 1}
# Greedy with alternatives, seeded sampling with only the chosen token's logprob, a request asking
# for nothing beside them (it must get None and cost nothing), a sampled one whose max_tokens cuts
# an accepted run short, and one with the prompt's logprobs (echo).
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=5),
    SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True, logprobs=0),
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=11, temperature=0.7, top_p=0.9, seed=9, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=MAX_LOGPROBS, prompt_logprobs=3),
]


@pytest.fixture(scope="module")
def target_hf(tiny_tokenizer):
    return make_tiny_hf_model(len(tiny_tokenizer), seed=0, layers=4)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    ids = [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]
    return [*ids, ids[0] + ids[1], ids[2] + ids[0]]  # five prompts for the five parameter sets


def engine_for(target_hf, tokenizer, dtype: torch.dtype = torch.float32):
    """n-gram, self-speculation and the target as its own draft (everything accepted) in one engine."""
    proposers = {"ngram": NGRAM, "self": {}, "draft": {}}
    return make_tiny_engine(target_hf, tokenizer, proposers=proposers, max_depth=8, self_skip=[1],
                            dtype=dtype)  # fmt: skip


@pytest.fixture(scope="module")
def engine(target_hf, tiny_tokenizer):
    return engine_for(target_hf, tiny_tokenizer)


def assert_identical(a: LogprobRun | None, b: LogprobRun | None) -> None:
    """Bit for bit: Python floats made from the same float32 compare equal only when identical."""
    assert a is not None and b is not None
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs
    assert a.top_ids == b.top_ids and a.top_logprobs == b.top_logprobs
    assert a.pieces == b.pieces


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_speculation_returns_the_logprobs_of_plain_decoding(
    target_hf, tiny_tokenizer, prompts, dtype
) -> None:
    engine = engine_for(target_hf, tiny_tokenizer, dtype)
    assert engine.exact
    plain = engine.generate(prompts, PARAMS, SpecOverride("off"))
    for result, params in zip(plain, PARAMS, strict=True):
        if params.logprobs is None:
            assert result.logprobs is None and result.prompt_logprobs is None
            continue
        assert result.logprobs.token_ids == result.token_ids  # one entry per token, after any cut
        assert all(len(top) == params.logprobs for top in result.logprobs.top_ids)
    accepted: dict[str, int] = {}
    for mode in ("ngram", "self", "draft"):
        for depth in (1, 4):
            spec = engine.generate(prompts, PARAMS, SpecOverride(mode, depth))
            for s, p, params in zip(spec, plain, PARAMS, strict=True):
                assert s.token_ids == p.token_ids
                if params.logprobs is not None:
                    assert_identical(s.logprobs, p.logprobs)
                if params.prompt_logprobs is not None:
                    assert_identical(s.prompt_logprobs, p.prompt_logprobs)
                accepted[mode] = accepted.get(mode, 0) + s.spec_stats.accepted
    assert all(accepted.values()), accepted  # every proposer had drafts verified and kept


def test_values_are_the_log_softmax_of_the_targets_logits(engine, target_hf, prompts) -> None:
    """Against transformers' forward of prompt + output, one pass: the raw distribution (no
    temperature / top-p, even for sampled requests), full vocabulary, float32."""
    results = engine.generate(prompts, PARAMS, SpecOverride("draft", 4))
    for prompt, result, params in zip(prompts, results, PARAMS, strict=True):
        if params.logprobs is None:
            continue
        sequence = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(target_hf(sequence).logits[0].float(), dim=-1)  # [P + n, V]
        generated = logp[len(prompt) - 1 : -1]  # [n, V]: position i scores output token i
        chosen = generated.gather(1, torch.tensor(result.token_ids).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(result.logprobs.logprobs), chosen, atol=1e-4, rtol=0)
        if params.logprobs:
            best = generated.topk(params.logprobs, dim=-1)
            assert result.logprobs.top_ids == best.indices.tolist()
            torch.testing.assert_close(
                torch.tensor(result.logprobs.top_logprobs), best.values, atol=1e-4, rtol=0
            )
        if params.prompt_logprobs is not None:
            run = result.prompt_logprobs
            assert run.token_ids == prompt and run.logprobs[0] is None and run.top_ids[0] == []
            scored = logp[: len(prompt) - 1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(torch.tensor(run.logprobs[1:]), scored, atol=1e-4, rtol=0)
            assert run.top_ids[1:] == logp[: len(prompt) - 1].topk(params.prompt_logprobs).indices.tolist()


def test_greedy_tokens_are_the_most_likely_alternative(engine, prompts) -> None:
    (result,) = engine.generate(prompts[:1], PARAMS[:1], SpecOverride("self", 4))
    run = result.logprobs
    assert [top[0] for top in run.top_ids] == result.token_ids
    assert [top[0] for top in run.top_logprobs] == run.logprobs
    assert all(top == sorted(top, reverse=True) for top in run.top_logprobs)


def test_streamed_outputs_carry_the_logprobs_of_their_tokens(engine, prompts) -> None:
    params = PARAMS[4]
    outputs = list(engine.stream(prompts[4], params, SpecOverride("draft", 4)))
    assert outputs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outputs[1:])
    assert all(o.logprobs.token_ids == o.new_token_ids for o in outputs)
    (whole,) = engine.generate([prompts[4]], [params], SpecOverride("off"))
    assert_identical(LogprobRun.concat(o.logprobs for o in outputs), whole.logprobs)


def test_token_pieces_are_each_tokens_text_and_exact_bytes(tiny_tokenizer) -> None:
    pieces = TokenPieces(tiny_tokenizer)
    text = "naïve → ok"
    ids = tiny_tokenizer(text)["input_ids"]
    got = pieces(ids)
    assert b"".join(got[i][1] for i in ids) == text.encode()  # bytes join into the text exactly
    assert all(got[i][0] == tiny_tokenizer.decode([i]) for i in ids)
    eos = tiny_tokenizer.convert_tokens_to_ids("<eos>")
    assert pieces.piece(eos) == ("<eos>", b"<eos>")


def test_logprob_runs_join_and_cut() -> None:
    a = LogprobRun([1, 2], [-0.5, -1.0], [[1], [3]], [[-0.5], [-0.7]], {1: ("a", b"a"), 2: ("b", b"b")})
    b = LogprobRun([4], [-2.0], [[4]], [[-2.0]], {4: ("d", b"d")})
    joined = LogprobRun.concat([a, None, b])
    assert joined.token_ids == [1, 2, 4] and joined.logprobs == [-0.5, -1.0, -2.0]
    assert joined.piece(4) == ("d", b"d") and joined.piece(99) == ("", b"")
    assert joined.head(1).token_ids == [1] and joined.head(5) is joined
    assert LogprobRun.concat([None]) is None and LogprobRun.concat([a]) is a
    with pytest.raises(ValueError):
        LogprobRun([1], [], [], [])


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 1.5])
def test_sampling_params_bound_the_alternatives(bad) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: bad})


def test_a_q8_target_returns_the_same_logprobs_with_speculation(tiny_tokenizer) -> None:
    """The served models compute on quantized blocks: the same identity holds there (the kernels'
    rows are exact too)."""
    require_built_kernels()
    hf = make_tiny_hf_model(len(tiny_tokenizer), layers=2)
    engine = make_tiny_engine(hf, tiny_tokenizer, proposers={"ngram": NGRAM, "self": {}}, self_skip=[1],
                              weight_format="q8")  # fmt: skip
    prompts = [tiny_tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    params = PARAMS[:2]
    plain = engine.generate(prompts, params, SpecOverride("off"))
    accepted = 0
    for mode in ("ngram", "self"):
        for depth in (1, 4):
            for s, p in zip(engine.generate(prompts, params, SpecOverride(mode, depth)), plain, strict=True):
                assert s.token_ids == p.token_ids
                assert_identical(s.logprobs, p.logprobs)
                accepted += s.spec_stats.accepted
    assert accepted > 0
