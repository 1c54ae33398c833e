"""AcceptanceEstimator: conditional acceptance per position, per request, pooled per workload."""

from __future__ import annotations

import random

import pytest

from policies import AcceptanceEstimator, Outcome, RequestOutcome
from policies.acceptance import PositionCounts


def test_priors_default_and_lookup_order():
    est = AcceptanceEstimator(
        {("draft", "code"): (0.9, 0.8), ("ngram", "*"): (0.3,), ("pairA", "draft", "prose"): (0.5,)},
        model_pair="pairA",
        default=0.7,
        decay=0.5,
        max_depth=4,
        optimism=0.0,  # the guesses as given (test_a_guess_is_explored_optimistically)
    )
    assert est.estimate("r", "draft", 4, workload="code") == (0.9, 0.8, 0.8, 0.8)
    assert est.estimate("r", "draft", 2, workload="prose") == (0.5, 0.5)
    assert est.estimate("r", "ngram", 3, workload="json") == (0.3, 0.3, 0.3)
    assert est.estimate("r", "medusa", 3) == (0.7, 0.35, 0.175)
    assert est.estimate("r", "draft", 6, workload="code")[-1] == 0.8  # longer than max_depth: repeats
    other = AcceptanceEstimator(
        {("pairB", "draft", "prose"): (0.5,)}, model_pair="pairA", default=0.6, decay=1, optimism=0.0
    )
    assert other.estimate("r", "draft", 1, workload="prose") == (0.6,)


def test_only_positions_judged_on_their_own_merit_are_updated():
    est = AcceptanceEstimator(
        default=0.5, decay=1.0, alpha=0.5, prior_weight=1.0, pool_alpha=0.1, max_depth=6
    )
    est.start("r", "code")
    est.update("r", "draft", drafted=5, accepted=2)  # positions 0, 1 accepted; 2 rejected; 3, 4 unknown
    # rates 0.75, 0.75, 0.25 (each judged once); each position past the first leans on the one
    # before it by evidence, (n * rate + w * previous * decay) / (n + w) with n = 1, w = 1:
    # position 2 = (0.25 + 0.75) / 2; 3.. never judged: equal to the position before
    assert est.estimate("r", "draft", 6) == (0.75, 0.75, 0.5, 0.5, 0.5, 0.5)
    est.update("r", "draft", drafted=2, accepted=2)  # all accepted: no rejection observed
    # positions 0, 1 -> 0.875 (judged twice); position 2 unchanged (0.25, once) -> (0.25 + 0.875) / 2
    assert est.estimate("r", "draft", 3) == pytest.approx((0.875, 0.875, 0.5625))
    est.update("r", "draft", drafted=0, accepted=0)  # no draft: nothing learned
    assert est.estimate("r", "draft", 1) == (0.875,)


def test_conditional_rates_converge_to_the_truth():
    rng = random.Random(0)
    truth = (0.9, 0.6, 0.8, 0.3)
    est = AcceptanceEstimator(default=0.5, max_depth=8, alpha=0.005)
    for _ in range(4000):
        accepted = 0
        while accepted < 4 and rng.random() < truth[accepted]:
            accepted += 1
        est.update("r", "draft", 4, accepted, workload="code")
    assert est.estimate("r", "draft", 4) == pytest.approx(truth, abs=0.05)


def test_warm_start_then_fixed_step():
    est = AcceptanceEstimator(default=0.5, decay=1.0, alpha=0.1, prior_weight=4.0, pool_alpha=0.01)
    est.update("r", "draft", 1, 1)  # first observation: step 1 / (1 + 4)
    assert est.estimate("r", "draft", 1) == (pytest.approx(0.6),)
    for _ in range(20):
        est.update("r", "draft", 1, 0)
    expected = 0.6
    for seen in range(2, 22):  # step 1 / (seen + 4) until it falls to alpha
        expected -= max(0.1, 1 / (seen + 4)) * expected
    assert est.estimate("r", "draft", 1) == (pytest.approx(expected),)


