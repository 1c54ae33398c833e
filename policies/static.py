"""``static``: one fixed proposer at one fixed depth (``default_proposer``, ``default_depth``).

What ``--speculative-config`` with a fixed ``num_speculative_tokens`` does in vLLM. The depth is
still capped per request (tokens left, overrides, limits); a forced proposer replaces the
configured one.
"""

from __future__ import annotations

from policies.base import Decision, Outcome, StepView
from policies.limits import fixed
from policies.registry import PolicyConfig, register_policy


class StaticPolicy:
    name = "static"

    def __init__(self, proposer: str | None, depth: int, max_depth: int) -> None:
        self.proposer = proposer
        self.depth = depth
        self.max_depth = max_depth

    def decide(self, step: StepView) -> list[Decision]:
        return [fixed(r, step, self.proposer, self.depth, self.max_depth) for r in step.requests]

    def observe(self, outcome: Outcome) -> None:
        pass


@register_policy("static", "a fixed proposer at a fixed depth (default_proposer, default_depth)")
def _build(config: PolicyConfig) -> StaticPolicy:
    config.check_params("static", ())
    return StaticPolicy(config.default_proposer, config.depth, config.max_depth)
