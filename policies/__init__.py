"""The decision layer: which proposer and how deep to speculate, per request and per step.

Pure Python (numpy for the cost model's fit); imports nothing from ``serve_app``. Importing this
package registers the built-in policies: plain, static, batch-threshold, heuristic, goodput (the
default) and bandit. See ``policies.base`` for the contracts and ``policies.limits`` for the
limits every policy obeys. The trace simulator is ``policies.simulate`` (import it from there).
"""

from policies import bandit, batch_threshold, goodput, heuristic, plain, static  # noqa: F401  (registers)
from policies.acceptance import AcceptanceEstimator, PositionCounts
from policies.base import (
    Continuation,
    CostModel,
    Decision,
    Outcome,
    Policy,
    RequestOutcome,
    RequestView,
    StepView,
)
from policies.continuation import ContinuationEstimator
from policies.cost_model import FittedCostModel, draft_profile_plan, profile_plan
from policies.registry import (
    DEFAULT_POLICY,
    FIXED_POLICY,
    PLAIN_POLICY,
    PolicyConfig,
    create_policy,
    policy_uses_cost_model,
    register_policy,
    registered_policies,
)
from policies.workload import classify

__all__ = [
    "DEFAULT_POLICY",
    "FIXED_POLICY",
    "PLAIN_POLICY",
    "AcceptanceEstimator",
    "Continuation",
    "ContinuationEstimator",
    "CostModel",
    "Decision",
    "FittedCostModel",
    "Outcome",
    "Policy",
    "PolicyConfig",
    "PositionCounts",
    "RequestOutcome",
    "RequestView",
    "StepView",
    "classify",
    "create_policy",
    "draft_profile_plan",
    "policy_uses_cost_model",
    "profile_plan",
    "register_policy",
    "registered_policies",
]
