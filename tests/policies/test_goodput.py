"""goodput: per request proposer and depth maximising the step's expected tokens per second."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from policies import Decision, PolicyConfig, create_policy
from policies.goodput import GoodputPolicy, catch_up_seconds, expected_tokens, prefill_seconds
from tests.policies.helpers import batch, outcome, qwen_cpu_cost, request, step


def goodput(**params) -> GoodputPolicy:
    return create_policy("goodput", PolicyConfig(params=params))  # type: ignore[return-value]


def step_value(view, plan, admitted=frozenset()) -> float:
    """The objective, written out independently of the policy's incremental bookkeeping."""
    cost, rows = view.cost, view.batch_size
    ctx = round(sum(r.context_len for r in view.requests) / rows)
    tokens = prefill = 0.0
    deepest: dict[str, int] = {}
    used: dict[str, int] = {}
    for r, (p, k) in zip(view.requests, plan, strict=True):
        if p is None:
            tokens += 1
            continue
        e = 1.0 + sum(math.prod(r.acceptance[p][: j + 1]) for j in range(k))
        tokens += e
        if (r.request_id, p) not in admitted:
            prefill += cost.draft_prefill_time(p, r.context_len) * e / r.tokens_left
        deepest[p] = max(deepest.get(p, 0), k)
        used[p] = used.get(p, 0) + 1
    seconds = cost.target_time(rows, 1 + max(deepest.values(), default=0), ctx) + prefill
    seconds += sum(d * cost.draft_time(p, used[p], ctx) for p, d in deepest.items())
    return tokens / seconds


def test_expected_tokens():
    assert expected_tokens((0.5, 0.5), 3, 0.7) == [1.0, 1.5, 1.75, 1.875]  # the last rate repeats
    assert expected_tokens((), 2, 0.5) == [1.0, 1.5, 1.75]  # no estimate: the default
    assert expected_tokens((1.0,) * 4, 4, 0.0) == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_the_cost_model_of_these_tests_matches_the_measured_forwards():
    cost = qwen_cpu_cost()
    measured = {1: 0.135, 4: 0.130, 8: 0.155, 16: 0.185, 32: 0.290}
    for n, seconds in measured.items():
        assert cost.target_time(1, n, 200) == pytest.approx(seconds, rel=0.06)
    assert cost.draft_time("draft", 1, 200) == pytest.approx(0.036)


def test_batch_one_high_acceptance_speculates_deep_with_the_draft_model():
    assert goodput().decide(batch(1, draft=0.95, ngram=0.3)) == [Decision("draft", 7)]


def test_depth_shrinks_as_the_batch_grows_and_stops_at_heavy_load():
    policy = goodput()
    depths = [policy.decide(batch(size, draft=0.95, ngram=0.3))[0].depth for size in (1, 2, 4, 8, 16, 32)]
    assert depths == sorted(depths, reverse=True)
    assert depths[0] >= 6 and depths[-2:] == [0, 0]


@pytest.mark.parametrize(("draft", "ngram"), [(0.8, 0.3), (0.95, 0.3), (0.95, 0.5)])
def test_batch_32_is_plain(draft, ngram):
    assert goodput().decide(batch(32, draft=draft, ngram=ngram)) == [Decision.plain()] * 32


def test_low_acceptance_is_plain():
    assert goodput().decide(batch(1, draft=0.1, proposers=("draft",))) == [Decision.plain()]
    assert goodput().decide(batch(4, draft=0.1, ngram=0.1)) == [Decision.plain()] * 4


def test_a_free_proposer_on_a_flat_forward_costs_nothing_so_it_may_still_be_used():
    # Documented: at batch 1 the forward costs the same for 1..4 tokens and n-gram lookup is free.
    [d] = goodput().decide(batch(1, draft=0.1, ngram=0.1))
    assert d == Decision.plain() or d.proposer == "ngram"


@pytest.mark.parametrize("left", [0, 1])
def test_one_token_left_is_plain(left):
    assert goodput().decide(batch(2, draft=1.0, ngram=1.0, left=left)) == [Decision.plain()] * 2


def test_few_tokens_left_cap_the_depth():
    [d] = goodput().decide(batch(1, draft=0.99, ngram=0.99, left=3))
    assert d.depth == 2


def test_a_long_prompt_with_few_tokens_left_does_not_pay_the_draft_prefill():
    only_draft = {"proposers": ("draft",)}
    assert goodput().decide(batch(1, draft=0.95, prompt=8000, left=10, **only_draft)) == [Decision.plain()]
    assert goodput().decide(batch(1, draft=0.95, prompt=8000, left=2000, **only_draft))[0].depth >= 6


def test_a_request_that_already_paid_the_prefill_speculates_again():
    policy = goodput()
    view = step([request(draft=0.95, prompt=8000, left=10)], proposers=("draft",))
    assert policy.decide(view) == [Decision.plain()]
    policy.observe(outcome([Decision("draft", 4)], view, [4]))  # e.g. a forced step used it
    assert policy.decide(view)[0].proposer == "draft"
    policy.decide(step([request("other")]))  # r0 finished: its state goes
    assert policy.read == {}


