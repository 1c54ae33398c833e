"""Self-speculation in the cost model and the goodput policy: admitting a request to a proposer that
drafts from the target's own KV cache costs no prefill, and where self-speculation's measured cost
and acceptance lose to plain decoding the policy stays plain."""

from __future__ import annotations

import json

from policies import FittedCostModel, PolicyConfig, RequestView, create_policy
from tests.policies.helpers import qwen_cpu_cost, step


def view(rid: str, acceptance: dict[str, float], prompt: int = 200, left: int = 100) -> RequestView:
    return RequestView(
        request_id=rid, prompt_len=prompt, generated=0, tokens_left=left, temperature=0.0, workload="code",
        acceptance={p: (a,) * 16 for p, a in acceptance.items()}, override_mode="auto",
        override_max_depth=None,
    )  # fmt: skip


def test_no_prefill_proposers_cost_nothing_to_admit_and_persist() -> None:
    cost = FittedCostModel(draft={"self": (0.03, 0.0, 0.0), "draft": (0.03, 0.0, 0.0)})
    assert cost.draft_prefill_time("self", 640) == cost.draft_prefill_time("draft", 640) > 0
    cost.mark_no_prefill("self")
    assert cost.draft_prefill_time("self", 640) == 0.0
    assert cost.draft_prefill_time("draft", 640) == 0.03 * 10  # one forward per 64 tokens
    assert cost.draft_time("self", 1, 640) == 0.03  # the draft STEP still costs what it costs
    copy = FittedCostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert copy.no_prefill == {"self"} and copy.draft_prefill_time("self", 640) == 0.0
    old = {k: v for k, v in cost.to_dict().items() if k != "no_prefill"}  # written before the field
    assert FittedCostModel.from_dict(old).no_prefill == set()


def test_a_long_prompt_near_its_end_self_speculates_only_without_a_prefill_charge() -> None:
    """3000 prompt tokens, 10 left: a draft model's prefill (47 forwards) is never repaid, a cheap
    self draft (a quarter of a target step, 90% accepted) drafting in the target's cache pays."""
    policy = create_policy("goodput", PolicyConfig())
    request = view("r", {"self": 0.9}, prompt=3000, left=10)
    charged = qwen_cpu_cost()
    charged.set_draft("self", (0.033, 0.0, 0.0))
    (decision,) = policy.decide(step([request], proposers=("self",), cost=charged))
    assert decision.depth == 0
    free = FittedCostModel.from_dict(charged.to_dict())
    free.mark_no_prefill("self")
    policy = create_policy("goodput", PolicyConfig())
    (decision,) = policy.decide(step([request], proposers=("self",), cost=free))
    assert decision.proposer == "self" and decision.depth >= 1


def test_goodput_stays_plain_where_self_speculation_loses() -> None:
    """Shaped like SmolLM2-135M on the AVX2 machine (BENCHMARKS.md, skip curve): a plain step 35 ms,
    each further verified token +23 ms; the calibrated self draft 0.87 of a plain step, 86% accepted:
    1.86 tokens per 0.088 s < 1 token per 0.035 s, at every batch size and depth."""
    cost = FittedCostModel(target=(0.012, 0.0, 0.023, 0.0), knee=64, draft={"self": (0.030, 0.0, 0.0)})
    cost.mark_no_prefill("self")
    policy = create_policy("goodput", PolicyConfig())
    for size in (1, 2, 4, 8):
        requests = [view(f"r{i}", {"self": 0.86, "ngram": 0.0}) for i in range(size)]
        decisions = policy.decide(step(requests, proposers=("self", "ngram"), cost=cost))
        assert all(d.depth == 0 or d.proposer != "self" for d in decisions), decisions
