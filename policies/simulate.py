"""Replay acceptance traces through a policy and a cost model: throughput without a model run.

A ``Trace`` is one request: its workload, prompt and output lengths, and per proposer one of
- ``matches``: recorded per output position (``policies.traces``): a draft of k tokens starting
  after g output tokens keeps min(matches[g], k); exact for greedy, deterministic proposers; a
  lookup proposer also has ``draftable`` per position, passed to the policy as the engine does;
- ``first_rejected``: accepted-run lengths per step, replayed in order and cycled (min(run, k));
- ``accept``: conditional acceptance probabilities per position (sampled, the last one repeating).
``simulate`` keeps ``concurrency`` requests running (refilled
from the queue in trace order); at each step it builds the ``StepView`` the engine would (estimates
from an ``AcceptanceEstimator`` fed by the simulated outcomes), asks the policy, samples what the
target accepts, and advances the clock by the cost model's prediction of the step (target forward,
draft steps, draft prefills, and the target prefill of newly admitted requests when
``include_prefill``). ``true_cost`` may differ from the ``cost`` the policy sees (model error).
Deterministic for a seed: each (request, proposer) draws from its own seeded stream, so policies
compared on one seed see common random numbers.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.acceptance import AcceptanceEstimator
from policies.base import CostModel, Outcome, Policy, RequestOutcome, RequestView, StepView
from policies.goodput import prefill_seconds
from policies.limits import depth_cap
from policies.registry import FIXED_POLICY, PLAIN_POLICY, PolicyConfig, create_policy


@dataclass(frozen=True)
class Trace:
    workload: str
    prompt_len: int
    output_len: int
    accept: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # conditional, per position
    first_rejected: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # recorded runs
    matches: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # per output position
    draftable: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # lookups, per position

    def proposers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.accept, *self.first_rejected, *self.matches)))


@dataclass(frozen=True)
class SimResult:
    policy: str
    concurrency: int
    tokens: int  # emitted, all requests
    seconds: float  # simulated
    steps: int
    request_steps: int  # sum over steps of the batch size
    drafted: dict[str, int]  # per proposer
    accepted: dict[str, int]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_draft_depth(self) -> float:
        """Drafted tokens per request-step (0 = always plain)."""
        return sum(self.drafted.values()) / max(1, self.request_steps)


class _Running:
    def __init__(self, index: int, trace: Trace, seed: int) -> None:
        self.id = f"r{index}"
        self.trace = trace
        self.generated = 0
        self.cursor: dict[str, int] = {}
        self.admitted: set[str] = set()
        self.streams = {p: random.Random(f"{seed}:{index}:{p}") for p in trace.accept}

    def draftable(self) -> dict[str, int]:
        """``RequestView.draftable`` at the current position (lookup proposers only)."""
        at = self.generated
        return {p: d[at] if at < len(d) else 0 for p, d in self.trace.draftable.items()}

    def accepted(self, proposer: str, depth: int) -> int:
        matches = self.trace.matches.get(proposer)
        if matches is not None:
            return min(matches[self.generated], depth) if self.generated < len(matches) else 0
        runs = self.trace.first_rejected.get(proposer)
        if runs:
            at = self.cursor.get(proposer, 0)
            self.cursor[proposer] = at + 1
            return min(runs[at % len(runs)], depth)
        rates = self.trace.accept.get(proposer, ())
        kept = 0
        while kept < depth and rates and self.streams[proposer].random() < rates[min(kept, len(rates) - 1)]:
            kept += 1
        return kept


def simulate(
    policy: Policy,
    traces: Sequence[Trace],
    cost: CostModel,
    concurrency: int,
    *,
    proposers: Sequence[str] | None = None,
    max_depth: int = 8,
    seed: int = 0,
    estimator: AcceptanceEstimator | None = None,
    priors: Mapping[tuple[str, ...], Sequence[float]] | None = None,
    estimator_options: Mapping[str, float] | None = None,
    true_cost: CostModel | None = None,
    include_prefill: bool = True,
) -> SimResult:
    """Run every trace through ``policy`` with at most ``concurrency`` requests at a time.

    Without an ``estimator``, a fresh ``AcceptanceEstimator(priors, **estimator_options)``."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if proposers is None:
        proposers = list(dict.fromkeys(p for t in traces for p in t.proposers()))
    proposers = tuple(proposers)
    estimator = estimator or AcceptanceEstimator(
        priors, max_depth=max(16, max_depth), **(estimator_options or {})
    )
    clock = true_cost or cost
    queue = [_Running(i, t, seed) for i, t in reversed(list(enumerate(traces)))]
    running: list[_Running] = []
    tokens = steps = request_steps = 0
    seconds = 0.0
    drafted = dict.fromkeys(proposers, 0)
    accepted = dict.fromkeys(proposers, 0)
    while queue or running:
        while queue and len(running) < concurrency:
            request = queue.pop()
            running.append(request)
            estimator.start(request.id, request.trace.workload)
            if include_prefill:
                seconds += clock.target_time(1, request.trace.prompt_len, 0)
        views = tuple(
            RequestView(
                request_id=r.id,
                prompt_len=r.trace.prompt_len,
                generated=r.generated,
                tokens_left=r.trace.output_len - r.generated,
                temperature=0.0,
                workload=r.trace.workload,
                acceptance=estimator.estimates(r.id, proposers, max_depth),
                draftable=r.draftable(),
            )
            for r in running
        )
        step = StepView(views, len(queue), proposers, max_depth, cost)
        decisions = policy.decide(step)
        if len(decisions) != len(running):
            raise RuntimeError(f"{policy.name}: {len(decisions)} decisions for {len(running)} requests")
        ctx = round(sum(v.context_len for v in views) / len(views))
        rows: dict[str, int] = {}
        deepest: dict[str, int] = {}
        outcomes = []
        for request, view, decision in zip(running, views, decisions, strict=True):
            name, depth = decision.proposer, decision.depth
            if (
                (name is None) != (depth == 0)
                or depth > depth_cap(view, step, proposer=name)
                or name not in (None, *proposers)
            ):
                raise RuntimeError(f"{policy.name}: decision {decision} breaks the limits of {view}")
            kept = 0
            if name is not None:
                kept = request.accepted(name, depth)
                rows[name] = rows.get(name, 0) + 1
                deepest[name] = max(deepest.get(name, 0), depth)
                drafted[name] += depth
                accepted[name] += kept
                if name not in request.admitted:
                    request.admitted.add(name)
                    seconds += prefill_seconds(clock, name, view.context_len)
            emitted = min(1 + kept, view.tokens_left)
            request.generated += emitted
            tokens += emitted
            outcomes.append(RequestOutcome(request.id, view.workload, name, depth, depth, kept, emitted))
        width = 1 + max(deepest.values(), default=0)
        target_seconds = clock.target_time(len(running), width, ctx)
        draft_seconds = {p: d * clock.draft_time(p, rows[p], ctx) for p, d in deepest.items()}
        step_seconds = target_seconds + sum(draft_seconds.values())
        seconds += step_seconds
        steps += 1
        request_steps += len(running)
        outcome = Outcome(
            tuple(outcomes), target_seconds, draft_seconds, dict(deepest), width, ctx, step_seconds
        )
        estimator.observe(outcome)  # as the engine's planner does: verdicts, then relaxation
        policy.observe(outcome)
        for request in [r for r in running if r.generated >= r.trace.output_len]:
            running.remove(request)
            estimator.forget(request.id)
    return SimResult(policy.name, concurrency, tokens, seconds, steps, request_steps, drafted, accepted)


