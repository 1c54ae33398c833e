"""`specserve bench --sweep / --cost-curve`: where speculation stops paying, and why.

Batch sweep: for each concurrency c, c greedy requests (the benchmark's prompts, cycled) are
submitted at once into one engine and run as one continuous batch, plain (every request
speculation "off") and speculative (every request on one proposer at one depth: the sweep's depth,
or the mode's own, e.g. self-speculation at its calibrated depth); throughput is all generated
tokens / wall time (prefills included), median over repeats after a short warm-up, modes
interleaved (plain, then each proposer, plain, ...) so all see the same machine state. Modes:
``--sweep-modes`` (default: ``sweep_modes()``, plain and every registered proposer but trained
heads; ``sweep_mode_choices()`` adds those and ``auto``: every request "auto", on an engine of its
own under the configured policy, as a replica serves it, whose steps are counted per proposer).

Cost curve: the target's forward over ``[B, T]`` new tokens against a cache of ``context`` tokens
per row, logits included, for T tokens per row at batch B; and the draft's single-token step.
The cache lengths are never advanced, so every repeat runs at the same context. Median of the
repeats after a warm-up. This is the curve the policy's cost model has to predict.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from policies import PLAIN_POLICY
from serve_app.config import OFF
from serve_app.engine.proposers.registry import proposer_specs

SWEEP_PLAIN = PLAIN_POLICY  # the plain-decoding mode (speculation off); every other mode is a proposer
SWEEP_AUTO = "auto"  # ... or the configured policy's choice, on the engine given for it
COST_TOKENS = (1, 2, 4, 8, 16, 32)  # new tokens per row in one target forward
COST_BATCHES = (1, 8)
COST_CONTEXT = 200


def sweep_modes() -> list[str]:
    """The default modes: plain, then every registered proposer but trained heads (a machine has
    those only after training)."""
    return [SWEEP_PLAIN, *(s.name for s in proposer_specs() if not s.trained)]


def sweep_mode_choices() -> list[str]:
    """What ``--sweep-modes`` may name: plain, every registered proposer, and auto."""
    return [SWEEP_PLAIN, *(s.name for s in proposer_specs()), SWEEP_AUTO]


def _log(message: str) -> None:
    print(message, file=sys.stderr)


# ------------------------------------------------------------------------------------ batch sweep
@dataclass(frozen=True)
class SweepRun:
    """One timed continuous batch of one mode at one concurrency."""

    tokens: int  # generated, all requests together
    seconds: float  # wall time of the whole batch
    drafted: int = 0
    accepted: int = 0
    spec_steps: int = 0
    differs: int | None = None  # requests whose output differs from the plain one (None: no plain)
    by_proposer: dict[str, int] = field(default_factory=dict)  # speculative steps of each proposer


@dataclass
class SweepPoint:
    concurrency: int
    runs: dict[str, list[SweepRun]] = field(default_factory=dict)  # mode -> timed runs


@dataclass
class Sweep:
    max_tokens: int  # per request
    depth: int  # draft tokens per step of the speculative modes
    repeats: int
    modes: list[str]
    points: list[SweepPoint]
    mode_depths: dict[str, int] = field(default_factory=dict)  # a mode's own depth, over ``depth``
    # a peer's timed batches per concurrency, (tokens, seconds) each: llama.cpp's server
    peer: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    peer_name: str = ""

    def depth_of(self, mode: str) -> int:
        return self.mode_depths.get(mode, self.depth)


def measure_sweep(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    concurrencies: Sequence[int],
    n: int,
    depth: int,
    repeats: int,
    modes: Sequence[str] | None = None,
    log: Callable[[str], None] = _log,
    mode_depths: dict[str, int] | None = None,
    auto_engine: Any | None = None,
) -> Sweep:
    """Time every mode at every concurrency (see the module docstring); ``mode_depths`` gives a
    mode a depth of its own; ``auto_engine`` runs the ``SWEEP_AUTO`` mode (needed for it). Default
    modes: plain (``SWEEP_PLAIN``) and every proposer loaded."""
    mode_depths = dict(mode_depths or {})
    if modes is None:
        modes = [SWEEP_PLAIN, *engine.proposers]
    missing = [m for m in modes if m not in (SWEEP_PLAIN, SWEEP_AUTO) and m not in engine.proposers]
    if missing:
        raise ValueError(f"sweep modes {missing} have no proposer loaded ({', '.join(engine.proposers)})")
    if SWEEP_AUTO in modes and auto_engine is None:
        raise ValueError(f"sweep mode {SWEEP_AUTO!r} needs an engine under the policy (auto_engine)")
    from serve_app.engine.params import SamplingParams, SpecOverride

    if max(concurrencies) > engine.config.max_slots:
        raise ValueError(f"concurrency {max(concurrencies)} > the engine's {engine.config.max_slots} slots")
    points = []
    for c in concurrencies:
        batch = [list(prompts[i % len(prompts)]) for i in range(c)]
        point = SweepPoint(c, {m: [] for m in modes})
        plain_outputs: list[list[int]] | None = None
        for rep in range(repeats + 1):  # rep 0: a short warm-up of every mode at this batch size
            tokens = min(n, 16) if rep == 0 else n
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            for mode in modes:
                k = mode_depths.get(mode, depth)
                spec = SpecOverride(OFF) if mode == SWEEP_PLAIN else SpecOverride(mode, max_depth=k)
                runs_on = engine
                if mode == SWEEP_AUTO:  # the policy picks proposer and depth
                    spec, runs_on = SpecOverride(SWEEP_AUTO), auto_engine
                start = time.perf_counter()
                done = runs_on.generate(batch, params, [spec] * c)
                seconds = time.perf_counter() - start
                outputs = [d.token_ids for d in done]
                if rep == 0:
                    continue
                if mode == SWEEP_PLAIN and plain_outputs is None:
                    plain_outputs = outputs
                stats = [d.spec_stats for d in done if d.spec_stats is not None]
                by_proposer = dict(sum((Counter(st.steps_by_proposer) for st in stats), Counter()))
                run = SweepRun(
                    tokens=sum(len(o) for o in outputs), seconds=seconds,
                    drafted=sum(s.drafted for s in stats), accepted=sum(s.accepted for s in stats),
                    spec_steps=sum(s.spec_steps for s in stats),
                    differs=None if plain_outputs is None else sum(
                        o != p for o, p in zip(outputs, plain_outputs, strict=True)),
                    by_proposer=by_proposer,
                )  # fmt: skip
                point.runs[mode].append(run)
                log(f"[sweep c={c}] {mode} repeat {rep}/{repeats}: {run.tokens / seconds:.2f} tok/s")
        points.append(point)
    return Sweep(n, depth, repeats, list(modes), points, mode_depths)


def sweep_summary(sweep: Sweep) -> dict[str, Any]:
    """Per concurrency: tok/s per mode (median), ratio to plain, acceptance (pooled over repeats),
    requests differing from plain (worst repeat); and where each speculative mode stops paying."""
    rows = []
    for p in sweep.points:
        rate = {m: statistics.median(r.tokens / r.seconds for r in runs) for m, runs in p.runs.items()}
        drafted = {m: sum(r.drafted for r in runs) for m, runs in p.runs.items()}
        differs = {m: [r.differs for r in runs if r.differs is not None] for m, runs in p.runs.items()}
        rows.append({
            "concurrency": p.concurrency, "tok_s": rate,
            "ratio": {m: r / rate[SWEEP_PLAIN] for m, r in rate.items()
                      if SWEEP_PLAIN in rate and m != SWEEP_PLAIN},
            "acceptance": {m: sum(r.accepted for r in p.runs[m]) / drafted[m] for m in rate if drafted[m]},
            "differs": {m: max(d) for m, d in differs.items() if d and m != SWEEP_PLAIN},
            "steps_by_proposer": {m: _pooled_steps(runs) for m, runs in p.runs.items() if m == SWEEP_AUTO},
        })  # fmt: skip
        if runs := sweep.peer.get(p.concurrency):
            rows[-1]["peer_tok_s"] = statistics.median(t / s for t, s in runs)
    speculative = [m for m in sweep.modes if m != SWEEP_PLAIN]
    stops = {
        m: next((r["concurrency"] for r in rows if r["ratio"].get(m, 1.0) < 1.0), None) for m in speculative
    }
    return {"rows": rows, "stops_paying_at": stops}


def _pooled_steps(runs: Sequence[SweepRun]) -> dict[str, int]:
    """Speculative steps per proposer, summed over ``runs``, most first."""
    return dict(sum((Counter(run.by_proposer) for run in runs), Counter()).most_common())


def sweep_markdown(sweep: Sweep) -> str:
    """The sweep table and one line on where speculation stops paying."""
    s = sweep_summary(sweep)
    label = {m: m if m in (SWEEP_PLAIN, SWEEP_AUTO) else f"{m} d{sweep.depth_of(m)}" for m in sweep.modes}
    speculative = [m for m in sweep.modes if m != SWEEP_PLAIN]
    head = ["concurrent requests", *(["plain tok/s"] if SWEEP_PLAIN in sweep.modes else [])]
    head += [c for m in speculative for c in (f"{label[m]} tok/s", f"{label[m]} / plain", f"{m} acceptance")]
    peer = sweep.peer_name if sweep.peer else ""
    head += [f"{peer} tok/s", f"best of ours / {peer}"] if peer else []
    head += ["outputs differing from plain"]
    lines = ["### Batch sweep", "",
             f"Greedy, {sweep.max_tokens} new tokens per request (EOS ignored), all submitted at once; "
             f"tok/s = all generated tokens / wall time (prefills included), median of {sweep.repeats} "
             "after a short warm-up; acceptance pooled over the repeats.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for r in s["rows"]:
        c = r["concurrency"]
        cells = [str(c), *([f"{r['tok_s'][SWEEP_PLAIN]:.2f}"] if SWEEP_PLAIN in sweep.modes else [])]
        for m in speculative:
            ratio, acc = r["ratio"].get(m), r["acceptance"].get(m)
            cells += [f"{r['tok_s'][m]:.2f}", "-" if ratio is None else f"{ratio:.2f}x",
                      "-" if acc is None else f"{acc:.0%}"]  # fmt: skip
        if peer:
            theirs = r.get("peer_tok_s")
            cells += (
                ["-", "-"]
                if theirs is None
                else [f"{theirs:.2f}", f"{max(r['tok_s'].values()) / theirs:.2f}x"]
            )
        cells.append(", ".join(f"{m} {r['differs'][m]}/{c}" for m in speculative if m in r["differs"]) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    stops = [f"{label[m]} at {c} concurrent requests" if c else f"{label[m]}: pays at every concurrency"
             for m, c in s["stops_paying_at"].items()]  # fmt: skip
    if stops:
        lines += [
            "",
            "Speculation stops paying (first concurrency with ratio < 1): " + "; ".join(stops) + ".",
        ]
    picks = [f"{r['concurrency']}: " + (", ".join(f"{p} {n}" for p, n in steps.items()) or "none")
             for r in s["rows"] if (steps := r["steps_by_proposer"].get(SWEEP_AUTO)) is not None]  # fmt: skip
    if picks:
        lines += ["", f"{SWEEP_AUTO}'s speculative steps by proposer (all repeats), by concurrency: "
                  + "; ".join(picks) + "."]  # fmt: skip
    return "\n".join([*lines, ""])


# ------------------------------------------------------------------------------------ cost curve
@dataclass
class CostCurve:
    context: int  # cached tokens per row
    repeats: int
    target: dict[int, dict[int, list[float]]]  # batch -> tokens per row -> seconds of each forward
    draft: dict[int, list[float]]  # batch -> seconds of each single-token draft step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


@torch.inference_mode()
def _forward_times(
    model: Any, context: int, tokens: Sequence[int], batches: Sequence[int], repeats: int, seed: int
) -> dict[int, dict[int, list[float]]]:
    """Seconds of ``model.logits(model.forward([B, T]))`` at a prefilled context, per B and T."""
    gen = torch.Generator().manual_seed(seed)
    vocab, device = model.cfg.vocab_size, model.device
    slots = max(batches)
    cache = model.new_cache(slots, context + max(tokens))
    model.forward(
        torch.randint(0, vocab, (slots, context), generator=gen).to(device), cache, list(range(slots))
    )
    for slot in range(slots):
        cache.set_length(slot, context)
    times: dict[int, dict[int, list[float]]] = {}
    for b in batches:
        times[b] = {}
        for t in tokens:
            ids = torch.randint(0, vocab, (b, t), generator=gen).to(device)
            times[b][t] = _timed(lambda ids=ids, b=b: model.logits(model.forward(ids, cache, list(range(b)))),
                                 device, repeats)  # fmt: skip
    return times


def measure_cost_curve(
    target: Any,
    draft: Any | None = None,
    context: int = COST_CONTEXT,
    tokens: Sequence[int] = COST_TOKENS,
    batches: Sequence[int] = COST_BATCHES,
    repeats: int = 5,
    log: Callable[[str], None] = _log,
) -> CostCurve:
    """Target forward times for every (B, T) and the draft's single-token step (see the docstring)."""
    log(f"[cost curve] target: {len(batches)} x {len(tokens)} shapes at context {context} ...")
    target_times = _forward_times(target, context, tokens, batches, repeats, seed=0)
    draft_times: dict[int, list[float]] = {}
    if draft is not None:
        log("[cost curve] draft step ...")
        draft_times = {b: t[1] for b, t in _forward_times(draft, context, [1], batches, repeats, 1).items()}
    return CostCurve(context, repeats, target_times, draft_times)


