"""Profile the cost model on the real models when an engine starts (a few seconds).

Times target forwards over the shapes of ``policies.cost_model.profile_plan()`` (rows x tokens per
row, at one context) and single-token draft steps of every model-based proposer, using the
engine's free KV slots (nothing is kept: cache lengths are never advanced), and fits a
``FittedCostModel``. Shapes with more rows than free slots are skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from policies import FittedCostModel, draft_profile_plan, profile_plan
from serve_app.engine.kv_cache import KVCache
from serve_app.engine.model import DecoderModel

CONTEXT = 128  # tokens already in the cache while timing (less if the cache is shorter)


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _time_forward(model: DecoderModel, cache: KVCache, slots: list[int], width: int, repeats: int) -> float:
    tokens = torch.randint(0, model.cfg.vocab_size, (len(slots), width), device=model.device)
    return _median_seconds(lambda: model.logits(model.forward(tokens, cache, slots)), repeats)


@torch.inference_mode()
def profile_cost_model(
    target: DecoderModel,
    target_cache: KVCache,
    drafts: dict[str, tuple[DecoderModel, KVCache]],
    repeats: int = 2,
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
        samples = [
            (rows, width, context, _time_forward(target, target_cache, slots[:rows], width, repeats))
            for rows, width in profile_plan()
            if rows <= len(slots)
        ]
    finally:
        for slot in slots:
            target_cache.free(slot)
    cost = FittedCostModel().fit(samples)
    for name, (model, cache) in drafts.items():
        draft_slots = [cache.allocate() for _ in range(cache.num_free)]
        try:
            for slot in draft_slots:
                model.forward(prefill, cache, [slot])
                cache.set_length(slot, context)
            timed = [
                (rows, context, _time_forward(model, cache, draft_slots[:rows], 1, repeats))
                for rows in draft_profile_plan()
                if rows <= len(draft_slots)
            ]
        finally:
            for slot in draft_slots:
                cache.free(slot)
        if timed:
            cost.fit_draft(name, timed)
    return cost