def oracle_best_static(
    traces: Sequence[Trace],
    cost: CostModel,
    concurrency: int,
    *,
    proposers: Sequence[str] | None = None,
    max_depth: int = 8,
    seed: int = 0,
    **options: object,
) -> tuple[tuple[str | None, int], SimResult, dict[tuple[str | None, int], SimResult]]:
    """Every static (proposer, depth), plain included: (the best, its result, all results)."""
    if proposers is None:
        proposers = list(dict.fromkeys(p for t in traces for p in t.proposers()))
    results: dict[tuple[str | None, int], SimResult] = {}
    for arm in static_arms(proposers, max_depth):
        results[arm] = simulate(
            static_policy(arm, max_depth),
            traces,
            cost,
            concurrency,
            proposers=proposers,
            max_depth=max_depth,
            seed=seed,
            **options,
        )  # type: ignore[arg-type]
    best = max(results, key=lambda arm: results[arm].tokens_per_second)
    return best, results[best], results


def uniform_traces(specs: Mapping[str, tuple[int, int, Mapping[str, float]]], repeat: int) -> list[Trace]:
    """Synthetic traces: per workload (prompt_len, output_len, {proposer: rate}), ``repeat`` each,
    interleaved (workload A, B, C, A, B, C, ...)."""
    return [
        Trace(workload, prompt, output, {p: (rate,) for p, rate in rates.items()})
        for _ in range(repeat)
        for workload, (prompt, output, rates) in specs.items()
    ]


