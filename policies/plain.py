"""``plain``: never speculate (the baseline every other policy is measured against).

A request's proposer override does not change this: the server chose to run without speculation.
"""

from __future__ import annotations

from policies.base import Decision, Outcome, StepView
from policies.registry import PolicyConfig, register_policy


class PlainPolicy:
    name = "plain"

    def decide(self, step: StepView) -> list[Decision]:
        return [Decision.plain() for _ in step.requests]

    def observe(self, outcome: Outcome) -> None:
        pass


@register_policy("plain", "never speculate: one target token per request per step")
def _build(config: PolicyConfig) -> PlainPolicy:
    config.check_params("plain", ())
    return PlainPolicy()
