"""Losslessness of speculative decoding on tiny float32 models: greedy token equality.

Speculative output must equal our plain decoding and transformers' `generate`, for both proposers,
depths 1..8, batches of 1..8 with mixed depths and prompt lengths, requests joining and finishing
mid-batch. A random draft rarely agrees with a random target, so the tests also use the target as
its own draft (everything accepted, bonus tokens) and an oracle that proposes the true greedy
continuation with a known probability (partial acceptance), and check each path was taken.
"""

from __future__ import annotations

import random

import pytest

from serve_app.engine.model import DecoderModel
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.proposers.base import Draft, ProposeRow
from serve_app.engine.proposers.draft_model import DraftModelProposer
from tests.conftest import hf_greedy, make_tiny_engine, make_tiny_hf_model

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    '{"name": "specserve", "tags": [',
    "for i in range(10):\n    print(i",
    "The dog",
    "x",
    "return a + b\ndef add(a, b):\n    return",
    '"version": 1, "tags": ["fast", "lossless"]}',
]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
NGRAM_3_1 = {"max_ngram": 3, "min_ngram": 1}  # the n-gram lookup's options: suffixes of 1..3 tokens


class OracleProposer:
    """Proposes the true greedy continuation, each token right with probability ``agree``."""

    name = "oracle"

    def __init__(self, references: list[list[int]], agree: float, vocab: int, seed: int = 0) -> None:
        self.references = references  # prompt + plain greedy output, per prompt
        self.agree = agree
        self.vocab = vocab
        self.rng = random.Random(seed)

    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        pass

    def commit(self, slot: int, num_accepted: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        drafts = []
        for row in rows:
            n = len(row.token_ids)
            ref = next(r for r in self.references if r[:n] == row.token_ids)
            tokens = []
            for token in ref[n : n + row.depth]:
                wrong = (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                tokens.append(token if self.rng.random() < self.agree else wrong)
            drafts.append(Draft(tokens=tokens))
        return drafts


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def references(target_hf, prompts) -> list[list[int]]:
    """Prompt + transformers' greedy continuation (20 tokens) for each prompt."""
    return [prompt + hf_greedy(target_hf, prompt, 20) for prompt in prompts]


def assert_matches_reference(results, prompts, references) -> None:
    for prompt, ref, result in zip(prompts, references, results, strict=True):
        assert result.token_ids == ref[len(prompt) :], (prompt, result.spec_stats)


@pytest.mark.parametrize("depth", [1, 2, 3, 5, 8])
def test_self_draft_accepts_everything_and_matches(
    target_hf, tiny_tokenizer, prompts, references, depth
) -> None:
    engine = make_tiny_engine(
        target_hf, tiny_tokenizer, proposers=["draft"], method="draft", depth=depth, max_depth=8
    )
    results = engine.generate(prompts, GREEDY)
    assert_matches_reference(results, prompts, references)
    for result in results:
        stats = result.spec_stats
        assert stats.drafted > 0 and stats.accepted == stats.drafted  # full acceptance, every step
        assert stats.steps_all_accepted == stats.spec_steps > 0
        assert stats.mean_accepted_length > 1.0
    assert engine.cache.num_free == 8


@pytest.mark.parametrize("agree", [0.0, 0.5, 0.8])
def test_oracle_partial_acceptance_matches(target_hf, tiny_tokenizer, prompts, references, agree) -> None:
    vocab = len(tiny_tokenizer)
    oracle = OracleProposer(references, agree, vocab, seed=int(agree * 10))
    engine = make_tiny_engine(
        target_hf, tiny_tokenizer, proposers={"oracle": oracle}, method="oracle", depth=4, max_depth=8
    )
    results = engine.generate(prompts, GREEDY)
    assert_matches_reference(results, prompts, references)
    total_all = sum(r.spec_stats.steps_all_accepted for r in results)
    total_none = sum(r.spec_stats.steps_none_accepted for r in results)
    rate = sum(r.spec_stats.accepted for r in results) / sum(r.spec_stats.drafted for r in results)
    assert total_none > 0  # immediate rejections happened
    if agree > 0:
        assert total_all > 0  # full acceptance and a bonus token happened too
        assert 0 < rate < 1  # and partial acceptance
    else:
        assert rate == 0


def test_random_draft_model_mixed_depths_and_batches(target_hf, tiny_tokenizer, prompts, references) -> None:
    """A different random model as the draft, per-request depths 1..8, batches of 1..8."""
    other = make_tiny_hf_model(len(tiny_tokenizer), seed=7)
    for batch in (1, 3, 8):
        engine = make_tiny_engine(
            target_hf, tiny_tokenizer, proposers=["draft"], draft_hf=other, method="draft", depth=8,
            max_depth=8, slots=batch,
        )  # fmt: skip
        overrides = [SpecOverride(mode="auto", max_depth=1 + i % 8) for i in range(len(prompts))]
        results = engine.generate(prompts, GREEDY, overrides)  # more prompts than slots: joins
        assert_matches_reference(results, prompts, references)
        assert engine.cache.num_free == batch
        assert engine.proposers["draft"].cache.num_free == batch


def test_ngram_proposer_matches(target_hf, tiny_tokenizer, prompts, references) -> None:
    proposers = {"ngram": NGRAM_3_1}
    for depth in (1, 4, 8):
        engine = make_tiny_engine(
            target_hf, tiny_tokenizer, proposers=proposers, method="ngram", depth=depth, max_depth=8
        )
        results = engine.generate(prompts, GREEDY)
        assert_matches_reference(results, prompts, references)
        assert sum(r.spec_stats.drafted for r in results) > 0


def test_mixed_proposers_and_plain_in_one_batch(target_hf, tiny_tokenizer, prompts, references) -> None:
    proposers = {"draft": {}, "ngram": NGRAM_3_1}
    engine = make_tiny_engine(
        target_hf, tiny_tokenizer, proposers=proposers, method="draft", depth=3, max_depth=8
    )
    modes = ["auto", "off", "ngram", "draft", "auto", "ngram", "off", "draft"]
    overrides = [SpecOverride(mode=m, max_depth=1 + i) for i, m in enumerate(modes)]
    # Different max_tokens make requests finish at different steps while others keep going.
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    results = engine.generate(prompts, params, overrides)
    for prompt, ref, p, result, mode in zip(prompts, references, params, results, modes, strict=True):
        assert result.token_ids == ref[len(prompt) : len(prompt) + p.max_tokens]
        assert (result.spec_stats.drafted == 0) == (mode == "off")


def test_goodput_with_a_lookup_proposer_stays_lossless_and_releases_it(
    target_hf, tiny_tokenizer, prompts, references
) -> None:
    """goodput sees what n-gram can draft (its lookahead) for every auto request; the lookup is
    admitted for each request it looked at and released with it, whether it drafted or not."""
    engine = make_tiny_engine(
        target_hf, tiny_tokenizer, proposers={"draft": {}, "ngram": NGRAM_3_1}, method="draft", depth=4,
        max_depth=8, slots=3, policy="goodput",
    )  # fmt: skip
    seen: list[dict[str, int]] = []
    decide = engine.planner.decide

    def watch(rows, queue):
        seen.extend(r.draftable for r in rows)
        return decide(rows, queue)

    engine.planner.decide = watch
    overrides = [SpecOverride(mode="off" if i == 1 else "auto") for i in range(len(prompts))]
    results = engine.generate(prompts, GREEDY, overrides)
    assert_matches_reference(results, prompts, references)
    assert seen and all(set(d) <= {"ngram"} for d in seen) and {} in seen  # "off" rows: no lookup
    assert any(d.get("ngram", 0) > 0 for d in seen) and any(d.get("ngram") == 0 for d in seen)
    assert not engine.proposers["ngram"]._slots and engine.cache.num_free == 3


def test_stop_inside_accepted_run_cuts_like_plain(target_hf, tiny_tokenizer, prompts, references) -> None:
    """EOS-like stop ids and max_tokens that fall inside an accepted run cut exactly there."""
    plain = make_tiny_engine(target_hf, tiny_tokenizer, depth=1, max_depth=8)
    spec = make_tiny_engine(
        target_hf, tiny_tokenizer, proposers=["draft"], method="draft", depth=8, max_depth=8
    )
    for prompt, ref in zip(prompts, references, strict=True):
        out = ref[len(prompt) :]
        for params in (
            SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(out[5],)),
        ):
            expected = plain.generate([prompt], params)[0]
            got = spec.generate([prompt], params)[0]
            assert got.token_ids == expected.token_ids
            assert got.text == expected.text and got.finish_reason == expected.finish_reason


def test_stop_string_inside_accepted_run(target_hf, tiny_tokenizer, prompts) -> None:
    plain = make_tiny_engine(target_hf, tiny_tokenizer, depth=1, max_depth=8)
    spec = make_tiny_engine(
        target_hf, tiny_tokenizer, proposers=["draft"], method="draft", depth=8, max_depth=8
    )
    for prompt in prompts:
        full = plain.generate([prompt], GREEDY)[0]
        stop = full.text[len(full.text) // 2 :][:2]
        if not stop.strip():
            continue
        params = SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,))
        expected, got = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            expected.token_ids, expected.text, expected.finish_reason
        )  # fmt: skip


