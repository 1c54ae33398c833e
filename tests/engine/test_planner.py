"""The engine under every registered policy: decisions change speed, never the output."""

from __future__ import annotations

import pytest

from policies import FittedCostModel, registered_policies
from serve_app.config import StatsSettings
from serve_app.engine.engine import SpecEngine
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.observability.shared_stats import AcceptanceKey, EngineStatsSink, SharedStats
from tests.conftest import hf_greedy, make_tiny_engine

PROMPTS = ["def add(a, b):", "The quick brown fox", '{"name": "specserve", "tags": [', "x"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def references(target_hf, prompts) -> list[list[int]]:
    return [hf_greedy(target_hf, prompt, 16) for prompt in prompts]


def make_engine(target_hf, tokenizer, policy: str, stats=None) -> SpecEngine:
    """The target as its own draft, beside an n-gram lookup."""
    return make_tiny_engine(
        target_hf, tokenizer, proposers={"draft": {}, "ngram": {"max_ngram": 3, "min_ngram": 1}},
        method="draft", depth=4, max_depth=6, slots=4, policy=policy, stats=stats, model_pair="tiny|tiny",
    )  # fmt: skip


@pytest.mark.parametrize("policy", sorted(registered_policies()))
def test_every_policy_is_lossless(target_hf, tiny_tokenizer, prompts, references, policy) -> None:
    engine = make_engine(target_hf, tiny_tokenizer, policy)
    results = engine.generate(prompts, GREEDY)
    for result, ref in zip(results, references, strict=True):
        assert result.token_ids == ref
    drafted = sum(r.spec_stats.drafted for r in results)
    assert (drafted == 0) == (policy == "plain")
    assert engine.cache.num_free == 4 and not engine.planner.estimator._rates  # state is dropped
    assert not engine.planner.continuation._request


def test_a_draft_that_stops_early_is_planned_at_what_it_drafts(
    target_hf, tiny_tokenizer, prompts, references
) -> None:
    """A draft told to stop below a confidence no tiny random model reaches drafts one token per
    step: the planner learns that it stops (RequestView.continuation), and the output is plain's."""
    engine = make_tiny_engine(
        target_hf, tiny_tokenizer, proposers={"draft": {"min_confidence": 0.99}},
        method="draft", depth=4, max_depth=6, slots=4, policy="static", model_pair="tiny|tiny",
    )  # fmt: skip
    results = engine.generate(prompts, GREEDY)
    for result, ref in zip(results, references, strict=True):
        assert result.token_ids == ref
        assert 0 < result.spec_stats.drafted <= result.spec_stats.spec_steps  # one a step at most
    planner = engine.planner
    planner.admit("next", PROMPTS[0])
    (rates,) = planner.continuation.estimates("next", ["draft"], 6).values()
    assert max(rates.drafted) < 0.2  # it has stopped after its first token every time
    (view,) = [planner._view(r) for r in [_planned("next")]]
    assert view.continuation == {"draft": rates}


def _planned(request_id: str):
    from serve_app.engine.planner import PlannedRequest

    return PlannedRequest(request_id, 4, 0, 16, 0.0, "auto", None, 100)


def test_overrides_hold_under_goodput(target_hf, tiny_tokenizer, prompts, references) -> None:
    engine = make_engine(target_hf, tiny_tokenizer, "goodput")
    modes = [SpecOverride("off"), SpecOverride("ngram", 2), SpecOverride("draft", 1), SpecOverride("auto")]
    results = engine.generate(prompts, GREEDY, modes)
    for result, ref, mode in zip(results, references, modes, strict=True):
        assert result.token_ids == ref
        if mode.mode == "off":
            assert result.spec_stats.drafted == 0
        if mode.max_depth is not None and result.spec_stats.spec_steps:
            assert len(result.spec_stats.drafted_per_position) <= mode.max_depth


def test_profiled_cost_model_and_shared_priors(target_hf, tiny_tokenizer, prompts) -> None:
    stats = SharedStats(StatsSettings(redis_url=None), replica_id="test")
    # static: every auto request drafts with the draft model, so there are counts to share.
    engine = make_engine(target_hf, tiny_tokenizer, "static", EngineStatsSink(stats))
    cost = engine.profile_cost_model(repeats=1)
    assert isinstance(cost, FittedCostModel) and engine.planner.cost is cost
    assert cost.target_time(1, 1, 64) > 0 and cost.draft_time("draft", 1, 64) > 0
    assert cost.draft_prefill["draft"] > 0  # its prefill was timed: admission priced by measurement
    assert engine.cache.num_free == 4 and engine.proposers["draft"].cache.num_free == 4
    engine.generate(prompts, GREEDY)
    # The self-draft accepts everything: the shared statistics say so, per workload class.
    rates = [stats.priors(AcceptanceKey("tiny|tiny", "draft", w)) for w in ("code", "json", "prose")]
    seen = [r for r in rates if r]
    assert seen and all(rate == 1.0 for r in seen for rate in r)
    # A new request starts from those priors.
    engine.add_request(prompts[0], GREEDY, request_id="new")
    estimate = engine.planner.estimator.estimate("new", "draft", 3)
    assert min(estimate) > 0.9
    engine.abort("new")


def test_empty_drafts_count_as_rejections() -> None:
    """An n-gram proposer that finds no match must not keep looking like free accepted tokens."""
    from policies import PolicyConfig, create_policy
    from policies.base import Decision
    from serve_app.engine.planner import PlannedRequest, SpeculationPlanner

    planner = SpeculationPlanner(create_policy("goodput", PolicyConfig()), ["ngram"], 4, "ngram")
    planner.admit("r", "some prose without repeats")
    request = PlannedRequest("r", 10, 5, 50, 0.0, "auto", None, 100)
    before = planner.estimator.estimate("r", "ngram", 1)[0]
    for _ in range(10):  # ten empty drafts: the prior counts as 8 verdicts
        times = (0.1, {"ngram": 0.0}, {"ngram": 0}, 0.1)
        planner.observe([request], [Decision("ngram", 4)], [0], [0], [1], *times)
    assert planner.estimator.estimate("r", "ngram", 1)[0] < before / 2


def test_fresh_engine_starts_ngram_from_its_cold_acceptance(target_hf, tiny_tokenizer, prompts) -> None:
    """Without shared statistics an n-gram lookup starts from its registered acceptance given a
    match, not the estimator's generic default; the draft model keeps the default; both are
    guesses, read optimistically until judged (policies.acceptance); shared priors win."""
    from serve_app.engine.proposers.registry import proposer_spec

    COLD_ACCEPTANCE = proposer_spec("ngram").cold_acceptance

    sink = EngineStatsSink(SharedStats(StatsSettings(redis_url=None), replica_id="test"))
    engine = make_engine(target_hf, tiny_tokenizer, "goodput", sink)
    workload = engine.planner.admit("cold", "def add(a, b):")
    estimator = engine.planner.estimator

    def optimistic(rate: float) -> float:
        return rate + estimator.optimism * (1 - rate)

    assert estimator.estimate("cold", "ngram", 3) == pytest.approx(
        [optimistic(r) for r in COLD_ACCEPTANCE[:3]]
    )
    assert estimator.estimate("cold", "draft", 1) == (pytest.approx(optimistic(estimator.default[0])),)
    for _ in range(50):  # the cluster has seen this class's n-gram drafts all accepted
        sink.record(("tiny|tiny", "ngram", workload), 3, 3)
    engine.planner.admit("warm", "def add(a, b):")
    assert min(estimator.estimate("warm", "ngram", 3)) > 0.9