def test_a_draft_that_sat_out_many_steps_pays_for_the_tokens_it_missed():
    """After 300 plain steps the draft model's cache is 300 tokens behind: with 6 tokens left, reading
    them (a measured 2 ms a token) costs more than drafting saves; one token behind is free."""
    cost = qwen_cpu_cost()
    cost.set_draft_prefill("draft", 128, 0.256)
    policy = goodput()
    only_draft = {"proposers": ("draft",)}
    first = step([request(draft=0.8, prompt=20, left=200)], cost=cost, **only_draft)
    (decision,) = policy.decide(first)
    assert decision.proposer == "draft"
    policy.observe(outcome([decision], first, [decision.depth]))
    caught_up = first.requests[0].context_len + decision.depth  # accepted all: the bonus token is next
    behind = request(draft=0.8, prompt=20, generated=caught_up - 20 + 300, left=6)
    later = step([behind], cost=cost, **only_draft)
    assert policy.decide(later) == [Decision.plain()]
    assert catch_up_seconds(cost, "draft", 300) == pytest.approx(0.600 - 0.036)
    assert catch_up_seconds(cost, "draft", 1) == 0.0
    level = request(draft=0.8, prompt=20, generated=caught_up - 20 + 1, left=6)
    near = step([level], cost=cost, **only_draft)
    assert policy.decide(near)[0].proposer == "draft"


def test_prefill_falls_back_to_the_documented_formula():
    class Bare:  # a CostModel without draft_prefill_time
        def target_time(self, rows, tokens_per_row, context):
            return 0.1

        def draft_time(self, proposer, rows, context):
            return 0.01

    assert prefill_seconds(Bare(), "draft", 130) == pytest.approx(0.03)  # ceil(130 / 64) = 3 forwards
    assert prefill_seconds(qwen_cpu_cost(), "draft", 130) == pytest.approx(3 * 0.036)


def test_each_request_gets_its_own_decision():
    view = step([request("code", draft=0.97, ngram=0.0), request("prose", draft=0.0, ngram=0.0)])
    code, prose = goodput().decide(view)
    assert code.proposer == "draft" and code.depth >= 4
    assert prose == Decision.plain()


def test_margin_keeps_plain_when_the_gain_is_marginal():
    view = batch(8, draft=0.0, ngram=0.5)
    no_margin = goodput(margin=0.0).decide(view)
    assert goodput(margin=10.0).decide(view) == [Decision.plain()] * 8
    assert no_margin != [Decision.plain()] * 8


def test_deterministic():
    view = step([request(f"r{i}", draft=0.5 + i / 20, ngram=0.9 - i / 10) for i in range(6)])
    assert goodput().decide(view) == goodput().decide(view) == goodput().decide(view)


def test_search_is_near_the_brute_force_optimum():
    rng = random.Random(7)
    options = [(None, 0)] + [(p, k) for p in ("draft", "ngram") for k in range(1, 5)]
    for _ in range(40):
        requests = [
            request(
                f"r{i}",
                draft=rng.random() ** 0.5,
                ngram=rng.random() ** 2,
                prompt=rng.choice([100, 1000, 6000]),
                left=rng.choice([3, 20, 300]),
            )
            for i in range(rng.choice([1, 2, 3]))
        ]
        view = step(requests, max_depth=4)
        got = step_value(view, [(d.proposer, d.depth) for d in goodput(margin=0.0).decide(view)])
        best = max(
            step_value(view, plan)
            for plan in itertools.product(options, repeat=len(requests))
            if all(k <= r.tokens_left - 1 for r, (_, k) in zip(requests, plan, strict=True))
        )
        assert got >= 0.99 * best


def test_a_lookup_without_a_match_leaves_the_request_to_the_draft_model():
    # Free n-gram with a high estimate wins while it has a match; without one (draftable 0) the
    # draft model drafts instead of a wasted n-gram step; a short match caps the n-gram's depth.
    assert goodput().decide(batch(1, draft=0.8, ngram=0.9)) == [Decision("ngram", 8)]
    [d] = goodput().decide(batch(1, draft=0.8, ngram=0.9, draftable={"ngram": 0}))
    assert d.proposer == "draft" and d.depth >= 3
    [d] = goodput().decide(batch(1, draft=0.1, ngram=0.9, draftable={"ngram": 2}))
    assert d == Decision("ngram", 2)


def test_a_cheap_wide_forward_after_dear_narrow_ones_is_found():
    # One row's forward by width, shaped as measured here but exaggerated: two to five tokens
    # cost three times one, six tokens less than one. A search that stopped at the first width
    # whose forward is too dear (assuming monotone costs) would stay plain.
    cost = qwen_cpu_cost()
    cost.shape = {1: 1.0, 2: 3.0, 3: 3.0, 4: 3.0, 5: 3.0, 6: 0.7}
    view = batch(1, ngram=0.6, proposers=("ngram",), cost=cost, max_depth=5)
    assert goodput().decide(view) == [Decision("ngram", 5)]


def test_search_is_near_the_brute_force_optimum_when_width_costs_are_not_monotone():
    rng = random.Random(11)
    options = [(None, 0)] + [(p, k) for p in ("draft", "ngram") for k in range(1, 6)]
    for _ in range(30):
        cost = qwen_cpu_cost()
        cost.shape = {n: rng.uniform(0.7, 1.4) for n in range(1, 13)}
        requests = [
            request(f"r{i}", draft=rng.random() ** 0.5, ngram=rng.random() ** 2, left=rng.choice([20, 300]))
            for i in range(rng.choice([1, 2]))
        ]
        view = step(requests, max_depth=5, cost=cost)
        got = step_value(view, [(d.proposer, d.depth) for d in goodput(margin=0.0).decide(view)])
        best = max(step_value(view, plan) for plan in itertools.product(options, repeat=len(requests)))
        assert got >= 0.99 * best


def test_decide_is_cheap_at_batch_32():
    import time

    view = step([request(f"r{i}", draft=0.8, ngram=0.8, left=200) for i in range(32)], max_depth=16)
    policy = goodput()
    start = time.process_time()
    for _ in range(5):
        policy.decide(view)
    assert (time.process_time() - start) / 5 < 0.05  # generous: ~2 ms on this machine
