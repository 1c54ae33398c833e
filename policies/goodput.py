"""``goodput`` (the default): per request, the proposer and depth that maximise the whole step's
expected emitted tokens per second.

Model. Request i drafting k tokens with proposer p, whose conditional acceptances are
a_1..a_k (``RequestView.acceptance[p]``; a missing estimate is ``default_acceptance``), emits

    E_i(p, k) = 1 + sum_{j=1..k} prod_{m<=j} a_m        tokens on average (E = 1 when plain).

The step costs one target forward over every row padded to the deepest draft, plus each
proposer's draft steps (as many as its deepest row, each over all of its rows), plus the amortised
draft prefill of requests that have not used that proposer yet:

    T = target_time(B, 1 + max_i k_i, ctx) + sum_p (max_{i: p_i = p} k_i) * draft_time(p, n_p, ctx)
        + sum_{i new to p_i} prefill_i * E_i / tokens_left_i

with ctx the batch's mean context. A proposer that may end a draft early (a draft model stopping
at its first unsure token: ``RequestView.continuation[p]``, see ``policies.base.Continuation``)
drafts D_i(p, k) <= k tokens on average and emits E_i with the chance that it goes on after each
accepted position folded in; k_i above is then D_i (the forward's width interpolated between whole
widths, the max over rows a max of expectations). Without that, a deep cap is charged k draft steps
and a k-wide verify that a stopping draft never pays, and the plan stays shallow.

A proposer new to a request must first read its whole context
(context_len_i = prompt_len + generated, the prompt alone before the first token):
prefill_i = cost.draft_prefill_time(p, context_len_i) if the cost model has that method (the
profile measures it), else draft_time(p, 1, context_len_i) * ceil(context_len_i / 64) (one draft
forward per 64 prompt tokens). A proposer that drafted for the request before and sat out the
steps since reads the tokens it missed: prefill(lag) - prefill(1), lag = context_len_i minus what
it had read (a draft model's cache behind by 40 tokens costs a 40-token forward before it drafts:
on an AVX-512 EPYC one such step in a prose request cost it 17% against plain decoding).
Amortising over the ~tokens_left_i / E_i steps that remain is exact for one request:
speculating wins iff (L / E) * T_spec + prefill < L * T_plain, i.e. iff
E / (T_spec + prefill * E / L) > 1 / T_plain. So a long prompt with few tokens left stays plain.
The objective is sum_i E_i / T; the best all-plain plan must be beaten by a factor ``1 + margin``.

Search (deterministic, O(K * 2^P * B * P) with K <= max depth, P <= 3 proposers):
1. for every width K = 1..max cap and every non-empty set S of proposers: each request takes the
   option of S (at depth min(K, its cap)) or plain that is best for it, weighing seconds by the
   all-plain rate (its own prefill and its marginal draft rows); the plan's exact objective is kept
   if it is the best so far (K = 0, all plain, is the first candidate). Widths stop early once
   every request's best tokens over the cheapest target forward of that width or wider cannot
   beat the best plan;
2. local search on the best plan: move single requests to plain or to another proposer, then lower
   each proposer's depth, while the exact objective improves.
It goes to plain by itself when the forward is compute-bound (heavy batch), acceptance is low, few
tokens are left, or the draft prefill would not be repaid. Overrides: see ``policies.limits``;
a forced proposer speculates at depth >= 1 (it never competes with plain).
"""

from __future__ import annotations

import math
from itertools import combinations

from policies.base import Continuation, CostModel, Decision, Outcome, StepView
from policies.limits import allowed_proposers, clamp, depth_cap, forced_proposer
from policies.registry import PolicyConfig, register_policy

PREFILL_CHUNK = 64
Choice = tuple[str | None, int]  # one request's (proposer, depth)
PLAIN: Choice = (None, 0)


def _rate(rates: tuple[float, ...], j: int, default: float) -> float:
    """rates[j], the last one past the end, ``default`` if there are none; clipped to [0, 1]."""
    rate = rates[j] if j < len(rates) else (rates[-1] if rates else default)
    return min(1.0, max(0.0, rate))


def expected_tokens(
    acceptance: tuple[float, ...], depth: int, default: float, continuation: Continuation | None = None
) -> list[float]:
    """E at depths 0..depth: 1 + sum over positions j of P(j drafted and positions 0..j accepted).

    Without ``continuation`` every position up to the depth is drafted: the sum of the products of
    conditional acceptances (the last one repeats). With it, reaching j + 1 also needs the draft to
    go on after the accepted position j (``Continuation.accepted[j]``)."""
    going_on = continuation.accepted if continuation is not None else ()
    out, run, reach = [1.0], 1.0, 1.0  # reach: P(position j drafted and positions < j accepted)
    for j in range(depth):
        accepted = reach * _rate(acceptance, j, default)
        run += accepted
        out.append(run)
        reach = accepted * _rate(going_on, j, 1.0)
    return out