def test_a_new_request_starts_from_its_workload_pool():
    est = AcceptanceEstimator(default=0.5, decay=1.0, pool_alpha=0.2, optimism=0.0)
    for i in range(30):
        est.update(f"old{i}", "draft", 3, 3, workload="code")
    code = est.estimate("new", "draft", 3, workload="code")
    assert all(rate > 0.95 for rate in code)
    assert est.estimate("new", "draft", 1, workload="prose") == (0.5,)
    assert est.prior("draft", "code")[:3] == code
    est.set_prior("draft", "code", (0.4,))  # fresh shared stats replace the pool
    assert est.prior("draft", "code")[0] == 0.4


def test_forget_retain_and_estimates_per_proposer():
    est = AcceptanceEstimator(default=0.5, decay=1.0, alpha=0.5, pool_alpha=0.01)
    for rid in ("a", "b", "c"):
        est.update(rid, "draft", 1, 1, workload="code")
    est.forget("a")
    est.retain(["b"])
    assert set(est._rates) == {"b"} and set(est._workload) == {"b"}
    rates = est.estimates("b", ("draft", "ngram"), 2)
    assert set(rates) == {"draft", "ngram"} and rates["draft"][0] > rates["ngram"][0]


def test_observe_outcome_and_drain_counts():
    est = AcceptanceEstimator(max_depth=8)
    rows = (
        RequestOutcome("a", "code", "draft", 4, 4, 2, 3),
        RequestOutcome("b", "code", "draft", 3, 3, 3, 4),
        RequestOutcome("c", "prose", "ngram", 2, 2, 0, 1),
        RequestOutcome("d", "prose", None, 0, 0, 0, 1),
    )
    est.observe(Outcome(rows, 0.2, {}, {}, 5, 100, 0.3))
    counts = est.drain_counts()
    assert set(counts) == {("draft", "code"), ("ngram", "prose")}
    code = counts[("draft", "code")]
    assert code.drafted == [2, 2, 2, 1]
    assert code.reached == [2, 2, 2, 0]  # a: rejected at position 2, so position 3 was never judged
    assert code.accepted == [2, 2, 1, 0]
    assert code.conditional() == (1.0, 1.0, 0.5, None)
    assert counts[("ngram", "prose")] == PositionCounts([1, 1], [1, 0], [0, 0])
    assert est.drain_counts() == {}


def test_an_estimate_not_drafted_with_relaxes_back_to_the_pool():
    # Three rejections in a row push a request below its class's 0.63; plain steps bring it back.
    est = AcceptanceEstimator(
        {("draft", "prose"): (0.63,)}, max_depth=2, relax=0.05, prior_weight=4.0, pool_alpha=0.05
    )
    est.start("r", "prose")
    for _ in range(3):
        est.observe(Outcome((RequestOutcome("r", "prose", "draft", 1, 1, 0, 1),), 0.1, {}, {}, 2, 10, 0.1))
    low = est.estimate("r", "draft", 1)[0]
    assert low < 0.4
    plain = Outcome((RequestOutcome("r", "prose", None, 0, 0, 0, 1),), 0.1, {}, {}, 1, 10, 0.1)
    est.observe(plain)
    gap = est.prior("draft", "prose")[0] - low
    assert est.estimate("r", "draft", 1)[0] == pytest.approx(low + 0.05 * gap)
    for _ in range(60):
        est.observe(plain)
    # the pool learned from the rejections too (0.63 -> 0.54); the request is back near it
    assert est.estimate("r", "draft", 1)[0] == pytest.approx(est.prior("draft", "prose")[0], abs=0.02)
    frozen = AcceptanceEstimator({("draft", "prose"): (0.63,)}, max_depth=2, relax=0.0)
    frozen.start("r", "prose")
    frozen.update("r", "draft", 1, 0)
    before = frozen.estimate("r", "draft", 1)
    frozen.observe(plain)
    assert frozen.estimate("r", "draft", 1) == before


def test_bad_parameters():
    with pytest.raises(ValueError):
        AcceptanceEstimator(relax=1.5)
    with pytest.raises(ValueError):
        AcceptanceEstimator(alpha=0.0)
    with pytest.raises(ValueError):
        AcceptanceEstimator({("draft",): (0.5,)})


