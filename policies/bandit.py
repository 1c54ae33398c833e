"""``bandit``: UCB1 over arms (proposer, depth), plain included, learned per workload class.

Arms: plain plus every (proposer, depth) for the configured ``depths`` (default 0, 2, 4, 6, 8;
0 is the plain arm) and every proposer the replica loaded. Each request pulls one arm per step; the
reward is the tokens it emitted per second of that step (emitted / step_seconds), so an arm that
makes the whole batch's step slower pays for it in every request's reward. UCB1 (Auer et al. 2002):

    score(arm) = mean(arm) + c * scale * sqrt(2 ln N / n(arm))

with N the class's pulls, n(arm) the arm's, ``c`` = params ``exploration`` (default 1.0) and
``scale`` the best mean of the class (rewards are not in [0, 1]). An arm never pulled is tried
first (in arm order). Requests of one class in one step count their picks as pulls already, so
they spread over untried arms instead of all trying the same one. Only arms within a request's
limits compete (a forced proposer leaves that proposer's arms, without plain); a request with no
arm within its limits gets its forced proposer at its cap, and that step teaches nothing.
Deterministic: ties go to the first arm.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.base import Decision, Outcome, RequestView, StepView
from policies.limits import allowed_proposers, clamp, depth_cap, forced_proposer
from policies.registry import PolicyConfig, register_policy

Arm = tuple[str | None, int]
PLAIN: Arm = (None, 0)
DEFAULT_DEPTHS = (0, 2, 4, 6, 8)


class _ArmStats:
    __slots__ = ("mean", "pulls")

    def __init__(self) -> None:
        self.pulls = 0
        self.mean = 0.0


class BanditPolicy:
    name = "bandit"

    def __init__(self, depths: Sequence[int] = DEFAULT_DEPTHS, exploration: float = 1.0, max_depth: int = 8):
        if not depths or any(int(d) < 0 for d in depths):
            raise ValueError(f"bandit: depths must be a non-empty list of ints >= 0: {depths!r}")
        self.depths = tuple(sorted({int(d) for d in depths}))
        self.exploration = exploration
        self.max_depth = max_depth
        self.stats: dict[str, dict[Arm, _ArmStats]] = {}  # workload -> arm -> stats
        self.pending: dict[str, tuple[str, Arm]] = {}  # request id -> (workload, arm) of the last step

    def arms(self, proposers: Sequence[str]) -> list[Arm]:
        return [PLAIN] + [(p, d) for p in proposers for d in self.depths if d > 0]

    def _feasible(self, request: RequestView, step: StepView) -> list[Arm]:
        allowed = allowed_proposers(request, step)
        cap = depth_cap(request, step, self.max_depth)
        arms = [] if forced_proposer(request) is not None else [PLAIN]
        return arms + [(p, d) for p, d in self.arms(step.proposers)[1:] if p in allowed and d <= cap]

    def _choose(self, workload: str, feasible: list[Arm], picked: dict[Arm, int]) -> Arm:
        stats = self.stats.setdefault(workload, {})
        empty = _ArmStats()
        pulls = {arm: stats.get(arm, empty).pulls + picked.get(arm, 0) for arm in feasible}
        for arm in feasible:
            if pulls[arm] == 0:
                return arm
        total = sum(s.pulls for s in stats.values()) + sum(picked.values())
        scale = max((s.mean for s in stats.values() if s.pulls), default=1.0) or 1.0
        best, best_score = feasible[0], -math.inf
        for arm in feasible:
            bonus = self.exploration * scale * math.sqrt(2.0 * math.log(total) / pulls[arm])
            score = stats.get(arm, empty).mean + bonus
            if score > best_score + 1e-12:
                best, best_score = arm, score
        return best

    def decide(self, step: StepView) -> list[Decision]:
        self.pending = {}
        picked: dict[str, dict[Arm, int]] = {}
        decisions = []
        for request in step.requests:
            feasible = self._feasible(request, step)
            if not feasible:  # a forced proposer whose arms are all deeper than the cap
                cap = depth_cap(request, step, self.max_depth)
                decisions.append(
                    clamp(Decision(forced_proposer(request), cap), request, step, self.max_depth)
                )
                continue
            in_step = picked.setdefault(request.workload, {})
            arm = self._choose(request.workload, feasible, in_step)
            in_step[arm] = in_step.get(arm, 0) + 1
            self.pending[request.request_id] = (request.workload, arm)
            decisions.append(clamp(Decision(*arm), request, step, self.max_depth))
        return decisions

    def observe(self, outcome: Outcome) -> None:
        if outcome.step_seconds <= 0:
            return
        for r in outcome.requests:
            pending = self.pending.get(r.request_id)
            if pending is None:
                continue
            workload, arm = pending
            stats = self.stats.setdefault(workload, {}).setdefault(arm, _ArmStats())
            stats.pulls += 1
            stats.mean += (r.emitted / outcome.step_seconds - stats.mean) / stats.pulls
        self.pending = {}

    def best_arm(self, workload: str) -> Arm | None:
        """The arm with the best mean reward so far for ``workload`` (None before any pull)."""
        stats = [
            (s.mean, -i, arm) for i, (arm, s) in enumerate(self.stats.get(workload, {}).items()) if s.pulls
        ]
        return max(stats)[2] if stats else None


@register_policy(
    "bandit",
    "UCB1 over (proposer, depth) arms incl. plain per workload; reward tokens/s",
    uses_cost_model=True,
)
def _build(config: PolicyConfig) -> BanditPolicy:
    config.check_params("bandit", ("depths", "exploration"))
    depths = config.params.get("depths", DEFAULT_DEPTHS)
    exploration = float(config.params.get("exploration", 1.0))  # type: ignore[arg-type]
    if exploration < 0:
        raise ValueError(f"bandit: exploration must be >= 0: {exploration}")
    return BanditPolicy(tuple(depths), exploration, config.max_depth)  # type: ignore[arg-type]
