"""Why self-speculation pays or not: acceptance and draft cost against the number of layers skipped.

``specserve calibrate self-spec --curve 0 2 4 ...`` runs this instead of the search. For each count
c it takes the c layers that hurt first-position acceptance least when skipped alone (a ranking
measured on a strided subset of the calibration's starts, as the search's first phase does), then
measures, on the same greedy reference continuations and replay as the calibration
(``SelfSpecCalibrator``):

- conditional acceptance a_1 (and a_2, ...) of the draft over every start;
- the draft step's cost, TIMED (one token through the kept layers + the output head, at the first
  prompt's full context), as a fraction of a timed plain step, beside the fraction of the weight
  bytes it reads (kept layers + head + final norm): on a memory-bound machine the two move
  together, falling only linearly in c;
- the expected speedup over plain decoding at batch 1 for each depth k, with the timed verify
  forwards: ``E(k) * t_plain / (k * t_draft + t_verify(1 + k))``, E(k) = 1 + sum_j prod_{i<=j} a_i.

Count 0 is the full model drafting for itself (acceptance 1 by definition, nothing replayed). Sets
given by name (the calibrated and the default skip sets) are measured the same way. Deterministic
apart from the timings.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from loadtest.calibrate.self_spec import Costs, SelfSpecCalibrator, expected_tokens
from serve_app.engine.weights import weight_nbytes


@dataclass(frozen=True)
class CurveRow:
    """One skip set, measured."""

    label: str  # "2 layers" or a name (calibrated, default)
    skip: tuple[int, ...]
    acceptance: tuple[float, ...]  # conditional, positions 1..depth
    tried: tuple[int, ...]
    draft_fraction: float  # timed draft step / timed plain step
    weight_fraction: float  # bytes the draft step reads / bytes a plain step reads
    speedup: tuple[float, ...]  # expected tokens/s vs plain at depths 1..depth

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "skip_layers": list(self.skip),
                "acceptance": [round(a, 4) for a in self.acceptance], "tried": list(self.tried),
                "draft_fraction": round(self.draft_fraction, 4),
                "weight_fraction": round(self.weight_fraction, 4),
                "expected_speedup": [round(s, 4) for s in self.speedup]}  # fmt: skip


@dataclass
class SkipCurve:
    """Rows by count (then named sets), the costs they were scored with, the layer ranking."""

    num_layers: int
    depth: int
    costs: Costs
    rows: list[CurveRow]
    ranking: list[tuple[int, float]] = field(default_factory=list)  # (layer, a_1 skipped alone)
    starts: int = 0
    rank_starts: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "depth": self.depth, "starts": self.starts,
                "rank_starts": self.rank_starts, "seconds": round(self.seconds, 1),
                "plain_step_s": round(self.costs.verify[0], 5),
                "verify_s": [round(t, 5) for t in self.costs.verify],
                "ranking": [[layer, round(a, 4)] for layer, a in self.ranking],
                "rows": [r.as_dict() for r in self.rows]}  # fmt: skip


@torch.inference_mode()
def timed_draft_fraction(calibrator: SelfSpecCalibrator, skip: Sequence[int], repeats: int = 11) -> float:
    """Median over ``repeats`` pairs of (one draft token through the layers ``skip`` leaves, plus
    the output head) / (one plain step), timed back to back at the first prompt's full context in
    work slot 0 (the cache length is not advanced). Pairs, so drift hits both sides alike."""
    model, work = calibrator.model, calibrator.work
    calibrator._load([(0, 0)])
    work.set_length(0, len(calibrator.sequences[0]) - 1)
    kept = [i for i in range(model.cfg.num_layers) if i not in set(skip)]
    token = torch.tensor([[calibrator.sequences[0][-1]]], device=model.device)

    def seconds(layers: Sequence[int] | None) -> float:
        start = time.perf_counter()
        model.logits(model.forward(token, work, [0], layers=layers))
        return time.perf_counter() - start

    seconds(None), seconds(kept)  # warm-up
    return statistics.median(seconds(kept) / seconds(None) for _ in range(repeats))


def _weight_fraction(calibrator: SelfSpecCalibrator, skip: Sequence[int]) -> float:
    model = calibrator.model
    skipped = sum(weight_nbytes(t) for i in set(skip) for t in model.layers[i].tensors())
    return (model.weight_bytes - skipped) / model.weight_bytes


def measure_skip_curve(
    calibrator: SelfSpecCalibrator,
    counts: Sequence[int],
    named: Mapping[str, Sequence[int]] | None = None,
    rank_starts: int = 32,
    log: Callable[[str], None] = lambda message: None,
) -> SkipCurve:
    """Score the ``counts`` least harmful layers (and each ``named`` set); see the module docstring.

    Depth: the calibrator's ``max_depth``. Verify forwards are timed once (``calibrator.costs``);
    every set's draft step in pairs with plain steps (``timed_draft_fraction``)."""
    started = time.monotonic()
    layers, depth = calibrator.model.cfg.num_layers, calibrator.max_depth
    if any(not 0 <= c < layers for c in counts):
        raise ValueError(f"skip counts must be in 0..{layers - 1}, got {list(counts)}")
    costs = calibrator.costs()
    log(f"costs: plain step {costs.verify[0] * 1e3:.1f} ms, verify of 1..{depth + 1} tokens "
        + " ".join(f"{t * 1e3:.0f}" for t in costs.verify) + " ms")  # fmt: skip
    ranking: list[tuple[int, float]] = []
    if any(c > 0 for c in counts):
        stride = max(1, len(calibrator.starts) // max(1, rank_starts))
        subset = calibrator.starts[::stride][:rank_starts]
        for i in range(layers):
            accepted, tried = calibrator.acceptance((i,), 1, subset)
            ranking.append((i, accepted[0] / max(1, tried[0])))
        ranking.sort(key=lambda x: (-x[1], x[0]))
        log("layers by first-position acceptance skipped alone: "
            + ", ".join(f"{i}:{a:.2f}" for i, a in ranking))  # fmt: skip
    sets = [(f"{c} layers", tuple(sorted(i for i, _ in ranking[:c]))) for c in sorted(set(counts))]
    sets += [(name, tuple(sorted(set(skip)))) for name, skip in (named or {}).items()]
    rows = []
    for label, skip in sets:
        if skip:
            accepted, tried = calibrator.acceptance(skip, depth, calibrator.starts)
            rates = tuple(a / n if n else 0.0 for a, n in zip(accepted, tried, strict=True))
        else:  # the full model drafting for itself: every greedy draft is the reference
            rates, tried = (1.0,) * depth, [0] * depth
        fraction = min(1.0, timed_draft_fraction(calibrator, skip)) if skip else 1.0
        speedup = tuple(
            expected_tokens(rates, k) / (k * fraction + costs.verify[k] / costs.verify[0])
            for k in range(1, depth + 1)
        )
        row = CurveRow(
            label, skip, rates, tuple(tried), fraction, _weight_fraction(calibrator, skip), speedup
        )
        rows.append(row)
        log(f"{label} {list(skip)}: acceptance " + " ".join(f"{a:.2f}" for a in rates)
            + f"; draft {fraction:.2f} of a plain step ({row.weight_fraction:.2f} of the bytes); expected "
            + " ".join(f"d{k + 1} {s:.2f}x" for k, s in enumerate(speedup)))  # fmt: skip
    return SkipCurve(layers, depth, costs, rows, ranking, len(calibrator.starts), min(rank_starts, len(
        calibrator.starts)), time.monotonic() - started)  # fmt: skip


def skip_curve_markdown(curve: SkipCurve, title: str) -> str:
    """The curve as a Markdown table: one row per skip set, acceptance, cost, expected speedup."""
    depths = range(1, curve.depth + 1)
    head = ["layers skipped", "skip set", *(f"a{k}" for k in depths), "E[tokens] at d1",
            "draft step / plain step (timed)", "weights read",
            *(f"expected speedup d{k}" for k in depths)]  # fmt: skip
    verify = ", ".join(f"{w} tokens {t / curve.costs.verify[0]:.2f}x" for w, t in
                       enumerate(curve.costs.verify[1:], 2))  # fmt: skip
    lines = [f"### {title}", "",
             f"{curve.num_layers} layers; plain step {curve.costs.verify[0] * 1e3:.0f} ms; verify forward of "
             f"{verify} a plain step (timed, batch 1). Acceptance: greedy, conditional per draft position, "
             f"over {curve.starts} starts; layers ranked by first-position acceptance skipped alone over "
             f"{curve.rank_starts} starts; the set for c layers = the c least harmful. Expected speedup = "
             "E(k) / (k x draft + verify(1 + k)), both in plain steps.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for r in curve.rows:
        named = not r.label.endswith(" layers")
        cells = [str(len(r.skip)), f"{r.label}: {list(r.skip)}" if named else str(list(r.skip) or "-")]
        cells += [f"{a:.2f}" for a in r.acceptance]
        cells += [
            f"{expected_tokens(r.acceptance, 1):.2f}",
            f"{r.draft_fraction:.2f}",
            f"{r.weight_fraction:.2f}",
        ]
        cells += [f"{s:.2f}x" for s in r.speedup]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, ""])