def test_positions_never_drafted_follow_the_deepest_observed_one():
    """A request that only ever drafts one token still learns that deeper drafts would pay
    (otherwise deeper positions stay at the default and a policy never tries them)."""
    est = AcceptanceEstimator(default=0.5, decay=0.9, max_depth=4, optimism=0.0)
    est.start("r", "code")
    for _ in range(30):
        est.update("r", "draft", drafted=1, accepted=1)
    rates = est.estimate("r", "draft", 4)
    assert rates[0] > 0.95
    assert rates[1:] == pytest.approx([rates[0] * 0.9, rates[0] * 0.81, rates[0] * 0.729])
    # the pool (what a new request of the class starts from) extrapolates the same way
    est.start("new", "code")
    pool = est.estimate("new", "draft", 4)
    assert pool[0] > 0.5 and pool[1] == pytest.approx(pool[0] * 0.9)
    # an explicit prior counts as evidence at every position of its pool: a new request of the
    # class starts from it unchanged
    est.set_prior("draft", "json", (0.9, 0.2, 0.2, 0.2))
    est.start("j", "json")
    assert est.estimate("j", "draft", 4) == pytest.approx((0.9, 0.2, 0.2, 0.2))
    # ... while a request's own estimate leans on what the request itself showed
    est.update("j", "draft", drafted=1, accepted=1)
    assert est.estimate("j", "draft", 4)[1] > 0.5


def test_one_unlucky_request_moves_its_class_little_by_default():
    # Ten rejections in a row from one request: its own estimate drops, while its class's pool (what
    # the next request of the class starts from) stays above the 0.5 that draft depth 1 needs here.
    est = AcceptanceEstimator({("draft", "prose"): (0.63,)}, max_depth=2)
    est.start("r", "prose")
    for _ in range(10):
        est.update("r", "draft", 1, 0)
    assert est.estimate("r", "draft", 1)[0] < 0.35
    assert est.prior("draft", "prose")[0] > 0.5
    fast = AcceptanceEstimator({("draft", "prose"): (0.63,)}, max_depth=2, pool_alpha=0.05)
    fast.start("r", "prose")
    for _ in range(10):
        fast.update("r", "draft", 1, 0)
    assert fast.prior("draft", "prose")[0] < 0.4


def test_a_guess_is_explored_optimistically_until_judged():
    """A cold cluster's registered acceptance (a prior for every workload, "*") or the default is a
    guess: a pool that starts from it reads optimistic by optimism x (1 - rate) x w / (n + w) and
    averages its first verdicts with it, so a policy tries the proposer instead of trusting a
    pessimistic guess forever (the cold trap). Measured evidence (a prior for the very workload,
    the shared statistics) is taken as given."""
    est = AcceptanceEstimator({("draft", "*"): (0.5,)}, decay=1.0, max_depth=2, prior_weight=8.0,
                              pool_alpha=0.02, optimism=0.5)  # fmt: skip
    assert est.estimate("new", "draft", 1, workload="code") == (pytest.approx(0.75),)  # 0.5 + 0.5 * 0.5
    for i in range(8):  # eight requests each see position 0 rejected
        est.update(f"r{i}", "draft", drafted=1, accepted=0, workload="code")
    # the pool's steps 1 / (n + 8) leave 0.5 * 8 / 16; the optimism fades to 8 / 16 of its start
    pool = 0.5 * 8 / 16
    assert est.prior("draft", "code")[0] == pytest.approx(pool + 0.5 * (1 - pool) * 8 / 16)
    assert est.estimate("new", "draft", 1, workload="prose") == (pytest.approx(0.75),)  # another pool
    est.set_prior("draft", "json", (0.5,))  # the shared statistics for json: evidence
    assert est.estimate("new", "draft", 1, workload="json") == (0.5,)
    est.update("j", "draft", drafted=1, accepted=0, workload="json")
    assert est.prior("draft", "json")[0] == pytest.approx(0.5 - 0.02 * 0.5)  # pool_alpha steps
    with pytest.raises(ValueError, match="optimism"):
        AcceptanceEstimator(optimism=1.5)
