"""Calibration of self-speculation: which layers the draft skips, by expected tokens per second.

Measured, not assumed. On a small prompt set (the catalogue's ``CALIBRATION`` set: code, JSON,
prose, chat, none of them the benchmark's; ``loadtest.catalogue``) the full model first decodes a
greedy reference continuation; its K/V stays in a reference cache. For a candidate skip set S the
draft is then replayed exactly as ``SelfSpecProposer`` runs it: from verified length t (cache rows
< t hold the full model's K/V, copied from the reference) the kept layers feed the sequence's token
t, then their own drafts, up to ``max_depth`` tokens; a draft token counts as accepted while it
equals the reference (greedy verification). Position j's conditional acceptance a_j = accepted at j
/ tried at j (tried only when 1..j-1 were accepted, which is exactly the draft state the server
would be in). Starts of all prompts run as one batch of rows, each in its own work slot.

Cost is measured too (medians of timed forwards at the prompts' context): a plain step t_1, a
verify forward t_w of w = 1 + k tokens (made non-decreasing in w: noise never makes a wider forward
look cheaper), the embedding + final norm + output head alone, and the full stack; a draft step
of S costs head + (kept layers / all layers) * (full - head), the layers being the same shape.
Objective, per S, the best depth k of

    speedup(S, k) = E_S(k) * t_1 / (k * draft(S) + t_{1+k}),   E_S(k) = 1 + sum_{j<=k} prod_{i<=j} a_i

i.e. expected tokens per second relative to plain decoding (the goodput policy's model for one
request). Search, bounded by a time budget: (1) every single layer skipped alone, first-position
acceptance on a subset of starts: a ranking of layers from least to most harmful to skip;
(2) greedy growth: each round tries adding each of the ``width`` least harmful layers not yet
skipped (first-position acceptance on the subset), keeps the best, and scores the grown set in
full (all starts, all depths); it stops after ``patience`` rounds without a better speedup, when
the best addition's first-position acceptance falls below ``floor``, when only one layer would be
left, or when the budget is spent. The best scored set wins (the default
set is scored too, for comparison). Deterministic apart from the timings.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from serve_app.engine.model import DecoderModel
from serve_app.engine.proposers.self_spec import LayerSkipModel
from serve_app.engine.proposers.skip_plan import SkipPlan, default_skip


@dataclass(frozen=True)
class Costs:
    """Measured seconds: plain step, verify forward by width, head-only pass, full stack."""

    verify: tuple[float, ...]  # [w - 1]: one forward of w tokens (w = 1 is a plain step)
    head: float  # embedding + final norm + output head, no layers
    full: float  # every layer (the same as verify[0])
    num_layers: int

    def draft(self, kept: int) -> float:
        return self.head + kept / self.num_layers * max(0.0, self.full - self.head)


@dataclass
class Scored:
    """One candidate skip set, measured."""

    skip: tuple[int, ...]
    acceptance: list[float]  # conditional acceptance at positions 1..max_depth
    tried: list[int]  # drafts tried at each position
    depth: int = 0
    speedup: float = 0.0  # expected tokens/s relative to plain decoding, at the best depth
    tokens_per_step: float = 1.0  # E at the best depth
    draft_cost: float = 0.0  # a draft step / a plain step

    def as_dict(self) -> dict[str, Any]:
        return {"skip_layers": list(self.skip), "depth": self.depth,
                "expected_speedup": round(self.speedup, 4), "tokens_per_step": round(self.tokens_per_step, 4),
                "draft_cost": round(self.draft_cost, 4), "acceptance": [round(a, 4) for a in self.acceptance],
                "tried": self.tried}  # fmt: skip


@dataclass
class CalibrationResult:
    best: Scored
    default: Scored
    costs: Costs
    history: list[Scored] = field(default_factory=list)  # every fully scored set, in search order
    ranking: list[tuple[int, float]] = field(default_factory=list)  # (layer, acceptance skipped alone)
    seconds: float = 0.0
    starts: int = 0
    prompts: int = 0

    def plan(self, model_name: str) -> SkipPlan:
        details = {
            "model": model_name, "calibrated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "objective": "expected tokens/s vs plain = E(k) * t_plain / (k * t_draft + t_verify(1 + k))",
            "expected_speedup": round(self.best.speedup, 4),
            "tokens_per_step": round(self.best.tokens_per_step, 4),
            "acceptance": [round(a, 4) for a in self.best.acceptance],
            "draft_cost": round(self.best.draft_cost, 4),
            "plain_step_s": round(self.costs.verify[0], 5),
            "verify_s": [round(t, 5) for t in self.costs.verify], "head_s": round(self.costs.head, 5),
            "default": self.default.as_dict(), "history": [s.as_dict() for s in self.history],
            "ranking": [[layer, round(a, 4)] for layer, a in self.ranking],
            "search_seconds": round(self.seconds, 1), "starts": self.starts, "prompts": self.prompts,
        }  # fmt: skip
        return SkipPlan(self.best.skip, self.costs.num_layers, "calibrated", self.best.depth, details)


def expected_tokens(acceptance: Sequence[float], depth: int) -> float:
    total, run = 1.0, 1.0
    for a in acceptance[:depth]:
        run *= a
        total += run
    return total


class SelfSpecCalibrator:
    """Measures skip sets on one model and a prompt set (see the module docstring)."""

    def __init__(
        self,
        model: DecoderModel,
        prompts: Sequence[Sequence[int]],
        new_tokens: int = 48,
        max_depth: int = 6,
        batch: int = 32,
        log: Callable[[str], None] = lambda message: None,
    ) -> None:
        if not prompts or new_tokens < 2 or max_depth < 1:
            raise ValueError("calibration needs prompts, new_tokens >= 2 and max_depth >= 1")
        self.model = model
        self.max_depth = max_depth
        self.log = log
        self.sequences = self._references([list(p) for p in prompts], new_tokens)
        longest = max(len(s) for s in self.sequences)
        self.work = model.new_cache(batch, longest + max_depth + 1)
        # Every verified length t from which the next token is known: feed seq[t], predict seq[t + 1].
        self.starts = [(p, t) for p, seq in enumerate(self.sequences)
                       for t in range(self.prompt_lens[p] - 1, len(seq) - 1)]  # fmt: skip
        stride = max(1, len(self.starts) // (4 * batch))
        self.quick_starts = self.starts[::stride][: 4 * batch]  # the subset for ranking moves

    # ----------------------------------------------------------------------------- references
    @torch.inference_mode()
    def _references(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy continuations by the full model; the reference cache keeps their K/V."""
        model = self.model
        self.prompt_lens = [len(p) for p in prompts]
        cache = model.new_cache(len(prompts), max(self.prompt_lens) + new_tokens + 1)
        slots = [cache.allocate() for _ in prompts]
        sequences = []
        for slot, prompt in zip(slots, prompts, strict=True):
            hidden = model.forward(torch.tensor([prompt], device=model.device), cache, [slot])
            cache.set_length(slot, len(prompt))
            sequences.append([*prompt, int(model.logits(hidden[:, -1]).argmax(-1))])
        for _ in range(new_tokens - 1):
            last = torch.tensor([[s[-1]] for s in sequences], device=model.device)
            logits = model.logits(model.forward(last, cache, slots)[:, -1])  # [P, V]
            for slot, seq, token in zip(slots, sequences, logits.argmax(-1).tolist(), strict=True):
                cache.set_length(slot, cache.lengths[slot] + 1)
                seq.append(token)
        self.reference = cache  # slot p holds the K/V of sequences[p][:-1]
        return sequences

    # ----------------------------------------------------------------------------- measuring
    @torch.inference_mode()
    def acceptance(
        self, skip: Sequence[int], depth: int, starts: Sequence[tuple[int, int]]
    ) -> tuple[list[int], list[int]]:
        """Accepted and tried drafts at positions 1..depth, replaying the draft from every start."""
        draft = LayerSkipModel(self.model, skip)
        accepted, tried = [0] * depth, [0] * depth
        rows = self.work.num_slots
        for first in range(0, len(starts), rows):
            chunk = starts[first : first + rows]
            self._load(chunk)
            active = list(range(len(chunk)))
            feed = [self.sequences[p][t] for p, t in chunk]
            for j in range(depth):
                active = [b for b in active if chunk[b][1] + j + 1 < len(self.sequences[chunk[b][0]])]
                if not active:
                    break
                for b in active:
                    self.work.set_length(b, chunk[b][1] + j)
                tokens = torch.tensor([[feed[b]] for b in active], device=self.model.device)
                predicted = draft.logits(draft.forward(tokens, self.work, active)[:, -1]).argmax(-1).tolist()
                still = []
                for b, token in zip(active, predicted, strict=True):
                    p, t = chunk[b]
                    tried[j] += 1
                    if token == self.sequences[p][t + j + 1]:
                        accepted[j] += 1
                        feed[b] = token
                        still.append(b)
                active = still
        return accepted, tried

    def _load(self, chunk: Sequence[tuple[int, int]]) -> None:
        """Work slot b gets prompt p's reference K/V (rows < t are what the draft may read)."""
        ref, work = self.reference, self.work
        width = min(ref.max_seq_len, work.max_seq_len)
        for b, (p, _) in enumerate(chunk):
            for layer in range(len(ref.k)):
                work.k[layer][b, :, :width].copy_(ref.k[layer][p, :, :width])
                work.v[layer][b, :, :width].copy_(ref.v[layer][p, :, :width])

    @torch.inference_mode()
    def costs(self, repeats: int = 5) -> Costs:
        """Median seconds of forwards at the first prompt's full context (nothing is kept)."""
        self._load([(0, 0)])
        context = len(self.sequences[0]) - 1
        self.work.set_length(0, context)
        model = self.model
        token = torch.tensor([[self.sequences[0][-1]]], device=model.device)

        def timed(tokens: torch.Tensor, layers: Sequence[int] | None) -> float:
            run = lambda: model.logits(model.forward(tokens, self.work, [0], layers=layers))  # noqa: E731
            run()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        full = timed(token, None)
        verify = [timed(token.repeat(1, w), None) for w in range(1, self.max_depth + 2)]
        head = timed(token, ())
        # The same shape timed twice: the lower median (a neighbour's burst inflates, never deflates).
        full = verify[0] = min(full, verify[0], timed(token, None))
        # A wider forward never costs less: timing noise below a narrower one's is clipped up.
        verify = list(itertools.accumulate(verify, max))
        return Costs(verify=tuple(verify), head=min(head, full), full=full, num_layers=model.cfg.num_layers)

    def score(self, skip: Sequence[int], costs: Costs) -> Scored:
        """Acceptance at every depth over all starts, and the best depth's expected speedup."""
        accepted, tried = self.acceptance(skip, self.max_depth, self.starts)
        rates = [a / n if n else 0.0 for a, n in zip(accepted, tried, strict=True)]
        kept = costs.num_layers - len(set(skip))
        draft = costs.draft(kept)
        scored = Scored(tuple(sorted(set(skip))), rates, tried, draft_cost=draft / costs.verify[0])
        for k in range(1, self.max_depth + 1):
            tokens = expected_tokens(rates, k)
            speedup = tokens * costs.verify[0] / (k * draft + costs.verify[k])
            if speedup > scored.speedup:
                scored.depth, scored.speedup, scored.tokens_per_step = k, speedup, tokens
        return scored

    # ----------------------------------------------------------------------------- search
    def search(
        self, budget_s: float = 240.0, width: int = 3, patience: int | None = None, floor: float = 0.2
    ) -> CalibrationResult:
        started = time.monotonic()
        layers = self.model.cfg.num_layers
        patience = patience or max(3, layers // 4)  # the curve may dip before cheaper drafts pay
        costs = self.costs()
        self.log(f"costs: plain step {costs.verify[0] * 1e3:.1f} ms, verify of {self.max_depth + 1} tokens "
                 f"{costs.verify[-1] * 1e3:.1f} ms, head alone {costs.head * 1e3:.1f} ms")  # fmt: skip

        def quick(skip: Sequence[int]) -> float:
            accepted, tried = self.acceptance(skip, 1, self.quick_starts)
            return accepted[0] / max(1, tried[0])

        def over_budget() -> bool:
            return time.monotonic() - started > budget_s

        ranking = sorted(((i, quick((i,))) for i in range(layers)), key=lambda x: (-x[1], x[0]))
        self.log("layers by acceptance when skipped alone: "
                 + ", ".join(f"{i}:{a:.2f}" for i, a in ranking))  # fmt: skip
        default = self.score(default_skip(layers), costs)
        self.log(f"default skip {list(default.skip)}: {self._describe(default)}")
        history: list[Scored] = []
        best: Scored | None = None
        current: list[int] = []
        since_best = 0
        while len(current) < layers - 1 and since_best < patience and not over_budget():
            pool = [i for i, _ in ranking if i not in current][:width]
            first = {i: quick([*current, i]) for i in pool}
            pick = max(pool, key=lambda i: first[i])  # ties: the better-ranked layer
            if first[pick] < floor:
                break  # the draft's first token is mostly wrong from here on
            current.append(pick)
            scored = self.score(current, costs)
            history.append(scored)
            self.log(f"skip {len(current):2d} layers {sorted(current)}: {self._describe(scored)}")
            if best is None or scored.speedup > best.speedup:
                best, since_best = scored, 0
            else:
                since_best += 1
        assert best is not None
        if default.speedup > best.speedup:
            best = default
        return CalibrationResult(best, default, costs, history, ranking, time.monotonic() - started,
                                 len(self.starts), len(self.sequences))  # fmt: skip

    @staticmethod
    def _describe(s: Scored) -> str:
        rates = " ".join(f"{a:.2f}" for a in s.acceptance)
        return (f"acceptance {rates}; draft step {s.draft_cost:.2f} of a plain step; best depth {s.depth}: "
                f"{s.tokens_per_step:.2f} tokens/step, expected speedup {s.speedup:.3f}x")  # fmt: skip


def calibrate_self_spec(
    model: DecoderModel,
    prompts: Sequence[Sequence[int]],
    new_tokens: int = 48,
    max_depth: int = 6,
    budget_s: float = 240.0,
    log: Callable[[str], None] = lambda message: None,
) -> CalibrationResult:
    """Measure and search skip sets for ``model`` on ``prompts`` (token ids); see the module docstring."""
    calibrator = SelfSpecCalibrator(model, prompts, new_tokens, max_depth, log=log)
    return calibrator.search(budget_s)