def expected_drafted(continuation: Continuation | None, depth: int) -> list[float]:
    """Tokens a draft of depth 0..depth holds on average: k without ``continuation``, else
    1 + sum_{j=1..k-1} prod_{m<j} drafted[m] (see ``policies.base.Continuation``)."""
    if continuation is None:
        return [float(k) for k in range(depth + 1)]
    out, run, reach = [0.0], 0.0, 1.0  # reach: P(position j drafted)
    for j in range(depth):
        run += reach
        out.append(run)
        reach *= _rate(continuation.drafted, j, 1.0)
    return out


def prefill_seconds(cost: CostModel, proposer: str, tokens: int) -> float:
    method = getattr(cost, "draft_prefill_time", None)
    if method is not None:
        return float(method(proposer, tokens))
    return cost.draft_time(proposer, 1, tokens) * math.ceil(tokens / PREFILL_CHUNK)


def catch_up_seconds(cost: CostModel, proposer: str, lag: int) -> float:
    """A proposer ``lag`` tokens behind a request reads them before it drafts; one token behind is
    every drafting step's own feed (the bonus token), already in its draft step."""
    if lag <= 1:
        return 0.0
    return max(0.0, prefill_seconds(cost, proposer, lag) - prefill_seconds(cost, proposer, 1))


class _Step:
    """One step's options per request: expected tokens and amortised prefill by proposer and depth."""

    def __init__(self, step: StepView, read: dict[tuple[str, str], int], limit: int, default: float) -> None:
        self.cost, self.rows = step.cost, step.batch_size
        self.ctx = round(sum(r.context_len for r in step.requests) / max(1, step.batch_size))
        self.caps = [depth_cap(r, step, limit) for r in step.requests]
        self.forced = [
            forced_proposer(r) if c > 0 else None for r, c in zip(step.requests, self.caps, strict=True)
        ]
        self.tokens: list[dict[str, list[float]]] = []  # [i][p][k]: E_i(p, k)
        self.prefill: list[dict[str, list[float]]] = []  # [i][p][k]: amortised prefill seconds
        self.drafted: list[dict[str, list[float]]] = []  # [i][p][k]: tokens a draft of k holds
        self.proposer_caps: list[dict[str, int]] = []  # [i][p]: <= caps[i] if p can draft fewer
        for request, cap in zip(step.requests, self.caps, strict=True):
            tokens, prefill, drafted, caps = {}, {}, {}, {}
            for p in allowed_proposers(request, step) if cap > 0 else ():
                proposer_cap = depth_cap(request, step, limit, p)
                if proposer_cap == 0:  # nothing to propose (a lookup without a match): not an option
                    continue
                caps[p] = proposer_cap
                going_on = request.continuation.get(p)
                tokens[p] = expected_tokens(request.acceptance.get(p, ()), proposer_cap, default, going_on)
                drafted[p] = expected_drafted(going_on, proposer_cap)
                seen = read.get((request.request_id, p))
                seconds = (
                    prefill_seconds(self.cost, p, request.context_len)
                    if seen is None
                    else catch_up_seconds(self.cost, p, request.context_len - seen)
                )
                prefill[p] = [seconds * e / max(1, request.tokens_left) for e in tokens[p]]
            self.tokens.append(tokens)
            self.prefill.append(prefill)
            self.drafted.append(drafted)
            self.proposer_caps.append(caps)
        # Per proposer: how many requests may use it (a request's marginal draft rows, step 1).
        self.crowd = {p: sum(p in t for t in self.tokens) for p in step.proposers}
        self._target: dict[int, float] = {}
        self._draft: dict[tuple[str, int], float] = {}

    def target(self, width: float) -> float:
        """The target forward over ``width`` tokens per row; an expected (fractional) width is
        interpolated between the whole widths around it."""
        low = int(width)
        if low == width:
            if low not in self._target:
                self._target[low] = self.cost.target_time(self.rows, low, self.ctx)
            return self._target[low]
        part = width - low
        return (1.0 - part) * self.target(low) + part * self.target(low + 1)

    def draft(self, proposer: str, rows: int) -> float:
        if (proposer, rows) not in self._draft:
            self._draft[(proposer, rows)] = self.cost.draft_time(proposer, rows, self.ctx)
        return self._draft[(proposer, rows)]

    def depth(self, i: int, proposer: str, width: int) -> int:
        """Request i's depth with ``proposer`` in a plan of ``width``: min(width, its cap)."""
        return min(width, self.proposer_caps[i][proposer])

    def option(self, i: int, proposers: tuple[str, ...], width: int, rate: float) -> Choice:
        """Request i's best choice among ``proposers`` at min(width, cap) and plain (search step 1)."""
        forced = self.forced[i]
        if forced is not None:
            return (forced, max(1, self.depth(i, forced, width))) if forced in self.tokens[i] else PLAIN
        best, best_value = PLAIN, 1.0
        for p in proposers:
            if p not in self.tokens[i]:
                continue
            depth = self.depth(i, p, width)
            crowd = self.crowd[p]
            extra_row = self.draft(p, crowd) - (self.draft(p, crowd - 1) if crowd > 1 else 0.0)
            marginal = self.drafted[i][p][depth] * extra_row
            value = self.tokens[i][p][depth] - rate * (self.prefill[i][p][depth] + marginal)
            if value > best_value + 1e-12:
                best, best_value = (p, depth), value
        return best


