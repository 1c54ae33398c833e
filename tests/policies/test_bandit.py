"""bandit: UCB1 over (proposer, depth) arms per workload class."""

from __future__ import annotations

import random
from collections import Counter

from policies import Decision, Outcome, PolicyConfig, RequestOutcome, create_policy
from policies.bandit import PLAIN, BanditPolicy
from tests.policies.helpers import request, step

# Mean reward (tokens per second) of each arm for "code"; the best is (draft, 4).
MEANS = {PLAIN: 7.0, ("draft", 2): 10.0, ("draft", 4): 13.0, ("draft", 6): 11.0, ("draft", 8): 9.0}
MEANS.update({("ngram", d): 8.0 for d in (2, 4, 6, 8)})


def play(policy: BanditPolicy, rounds: int, workload: str = "code", batch: int = 1, seed: int = 0) -> Counter:
    rng = random.Random(seed)
    pulls: Counter = Counter()
    for t in range(rounds):
        view = step([request(f"{workload}{t}-{i}", workload=workload) for i in range(batch)])
        rows = []
        for r, d in zip(view.requests, policy.decide(view), strict=True):
            arm = (d.proposer, d.depth)
            pulls[arm] += 1
            rows.append(RequestOutcome(r.request_id, workload, d.proposer, d.depth, d.depth, 0, 1))
        # One step for all: the reward of a request is emitted / step_seconds; noisy around the mean.
        reward = MEANS[(rows[0].proposer, rows[0].depth)] * rng.uniform(0.8, 1.2)
        policy.observe(Outcome(tuple(rows), 1 / reward, {}, {}, 1, 200, 1 / reward))
    return pulls


def test_converges_to_the_best_arm():
    policy = create_policy("bandit", PolicyConfig())
    assert isinstance(policy, BanditPolicy)
    pulls = play(policy, 3000)
    assert policy.best_arm("code") == ("draft", 4)
    assert pulls.most_common(1)[0][0] == ("draft", 4)
    assert set(pulls) == set(MEANS)  # every arm was tried
    late = play(policy, 300, seed=1)
    assert late[("draft", 4)] > 0.5 * 300


def test_arms_come_from_config_and_the_loaded_proposers():
    policy = create_policy("bandit", PolicyConfig(params={"depths": [0, 3], "exploration": 0.5}))
    assert policy.arms(("draft", "ngram")) == [PLAIN, ("draft", 3), ("ngram", 3)]
    assert policy.exploration == 0.5


def test_untried_arms_first_and_spread_within_a_step():
    policy = create_policy("bandit", PolicyConfig())
    view = step([request(f"r{i}") for i in range(9)])
    decisions = policy.decide(view)
    assert len({(d.proposer, d.depth) for d in decisions}) == 9  # 9 arms, 9 requests: one each
    assert decisions[0] == Decision.plain()


def test_classes_learn_separately():
    policy = create_policy("bandit", PolicyConfig())
    play(policy, 200, workload="code")
    assert policy.best_arm("code") is not None
    assert policy.best_arm("prose") is None
    assert policy.decide(step([request(workload="prose")])) == [Decision.plain()]  # untried: first arm


def test_forced_proposer_and_caps_restrict_the_arms():
    policy = create_policy("bandit", PolicyConfig())
    for _ in range(20):
        [d] = policy.decide(step([request(mode="ngram", max_depth=5)]))
        assert d.proposer == "ngram" and d.depth in (2, 4)
        policy.observe(
            Outcome((RequestOutcome("r0", "code", "ngram", d.depth, d.depth, 1, 2),), 0.1, {}, {}, 1, 9, 0.1)
        )
    [d] = policy.decide(step([request(mode="ngram", max_depth=1)]))  # no arm that shallow: depth 1
    assert d == Decision("ngram", 1)
    assert "r0" not in policy.pending


def test_observe_ignores_unknown_requests_and_bad_steps():
    policy = create_policy("bandit", PolicyConfig())
    policy.decide(step([request("a")]))
    policy.observe(Outcome((RequestOutcome("a", "code", None, 0, 0, 0, 1),), 0.0, {}, {}, 1, 9, 0.0))
    assert policy.best_arm("code") is None and "a" in policy.pending
    policy.observe(Outcome((RequestOutcome("zzz", "code", None, 0, 0, 0, 1),), 0.1, {}, {}, 1, 9, 0.1))
    assert policy.best_arm("code") is None
