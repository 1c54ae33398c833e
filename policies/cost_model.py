"""A fitted, online-corrected cost model: how long a target forward and a draft step take.

Target forward over ``rows`` rows of ``tokens_per_row`` tokens at mean context ``ctx``, with
n = rows x tokens_per_row tokens in the forward:

    t(rows, tpr, ctx) = c0 + c1 * max(0, n - knee) + c2 * n + c3 * rows * ctx

Why this shape: on this CPU a bf16 forward is memory-bound (it reads every weight once whatever n
is) until n reaches a knee (~8-16 tokens), then compute grows linearly (measured at ctx 200, batch
1: n = 1: 135 ms, 4: 130, 8: 155, 16: 185, 32: 290). c0 is the weight read, c2 the small per-token
work below the knee, c1 the extra slope of the compute-bound side, c3 attention reading each row's
KV cache. The knee is chosen from ``KNEE_CANDIDATES`` by the best fit; the coefficients by least
squares on relative error (numpy), kept non-negative (a negative column is dropped and the rest
refitted). Draft step per proposer (one token for every row): ``d0 + d1 * rows + d2 * rows * ctx``.
A proposer never fitted nor observed costs 0 (n-gram lookup): fit every model-based proposer.

Shape residual. The fit is monotone in n, the forward is not: measured on an AMD EPYC with
AVX-512 BF16 (2 threads, Qwen 1.5B bf16, ctx 100, oneDNN's prepacked bf16 products), n = 1..9
tokens cost about 150, 165, 148, 137, 131, 130, 150, 157, 158 ms: two tokens cost more than one,
and four to six cost less than one, since oneDNN's kernel for a single row is not its fastest.
The fitted curve averages that away, and a policy trusting it drafts at depths whose forwards are
dear and avoids the cheap ones (the real load-1 runs of BENCHMARKS.md, "Speculation policies").
So ``fit`` also keeps, for each n the profile measured, the ratio measured / fitted (``shape``; 1
where n was not profiled), and every prediction is multiplied by it. ``profile_plan`` measures
every n of one row up to ``SMALL_N`` for that reason.
Admitting a request to a proposer costs its prefill (``draft_prefill_time``), except for proposers
marked ``no_prefill`` (they draft from state the target already holds, e.g. self-speculation in the
target's own KV cache): 0. The profile times each draft model's prefill of its context
(``set_draft_prefill``: seconds per token, compute-bound: a 0.5B draft read 85 tokens in ~170 ms on
an AVX-512 EPYC, 20 of its 8 ms draft steps); a proposer without that measure is charged one draft
step per ``PREFILL_CHUNK`` tokens (the memory-bound guess, ~8x too cheap there).

Online correction: each measurement moves a multiplicative factor geometrically towards
measured / predicted, the ratio clipped to [1/2, 2] so one outlier (a GC pause, a neighbour's
burst) moves a prediction by at most 2**ALPHA. There is one global factor (so a uniformly slower
machine shifts every prediction, also of shapes not run lately) and one per regime for the
residual (target: each n up to ``SMALL_N`` on its own, since neighbouring widths differ by up to
25% here, then log2 buckets of n; draft: log2 buckets of rows).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from policies.base import Outcome

TargetSample = tuple[int, int, int, float]  # rows, tokens_per_row, context, seconds
DraftSample = tuple[int, int, float]  # rows, context, seconds
KNEE_CANDIDATES = (4, 6, 8, 12, 16, 24, 32, 48, 64)
PREFILL_CHUNK = 64  # unprofiled: a prefill costs one draft step per this many tokens
ALPHA = 0.1  # online step (in log space) per measurement
CLIP = 2.0  # a measurement's ratio to the prediction is clipped to [1/CLIP, CLIP]
FACTOR_BOUNDS = (0.1, 10.0)
BUCKETS = 8  # draft: log2 buckets of rows
SMALL_N = 16  # target: each n <= SMALL_N its own bucket, then LOG_N log2 buckets:
LOG_N = 4  # 17-32, 33-64, 65-128, above
TARGET_BUCKETS = SMALL_N + LOG_N
# 4: the measured draft prefill ("draft_prefill"); 3: the draft-step coefficients under "draft_steps"
# (2 said "draft"); older: profile again
VERSION = 4
# Used until ``fit`` runs: the fit of the Qwen2.5-Coder-1.5B bf16 forwards measured at ctx 200 on
# this machine (above), c3 from bandwidth: 28 KB of KV per token of context per row at ~23 GB/s.
DEFAULT_TARGET = (0.1313, 0.0053, 0.0, 1.2e-6)
DEFAULT_KNEE = 4


def profile_plan() -> list[tuple[int, int]]:
    """(rows, tokens_per_row) shapes to time at engine start (one context, e.g. 256): ~4.5 s a round.

    One row at every width 1..8 (the widths a lone request verifies, each with its own shape
    residual, module docstring), then n = rows x tokens_per_row up to 32 with rows 1/4/8, both
    sides of the knee, and the same n at different rows (which separates the per-row term); rows
    16 and 32 (n up to 128) pin the compute-bound slope where heavy batches live. Shapes needing
    more KV slots than the engine has are skipped: the fit needs at least 4 samples.
    """
    return [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (1, 16), (4, 1), (4, 4),
            (8, 1), (8, 2), (8, 4), (16, 1), (16, 4), (32, 1), (32, 2), (32, 4)]  # fmt: skip


def draft_profile_plan() -> list[int]:
    """Row counts at which to time one single-token draft step of each model-based proposer."""
    return [1, 2, 4, 8, 16, 32]


def _bucket(value: int) -> int:
    """Draft correction bucket of ``value`` rows: log2."""
    return min(BUCKETS - 1, max(0, int(value).bit_length() - 1))


def _target_bucket(n: int) -> int:
    """Target correction bucket of n tokens in the forward: n - 1 up to ``SMALL_N``, then log2
    (17..32 -> 16, 33..64 -> 17, ...)."""
    n = max(1, int(n))
    if n <= SMALL_N:
        return n - 1
    return min(TARGET_BUCKETS - 1, SMALL_N + (n - 1).bit_length() - SMALL_N.bit_length())


def _nonneg_lstsq(columns: list[np.ndarray], y: np.ndarray, drop_order: Sequence[int]) -> np.ndarray:
    """Least squares on relative error with coefficients >= 0 (an active set that drops columns)."""
    weights = 1.0 / y
    active = list(range(len(columns)))
    matrix = np.stack(columns, axis=1) * weights[:, None]
    target = y * weights
    # Rank deficiency (e.g. a single context): drop columns in ``drop_order`` until full rank.
    for col in drop_order:
        if np.linalg.matrix_rank(matrix[:, active]) >= len(active):
            break
        active.remove(col)
    while True:
        coef, *_ = np.linalg.lstsq(matrix[:, active], target, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            result = np.zeros(len(columns))
            result[active] = np.maximum(coef, 0.0)
            return result
        active.pop(int(np.argmin(coef)))


class FittedCostModel:
    """Implements ``policies.base.CostModel``; fitted from profiles, corrected online."""

    def __init__(
        self,
        target: Sequence[float] = DEFAULT_TARGET,
        knee: int = DEFAULT_KNEE,
        draft: Mapping[str, Sequence[float]] | None = None,
        no_prefill: Iterable[str] = (),
        shape: Mapping[int, float] | None = None,
        draft_prefill: Mapping[str, float] | None = None,
    ) -> None:
        self.target = tuple(float(c) for c in target)  # c0, c1, c2, c3
        self.knee = int(knee)
        # n -> measured / fitted at the profile (module docstring); part of the fit, not corrected
        self.shape = {int(n): float(f) for n, f in (shape or {}).items()}
        self.draft = {name: tuple(float(c) for c in coef) for name, coef in (draft or {}).items()}
        self.no_prefill: set[str] = set(no_prefill)  # proposers whose admission costs nothing
        # proposer -> measured seconds per context token of its prefill (set_draft_prefill)
        self.draft_prefill = {name: float(v) for name, v in (draft_prefill or {}).items()}
        self.reset_corrections()

    def reset_corrections(self) -> None:
        self.target_factor = [1.0, [1.0] * TARGET_BUCKETS]  # global, per bucket of n
        self.draft_factor: dict[str, list] = {name: [1.0, [1.0] * BUCKETS] for name in self.draft}

    # ------------------------------------------------------------------------------ prediction
    def fitted_target_time(self, rows: int, tokens_per_row: int, context: int) -> float:
        """The parametric fit alone (no shape residual, no correction)."""
        c0, c1, c2, c3 = self.target
        n = rows * tokens_per_row
        return max(1e-6, c0 + c1 * max(0, n - self.knee) + c2 * n + c3 * rows * context)

    def base_target_time(self, rows: int, tokens_per_row: int, context: int) -> float:
        """The fit times the profile's shape residual at n (what the corrections multiply)."""
        fitted = self.fitted_target_time(rows, tokens_per_row, context)
        return fitted * self.shape.get(rows * tokens_per_row, 1.0)

    def base_draft_time(self, proposer: str, rows: int, context: int) -> float:
        d0, d1, d2 = self.draft.get(proposer, (0.0, 0.0, 0.0))
        return d0 + d1 * rows + d2 * rows * context if rows > 0 else 0.0

    def target_time(self, rows: int, tokens_per_row: int, context: int) -> float:
        g, buckets = self.target_factor
        return (
            self.base_target_time(rows, tokens_per_row, context)
            * g
            * buckets[_target_bucket(rows * tokens_per_row)]
        )

    def draft_time(self, proposer: str, rows: int, context: int) -> float:
        base = self.base_draft_time(proposer, rows, context)
        if base <= 0.0:
            return 0.0
        g, buckets = self.draft_factor.setdefault(proposer, [1.0, [1.0] * BUCKETS])
        return base * g * buckets[_bucket(rows)]

    def set_draft(self, proposer: str, coefficients: Sequence[float]) -> None:
        """Set ``proposer``'s (d0, d1, d2) directly (e.g. 0s for a proposer known to be free)."""
        d0, d1, d2 = (float(c) for c in coefficients)
        self.draft[proposer] = (d0, d1, d2)
        self.draft_factor[proposer] = [1.0, [1.0] * BUCKETS]

    def mark_no_prefill(self, proposer: str) -> None:
        """``proposer`` needs no prefill to start drafting for a request (``draft_prefill_time`` 0)."""
        self.no_prefill.add(proposer)

    def set_draft_prefill(self, proposer: str, tokens: int, seconds: float) -> None:
        """``proposer`` read ``tokens`` of context in ``seconds`` (the profile's timed prefill)."""
        if tokens > 0 and seconds > 0:
            self.draft_prefill[proposer] = seconds / tokens

    def draft_prefill_time(self, proposer: str, tokens: int) -> float:
        """The proposer reads ``tokens`` of context (admitting a request, or catching up after steps
        it did not draft): the measured rate, never below one draft step; unmeasured, one draft step
        per ``PREFILL_CHUNK`` tokens; 0 for ``no_prefill``.

        The draft steps' online factor does not move the measured rate: it learns what a real step
        costs beyond the profile's one-token forward (each step's first forward feeds two tokens,
        the bonus and the last accepted draft, plus the proposer's Python), which one long forward
        does not pay. Measured on an AVX-512 EPYC: the factor at 1.27-1.38 after a few requests,
        while admitting a 39-token prompt took 1.87 ms a token against the profile's 1.85."""
        if proposer in self.no_prefill:
            return 0.0
        step = self.draft_time(proposer, 1, tokens)
        per_token = self.draft_prefill.get(proposer)
        if per_token is None:
            return step * math.ceil(max(0, tokens) / PREFILL_CHUNK)
        return max(step, per_token * max(0, tokens))

    # ------------------------------------------------------------------------------------- fit
    def fit(self, samples: Sequence[TargetSample]) -> FittedCostModel:
        """Fit the target's coefficients, knee and shape residual to profiled samples; resets its
        corrections."""
        data = np.asarray([s for s in samples if s[3] > 0], dtype=float).reshape(-1, 4)
        if len(data) < 4:
            raise ValueError(f"cost model fit needs >= 4 target samples with seconds > 0, got {len(data)}")
        rows, tpr, ctx, y = data.T
        n = rows * tpr
        best = None
        for knee in [k for k in KNEE_CANDIDATES if k < n.max()] or [int(n.max())]:
            columns = [np.ones_like(n), np.maximum(0.0, n - knee), n, rows * ctx]
            coef = _nonneg_lstsq(columns, y, drop_order=(3, 1))
            pred = np.stack(columns, axis=1) @ coef
            error = float(np.sum(((pred - y) / y) ** 2))
            if best is None or error < best[0] - 1e-12:
                best = (error, knee, coef)
        _, self.knee, coef = best  # type: ignore[misc]
        self.target = tuple(float(c) for c in coef)
        # Shape residual per n: the geometric mean of measured / fitted over the samples at that n.
        logs: dict[int, list[float]] = {}
        for r, t, c, seconds in data:
            n = int(r * t)
            logs.setdefault(n, []).append(math.log(seconds / self.fitted_target_time(int(r), int(t), int(c))))
        self.shape = {n: math.exp(sum(v) / len(v)) for n, v in sorted(logs.items())}
        self.target_factor = [1.0, [1.0] * TARGET_BUCKETS]
        return self

    def fit_draft(self, proposer: str, samples: Sequence[DraftSample]) -> FittedCostModel:
        """Fit ``proposer``'s draft step from (rows, context, seconds) samples."""
        data = np.asarray([s for s in samples if s[2] > 0], dtype=float).reshape(-1, 3)
        if len(data) < 1:
            raise ValueError(f"cost model fit of {proposer!r} needs >= 1 draft sample with seconds > 0")
        rows, ctx, y = data.T
        coef = _nonneg_lstsq([np.ones_like(rows), rows, rows * ctx], y, drop_order=(2, 1))
        self.draft[proposer] = tuple(float(c) for c in coef)
        self.draft_factor[proposer] = [1.0, [1.0] * BUCKETS]
        return self

    # ------------------------------------------------------------------------ online correction
    @staticmethod
    def _correct(factor: list, bucket: int, base: float, seconds: float) -> None:
        """Global factor towards measured / (base * global), then the bucket's on the rest."""

        def step(value: float, ratio: float) -> float:
            ratio = min(CLIP, max(1.0 / CLIP, ratio))
            return min(FACTOR_BOUNDS[1], max(FACTOR_BOUNDS[0], value * ratio**ALPHA))

        factor[0] = step(factor[0], seconds / (base * factor[0]))
        factor[1][bucket] = step(factor[1][bucket], seconds / (base * factor[0] * factor[1][bucket]))

    def observe_target(self, rows: int, tokens_per_row: int, context: int, seconds: float) -> None:
        """A measured target forward; moves the prediction for its shape towards it."""
        if rows > 0 and tokens_per_row > 0 and seconds > 0 and math.isfinite(seconds):
            base = self.base_target_time(rows, tokens_per_row, context)
            self._correct(self.target_factor, _target_bucket(rows * tokens_per_row), base, seconds)

    def observe_draft(self, proposer: str, rows: int, context: int, seconds: float) -> None:
        """A measured single-token draft step; an unknown proposer starts as constant-per-step."""
        if rows <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        if proposer not in self.draft:
            self.draft[proposer] = (float(seconds), 0.0, 0.0)
            self.draft_factor[proposer] = [1.0, [1.0] * BUCKETS]
            return
        base = self.base_draft_time(proposer, rows, context)
        if base > 0:
            self._correct(self.draft_factor[proposer], _bucket(rows), base, seconds)

    def observe(self, outcome: Outcome) -> None:
        """Both corrections from an engine step (draft seconds per step = total / steps)."""
        rows = len(outcome.requests)
        self.observe_target(rows, outcome.tokens_per_row, outcome.context, outcome.target_seconds)
        for proposer, seconds in outcome.draft_seconds.items():
            steps = outcome.draft_steps.get(proposer, 0)
            used = sum(1 for r in outcome.requests if r.proposer == proposer and r.depth > 0)
            if steps > 0 and used > 0:
                self.observe_draft(proposer, used, outcome.context, seconds / steps)

    # ---------------------------------------------------------------------- reports, persistence
    def fit_report(
        self,
        held_out: Sequence[TargetSample],
        draft_held_out: Mapping[str, Sequence[DraftSample]] | None = None,
    ) -> dict:
        """Predicted vs measured on samples not used to fit: per sample and mean/max abs % error."""

        def summary(pairs: list[tuple[dict, float, float]]) -> dict:
            samples = []
            for shape, measured, predicted in pairs:
                error = abs(predicted - measured) / measured * 100.0
                samples.append(
                    {**shape, "measured": measured, "predicted": predicted, "abs_pct_error": error}
                )
            errors = [s["abs_pct_error"] for s in samples]
            return {
                "n": len(samples),
                "mean_abs_pct_error": float(np.mean(errors)) if errors else float("nan"),
                "max_abs_pct_error": float(np.max(errors)) if errors else float("nan"),
                "samples": samples,
            }

        report = summary(
            [
                ({"rows": r, "tokens_per_row": t, "context": c}, s, self.target_time(r, t, c))
                for r, t, c, s in held_out
                if s > 0
            ]
        )
        if draft_held_out:
            report["draft_steps"] = {
                name: summary(
                    [({"rows": r, "context": c}, s, self.draft_time(name, r, c)) for r, c, s in rows if s > 0]
                )
                for name, rows in draft_held_out.items()
            }
        return report

    def to_dict(self) -> dict:
        """JSON-able coefficients and corrections (cached per (hardware, model) in shared stats)."""
        return {
            "version": VERSION,
            "knee": self.knee,
            "target": list(self.target),
            "shape": {str(n): f for n, f in sorted(self.shape.items())},
            "draft_steps": {name: list(coef) for name, coef in self.draft.items()},
            "no_prefill": sorted(self.no_prefill),
            "draft_prefill": dict(sorted(self.draft_prefill.items())),
            "target_factor": [self.target_factor[0], list(self.target_factor[1])],
            "draft_factor": {name: [f[0], list(f[1])] for name, f in self.draft_factor.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> FittedCostModel:
        """Read ``to_dict``'s form (this ``VERSION`` only: a replica profiles again rather than
        trust an older layout)."""
        version = data.get("version")
        if version != VERSION:
            raise ValueError(f"unsupported cost model version {version!r} (this is {VERSION})")
        shape = {int(n): float(f) for n, f in data.get("shape", {}).items()}
        drafts = data.get("draft_steps", {})
        model = cls(data["target"], data["knee"], drafts, data.get("no_prefill", ()), shape,
                    data.get("draft_prefill", {}))  # fmt: skip
        if "target_factor" in data:
            g, buckets = data["target_factor"]
            if len(buckets) == TARGET_BUCKETS:
                model.target_factor = [float(g), [float(b) for b in buckets]]
            else:
                model.target_factor = [float(g), [1.0] * TARGET_BUCKETS]
        for name, (g, buckets) in data.get("draft_factor", {}).items():
            if name in model.draft:
                model.draft_factor[name] = [float(g), [float(b) for b in buckets]]
        return model