class _Plan:
    """A choice per request, with running token and prefill totals."""

    def __init__(self, s: _Step, choices: list[Choice]) -> None:
        self.s, self.choices = s, list(choices)
        self.tokens = self.prefill = 0.0
        self.rows = dict.fromkeys(s.crowd, 0)
        for i, choice in enumerate(self.choices):
            self._account(i, choice, 1)

    def _account(self, i: int, choice: Choice, sign: int) -> None:
        p, k = choice
        if p is None:
            self.tokens += sign
            return
        self.tokens += sign * self.s.tokens[i][p][k]
        self.prefill += sign * self.s.prefill[i][p][k]
        self.rows[p] += sign

    def value(self) -> float:
        """Expected tokens per second of the step (the objective). Each proposer runs as many
        draft steps as its longest expected draft, and the forward is as wide as the longest draft
        of all (the max of expectations: exact at batch 1, a little low for a batch of drafts
        that may stop early)."""
        longest: dict[str, float] = {}
        for i, (p, k) in enumerate(self.choices):
            if p is not None:
                longest[p] = max(longest.get(p, 0.0), self.s.drafted[i][p][k])
        seconds = self.prefill + sum(n * self.s.draft(p, self.rows[p]) for p, n in longest.items())
        return self.tokens / (seconds + self.s.target(1 + max(longest.values(), default=0.0)))

    def move(self, i: int, choice: Choice) -> None:
        self._account(i, self.choices[i], -1)
        self.choices[i] = choice
        self._account(i, choice, 1)


