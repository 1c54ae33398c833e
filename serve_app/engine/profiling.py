"""Profile the cost model on the real models when an engine starts (Qwen pair, 8 slots, 2 cores: ~16 s).

Times target forwards over the shapes of ``policies.cost_model.profile_plan()`` (rows x tokens per
row, at one context), single-token draft steps of every model-based proposer and its prefill of
that context (a request's admission to it), using the
engine's free KV slots (nothing is kept: cache lengths are never advanced), and fits a
``FittedCostModel``. Shapes with more rows than free slots are skipped.

Each shape's time is the median of ``repeats`` timings taken in rounds (every shape once per
round), not back to back: this machine's memory bandwidth drifts from
second to second, and the cost model keeps a residual per width (``policies.cost_model``), so a
slow spell must not land on the timings of one width only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from policies import FittedCostModel, draft_profile_plan, profile_plan
from serve_app.engine.kv_cache import KVCache
from serve_app.engine.model import DecoderModel

CONTEXT = 128  # tokens already in the cache while timing (less if the cache is shorter)


def _median_seconds_in_rounds(runs: list[Callable[[], object]], repeats: int) -> list[float]:
    """Each run's median time over ``repeats`` rounds (the lower median for an even count), after
    one untimed warm-up call of every run: a shape's first call builds its kernels (oneDNN creates
    a primitive per row count), and with two repeats the median of a cold and a warm timing was
    the cold one (measured on SmolLM2: 1 token timed at 1.6x a 5-token forward)."""
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(max(1, repeats)):
        for run, seen in zip(runs, times, strict=True):
            start = time.perf_counter()
            run()
            seen.append(time.perf_counter() - start)
    return [sorted(seen)[(len(seen) - 1) // 2] for seen in times]


def _forward(model: DecoderModel, cache: KVCache, slots: list[int], width: int) -> Callable[[], object]:
    tokens = torch.randint(0, model.cfg.vocab_size, (len(slots), width), device=model.device)
    return lambda: model.logits(model.forward(tokens, cache, slots))


@torch.inference_mode()
def profile_cost_model(
    target: DecoderModel,
    target_cache: KVCache,
    drafts: dict[str, tuple[DecoderModel, KVCache]],
    repeats: int = 3,
) -> FittedCostModel:
    """Fit a cost model from timed forwards of ``target`` and each draft model (free slots only)."""
    widest = max(width for _, width in profile_plan())
    context = max(1, min(CONTEXT, target_cache.max_seq_len - widest))
    slots = [target_cache.allocate() for _ in range(target_cache.num_free)]
    try:
        prefill = torch.randint(0, target.cfg.vocab_size, (1, context), device=target.device)
        for slot in slots:
            target.forward(prefill, target_cache, [slot])
            target_cache.set_length(slot, context)
        shapes = [(rows, width) for rows, width in profile_plan() if rows <= len(slots)]
        seconds = _median_seconds_in_rounds(
            [_forward(target, target_cache, slots[:rows], width) for rows, width in shapes], repeats
        )
        samples = [(rows, width, context, s) for (rows, width), s in zip(shapes, seconds, strict=True)]
    finally:
        for slot in slots:
            target_cache.free(slot)
    cost = FittedCostModel().fit(samples)
    for name, (model, cache) in drafts.items():
        draft_slots = [cache.allocate() for _ in range(cache.num_free)]
        try:
            prefills = []  # each slot's prefill, timed: what admitting a request costs the proposer
            for slot in draft_slots:
                start = time.perf_counter()
                model.forward(prefill, cache, [slot])
                prefills.append(time.perf_counter() - start)
                cache.set_length(slot, context)
            counts = [rows for rows in draft_profile_plan() if rows <= len(draft_slots)]
            seconds = _median_seconds_in_rounds(
                [_forward(model, cache, draft_slots[:rows], 1) for rows in counts], repeats
            )
            timed = [(rows, context, s) for rows, s in zip(counts, seconds, strict=True)]
        finally:
            for slot in draft_slots:
                cache.free(slot)
        if timed:
            cost.fit_draft(name, timed)
        if prefills:  # the median: the first is a cold call
            cost.set_draft_prefill(name, context, sorted(prefills)[(len(prefills) - 1) // 2])
    return cost