@dataclass(frozen=True)
class Phase:
    """Part of a workload mix: these traces, run with at most ``concurrency`` at a time."""

    traces: Sequence[Trace]
    concurrency: int


def simulate_mix(
    policy: Policy,
    phases: Sequence[Phase],
    cost: CostModel,
    *,
    max_depth: int = 8,
    seed: int = 0,
    proposers: Sequence[str] | None = None,
    priors: Mapping[tuple[str, ...], Sequence[float]] | None = None,
    estimator_options: Mapping[str, float] | None = None,
    **options: object,
) -> SimResult:
    """Phases one after the other under ONE policy instance and ONE estimator (what it learned in a
    phase carries into the next, as on a replica whose load changes): totals over all phases."""
    if proposers is None:
        proposers = list(dict.fromkeys(p for ph in phases for t in ph.traces for p in t.proposers()))
    estimator = AcceptanceEstimator(priors, max_depth=max(16, max_depth), **(estimator_options or {}))
    parts = [
        simulate(policy, ph.traces, cost, ph.concurrency, proposers=proposers, max_depth=max_depth,
                 seed=seed + i, estimator=estimator, **options)  # type: ignore[arg-type]
        for i, ph in enumerate(phases)
    ]  # fmt: skip
    return SimResult(
        policy.name, max(ph.concurrency for ph in phases), sum(p.tokens for p in parts),
        sum(p.seconds for p in parts), sum(p.steps for p in parts), sum(p.request_steps for p in parts),
        {k: sum(p.drafted.get(k, 0) for p in parts) for k in proposers},
        {k: sum(p.accepted.get(k, 0) for p in parts) for k in proposers},
    )  # fmt: skip


def static_arms(proposers: Sequence[str], max_depth: int) -> list[tuple[str | None, int]]:
    """Every static choice: plain, then each proposer at depths 1..max_depth."""
    return [(None, 0)] + [(p, d) for p in proposers for d in range(1, max_depth + 1)]


def static_policy(arm: tuple[str | None, int], max_depth: int) -> Policy:
    """The policy that always takes ``arm`` (plain for (None, 0))."""
    name, depth = arm
    if name is None:
        return create_policy(PLAIN_POLICY, PolicyConfig())
    config = PolicyConfig(default_proposer=name, default_depth=depth, max_depth=max_depth)
    return create_policy(FIXED_POLICY, config)


def replay(recorded: Sequence[object]) -> list[Trace]:
    """Simulator traces from ``policies.traces.RecordedTrace`` objects (matches per position)."""
    return [
        Trace(
            t.workload,  # type: ignore[attr-defined]
            t.prompt_len,  # type: ignore[attr-defined]
            t.output_len,  # type: ignore[attr-defined]
            matches=dict(t.matches),  # type: ignore[attr-defined]
            draftable=dict(getattr(t, "draftable", {})),
        )
        for t in recorded
    ]
