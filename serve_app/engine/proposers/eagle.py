"""EAGLE proposer: a one-layer head drafts from the target's own features (Li et al. 2024).

The engine gives the proposer every feature the target computes (``FeatureProposer``). With a
row's sequence ``x_0 .. x_n`` (``x_n`` emitted last, not yet in the target's cache), the target has
computed ``feature_0 .. feature_{n-1}``; the head's cache holds pairs ``(feature_r, x_{r+1})`` for
rows ``r < c``. A proposal:

1. catch-up: feed the pairs ``r = c .. n-1`` (every row of the batch in one ragged forward); the
   prediction at ``r = n-1`` approximates ``feature_n`` and its logits give draft ``d_1``;
2. each further draft token ``d_{j+1}``: feed ``(prediction_j, d_j)`` at row ``n + j - 1``.

Given a node budget, the runner-up at each drafted position may join as a sibling (a token tree,
``proposers.alternatives``; never fed to the head). Rows ``>= n`` of the head's cache were written
from predicted features, so the cache length goes back to ``n`` before ``propose`` returns:
whatever the target accepts, the next catch-up feeds the true features of the accepted tokens
(which the engine hands over after verification). Nothing in the head touches the target's
numbers: verification is the same as for any proposer, so the output is plain decoding's (greedy
argmax match; sampling: the recorded q, or coupled noise).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from serve_app.engine.heads.eagle_head import EagleHead
from serve_app.engine.proposers.alternatives import Alternatives, offer_runner_ups
from serve_app.engine.proposers.base import Draft, ProposeRow
from serve_app.engine.proposers.choice import choose_tokens, take_choices
from serve_app.engine.proposers.head_loading import HeadParts, load_head_parts
from serve_app.engine.proposers.registry import ProposerContext

log = logging.getLogger(__name__)
KIND = "eagle"


@dataclass
class _SlotState:
    features: list[torch.Tensor] = field(default_factory=list)  # [n_i, H] not yet fed, in order

    @property
    def pending(self) -> int:
        return sum(f.shape[0] for f in self.features)


class EagleProposer:
    """Drafts with an :class:`EagleHead` over its own slot KV cache."""

    name = KIND
    prefills = False  # admission costs nothing; the prompt's features are fed with the first draft
    branches = True  # the runner-up at each drafted position may join as an alternative

    def __init__(
        self, head: EagleHead, max_slots: int, max_seq_len: int, min_confidence: float = 0.0
    ) -> None:
        self.model = head
        self.cache = head.new_cache(max_slots, max_seq_len)
        self.min_confidence = min_confidence
        self._slots: dict[int, _SlotState] = {}

    # ----------------------------------------------------------------------------- lifecycle
    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        if slot not in self._slots:
            self.cache.allocate(slot)
            self._slots[slot] = _SlotState()

    def observe_features(self, slot: int, features: torch.Tensor) -> None:
        self.admit(slot, [])
        self._slots[slot].features.append(features.detach())

    def commit(self, slot: int, num_accepted: int) -> None:
        """Nothing to do: ``propose`` left the cache at the verified pairs (see the docstring)."""

    def release(self, slot: int) -> None:
        if self._slots.pop(slot, None) is not None:
            self.cache.free(slot)

    # ----------------------------------------------------------------------------- drafting
    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        if not rows:
            return []
        cache = self.cache
        slots = [row.slot for row in rows]
        ends = [len(row.token_ids) - 1 for row in rows]  # n: pairs r < n are known
        predicted = self._catch_up(rows, ends)  # [B, H]: the prediction of feature_n
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = list(range(len(rows)))
        alternatives = {i: Alternatives(r.nodes, r.min_score) for i, r in enumerate(rows) if r.nodes > 0}
        confident = self.min_confidence > 0 or bool(alternatives)
        try:
            while True:
                logits = self.model.logits(predicted[active])  # [A, V]
                drafted = [len(tokens[i]) for i in active]
                chosen = choose_tokens([rows[i] for i in active], logits, confident, drafted)
                offer_runner_ups(alternatives, active, rows, logits, chosen, drafted)
                active = take_choices(
                    active, chosen, rows, tokens, probs, self.min_confidence, keep_unsure=False
                )
                if not active:
                    break
                for i in active:  # the pair (prediction, d_j) goes to row n + j - 1
                    cache.set_length(slots[i], ends[i] + len(tokens[i]) - 1)
                batch = torch.tensor([[tokens[i][-1]] for i in active], device=self.model.device)  # [A, 1]
                hidden = self.model.forward(
                    batch, cache, [slots[i] for i in active], features=predicted[active][:, None]
                )  # [A, 1, H]
                predicted = predicted.clone()
                predicted[active] = hidden[:, 0]
        finally:
            for slot, end in zip(slots, ends, strict=True):
                cache.set_length(slot, end)
        return [
            Draft(tokens=t, probs=torch.stack(p) if p else None,
                  tree=alternatives[i].tree(t) if i in alternatives else None)
            for i, (t, p) in enumerate(zip(tokens, probs, strict=True))
        ]  # fmt: skip

    def _catch_up(self, rows: list[ProposeRow], ends: list[int]) -> torch.Tensor:
        """Feed every row's known pairs ``c .. n-1`` in one ragged forward; the last prediction of
        each row ``[B, H]``. Afterwards the cache holds ``n`` rows per slot."""
        chunks, features = [], []
        for row, end in zip(rows, ends, strict=True):
            state = self._slots.get(row.slot)
            cached = self.cache.lengths[row.slot] if state is not None else 0
            pending = state.pending if state is not None else 0
            if state is None or cached + pending != end or pending == 0:
                raise RuntimeError(
                    f"slot {row.slot}: the EAGLE head holds {cached} pairs and {pending} new features, "
                    f"the sequence needs {end} (the engine must hand over every feature)"
                )
            chunks.append(row.token_ids[cached + 1 : end + 1])
            features.append(torch.cat(state.features))  # [k, H]
            state.features = []
        width = max(len(c) for c in chunks)
        hidden_size = features[0].shape[-1]
        device = self.model.device
        batch = torch.zeros(len(rows), width, dtype=torch.long, device=device)  # [B, T], right-padded
        feats = torch.zeros(len(rows), width, hidden_size, dtype=self.model.dtype, device=device)  # [B, T, H]
        for b, (chunk, feature) in enumerate(zip(chunks, features, strict=True)):
            batch[b, : len(chunk)] = torch.tensor(chunk)
            feats[b, : len(chunk)] = feature
        hidden = self.model.forward(
            batch, self.cache, [row.slot for row in rows], features=feats
        )  # [B, T, H]
        for row, end in zip(rows, ends, strict=True):
            self.cache.set_length(row.slot, end)
        last = torch.tensor([len(c) - 1 for c in chunks], device=device)
        return hidden[torch.arange(len(rows), device=device), last]  # [B, H]


def build_eagle_proposer(context: ProposerContext) -> EagleProposer:
    """Options (``HeadOptions``): ``path`` (the head file; default: the one stored with the
    target), ``weight_format``, ``head_tokens``, ``min_confidence``."""
    parts: HeadParts = load_head_parts(context, KIND)
    head = EagleHead(
        context.target,  # type: ignore[arg-type]
        parts.tensors,
        int(parts.manifest.config["intermediate_size"]),
        parts.head_ids,
        parts.output_head,
        parts.weight_format,
    )
    log.info("EAGLE head from %s (%d MB per draft step)", parts.path, head.weight_bytes >> 20)
    return EagleProposer(head, context.max_slots, context.max_seq_len, parts.min_confidence)
