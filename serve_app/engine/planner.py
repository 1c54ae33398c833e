"""SpeculationPlanner: asks the policy for each running request's (proposer, depth), and learns.

The scheduler decides who runs; the planner decides how each running request decodes this step.
It owns what a policy needs and the engine must not know about: the acceptance estimator (per
request, seeded with priors per (model pair, proposer, workload) from the shared statistics), the
how far drafts that may stop early go, the cost model (profiled at start, corrected online from
measured step times) and each request's
workload class. It also shapes each decision the policy makes into what the step runs: a draft
of a proposer that branches gets a token-tree budget (the request's ``tree_nodes``, else the
replica's ``speculation.tree_nodes``) and the floor its alternatives must pass, which the cost
model sets (``policies.trees``: an alternative joins only where its expected gain beats its
verify row). After every step it turns the measurements into an ``Outcome`` for the policy, the
estimator and the cost model, and into counts for the shared statistics sink.

The stats sink is anything with ``record(key, drafted, accepted)`` and ``priors(key)``, keys being
``(model_pair, proposer, workload)`` tuples: the serving layer passes an adapter over Redis-backed
``serve_app.observability.shared_stats.SharedStats``; the engine itself never imports Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from policies import AcceptanceEstimator, ContinuationEstimator, FittedCostModel, Policy, classify
from policies.acceptance import ANY
from policies.base import Decision, Outcome, RequestOutcome, RequestView, StepView
from policies.goodput import expected_tokens
from policies.trees import alternative_floor

log = logging.getLogger(__name__)

StatsKey = tuple[str, str, str]  # (model pair, proposer, workload)
DEFAULT_ACCEPTANCE = 0.5  # where a proposer has no estimate (goodput's default)


class StatsSink(Protocol):
    """Where acceptance counts go and priors come from (O(1), never blocking)."""

    def record(self, key: StatsKey, drafted: int, accepted: int) -> None: ...

    def priors(self, key: StatsKey) -> tuple[float, ...] | None: ...


@dataclass(frozen=True)
class PlannedRequest:
    """What the planner needs of a running request (the engine's Request has all of it)."""

    request_id: str
    prompt_len: int
    generated: int
    tokens_left: int
    temperature: float
    mode: str
    max_depth: int | None
    room: int  # draft tokens the KV cache can still take for this request
    draftable: Mapping[str, int] = field(default_factory=dict)  # lookahead proposers' draft lengths
    tree_nodes: int | None = None  # the request's tree budget (SpecOverride.tree_nodes)
    tree_row: bool = True  # whether it may verify a tree at all (drafting.tree_row)


class SpeculationPlanner:
    """Policy + acceptance estimates + cost model for one engine."""

    def __init__(
        self,
        policy: Policy,
        proposers: Sequence[str],
        max_depth: int,
        default_method: str | None,
        model_pair: str = "",
        cost: FittedCostModel | None = None,
        stats: StatsSink | None = None,
        cold_priors: Mapping[str, Sequence[float]] | None = None,
        trees: Mapping[str, int] | None = None,
    ) -> None:
        """``cold_priors``: proposer -> the acceptance to assume for it before any statistics, for
        every workload (what the proposer registered as ``cold_acceptance``); the shared statistics'
        priors per workload take precedence once they exist. ``trees``: proposer -> the alternatives
        its drafts may add as a token tree where a request does not say (``_shaped``)."""
        self.policy = policy
        self.proposers = tuple(proposers)
        self.trees = {p: n for p, n in (trees or {}).items() if p in self.proposers}
        self.max_depth = max_depth
        self.default_method = default_method
        self.model_pair = model_pair
        self.cost = cost or FittedCostModel()
        self.stats = stats
        self.estimator = AcceptanceEstimator(
            {(p, ANY): rates for p, rates in (cold_priors or {}).items() if p in self.proposers},
            model_pair=model_pair or None,
            max_depth=max(1, max_depth),
        )
        # how far drafts that may stop early go (RequestView.continuation)
        self.continuation = ContinuationEstimator(max_depth=max(1, max_depth))
        self._workload: dict[str, str] = {}
        self._finished: set[str] = set()  # finished during a step; forgotten after its outcome

    # ----------------------------------------------------------------------------- requests
    def admit(self, request_id: str, prompt_text: str, tag: str | None = None) -> str:
        """Classify the request's workload and seed its estimates with the cluster's priors."""
        workload = classify(prompt_text, tag)
        self._workload[request_id] = workload
        self.estimator.start(request_id, workload)
        self.continuation.start(request_id, workload)
        if self.stats is not None:
            for proposer in self.proposers:
                rates = self.stats.priors((self.model_pair, proposer, workload))
                if rates:
                    self.estimator.set_prior(proposer, workload, rates)
        return workload

    def finish(self, request_id: str) -> None:
        """Forget the request once the current step's outcome has been observed."""
        self._finished.add(request_id)

    def _forget_finished(self) -> None:
        for request_id in self._finished:
            self._workload.pop(request_id, None)
            self.estimator.forget(request_id)
            self.continuation.forget(request_id)
        self._finished.clear()

    # ----------------------------------------------------------------------------- deciding
    def decide(self, requests: Sequence[PlannedRequest], queue_depth: int) -> list[Decision]:
        self._forget_finished()  # requests aborted between steps
        views = tuple(self._view(r) for r in requests)
        step = StepView(views, queue_depth, self.proposers, self.max_depth, self.cost)
        decisions = self.policy.decide(step)
        if len(decisions) != len(requests):
            raise RuntimeError(
                f"policy {self.policy.name} returned {len(decisions)} decisions for {len(requests)}"
            )
        # The policy cannot see the KV cache; a draft never runs past the request's room.
        decisions = [self._shaped(d, r) for d, r in zip(decisions, requests, strict=True)]
        return self._with_floor(step, decisions) if any(d.nodes for d in decisions) else decisions

    def _shaped(self, decision: Decision, request: PlannedRequest) -> Decision:
        """``decision`` as the step runs it: its tree budget granted (the request's ``tree_nodes``,
        else the replica's for a proposer that branches; none for a request that may not verify a
        tree), then cut to the request's KV room."""
        nodes = 0
        if decision.proposer is not None and request.tree_row:
            granted = self.trees.get(decision.proposer, 0)
            nodes = granted if request.tree_nodes is None else request.tree_nodes
        shaped = replace(decision, nodes=nodes) if nodes != decision.nodes else decision
        return _within_room(shaped, request.room)

    def _with_floor(self, step: StepView, decisions: list[Decision]) -> list[Decision]:
        """Tree decisions with the floor their alternatives must reach (``policies.trees``): the
        step's expected tokens and time from the estimates and the cost model, at its width."""
        ctx = sum(v.context_len for v in step.requests) // max(1, step.batch_size)
        tokens, longest = 0.0, {}
        for view, d in zip(step.requests, decisions, strict=True):
            if d.proposer is None:
                tokens += 1.0
                continue
            rates = view.acceptance.get(d.proposer, ())
            going_on = view.continuation.get(d.proposer)
            tokens += expected_tokens(rates, d.depth, DEFAULT_ACCEPTANCE, going_on)[d.depth]
            longest[d.proposer] = max(longest.get(d.proposer, 0), d.depth)
        rows = step.batch_size
        draft = sum(k * self.cost.draft_time(p, rows, ctx) for p, k in longest.items())
        width = 1 + max(d.depth for d in decisions)
        floor = alternative_floor(self.cost, rows, width, ctx, tokens / rows, draft)
        return [replace(d, min_score=floor) if d.nodes else d for d in decisions]

    def _view(self, r: PlannedRequest) -> RequestView:
        mode = r.mode
        if mode == "auto" and self.default_method is None:
            mode = "off"  # the server speculates for nobody unless asked
        return RequestView(
            request_id=r.request_id,
            prompt_len=r.prompt_len,
            generated=r.generated,
            tokens_left=r.tokens_left,
            temperature=r.temperature,
            workload=self._workload.get(r.request_id, "prose"),
            acceptance=self.estimator.estimates(r.request_id, self.proposers, self.max_depth),
            override_mode=mode,
            override_max_depth=r.max_depth,
            draftable=dict(r.draftable),
            continuation=self.continuation.estimates(r.request_id, self.proposers, self.max_depth),
        )

    # ----------------------------------------------------------------------------- learning
    def observe(
        self,
        requests: Sequence[PlannedRequest],
        decisions: Sequence[Decision],
        drafted: Sequence[int],
        accepted: Sequence[int],
        emitted: Sequence[int],
        target_seconds: float,
        draft_seconds: dict[str, float],
        draft_steps: dict[str, int],
        step_seconds: float,
        width: int | None = None,
    ) -> None:
        """Learn from a step: ``drafted`` per row is its draft's depth (a tree's longest path),
        ``width`` the forward's tokens per row (default: 1 + the deepest draft; a tree's nodes)."""
        # A proposer asked for a draft that proposed nothing gave what a first-position rejection
        # gives: one token. Counted so, its estimate stays honest; else a free proposer that
        # rarely proposes looks like free tokens at the default acceptance. (n-gram says ahead
        # whether it has a match, RequestView.draftable, and is not asked when it has none: its
        # estimates are its acceptance given a match.)
        asked = [d.proposer is not None and d.depth > 0 for d in decisions]
        effective = [n if n or not a else 1 for n, a in zip(drafted, asked, strict=True)]
        outcomes = tuple(
            RequestOutcome(
                r.request_id, self._workload.get(r.request_id, "prose"), d.proposer, d.depth, n, a, e
            )
            for r, d, n, a, e in zip(requests, decisions, effective, accepted, emitted, strict=True)
        )
        context = sum(r.prompt_len + r.generated for r in requests) // max(1, len(requests))
        outcome = Outcome(
            requests=outcomes,
            target_seconds=target_seconds,
            draft_seconds=draft_seconds,
            draft_steps=draft_steps,
            tokens_per_row=width if width is not None else 1 + max(drafted, default=0),
            context=context,
            step_seconds=step_seconds,
        )
        self.estimator.observe(outcome)
        self.continuation.observe(outcome)
        self.cost.observe(outcome)
        self.policy.observe(outcome)
        if self.stats is not None:
            for o, n in zip(outcomes, drafted, strict=True):
                if o.proposer is not None and n:  # shared counts: real drafts only
                    self.stats.record((self.model_pair, o.proposer, o.workload), n, o.accepted)
        self._forget_finished()


def _within_room(decision: Decision, room: int) -> Decision:
    """``decision`` cut to what the request's KV slot can still take: the chain first, then the
    tree's alternatives (every node of a tree takes a cache row in the verify forward)."""
    depth = min(decision.depth, room)
    if depth <= 0 or decision.proposer is None:
        return Decision.plain()
    nodes = min(decision.nodes, room - depth)
    if (depth, nodes) == (decision.depth, decision.nodes):
        return decision
    return replace(decision, depth=depth, nodes=nodes)
