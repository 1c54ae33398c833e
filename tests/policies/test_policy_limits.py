"""Every policy obeys the request's override, the depth caps and the loaded proposers."""

from __future__ import annotations

import random

import pytest

from policies import Decision, PolicyConfig, create_policy, registered_policies
from policies.limits import allowed_proposers, clamp, depth_cap, pick_proposer
from tests.policies.helpers import batch, outcome, request, step

ALL = sorted(registered_policies())
SPECULATING = [name for name in ALL if name != "plain"]


def build(name: str, **config):
    return create_policy(name, PolicyConfig(default_proposer="draft", **config))


def check(decisions, view) -> None:
    assert len(decisions) == view.batch_size
    for d, r in zip(decisions, view.requests, strict=True):
        assert isinstance(d, Decision)
        assert (d.proposer is None) == (d.depth == 0), d
        assert d.depth <= depth_cap(r, view, proposer=d.proposer), (d, r)
        assert d.proposer is None or d.proposer in allowed_proposers(r, view), (d, r)


@pytest.mark.parametrize("name", ALL)
def test_random_steps_stay_within_limits(name):
    rng = random.Random(name)
    policy = build(name)
    for _ in range(150):
        requests = [
            request(
                f"r{rng.randrange(12)}-{i}",
                draft=rng.random(),
                ngram=rng.random(),
                prompt=rng.choice([10, 200, 3000]),
                generated=rng.randrange(50),
                left=rng.choice([1, 2, 3, 5, 40, 500]),
                mode=rng.choice(["auto", "auto", "off", "draft", "ngram", "medusa"]),
                max_depth=rng.choice([None, None, 0, 1, 3]),
                positions=rng.choice([0, 3, 16]),
                draftable=rng.choice([None, {"ngram": 0}, {"ngram": rng.randrange(1, 6)}]),
            )
            for i in range(rng.choice([1, 1, 2, 4, 8, 32]))
        ]
        view = step(
            requests,
            proposers=rng.choice([("draft", "ngram"), ("ngram",), ()]),
            max_depth=rng.choice([0, 4, 8]),
        )
        decisions = policy.decide(view)
        check(decisions, view)
        policy.observe(outcome(decisions, view, [rng.randrange(9) for _ in requests]))


@pytest.mark.parametrize("name", ALL)
def test_off_means_plain(name):
    view = batch(3, mode="off", draft=0.99)
    assert build(name).decide(view) == [Decision.plain()] * 3


@pytest.mark.parametrize("name", SPECULATING)
def test_a_forced_proposer_is_the_only_one_and_speculates(name):
    for batch_size in (1, 32):  # even where the policy would go plain by itself
        view = batch(batch_size, mode="ngram", draft=0.99, ngram=0.05)
        for d in build(name).decide(view):
            assert d.proposer == "ngram" and d.depth >= 1


def test_plain_ignores_a_forced_proposer():
    assert build("plain").decide(batch(2, mode="draft")) == [Decision.plain()] * 2


@pytest.mark.parametrize("name", ALL)
def test_a_forced_proposer_that_is_not_loaded_decodes_plain(name):
    assert build(name).decide(batch(2, mode="medusa")) == [Decision.plain()] * 2


@pytest.mark.parametrize("name", SPECULATING)
def test_depth_caps(name):
    policy = build(name, default_depth=8)
    checks = [
        (batch(1, left=1), 0),  # the target's own token is the last one
        (batch(1, left=3), 2),
        (batch(1, max_depth=1), 1),  # the request's cap
        (batch(1, max_depth=0), 0),
        (step([request()], max_depth=2), 2),  # the server's
        (step([request()], max_depth=0), 0),
    ]
    for view, cap in checks:
        for d in policy.decide(view):
            assert d.depth <= cap
    assert build(name, max_depth=2).decide(batch(1, mode="draft"))[0].depth <= 2  # the policy's own


@pytest.mark.parametrize("name", ALL)
def test_no_proposers_loaded_means_plain(name):
    assert build(name).decide(batch(4, proposers=())) == [Decision.plain()] * 4


@pytest.mark.parametrize("name", ALL)
def test_empty_step(name):
    assert build(name).decide(step([])) == []


def test_limit_helpers():
    view = step([request(mode="ngram"), request(mode="off"), request(left=4, max_depth=9)], max_depth=5)
    r_forced, r_off, r_auto = view.requests
    assert allowed_proposers(r_forced, view) == ("ngram",)
    assert allowed_proposers(r_off, view) == ()
    assert allowed_proposers(r_auto, view) == ("draft", "ngram")
    assert depth_cap(r_auto, view) == 3 and depth_cap(r_auto, view, 2) == 2
    assert pick_proposer(r_forced, view, "draft") == "ngram"
    assert pick_proposer(r_auto, view, None) == "draft"
    assert pick_proposer(r_auto, view, "medusa") is None
    assert clamp(Decision("draft", 7), r_auto, view) == Decision("draft", 3)
    assert clamp(Decision("draft", 0), r_auto, view) == Decision.plain()
    assert clamp(Decision("draft", 2), r_forced, view) == Decision.plain()


@pytest.mark.parametrize("name", SPECULATING)
def test_a_lookup_with_nothing_to_propose_is_never_chosen(name):
    # n-gram said it has no match (draftable 0): forcing it decodes plain, auto never picks it.
    forced = batch(3, draft=0.9, ngram=0.99, mode="ngram", draftable={"ngram": 0})
    assert build(name).decide(forced) == [Decision.plain()] * 3
    short = batch(2, draft=0.1, ngram=0.99, mode="ngram", draftable={"ngram": 2})
    assert all(d.depth <= 2 for d in build(name).decide(short))
    auto = batch(2, draft=0.9, ngram=0.99, draftable={"ngram": 0})
    assert all(d.proposer != "ngram" for d in build(name).decide(auto))


def test_depth_cap_per_proposer():
    view = step([request(left=50, draftable={"ngram": 3})], max_depth=8)
    r = view.requests[0]
    assert depth_cap(r, view) == 8 and depth_cap(r, view, proposer="draft") == 8
    assert depth_cap(r, view, proposer="ngram") == 3
    assert clamp(Decision("ngram", 6), r, view) == Decision("ngram", 3)
    gone = step([request(draftable={"ngram": 0})])
    assert clamp(Decision("ngram", 6), gone.requests[0], gone) == Decision.plain()
