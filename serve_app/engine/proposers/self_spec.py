"""Self-speculative proposer: the target drafts for itself with some of its layers skipped.

The draft model is the target run through a subset of its layers (layer skipping as in Draft &
Verify, Zhang et al. 2023, and SWIFT, Xia et al. 2024); LayerSkip's early exit (the first n
layers, then the final norm and the output head) is the special case of skipping a suffix. It
shares the target's weights AND its KV cache: a replica speculates with no second model and no
memory beyond what the target already holds. Which layers to skip: ``skip_plan.resolve_plan``.

A draft step. Row b's target cache holds ``L_b = len(sequence) - 1`` verified tokens (the last
emitted token is not in it yet). Draft token j (j = 1..k) comes from feeding the previous token at
cache row ``L_b + j - 1`` through the kept layers only (``DecoderModel.forward(layers=...)``): each
kept layer writes its K/V at that row and attends to rows < L_b (the target's own K/V, written by
full forwards) and to the draft rows it wrote itself; skipped layers neither read nor write. For
each step the proposer sets ``lengths[slot]`` to ``L_b + j - 1`` (where the forward writes) and
puts it back to ``L_b`` before returning, so the engine sees the cache as it left it.

Why this stays lossless. The draft writes only rows >= L_b, which the cache's contract says are
garbage. The verify forward then feeds ``[last token, d_1 .. d_k]`` at rows ``L_b .. L_b + k``
through EVERY layer, and each layer writes those rows before any query reads them; so every K/V
row the target reads was written by a full forward of the target, its logits are those plain
decoding computes (exactly, in float32), and ``verify`` applies the same rule as for any proposer
(argmax match when greedy; min(1, p/q) with the draft's recorded q when sampling).

Why the cache needs no separate rollback. After verification the engine moves the length to
``L_b + 1 + a``: rows ``L_b .. L_b + a`` hold the full forward's K/V of the accepted tokens (what
plain decoding writes), rows beyond are garbage again, whatever the draft left there. The draft
has no cache of its own and keeps no per-request state (the verified sequence and the target's
cache length say everything), so ``admit``, ``commit`` and ``release`` have nothing to do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from serve_app.engine.kv_cache import KVCache
from serve_app.engine.model import DecoderModel
from serve_app.engine.proposers.base import Draft, ProposeRow
from serve_app.engine.proposers.choice import choose_tokens, take_choices
from serve_app.engine.proposers.registry import ProposerContext
from serve_app.engine.proposers.skip_plan import SkipPlan, check_skip, resolve_plan

log = logging.getLogger(__name__)


class LayerSkipModel:
    """The target seen through a subset of its layers, with a ``DecoderModel``'s forward/logits.

    Shares every tensor with the target; ``forward`` runs only ``layers`` (then the final norm).
    """

    def __init__(self, target: DecoderModel, skip: Sequence[int]) -> None:
        check_skip(list(skip), target.cfg.num_layers)
        self.target = target
        self.skip = tuple(sorted(set(skip)))
        self.layers = tuple(i for i in range(target.cfg.num_layers) if i not in set(self.skip))
        self.cfg = target.cfg
        self.device = target.device
        self.dtype = target.dtype

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        cache: KVCache,
        slots: Sequence[int],
        positions: torch.Tensor | None = None,
        block_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The target's forward over the kept layers only: normed hidden ``[B, T, hidden]``."""
        return self.target.forward(tokens, cache, slots, positions, block_mask, layers=self.layers)

    __call__ = forward

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one draft step reads (kept layers, embedding/head, final norm)."""
        from serve_app.engine.weights import weight_nbytes

        skipped = sum(weight_nbytes(t) for i in self.skip for t in self.target.layers[i].tensors())
        return self.target.weight_bytes - skipped


class SelfSpecProposer:
    """Drafts with the target's own kept layers, writing into the target's KV cache."""

    name = "self"
    prefills = False  # admitting a request costs nothing: the target's cache holds the sequence

    def __init__(
        self, target: DecoderModel, cache: KVCache, skip: Sequence[int], min_confidence: float = 0.0
    ) -> None:
        self.model = LayerSkipModel(target, skip)
        self.cache = cache  # the TARGET's cache (the draft writes garbage rows of it, see above)
        # Stop a row's draft once the draft's top probability falls below this (0 = never).
        self.min_confidence = min_confidence

    @property
    def skip(self) -> tuple[int, ...]:
        return self.model.skip

    # ----------------------------------------------------------------------------- lifecycle
    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        """Nothing to prefill: the target's cache already holds the sequence."""

    def commit(self, slot: int, num_accepted: int) -> None:
        """Nothing to roll back: the engine's cache length is the only state (see the docstring)."""

    def release(self, slot: int) -> None:
        """No per-request state."""

    # ----------------------------------------------------------------------------- drafting
    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        if not rows:
            return []
        cache = self.cache
        starts = [cache.lengths[row.slot] for row in rows]
        for row, start in zip(rows, starts, strict=True):
            if start != len(row.token_ids) - 1:
                raise RuntimeError(
                    f"slot {row.slot}: the target cache holds {start} tokens, the sequence has "
                    f"{len(row.token_ids)} (expected one more: the last token is not cached yet)"
                )
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = [i for i, row in enumerate(rows) if row.depth > 0]
        feed = [row.token_ids[-1] for row in rows]  # the token each row feeds next
        try:
            while active:
                for i in active:
                    cache.set_length(rows[i].slot, starts[i] + len(tokens[i]))
                batch = torch.tensor([[feed[i]] for i in active], device=self.model.device)  # [A, 1]
                hidden = self.model.forward(batch, cache, [rows[i].slot for i in active])  # [A, 1, H]
                logits = self.model.logits(hidden[:, -1])  # [A, V] float32
                chosen = choose_tokens(
                    [rows[i] for i in active],
                    logits,
                    self.min_confidence > 0,
                    [len(tokens[i]) for i in active],
                )
                for i, choice in zip(active, chosen, strict=True):
                    feed[i] = choice.token
                active = take_choices(active, chosen, rows, tokens, probs, self.min_confidence)
        finally:
            for row, start in zip(rows, starts, strict=True):
                cache.set_length(row.slot, start)
        return [
            Draft(tokens=t, probs=torch.stack(p) if p else None) for t, p in zip(tokens, probs, strict=True)
        ]


def plan_for(context: ProposerContext) -> SkipPlan:
    """The skip plan of the context's target: explicit ``skip_layers``, else stored, shipped, default."""
    skip = context.options.get("skip_layers")
    folder = context.target_path
    return resolve_plan(context.target.cfg.num_layers, list(skip) if skip else None,
                        None if folder is None else Path(folder))  # fmt: skip


def build_self_spec_proposer(context: ProposerContext) -> SelfSpecProposer:
    """Options: ``skip_layers`` (overrides the stored calibration), ``min_confidence``.

    Needs the target's KV cache in ``context.target_cache`` (``SpecEngine.from_path`` passes it)."""
    if context.target_cache is None:
        raise ValueError("self-speculation needs the target's KV cache (ProposerContext.target_cache)")
    plan = plan_for(context)
    log.info("self-speculation skips layers %s of %d (%s)", list(plan.skip), plan.num_layers, plan.source)
    min_confidence = float(context.options.get("min_confidence", 0.0) or 0.0)
    return SelfSpecProposer(context.target, context.target_cache, plan.skip, min_confidence)  # type: ignore[arg-type]
