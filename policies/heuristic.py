"""``heuristic``: transformers' assisted-generation schedule, per request.

Each request starts at ``default_depth``; after a step whose draft was fully accepted its depth
grows by 2, otherwise it shrinks by 1, never below 1 (transformers' "heuristic"
``num_assistant_tokens_schedule``). Steps where the proposer drafted nothing leave it unchanged.
The proposer is ``default_proposer`` (or the request's forced one). State lives per request id and
is dropped when the request no longer appears in a step.
"""

from __future__ import annotations

from policies.base import Decision, Outcome, StepView
from policies.limits import fixed
from policies.registry import PolicyConfig, register_policy

GROW = 2
SHRINK = 1


class HeuristicPolicy:
    name = "heuristic"

    def __init__(self, proposer: str | None, start_depth: int, max_depth: int) -> None:
        self.proposer = proposer
        self.start_depth = max(1, start_depth)
        self.max_depth = max_depth
        self.depths: dict[str, int] = {}  # request id -> its current schedule depth

    def decide(self, step: StepView) -> list[Decision]:
        ids = {r.request_id for r in step.requests}
        for gone in [rid for rid in self.depths if rid not in ids]:
            del self.depths[gone]
        decisions = []
        for request in step.requests:
            depth = self.depths.setdefault(request.request_id, self.start_depth)
            decisions.append(fixed(request, step, self.proposer, depth, self.max_depth))
        return decisions

    def observe(self, outcome: Outcome) -> None:
        for r in outcome.requests:
            if r.proposer is None or r.drafted <= 0 or r.request_id not in self.depths:
                continue
            depth = self.depths[r.request_id]
            depth = depth + GROW if r.accepted >= r.drafted else depth - SHRINK
            self.depths[r.request_id] = max(1, min(depth, max(1, self.max_depth)))


@register_policy("heuristic", "transformers' schedule: +2 after a fully accepted draft, -1 otherwise")
def _build(config: PolicyConfig) -> HeuristicPolicy:
    config.check_params("heuristic", ())
    return HeuristicPolicy(config.default_proposer, config.default_depth, config.max_depth)