def cost_curve_summary(curve: CostCurve) -> dict[str, Any]:
    """Median ms per shape, and each as a multiple of the target's smallest forward (T=1 at B=1)."""
    target = {b: {t: 1e3 * statistics.median(v) for t, v in row.items()} for b, row in curve.target.items()}
    draft = {b: 1e3 * statistics.median(v) for b, v in curve.draft.items()}
    b0 = min(target)
    unit = target[b0][min(target[b0])]
    return {
        "target_ms": target, "draft_ms": draft, "unit_ms": unit,
        "target_ratio": {b: {t: ms / unit for t, ms in row.items()} for b, row in target.items()},
        "draft_ratio": {b: ms / unit for b, ms in draft.items()},
    }  # fmt: skip


def cost_curve_markdown(curve: CostCurve) -> str:
    """Rows: target forwards by tokens per row, then the draft step; columns: ms and ratio per batch."""
    s = cost_curve_summary(curve)
    batches = sorted(s["target_ms"])
    tokens = sorted({t for row in s["target_ms"].values() for t in row})
    head = ["forward", *(c for b in batches for c in (f"batch {b} ms", f"batch {b} ratio"))]
    lines = ["### Cost curve", "",
             f"Target forward + logits over T new tokens per row against {curve.context} cached tokens per "
             f"row (cache not advanced), median of {curve.repeats} after a warm-up; the draft step is one "
             "token per row through the draft as the engine runs it (its int8 layers and restricted head "
             f"included). Ratio: time / the target's 1-token forward at batch {batches[0]} "
             f"({s['unit_ms']:.1f} ms).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip

    def row(label: str, ms: dict[int, float | None], ratio: dict[int, float | None]) -> str:
        cells = [label]
        for b in batches:
            cells += ["-", "-"] if ms.get(b) is None else [f"{ms[b]:.1f}", f"{ratio[b]:.2f}x"]
        return "| " + " | ".join(cells) + " |"

    for t in tokens:
        ms = {b: s["target_ms"][b].get(t) for b in batches}
        lines.append(row(f"target, {t} token{'s' if t > 1 else ''}/row", ms,
                         {b: s["target_ratio"][b].get(t) for b in batches}))  # fmt: skip
    if s["draft_ms"]:
        lines.append(row("draft step, 1 token/row", s["draft_ms"], s["draft_ratio"]))
    return "\n".join([*lines, ""])
