"""plain, static, batch-threshold and heuristic: fixed rules, easy to state exactly."""

from __future__ import annotations

import pytest

from policies import Decision, PolicyConfig, create_policy
from policies.batch_threshold import parse_table
from tests.policies.helpers import batch, outcome, request, step


def test_plain_never_speculates():
    policy = create_policy("plain")
    assert policy.decide(batch(4, draft=1.0)) == [Decision.plain()] * 4


def test_static_uses_the_configured_proposer_and_depth():
    policy = create_policy("static", PolicyConfig(default_proposer="ngram", default_depth=5))
    assert policy.decide(batch(3)) == [Decision("ngram", 5)] * 3
    assert policy.decide(batch(32, draft=0.0, ngram=0.0)) == [Decision("ngram", 5)] * 32
    view = step([request(left=3), request(mode="draft"), request(max_depth=2)])
    assert policy.decide(view) == [Decision("ngram", 2), Decision("draft", 5), Decision("ngram", 2)]


def test_static_without_a_proposer_takes_the_first_loaded_and_an_absent_one_is_plain():
    assert create_policy("static").decide(batch(1)) == [Decision("draft", 4)]
    absent = create_policy("static", PolicyConfig(default_proposer="eagle"))
    assert absent.decide(batch(1)) == [Decision.plain()]
    assert absent.decide(batch(1, mode="ngram")) == [Decision("ngram", 4)]


def test_static_depth_zero_is_plain_unless_forced():
    policy = create_policy("static", PolicyConfig(default_proposer="draft", default_depth=0))
    assert policy.decide(batch(1)) == [Decision.plain()]
    assert policy.decide(batch(1, mode="draft")) == [Decision("draft", 1)]


def test_batch_threshold_table():
    config = PolicyConfig(default_proposer="draft", params={"table": {"1": 6, 2: 5, 4: 3, 8: 2}})
    policy = create_policy("batch-threshold", config)
    expected = {1: 6, 2: 5, 3: 3, 4: 3, 5: 2, 8: 2, 9: 0, 32: 0}
    for size, depth in expected.items():
        want = Decision("draft", depth) if depth else Decision.plain()
        assert policy.decide(batch(size)) == [want] * size, size


def test_batch_threshold_default_table_and_caps():
    policy = create_policy("batch-threshold", PolicyConfig(default_proposer="draft", max_depth=4))
    assert policy.decide(batch(1)) == [Decision("draft", 4)]  # 6 from the table, capped at 4
    assert policy.decide(batch(16)) == [Decision.plain()] * 16
    assert policy.decide(batch(16, mode="draft")) == [Decision("draft", 1)] * 16


@pytest.mark.parametrize("table", [{}, {0: 3}, {1: -1}, {"x": 2}, [1, 2]])
def test_batch_threshold_rejects_bad_tables(table):
    with pytest.raises(ValueError, match="batch-threshold"):
        create_policy("batch-threshold", PolicyConfig(params={"table": table}))


def test_parse_table_sorts_bounds():
    assert parse_table({8: 2, 1: 6}) == ((1, 6), (8, 2))


def test_heuristic_schedule_grows_by_two_and_shrinks_by_one_never_below_one():
    policy = create_policy("heuristic", PolicyConfig(default_proposer="draft", default_depth=3, max_depth=10))
    view = batch(1)
    depths = []
    # full, full, partial, partial, rejected at once x4, full
    for accepted in [99, 99, 2, 0, 0, 0, 0, 0, 99]:
        decisions = policy.decide(view)
        depths.append(decisions[0].depth)
        policy.observe(outcome(decisions, view, [accepted]))
    assert depths == [3, 5, 7, 6, 5, 4, 3, 2, 1]
    assert policy.decide(view)[0].depth == 3
    for _ in range(10):
        decisions = policy.decide(view)
        policy.observe(outcome(decisions, view, [99]))
    assert policy.depths["r0"] == 10  # the schedule stops at the policy's own max_depth
    assert policy.decide(view)[0].depth == 8  # and the step's max_depth caps the decision


def test_heuristic_keeps_state_per_request_and_drops_finished_ones():
    policy = create_policy("heuristic", PolicyConfig(default_proposer="draft", default_depth=4))
    view = step([request("a"), request("b")])
    decisions = policy.decide(view)
    policy.observe(outcome(decisions, view, [99, 0]))
    assert [d.depth for d in policy.decide(view)] == [6, 3]
    policy.decide(step([request("b")]))
    assert set(policy.depths) == {"b"}
    assert [d.depth for d in policy.decide(view)] == [4, 3]  # "a" came back: a fresh start


def test_heuristic_ignores_steps_without_a_draft():
    policy = create_policy("heuristic", PolicyConfig(default_proposer="ngram", default_depth=4))
    view = batch(1)
    decisions = policy.decide(view)
    policy.observe(outcome([Decision.plain()], view, [0]))
    assert policy.decide(view) == decisions
