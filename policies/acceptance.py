"""Rolling acceptance estimates per draft position: what a policy's expected-tokens math runs on.

The quantity is the CONDITIONAL acceptance a_j = P(position j accepted | positions < j accepted),
j = 0, 1, ...: a draft of k tokens then emits 1 + sum_{j<k} prod_{m<=j} a_m tokens on average. A
step that drafted n tokens of which m were accepted tells us about positions 0..min(m, n-1) only:
positions < m were reached and accepted, position m (if m < n) was reached and rejected, and
positions after it were never judged on their own merit (counting them as rejections would make
deep positions look worse than they are).

Two levels of exponential moving average per position:
- a pool per (proposer, workload), slow (``pool_alpha``), started from the priors (the model
  pair's, e.g. read from shared stats, or ``default`` decaying by ``decay`` per position): the
  estimate for a request that has no history with that proposer yet;
- per (request, proposer), started from the pool when first updated, with a warm-start step
  max(alpha, 1 / (n + prior_weight)) at its n-th observation of that position: the first few
  observations are averaged with the pool's value as if it were ``prior_weight`` observations
  (a single early rejection must not switch a good request to plain, where it would never be
  measured again), then it tracks the request with step ``alpha``. One request's text can be
  far more (or less) predictable than its class.

Positions with little evidence lean on the position before them: position j's estimate is
(n_j * rate_j + w * est_{j-1} * decay) / (n_j + w), n_j the times it was judged (for a pool; a
request's own count for a request), w = ``prior_weight``. Measured on the Qwen pair the
conditional acceptance is nearly flat over the first six positions (code 0.85, 0.83, 0.81, 0.79,
...), so a request (or a whole class) that only ever drafted one token is estimated deeper down
from what it showed at position 0. Without this the default stays in place deeper down forever
and a policy never learns that drafting deeper pays (an exploration trap). For a pool, an explicit
prior (shared statistics) counts as ample evidence at every position, so a new request starts from
it as given; a request's own estimate weighs only the request's own observations (n_j), so once it
has drafted, positions it never reached follow what it showed at shallower ones.

A request's estimate for a proposer it is not drafting with relaxes back towards the pool's, by
``relax`` of the gap per step (``observe``). Without it a request whose estimate fell below
break-even after a few unlucky rejections (three in a row happen 5% of the time at a = 0.63) stays
plain to its end, since plain steps measure nothing: the exploration trap again, per request. With
``relax`` = 0.05 a request that was switched off tries again after ~5-15 plain steps (sooner the
closer it was), and each try is one cheap shallow draft whose outcome corrects the estimate.

How fast each level learns, and why. Measured on the recorded Qwen traces
(``policies/traces/``), requests of one class differ little in their true acceptance (position 0:
code 0.83-0.94, prose 0.54-0.69) against the binomial noise of single verdicts, so an empirical
Bayes prior weight (within-request variance / between-request variance) comes out far above a
handful of observations (18-96 for the draft model by class). ``prior_weight`` = 8 is a step
towards it that stays responsive (verdicts within a run are correlated, so each counts for less
than one independent observation). The pool is the class's rolling mean: with ``pool_alpha`` =
0.05 one request's unlucky start (ten rejections) dragged its whole class below break-even for
the requests after it; 0.02 (a memory of ~50 verdicts) keeps it near what the cluster has seen.
In the policy simulator's mixed workload these two moved goodput from 1.075x to 1.102x the best
single static depth; the sweep is in BENCHMARKS.md ("Speculation policies").

Guesses and evidence (the cold trap). A prior for a named workload is the shared statistics'
measurement and is taken as given. A prior for every workload (``"*"``: what a proposer registered
as its cold acceptance) and the default are guesses: a pool that starts from one averages its first
verdicts with it (steps max(pool_alpha, 1 / (n + prior_weight))), and while it has little evidence
it reads optimistic, each position raised towards 1 by ``optimism`` x (1 - rate) x w / (n_j + w).
Without that a fresh cluster whose guess (0.7 for the draft model) says drafting does not pay at 4
or 8 requests in flight never drafts, so it never learns that it does (goodput 0.948x and 0.962x
the best static depth there in the policy simulator's ``--no-priors`` run); with ``optimism`` = 0.5
every load is within 5% of the oracle (BENCHMARKS.md, "Thirteenth session").

``drain_counts`` hands the raw counts since the last drain to the shared-stats writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from policies.base import Outcome

ANY = "*"  # the workload of a prior that applies to every workload of its proposer


def lean(rates: Sequence[float], seen: Sequence[float], weight: float, decay: float = 1.0) -> list[float]:
    """Each position past the first blended with the one before it by evidence (module doc):
    (n_j * rate_j + weight * out_{j-1} * decay) / (n_j + weight), n_j = ``seen[j]`` (0 past its end)."""
    out = list(rates)
    for j in range(1, len(out)):
        n = seen[j] if j < len(seen) else 0.0
        out[j] = (n * out[j] + weight * out[j - 1] * decay) / (n + weight)
    return out


@dataclass
class PositionCounts:
    """Counts per draft position since the last drain (one (proposer, workload))."""

    drafted: list[int] = field(default_factory=list)  # drafts that had a token at position j
    reached: list[int] = field(default_factory=list)  # ... whose positions < j were all accepted
    accepted: list[int] = field(default_factory=list)  # ... and position j was accepted too

    def add(self, drafted: int, accepted: int) -> None:
        while len(self.drafted) < drafted:
            self.drafted.append(0)
            self.reached.append(0)
            self.accepted.append(0)
        for j in range(drafted):
            self.drafted[j] += 1
            if j <= accepted:
                self.reached[j] += 1
            if j < accepted:
                self.accepted[j] += 1

    def conditional(self) -> tuple[float | None, ...]:
        """accepted / reached per position (None where never reached)."""
        return tuple(a / r if r else None for a, r in zip(self.accepted, self.reached, strict=True))


class AcceptanceEstimator:
    def __init__(
        self,
        priors: Mapping[tuple[str, ...], Sequence[float]] | None = None,
        *,
        model_pair: str | None = None,
        default: float = 0.7,
        decay: float = 0.97,
        max_depth: int = 16,
        alpha: float = 0.1,
        prior_weight: float = 8.0,
        pool_alpha: float = 0.02,
        relax: float = 0.05,
        optimism: float = 0.5,
    ) -> None:
        """``priors``: (proposer, workload) or (model_pair, proposer, workload) -> rates per position.

        3-tuples of another ``model_pair`` are ignored; workload ``"*"`` applies to every workload.
        A prior shorter than ``max_depth`` repeats its last value. Priors for workload ``"*"`` are
        guesses, the others evidence; ``optimism``: how far a guess reads towards 1 before it is
        judged (module doc).
        """
        if not 0 < alpha <= 1 or not 0 < pool_alpha <= 1 or not 0 <= relax <= 1 or not 0 <= optimism <= 1:
            raise ValueError("alpha and pool_alpha must be in (0, 1], relax and optimism in [0, 1]")
        self.relax = relax
        self.optimism = optimism
        self.max_depth = max_depth
        self.alpha = alpha
        self.prior_weight = prior_weight
        self.pool_alpha = pool_alpha
        self.default = tuple(min(1.0, max(0.0, default * decay**j)) for j in range(max_depth))
        self.decay = decay
        self._priors: dict[tuple[str, str], tuple[float, ...]] = {}
        self._pool: dict[tuple[str, str], list[float]] = {}  # (proposer, workload) -> rates
        # per pool: how often each position was judged (an explicit prior counts as plenty)
        self._pool_seen: dict[tuple[str, str], list[float]] = {}
        self._rates: dict[str, dict[str, list[float]]] = {}  # request id -> proposer -> rates
        self._seen: dict[str, dict[str, list[int]]] = {}  # request id -> proposer -> times reached
        self._workload: dict[str, str] = {}  # request id -> workload
        self._counts: dict[tuple[str, str], PositionCounts] = {}
        for key, rates in (priors or {}).items():
            if len(key) == 3:
                if key[0] != model_pair:
                    continue
                key = key[1:]
            if len(key) != 2:
                raise ValueError(
                    f"prior key must be (proposer, workload) or (pair, proposer, workload): {key}"
                )
            self.set_prior(key[0], key[1], rates)

    def _pad(self, rates: Sequence[float]) -> list[float]:
        rates = [min(1.0, max(0.0, float(r))) for r in rates] or list(self.default[:1])
        return (rates + [rates[-1]] * self.max_depth)[: self.max_depth]

    def set_prior(self, proposer: str, workload: str, rates: Sequence[float]) -> None:
        """Replace a prior (e.g. fresh rates from shared stats); resets that pool."""
        self._priors[(proposer, workload)] = tuple(self._pad(rates))
        for key in [k for k in self._pool if k[0] == proposer and workload in (k[1], ANY)]:
            del self._pool[key]
            self._pool_seen.pop(key, None)

    def prior(self, proposer: str, workload: str) -> tuple[float, ...]:
        """What a request of ``workload`` with no history of ``proposer`` is estimated at."""
        pool = self._pool.get((proposer, workload))
        if pool is not None:
            seen = self._pool_seen[(proposer, workload)]
            return tuple(self._optimistic(self._lean(pool, seen), seen))
        prior = self._priors.get((proposer, workload))
        if prior is not None:  # evidence (the shared statistics): as given
            return prior
        guess = self._priors.get((proposer, ANY)) or self.default
        return tuple(self._optimistic(list(guess), ()))

    def _has_evidence(self, proposer: str, workload: str) -> bool:
        """A prior for this very workload is the shared statistics' measurement; one for ``"*"``
        (what a proposer registered as its cold acceptance) or the default is a guess."""
        return (proposer, workload) in self._priors

    def _optimistic(self, rates: list[float], seen: Sequence[float]) -> list[float]:
        """Each position raised towards 1 by ``optimism`` of the gap, fading as the pool is judged
        there: w / (n_j + w) with w = ``prior_weight`` (module doc: the cold trap)."""
        if not self.optimism:
            return rates
        w = self.prior_weight
        for j, rate in enumerate(rates):
            n = seen[j] if j < len(seen) else 0.0
            rates[j] = rate + self.optimism * (1.0 - rate) * w / (n + w)
        return rates

    def _lean(self, rates: Sequence[float], seen: Sequence[float]) -> list[float]:
        return lean(rates, seen, self.prior_weight, self.decay)

    def start(self, request_id: str, workload: str) -> None:
        """Tell the estimator a request's workload class (else the first update's, else "*")."""
        self._workload[request_id] = workload

    def update(
        self, request_id: str, proposer: str, drafted: int, accepted: int, *, workload: str | None = None
    ) -> None:
        """One verified draft: ``drafted`` tokens of which the first ``accepted`` were kept."""
        drafted = min(max(0, int(drafted)), self.max_depth)
        if drafted == 0:
            return
        accepted = min(max(0, int(accepted)), drafted)
        workload = self._workload.setdefault(request_id, workload or ANY)
        pool_key = (proposer, workload)
        if pool_key not in self._pool:
            evidence = self._has_evidence(proposer, workload)
            self._pool_seen[pool_key] = [1e9 if evidence else 0.0] * self.max_depth
            known = self._priors.get(pool_key) or self._priors.get((proposer, ANY)) or self.default
            self._pool[pool_key] = list(known)
        pool = self._pool[pool_key]
        pool_seen = self._pool_seen[pool_key]
        rates = self._rates.setdefault(request_id, {}).setdefault(proposer, list(pool))
        seen = self._seen.setdefault(request_id, {}).setdefault(proposer, [0] * self.max_depth)
        for j in range(min(accepted + 1, drafted)):
            hit = 1.0 if j < accepted else 0.0
            seen[j] += 1
            rates[j] += max(self.alpha, 1.0 / (seen[j] + self.prior_weight)) * (hit - rates[j])
            # a pool that started from a guess averages its first verdicts with it (as if it were
            # prior_weight verdicts), then tracks with pool_alpha; one backed by evidence: pool_alpha
            pool_seen[j] += 1
            pool[j] += max(self.pool_alpha, 1.0 / (pool_seen[j] + self.prior_weight)) * (hit - pool[j])
        self._counts.setdefault(pool_key, PositionCounts()).add(drafted, accepted)

    def estimate(
        self, request_id: str, proposer: str, max_depth: int, *, workload: str | None = None
    ) -> tuple[float, ...]:
        """Conditional acceptance of positions 0 .. max_depth - 1 for this request and proposer."""
        rates = self._rates.get(request_id, {}).get(proposer)
        if rates is None:
            rates = self.prior(proposer, self._workload.get(request_id, workload or ANY))
        else:
            rates = self._lean(rates, self._seen[request_id][proposer])
        out = tuple(rates[: max(0, max_depth)])
        return out + (out[-1:] or self.default[:1]) * (max_depth - len(out))

    def estimates(
        self, request_id: str, proposers: Iterable[str], max_depth: int, *, workload: str | None = None
    ) -> dict[str, tuple[float, ...]]:
        """``RequestView.acceptance`` for one request: an estimate per proposer."""
        return {p: self.estimate(request_id, p, max_depth, workload=workload) for p in proposers}

    def observe(self, outcome: Outcome) -> None:
        """Every request of an engine step: its draft's verdict, and relaxation of the estimates of
        the proposers it did not draft with this step (module doc)."""
        for r in outcome.requests:
            used = r.proposer if r.proposer is not None and r.drafted > 0 else None
            if used is not None:
                self.update(r.request_id, used, r.drafted, r.accepted, workload=r.workload)
            if self.relax > 0:
                for proposer, rates in self._rates.get(r.request_id, {}).items():
                    if proposer != used:
                        self._relax(r.request_id, proposer, rates)

    def _relax(self, request_id: str, proposer: str, rates: list[float]) -> None:
        pool = self.prior(proposer, self._workload.get(request_id, ANY))
        for j, target in enumerate(pool[: len(rates)]):
            rates[j] += self.relax * (target - rates[j])

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state (its counts stay in the pool and the drain)."""
        self._workload.pop(request_id, None)
        self._rates.pop(request_id, None)
        self._seen.pop(request_id, None)

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget every request not in ``request_ids`` (e.g. the running ones)."""
        keep = set(request_ids)
        for rid in (set(self._rates) | set(self._workload)) - keep:
            self.forget(rid)

    def drain_counts(self) -> dict[tuple[str, str], PositionCounts]:
        """Counts per (proposer, workload) since the last drain; resets them."""
        counts, self._counts = self._counts, {}
        return counts
