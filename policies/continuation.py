"""Rolling estimates of how far a proposer drafts when it may stop early (``base.Continuation``).

A draft model with ``min_confidence`` ends a draft after its first unsure token, so a draft of
depth k holds fewer than k tokens where the text gets hard: fewer draft steps and a narrower verify
than a policy planning k would pay for. A policy that charged k anyway would see deep caps as dear
and stay shallow (the eighteenth session measured goodput at depth 2 on code the draft accepted
whole). What one verified draft (decided depth k, drafted d >= 1, accepted m) tells, per position
j <= d - 1 with j + 1 < k (the depth allowed one more token):

- ``drafted[j]``: it went on (j < d - 1) or stopped after position j (j = d - 1);
- ``accepted[j]``, only where position j was accepted too (j < m): the same.

Worked example: k = 6, d = 3, m = 2. Positions 0 and 1 went on, position 2 stopped; position 2 was
not accepted, so ``accepted`` learns from 0 (on) and 1 (on) only. A draft that fills its depth
(d = k) is censored at position k - 1: it had to stop there and says nothing about it.

The second rate exists because stopping and acceptance are correlated (an unsure token is both
likely rejected and the one a draft stops after): emitted tokens depend on going on after an
accepted token, drafted tokens (the cost) on going on at all.

Levels as in ``policies.acceptance``: a pool per (proposer, workload), and per (request, proposer)
started from the pool. A pool averages its verdicts per position (then tracks with
``pool_alpha``) and is read leaning on the position before, by evidence (``acceptance.lean``, no
decay), with a guess of 1 (it never stops) before position 0 weighted as ``guess_weight``
verdicts: a position never judged reads as the one before it. A request starts from its pool's
reading and takes steps max(alpha, 1 / (n + prior_weight)) at its n-th verdict of a position. A proposer
that never stops early (n-gram drafts the match it found, its depth capped by it; a draft without
a threshold) is censored or goes on at every position, so its rates stay at 1 and a policy sees
the depth it asked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from policies.acceptance import ANY, lean
from policies.base import Continuation, Outcome

_RATES = ("drafted", "accepted")


class ContinuationEstimator:
    """Per request and proposer, ``Continuation`` rates learnt from verified drafts."""

    def __init__(
        self,
        *,
        max_depth: int = 16,
        alpha: float = 0.1,
        prior_weight: float = 4.0,
        pool_alpha: float = 0.02,
        guess_weight: float = 1.0,
    ) -> None:
        if not 0 < alpha <= 1 or not 0 < pool_alpha <= 1 or prior_weight < 0 or guess_weight < 0:
            raise ValueError("alpha and pool_alpha must be in (0, 1], the weights >= 0")
        self.positions = max(1, max_depth - 1)  # position j says whether j + 1 was drafted
        self.alpha, self.prior_weight = alpha, prior_weight
        self.pool_alpha, self.guess_weight = pool_alpha, guess_weight
        # (proposer, workload) -> rate name -> (rates, verdicts per position)
        self._pool: dict[tuple[str, str], dict[str, tuple[list[float], list[float]]]] = {}
        self._request: dict[tuple[str, str], dict[str, tuple[list[float], list[float]]]] = {}
        self._workload: dict[str, str] = {}

    def _fresh(self, start: dict[str, tuple[list[float], list[float]]] | None = None):
        if start is None:
            return {name: ([1.0] * self.positions, [0.0] * self.positions) for name in _RATES}
        return {name: (self._leaned(start[name]), [0.0] * self.positions) for name in _RATES}

    def _leaned(self, table: tuple[list[float], list[float]]) -> list[float]:
        """A pool's rates with the guess (1, before position 0) as ``guess_weight`` verdicts: each
        position blended with the one before it by evidence."""
        rates, seen = table
        return lean([1.0, *rates], [math.inf, *seen], self.guess_weight)[1:]

    def start(self, request_id: str, workload: str) -> None:
        """Tell the estimator a request's workload class (else the first update's, else "*")."""
        self._workload[request_id] = workload

    def update(
        self,
        request_id: str,
        proposer: str,
        depth: int,
        drafted: int,
        accepted: int,
        *,
        workload: str | None = None,
    ) -> None:
        """One verified draft: ``drafted`` tokens of a decided ``depth``, the first ``accepted`` kept."""
        depth = min(int(depth), self.positions + 1)
        drafted = min(max(0, int(drafted)), depth)
        if drafted == 0:
            return
        accepted = min(max(0, int(accepted)), drafted)
        workload = self._workload.setdefault(request_id, workload or ANY)
        pool = self._pool.setdefault((proposer, workload), self._fresh())
        mine = self._request.get((request_id, proposer))
        if mine is None:
            mine = self._request[(request_id, proposer)] = self._fresh(pool)
        for j in range(min(drafted, depth - 1)):  # j + 1 < depth: the depth allowed one more
            went_on = 1.0 if j < drafted - 1 else 0.0
            for name in _RATES if j < accepted else _RATES[:1]:
                self._step(pool[name], j, went_on, 0.0, self.pool_alpha)  # the guess: in _leaned
                self._step(mine[name], j, went_on, self.prior_weight, self.alpha)

    @staticmethod
    def _step(table: tuple[list[float], list[float]], j: int, hit: float, weight: float, alpha: float):
        rates, seen = table
        seen[j] += 1
        rates[j] += max(alpha, 1.0 / (seen[j] + weight)) * (hit - rates[j])

    def estimate(self, request_id: str, proposer: str, max_depth: int) -> Continuation | None:
        """The request's rates for positions 0 .. max_depth - 2; None before any verdict (then a
        policy assumes it drafts its full depth)."""
        size = max(0, max_depth - 1)
        mine = self._request.get((request_id, proposer))
        if mine is not None:  # started from the pool's leaned rates: its own verdicts on top
            rates = {name: mine[name][0][:size] for name in _RATES}
        else:
            pool = self._pool.get((proposer, self._workload.get(request_id, ANY)))
            if pool is None:
                return None
            rates = {name: self._leaned(pool[name])[:size] for name in _RATES}
        return Continuation(drafted=tuple(rates["drafted"]), accepted=tuple(rates["accepted"]))

    def estimates(self, request_id: str, proposers: Iterable[str], max_depth: int) -> dict[str, Continuation]:
        """``RequestView.continuation`` for one request: the proposers with any verdict so far."""
        out = {p: self.estimate(request_id, p, max_depth) for p in proposers}
        return {p: c for p, c in out.items() if c is not None}

    def observe(self, outcome: Outcome) -> None:
        """Every request of an engine step that drafted."""
        for r in outcome.requests:
            if r.proposer is not None and r.drafted > 0:
                self.update(r.request_id, r.proposer, r.depth, r.drafted, r.accepted, workload=r.workload)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's rates (what it taught stays in its pool)."""
        self._workload.pop(request_id, None)
        for key in [k for k in self._request if k[0] == request_id]:
            del self._request[key]

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget every request not in ``request_ids``."""
        keep = set(request_ids)
        for rid in ({k[0] for k in self._request} | set(self._workload)) - keep:
            self.forget(rid)
