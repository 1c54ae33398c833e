"""Medusa proposer: K heads over the target's last feature draft K tokens in one go.

Row ``x_0 .. x_n`` (``x_n`` emitted last): the engine has handed over ``feature_{n-1}``, the hidden
state whose logits chose ``x_n``, from the forward that verified the last step. Head k predicts
``x_{n+1+k}`` from it (``engine.heads.medusa_heads``), so drafting costs K small products and one
output head over K rows, no model forward. The draft is a chain: each head's top token (greedy),
its coupled winner, or a draw from its distribution with q recorded (sampling). Head k's q does
not depend on the tokens drafted before it, which is allowed: verification accepts ``d_j`` with
min(1, p/q_j) for any proposal distribution fixed before ``d_j`` is drawn, so the output is the
target's either way. Given a node budget (``ProposeRow.nodes``), head k's runner-up may join as a
sibling of ``d_k`` (``proposers.alternatives``), the top two of each head the verifier sees as a
token tree. The proposer keeps one feature per slot and no cache: nothing to roll back.
"""

from __future__ import annotations

import logging

import torch

from serve_app.engine.heads.medusa_heads import MedusaHeads
from serve_app.engine.proposers.alternatives import Alternatives, offer_runner_ups
from serve_app.engine.proposers.base import Draft, ProposeRow
from serve_app.engine.proposers.choice import choose_tokens, take_choices
from serve_app.engine.proposers.head_loading import load_head_parts
from serve_app.engine.proposers.registry import ProposerContext

log = logging.getLogger(__name__)
KIND = "medusa"


class MedusaProposer:
    """Drafts up to ``heads.num_heads`` tokens from each row's last target feature."""

    name = KIND
    prefills = False
    branches = True  # each head's runner-up may join as an alternative

    def __init__(self, heads: MedusaHeads, min_confidence: float = 0.0) -> None:
        self.heads = heads
        self.min_confidence = min_confidence
        self._last: dict[int, torch.Tensor] = {}  # slot -> feature_{n-1} [H]

    @property
    def max_depth(self) -> int:
        return self.heads.num_heads

    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        """Nothing to prefill: the features arrive through ``observe_features``."""

    def observe_features(self, slot: int, features: torch.Tensor) -> None:
        self._last[slot] = features[-1].detach()

    def commit(self, slot: int, num_accepted: int) -> None:
        """Nothing to roll back: the next feature replaces the last."""

    def release(self, slot: int) -> None:
        self._last.pop(slot, None)

    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        if not rows:
            return []
        missing = [row.slot for row in rows if row.slot not in self._last]
        if missing:
            raise RuntimeError(f"slots {missing}: no target feature was handed to the Medusa proposer")
        logits = self.heads.logits(torch.stack([self._last[row.slot] for row in rows]))  # [B, K, V]
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = [i for i, row in enumerate(rows) if row.depth > 0]
        alternatives = {i: Alternatives(r.nodes, r.min_score) for i, r in enumerate(rows) if r.nodes > 0}
        confident = self.min_confidence > 0 or bool(alternatives)
        for k in range(self.heads.num_heads):
            if not active:
                break
            head = logits[active, k]  # [A, V]: head k's, position k of every active row's draft
            chosen = choose_tokens([rows[i] for i in active], head, confident, [k] * len(active))
            offer_runner_ups(alternatives, active, rows, head, chosen, [k] * len(active))
            active = take_choices(active, chosen, rows, tokens, probs, self.min_confidence, keep_unsure=False)
        return [
            Draft(tokens=t, probs=torch.stack(p) if p else None,
                  tree=alternatives[i].tree(t) if i in alternatives else None)
            for i, (t, p) in enumerate(zip(tokens, probs, strict=True))
        ]  # fmt: skip


def build_medusa_proposer(context: ProposerContext) -> MedusaProposer:
    """Options (``HeadOptions``): ``path``, ``weight_format``, ``head_tokens``, ``min_confidence``."""
    parts = load_head_parts(context, KIND)
    heads = MedusaHeads(
        context.target,  # type: ignore[arg-type]
        parts.tensors,
        int(parts.manifest.config["num_heads"]),
        parts.head_ids,
        parts.output_head,
        parts.weight_format,
    )
    log.info(
        "Medusa heads (%d) from %s, %d MB per draft", heads.num_heads, parts.path, heads.weight_bytes >> 20
    )
    return MedusaProposer(heads, parts.min_confidence)
