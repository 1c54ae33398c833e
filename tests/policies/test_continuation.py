"""How far drafts that may stop early go: ``policies.continuation`` and goodput's use of it."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from policies import Continuation, ContinuationEstimator, Decision, Outcome, RequestOutcome
from policies.goodput import GoodputPolicy, expected_drafted, expected_tokens
from tests.policies.helpers import request, step


def test_the_worked_example_of_the_module_docstring():
    # depth 6, drafted 3, accepted 2: positions 0 and 1 went on, position 2 stopped; only 0 and 1
    # were accepted, so the rate after an accepted token learns nothing of position 2.
    est = ContinuationEstimator(max_depth=8, guess_weight=1.0, prior_weight=4.0)
    est.update("r", "draft", depth=6, drafted=3, accepted=2, workload="code")
    mine = est.estimate("r", "draft", 8)
    assert mine is not None and len(mine.drafted) == 7
    assert mine.drafted[:3] == (1.0, 1.0, pytest.approx(1.0 - 1.0 / 5))  # step 1 / (1 + 4)
    assert mine.accepted[:3] == (1.0, 1.0, 1.0)
    pool = est.estimate("other", "draft", 8)  # a request of no workload reads the "*" pool: none
    assert pool is None
    est.start("new", "code")
    fresh = est.estimate("new", "draft", 8)  # the code pool: guess 1 weighted as one verdict
    assert fresh is not None and fresh.drafted[2] == pytest.approx(0.5)
    assert fresh.drafted[3:] == pytest.approx((0.5,) * 4)  # positions never judged lean on 2


def test_a_draft_that_fills_its_depth_is_censored_there():
    est = ContinuationEstimator(max_depth=8)
    for _ in range(20):
        est.update("r", "ngram", depth=3, drafted=3, accepted=1, workload="code")
    rates = est.estimate("r", "ngram", 8)
    assert rates is not None and rates.drafted == (1.0,) * 7 and rates.accepted == (1.0,) * 7


def test_rates_converge_to_the_simulated_stop_and_the_request_is_forgotten():
    rng = random.Random(7)
    est = ContinuationEstimator(max_depth=8)
    for _ in range(2000):
        drafted = 1
        while drafted < 8 and rng.random() < 0.6:
            drafted += 1
        est.update("r", "draft", depth=8, drafted=drafted, accepted=rng.randint(0, drafted), workload="x")
    rates = est.estimate("r", "draft", 8)
    assert rates is not None
    assert rates.drafted[:4] == pytest.approx((0.6,) * 4, abs=0.25)  # an EMA of step 0.1: noisy
    est.forget("r")
    est.start("r", "x")  # back to the pool, which tracks the same stop with a longer memory
    pooled = est.estimate("r", "draft", 8)
    assert pooled is not None and pooled.drafted[:4] == pytest.approx((0.6,) * 4, abs=0.12)


def test_observe_reads_the_outcomes_of_drafting_requests_only():
    est = ContinuationEstimator(max_depth=4)
    outcome = Outcome(
        requests=(
            RequestOutcome("a", "code", "draft", 4, 1, 1, 2),
            RequestOutcome("b", "code", None, 0, 0, 0, 1),
        ),
        target_seconds=0.1,
        draft_seconds={},
        draft_steps={},
        tokens_per_row=2,
        context=10,
        step_seconds=0.1,
    )
    est.observe(outcome)
    assert est.estimates("a", ("draft", "ngram"), 4).keys() == {"draft"}
    assert est.estimates("b", ("draft",), 4) == {}  # it did not draft, and its class is unknown
    est.start("b", "code")
    assert est.estimates("b", ("draft",), 4) == {"draft": Continuation((0.5,) * 3, (0.5,) * 3)}  # a stop at 0


def test_expected_drafted_and_tokens_with_a_stop():
    going_on = Continuation(drafted=(0.5, 0.5), accepted=(0.8,))
    assert expected_drafted(None, 3) == [0.0, 1.0, 2.0, 3.0]
    assert expected_drafted(going_on, 3) == [0.0, 1.0, 1.5, 1.75]
    # E: position 0 accepted 0.9; position 1 drafted and reached 0.9 * 0.8, accepted 0.9 of that
    e = expected_tokens((0.9,), 3, 0.5, going_on)
    assert e == pytest.approx([1.0, 1.9, 1.9 + 0.9 * 0.8 * 0.9, 1.9 + 0.648 + 0.648 * 0.8 * 0.9])
    assert expected_tokens((0.9,), 3, 0.5, Continuation()) == expected_tokens((0.9,), 3, 0.5)


def _value(view, plan) -> float:
    """The objective written out for one request that has paid its prefill."""
    (r,), ((p, k),) = view.requests, plan
    if p is None:
        return 1.0 / view.cost.target_time(1, 1, r.context_len)
    going_on = r.continuation.get(p)
    a, drafted, reach, tokens, held = r.acceptance[p], 1.0, 1.0, 1.0, 0.0
    for j in range(k):
        held += drafted
        tokens += reach * a[j]
        reach *= a[j] * (going_on.accepted[min(j, 14)] if going_on else 1.0)
        drafted *= going_on.drafted[min(j, 14)] if going_on else 1.0
    low, part = int(held), held - int(held)
    width = (1 - part) * view.cost.target_time(1, 1 + low, r.context_len)
    width += part * view.cost.target_time(1, 2 + low, r.context_len) if part else 0.0
    return tokens / (width + held * view.cost.draft_time(p, 1, r.context_len))


@pytest.mark.parametrize("stop", [0.5, 0.7, 0.9])
def test_goodput_plans_deeper_caps_for_a_draft_that_stops_and_picks_the_best_of_them(stop):
    acceptance = (0.98, 0.97, 0.90, 0.87, 0.84, 0.82) + (0.8,) * 10
    base = replace(request(), acceptance={"draft": acceptance})
    going_on = Continuation(drafted=(stop,) * 15, accepted=(min(1.0, stop + 0.1),) * 15)
    stopping = replace(base, continuation={"draft": going_on})
    policy = GoodputPolicy(16)
    (fixed,) = policy.decide(step([base], proposers=("draft",), max_depth=16))
    policy.read[("r0", "draft")] = base.context_len  # it has read the request: no prefill to pay
    view = step([stopping], proposers=("draft",), max_depth=16)
    (chosen,) = policy.decide(view)
    assert chosen.proposer == "draft" and chosen.depth > fixed.depth
    values = [_value(view, [("draft", k) if k else (None, 0)]) for k in range(17)]
    # the shallowest cap within the policy's depth slack of the best one
    within = [k for k in range(1, 17) if values[k] >= max(values) * (1.0 - policy.depth_slack)]
    assert chosen.depth == min(within)
    exact = GoodputPolicy(16, depth_slack=0.0)
    exact.read[("r0", "draft")] = base.context_len
    assert exact.decide(view)[0].depth == max(range(17), key=values.__getitem__)


def test_goodput_without_stop_estimates_is_unchanged():
    plain_view = step([request()], max_depth=8)
    same = step([replace(request(), continuation={"draft": Continuation()})], max_depth=8)
    assert GoodputPolicy(8).decide(plain_view) == GoodputPolicy(8).decide(same) == [Decision("draft", 4)]


@pytest.mark.parametrize("left", [0, 1])
def test_a_request_with_no_room_to_draft_is_plain(left):
    going_on = Continuation(drafted=(0.7,) * 15, accepted=(0.8,) * 15)
    view = step([replace(request(left=left), continuation={"draft": going_on})], max_depth=8)
    assert GoodputPolicy(8).decide(view) == [Decision.plain()]


def test_a_stop_under_load_still_goes_plain():
    going_on = Continuation(drafted=(0.7,) * 15, accepted=(0.8,) * 15)
    rows = [replace(request(f"r{i}", draft=0.6), continuation={"draft": going_on}) for i in range(32)]
    assert all(d == Decision.plain() for d in GoodputPolicy(8).decide(step(rows, max_depth=8)))
    assert math.isfinite(sum(expected_drafted(going_on, 8)))
