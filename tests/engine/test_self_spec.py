"""Self-speculation (the target drafting through a subset of its own layers) on tiny float32 models.

The same losslessness checks as for the other proposers (``test_speculative``): greedy output equal
to our plain decoding and to transformers' `generate` for several skip sets and depths, in mixed
batches with the other proposers and plain rows, requests joining and finishing mid-batch; plus
the property self-speculation rests on: after every step the target's KV cache holds, for every
layer, exactly what plain decoding would hold for the accepted tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from serve_app.engine.model import DecoderModel
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.proposers.base import ProposeRow
from serve_app.engine.proposers.registry import ProposerContext, create_proposer
from serve_app.engine.proposers.self_spec import SelfSpecProposer
from serve_app.engine.proposers.skip_plan import CALIBRATION_FILE, default_skip, resolve_plan
from tests.conftest import hf_greedy, make_tiny_engine, make_tiny_hf_model
from tests.engine.test_speculative import GREEDY, PROMPTS

LAYERS = 4


@pytest.fixture(scope="module")
def target_hf(tiny_tokenizer):
    return make_tiny_hf_model(len(tiny_tokenizer), seed=0, layers=LAYERS)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def references(target_hf, prompts) -> list[list[int]]:
    return [prompt + hf_greedy(target_hf, prompt, 20) for prompt in prompts]


def self_engine(target_hf, tokenizer, skip, depth: int, slots: int = 8, extra: dict | None = None,
                draft_hf=None):  # fmt: skip
    """An engine whose "self" proposer drafts inside the engine's own cache; ``extra``: more
    proposers (name -> options), a "draft" one drafting with ``draft_hf``."""
    proposers = {"self": {}, **(extra or {})}
    return make_tiny_engine(target_hf, tokenizer, proposers=proposers, method="self", depth=depth,
                            max_depth=8, slots=slots, self_skip=skip, draft_hf=draft_hf)  # fmt: skip


def assert_matches_reference(results, prompts, references) -> None:
    for prompt, ref, result in zip(prompts, references, results, strict=True):
        assert result.token_ids == ref[len(prompt) :], (prompt, result.spec_stats)


@pytest.mark.parametrize("skip", [(1,), (2, 3), (0,), (1, 2)], ids=["mid", "early-exit", "first", "two"])
@pytest.mark.parametrize("depth", [1, 3, 6])
def test_greedy_matches_plain_and_transformers(target_hf, tiny_tokenizer, prompts, references, skip, depth):
    engine = self_engine(target_hf, tiny_tokenizer, skip, depth)
    results = engine.generate(prompts, GREEDY)
    assert_matches_reference(results, prompts, references)
    assert sum(r.spec_stats.drafted for r in results) > 0
    assert engine.cache.num_free == 8
    plain = self_engine(target_hf, tiny_tokenizer, skip, depth)
    off = plain.generate(prompts, GREEDY, [SpecOverride(mode="off")] * len(prompts))
    assert [r.token_ids for r in off] == [r.token_ids for r in results]


def test_partial_acceptance_happens(target_hf, tiny_tokenizer, prompts, references) -> None:
    engine = self_engine(target_hf, tiny_tokenizer, (2,), 4)
    results = engine.generate(prompts, GREEDY)
    assert_matches_reference(results, prompts, references)
    drafted = sum(r.spec_stats.drafted for r in results)
    accepted = sum(r.spec_stats.accepted for r in results)
    assert 0 < accepted < drafted
    assert sum(r.spec_stats.steps_none_accepted for r in results) > 0


def test_skipping_a_no_op_layer_accepts_everything(tiny_tokenizer, prompts) -> None:
    """A layer whose output projections are zero adds nothing to the residual stream: skipping it
    gives the target itself, so every draft is accepted and every step ends with a bonus token."""
    hf = make_tiny_hf_model(len(tiny_tokenizer), seed=1, layers=LAYERS)
    with torch.no_grad():
        hf.model.layers[2].self_attn.o_proj.weight.zero_()
        hf.model.layers[2].mlp.down_proj.weight.zero_()
    references = [p + hf_greedy(hf, p, 20) for p in prompts]
    engine = self_engine(hf, tiny_tokenizer, (2,), 5)
    results = engine.generate(prompts, GREEDY)
    assert_matches_reference(results, prompts, references)
    for result in results:
        stats = result.spec_stats
        assert stats.drafted > 0 and stats.accepted == stats.drafted
        assert stats.steps_all_accepted == stats.spec_steps


def test_mixed_proposers_depths_and_plain_in_one_batch(target_hf, tiny_tokenizer, prompts, references):
    """self, ngram, a draft model, plain and auto rows share batches; different max_tokens make
    requests finish while others run, and 3 slots for 8 prompts make requests join mid-way."""
    for slots in (3, 8):
        other = make_tiny_hf_model(len(tiny_tokenizer), seed=7, layers=2)
        extra = {"ngram": {"max_ngram": 3, "min_ngram": 1}, "draft": {}}
        engine = self_engine(target_hf, tiny_tokenizer, (1, 2), 3, slots=slots, extra=extra, draft_hf=other)
        modes = ["self", "off", "ngram", "self", "auto", "draft", "self", "off"]
        overrides = [SpecOverride(mode=m, max_depth=1 + i) for i, m in enumerate(modes)]
        params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
        results = engine.generate(prompts, params, overrides)
        for prompt, ref, p, result, mode in zip(prompts, references, params, results, modes, strict=True):
            assert result.token_ids == ref[len(prompt) : len(prompt) + p.max_tokens]
            assert (result.spec_stats.drafted == 0) == (mode == "off")
        assert engine.cache.num_free == slots


def test_cache_after_each_step_equals_plain_decodings(target_hf, tiny_tokenizer, prompts) -> None:
    """After every self-speculative step, every layer's K/V of each running request (skipped layers
    included) equals what one plain forward over its accepted sequence writes, and the length is
    the sequence minus the one token not fed yet."""
    engine = self_engine(target_hf, tiny_tokenizer, (1, 3), 4, slots=4)
    reference = engine.model
    depths = [1, 2, 4, 4]
    ids = [engine.add_request(p, GREEDY, speculation=SpecOverride("self", d))
           for p, d in zip(prompts[:4], depths, strict=True)]  # fmt: skip
    requests = {i: engine._requests[i] for i in ids}
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        for request in requests.values():
            if request.finished:
                continue
            sequence = request.prompt_ids + request.output_ids
            length = engine.cache.lengths[request.slot]
            assert length == len(sequence) - 1
            fresh = reference.new_cache(1, 128)
            reference.forward(torch.tensor([sequence[:-1]]), fresh, [fresh.allocate()])
            for layer in range(LAYERS):
                for ours, plain in ((engine.cache.k, fresh.k), (engine.cache.v, fresh.v)):
                    got, want = ours[layer][request.slot, :, :length], plain[layer][0, :, :length]
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert steps > 3
    assert sum(r.spec_stats.accepted for r in requests.values()) > 0


def test_propose_leaves_cache_lengths_and_refuses_a_stale_row(target_hf, tiny_tokenizer, prompts) -> None:
    model = DecoderModel.from_hf_model(target_hf)
    cache = model.new_cache(2, 64)
    proposer = SelfSpecProposer(model, cache, (1,))
    slot = cache.allocate()
    prompt = prompts[0]
    model.forward(torch.tensor([prompt[:-1]]), cache, [slot])
    cache.set_length(slot, len(prompt) - 1)
    before = [k[slot, :, : len(prompt) - 1].clone() for k in cache.k]
    (draft,) = proposer.propose([ProposeRow(slot, prompt, 5, GREEDY, None)])
    assert len(draft.tokens) == 5 and draft.probs is None
    assert cache.lengths[slot] == len(prompt) - 1
    for k, b in zip(cache.k, before, strict=True):  # verified rows untouched
        assert torch.equal(k[slot, :, : len(prompt) - 1], b)
    with pytest.raises(RuntimeError, match="expected one more"):
        proposer.propose([ProposeRow(slot, [*prompt, 5], 2, GREEDY, None)])


def test_factory_needs_the_target_cache_and_resolves_the_skip_plan(target_hf, tiny_tokenizer, tmp_path):
    model = DecoderModel.from_hf_model(target_hf)
    cache = model.new_cache(2, 64)
    with pytest.raises(ValueError, match="target's KV cache"):
        create_proposer("self", ProposerContext(model, tiny_tokenizer, 2, 64))
    built = create_proposer("self", ProposerContext(model, tiny_tokenizer, 2, 64, {}, cache, tmp_path))
    assert built.skip == default_skip(LAYERS) and built.cache is cache
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"version": 1, "num_layers": LAYERS,
                                                         "skip_layers": [3, 1], "depth": 2}))  # fmt: skip
    built = create_proposer("self", ProposerContext(model, tiny_tokenizer, 2, 64, {}, cache, tmp_path))
    assert built.skip == (1, 3)
    assert resolve_plan(LAYERS, folder=tmp_path).depth == 2
    explicit = ProposerContext(model, tiny_tokenizer, 2, 64, {"skip_layers": [0]}, cache, tmp_path)
    assert create_proposer("self", explicit).skip == (0,)
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"version": 1, "num_layers": 99, "skip_layers": [1]}))
    assert resolve_plan(LAYERS, folder=tmp_path).source == "default"  # another model's: ignored
    for bad in ([], [LAYERS], list(range(LAYERS))):
        with pytest.raises(ValueError):
            SelfSpecProposer(model, cache, bad)


def test_default_skip_sets_are_valid() -> None:
    for layers in (2, 3, 4, 12, 24, 28, 30, 32, 80):
        skip = default_skip(layers)
        assert skip and 0 < len(skip) < layers and all(0 <= i < layers for i in skip)
        assert (0 not in skip and layers - 1 not in skip) or layers <= 2


def test_profiler_times_the_self_draft_step(target_hf, tiny_tokenizer) -> None:
    engine = self_engine(target_hf, tiny_tokenizer, (1, 2), 3, slots=4)
    assert engine.planner.cost.draft_prefill_time("self", 500) == 0.0  # drafts in the target's cache
    cost = engine.profile_cost_model(repeats=1)
    assert "self" in cost.draft and cost.draft_time("self", 1, 64) > 0
    assert cost.no_prefill == {"self"} and cost.draft_prefill_time("self", 500) == 0.0
    assert engine.cache.num_free == 4 and all(n == 0 for n in engine.cache.lengths)


def test_shipped_calibrations_are_valid_and_used(tmp_path) -> None:
    """A pack's folder with no calibration of its own starts with the shipped one."""
    from serve_app.engine.proposers.skip_plan import PACK_FILE, SHIPPED

    assert SHIPPED
    for pack, data in SHIPPED.items():
        folder = tmp_path / pack
        folder.mkdir()
        (folder / PACK_FILE).write_text(json.dumps({"pack": pack}))
        plan = resolve_plan(data["num_layers"], folder=folder)
        assert plan.source == "shipped" and plan.skip == tuple(data["skip_layers"])
        assert plan.depth == data["depth"] and 0 < len(plan.skip) < data["num_layers"]