def test_unknown_speculation_mode_is_refused(target_hf, tiny_tokenizer) -> None:
    engine = make_tiny_engine(
        target_hf, tiny_tokenizer, proposers=["ngram"], method="ngram", depth=2, max_depth=8
    )
    with pytest.raises(ValueError, match="'eagle' is not available"):
        engine.add_request([1, 2], GREEDY, speculation=SpecOverride(mode="eagle"))
    with pytest.raises(ValueError, match="has no proposer loaded"):
        make_tiny_engine(target_hf, tiny_tokenizer, method="draft", depth=2, max_depth=8)


def test_cheap_draft_options_stay_lossless(target_hf, tiny_tokenizer, prompts, references) -> None:
    """int8 draft layers, a restricted draft head and a confidence stop change what is drafted,
    never what is emitted."""
    from serve_app.engine.model import DraftOptions

    state = {k: v.detach().clone() for k, v in target_hf.state_dict().items()}
    options = DraftOptions(int8=True, head_ids=tuple(range(0, len(tiny_tokenizer), 2)))
    model = DecoderModel(DecoderModel.from_hf_model(target_hf).cfg, target_hf.config, state, options)
    proposer = DraftModelProposer(model, model.cfg.vocab_size, 8, 128, min_confidence=0.5)
    engine = make_tiny_engine(
        target_hf, tiny_tokenizer, proposers={"draft": proposer}, method="draft", depth=6, max_depth=8
    )
    results = engine.generate(prompts, GREEDY)
    assert_matches_reference(results, prompts, references)
    assert sum(r.spec_stats.drafted for r in results) > 0
    assert sum(r.spec_stats.accepted for r in results) > 0
    assert sum(r.spec_stats.steps_none_accepted for r in results) > 0  # odd ids are never drafted
