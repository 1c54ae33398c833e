"""The trace simulator, and what it says about the policies under the CPU's cost shape."""

from __future__ import annotations

import pytest

from policies import Decision, PolicyConfig, create_policy
from policies.simulate import Trace, oracle_best_static, simulate, uniform_traces
from tests.policies.helpers import qwen_cpu_cost

# (prompt_len, output_len, conditional acceptance per proposer) per workload, as measured for the pair.
WORKLOADS = {
    "code": (200, 96, {"draft": 0.95, "ngram": 0.45}),
    "chat": (300, 96, {"draft": 0.78, "ngram": 0.25}),
    "prose": (150, 96, {"draft": 0.5, "ngram": 0.1}),
}


def run(name: str, traces, concurrency: int, **config):
    policy = create_policy(name, PolicyConfig(default_proposer="draft", **config))
    return simulate(policy, traces, qwen_cpu_cost(), concurrency)


def test_deterministic_for_a_seed_and_counts_add_up():
    traces = uniform_traces(WORKLOADS, 2)
    first, again = run("static", traces, 2), run("static", traces, 2)
    assert first == again
    assert first.tokens == sum(t.output_len for t in traces)
    assert first.drafted["draft"] >= first.accepted["draft"] > 0
    assert first.mean_draft_depth == pytest.approx(4.0, abs=0.5)
    other = simulate(create_policy("static"), traces, qwen_cpu_cost(), 2, seed=1)
    assert other.accepted != first.accepted


def test_plain_throughput_is_the_cost_model_s():
    traces = [Trace("prose", 100, 50)]
    result = simulate(create_policy("plain"), traces, qwen_cpu_cost(), 1, proposers=("draft",))
    cost = qwen_cpu_cost()
    expected = cost.target_time(1, 100, 0) + sum(cost.target_time(1, 1, 100 + g) for g in range(50))
    assert result.steps == 50
    assert result.seconds == pytest.approx(expected, rel=1e-3)


def test_recorded_runs_are_replayed_in_order():
    trace = Trace("code", 10, 40, first_rejected={"ngram": (3, 0, 5)})
    policy = create_policy("static", PolicyConfig(default_proposer="ngram", default_depth=4))
    result = simulate(policy, [trace], qwen_cpu_cost(), 1, include_prefill=False)
    # runs 3, 0, 5 -> kept 3, 0, 4 at depth 4: emitted 4, 1, 5 (10 tokens) four times
    assert result.accepted["ngram"] == sum([3, 0, 4] * 4)
    assert result.steps == 12 and result.tokens == 40


def test_a_policy_breaking_the_limits_is_caught():
    class Greedy:
        name = "greedy"

        def decide(self, step):
            return [Decision("draft", 99) for _ in step.requests]

        def observe(self, outcome):
            pass

    with pytest.raises(RuntimeError, match="breaks the limits"):
        simulate(Greedy(), [Trace("code", 10, 20, {"draft": (0.9,)})], qwen_cpu_cost(), 1)


def test_goodput_matches_the_best_static_choice_at_concurrency_1():
    traces = uniform_traces(WORKLOADS, 3)
    best, oracle, results = oracle_best_static(traces, qwen_cpu_cost(), 1)
    assert len(results) == 1 + 2 * 8 and best[0] is not None
    goodput = run("goodput", traces, 1)
    assert goodput.tokens_per_second >= 0.95 * oracle.tokens_per_second
    assert goodput.tokens_per_second >= 1.25 * results[(None, 0)].tokens_per_second


def test_goodput_never_loses_to_plain_at_concurrency_32():
    traces = uniform_traces(WORKLOADS, 16)
    plain = run("plain", traces, 32)
    goodput = run("goodput", traces, 32)
    static = run("static", traces, 32)
    assert goodput.tokens_per_second >= 0.98 * plain.tokens_per_second
    assert goodput.mean_draft_depth < 0.2
    assert static.tokens_per_second < 0.8 * plain.tokens_per_second  # what a fixed depth costs there


def test_goodput_at_middle_load_stays_near_the_better_of_plain_and_static():
    # At 4 requests the best choice gains only ~2% over plain: goodput must not lose much learning it.
    traces = uniform_traces(WORKLOADS, 4)
    results = {name: run(name, traces, 4).tokens_per_second for name in ("plain", "static", "goodput")}
    assert results["goodput"] >= 0.95 * max(results["plain"], results["static"])


def test_estimator_options_reach_the_estimator():
    # No priors: a request starts from the estimator's default acceptance. At default 0 without
    # optimism goodput expects nothing from a draft and stays plain (its relaxation pulls back
    # towards 0 too); at 0.9 it drafts from the first step; at default 0 with the default optimism
    # it tries the draft (the guess is not evidence) and learns that it pays.
    traces = uniform_traces({"code": WORKLOADS["code"]}, 2)
    policy = lambda: create_policy("goodput", PolicyConfig(default_proposer="draft"))  # noqa: E731
    cold = simulate(policy(), traces, qwen_cpu_cost(), 1, proposers=("draft",),
                    estimator_options={"default": 0.0, "optimism": 0.0})  # fmt: skip
    warm = simulate(policy(), traces, qwen_cpu_cost(), 1, proposers=("draft",),
                    estimator_options={"default": 0.9})  # fmt: skip
    explored = simulate(policy(), traces, qwen_cpu_cost(), 1, proposers=("draft",),
                        estimator_options={"default": 0.0})  # fmt: skip
    assert cold.drafted["draft"] == 0
    assert warm.drafted["draft"] > 0 and warm.tokens_per_second > cold.tokens_per_second
    assert explored.drafted["draft"] > 0 and explored.tokens_per_second > cold.tokens_per_second