class GoodputPolicy:
    name = "goodput"

    def __init__(
        self,
        max_depth: int,
        default_acceptance: float = 0.5,
        margin: float = 0.02,
        depth_slack: float = 0.005,
    ) -> None:
        """``margin``: how much the best plan must beat all-plain by. ``depth_slack``: for a draft
        that may stop early, a deeper cap must beat a shallower one by more than this share of the
        objective. Beyond such a draft's expected stop the objective is nearly flat in the cap, and
        the deepest cap then won on rounding; but a draft that goes on longer than the continuation
        estimate says pays for every extra draft step and verified row (measured on a prose prompt
        on an Intel Xeon: caps of 16 where depth 1 paid, 0.98x plain)."""
        self.max_depth = max_depth
        self.default_acceptance = default_acceptance
        self.margin = margin
        self.depth_slack = depth_slack
        # (request id, proposer) -> the request's tokens the proposer had read after its last draft
        self.read: dict[tuple[str, str], int] = {}
        self._context: dict[str, int] = {}  # request id -> its context at the last decision

    def decide(self, step: StepView) -> list[Decision]:
        ids = {r.request_id for r in step.requests}
        self.read = {key: n for key, n in self.read.items() if key[0] in ids}
        self._context = {r.request_id: r.context_len for r in step.requests}
        if not step.requests:
            return []
        plan = self.plan(step)
        return [
            clamp(Decision(p, k), r, step, self.max_depth)
            for r, (p, k) in zip(step.requests, plan, strict=True)
        ]

    def plan(self, step: StepView) -> list[Choice]:
        """Per request (proposer, depth); see the module docstring for the search."""
        s = _Step(step, self.read, self.max_depth, self.default_acceptance)
        used = tuple(p for p in step.proposers if s.crowd[p] > 0)
        rate = step.batch_size / s.target(1)
        baseline = _Plan(s, [s.option(i, (), 0, rate) for i in range(s.rows)])  # plain, but forced rows
        best, best_value = baseline, baseline.value() * (1.0 + self.margin)
        # No plan of width >= K beats best_value if even every request's best possible tokens over
        # the cheapest target forward of width >= K do not: the search stops there. (The cheapest,
        # not the one at K: a forward's time is not monotone in its width, see policies.cost_model.)
        # A draft that may stop early can be narrower than K: then the cheapest of any width.
        ceiling = sum(max((t[-1] for t in tokens.values()), default=1.0) for tokens in s.tokens)
        widths = range(1, max(s.caps) + 1)
        cheapest = [s.target(1 + w) for w in widths]
        stops = any(r.continuation for r in step.requests)
        for j in range(len(cheapest) - 2, -1, -1):
            cheapest[j] = min(cheapest[j], cheapest[j + 1])
        if stops and cheapest:
            cheapest = [min(cheapest)] * len(cheapest)
        for width, floor in zip(widths, cheapest, strict=True):
            if ceiling / floor <= best_value:
                break
            for size in range(1, len(used) + 1):
                for subset in combinations(used, size):
                    plan = _Plan(s, [s.option(i, subset, width, rate) for i in range(s.rows)])
                    value = plan.value()
                    if value > best_value + 1e-12:
                        best, best_value = plan, value
        best = _Plan(s, best.choices)
        stopping = {p for r in step.requests for p, c in r.continuation.items() if c is not None}
        self._refine(s, best, self.depth_slack, stopping)
        if best.value() < baseline.value() * (1.0 + self.margin):
            return baseline.choices
        return best.choices

    @staticmethod
    def _refine(s: _Step, plan: _Plan, slack: float, stopping: set[str]) -> None:
        """Search step 2: move single requests while it improves, then give each proposer its best
        depth; a proposer in ``stopping`` (drafts that may end early) the shallowest depth whose
        plan is within ``slack`` (relative) of that."""
        value = plan.value()
        width = max(1, max(k for _, k in plan.choices))
        for _ in range(2):
            moved = False
            for i in range(s.rows):
                choices = [] if s.forced[i] is not None else [PLAIN]
                choices += [(p, s.depth(i, p, width)) for p in s.tokens[i]]
                for choice in choices:
                    if choice == plan.choices[i]:
                        continue
                    current = plan.choices[i]
                    plan.move(i, choice)
                    trial = plan.value()
                    if trial > value + 1e-12:
                        value, moved = trial, True
                    else:
                        plan.move(i, current)
            if not moved:
                break
        for proposer in [p for p in s.crowd if plan.rows[p]]:
            before = list(plan.choices)
            deepest = max(k for p, k in before if p == proposer)
            values = {deepest: value}
            for depth in range(deepest - 1, 0, -1):
                for i, (p, k) in enumerate(before):
                    if p == proposer and k > depth:
                        plan.move(i, (p, depth))
                values[depth] = plan.value()
            top = max(values.values())
            # the shallowest cap within ``slack`` of the best (see GoodputPolicy)
            room = slack if proposer in stopping else 0.0
            best_depth = min(d for d, v in values.items() if v >= top * (1.0 - room))
            value = values[best_depth]
            for i, (p, k) in enumerate(before):
                plan.move(i, (p, min(k, best_depth)) if p == proposer else (p, k))

    def observe(self, outcome: Outcome) -> None:
        for r in outcome.requests:
            if r.proposer is not None and r.depth > 0:
                # it read the context and its accepted drafts; the bonus token comes with its next draft
                context = self._context.get(r.request_id, 0)
                self.read[(r.request_id, r.proposer)] = context + max(0, r.emitted - 1)


@register_policy(
    "goodput",
    "per request proposer and depth maximising the step's expected tokens per second",
    uses_cost_model=True,
)
def _build(config: PolicyConfig) -> GoodputPolicy:
    config.check_params("goodput", ("default_acceptance", "margin", "depth_slack"))
    default = float(config.params.get("default_acceptance", 0.5))  # type: ignore[arg-type]
    margin = float(config.params.get("margin", 0.02))  # type: ignore[arg-type]
    slack = float(config.params.get("depth_slack", 0.005))  # type: ignore[arg-type]
    if not 0.0 <= default <= 1.0 or margin < 0.0 or not 0.0 <= slack < 1.0:
        raise ValueError(
            "goodput: default_acceptance must be in [0, 1], margin >= 0 and depth_slack in [0, 1): "
            f"{default}, {margin}, {slack}"
        )
    return GoodputPolicy(config.max_depth, default, margin, slack)
