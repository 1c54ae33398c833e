"""How a model-based proposer picks its next draft token for each row, and what q it records.

A greedy request drafts the argmax (q is one-hot, so no q is recorded). A sampling request draws
from the proposer's own distribution after the request's temperature / top-k / top-p
(``sampling.process_logits``) with the request's generator, and records that distribution as q,
so that verification accepts with min(1, p/q) and the output stays distributed as the target's.
The confidence (the top probability) lets a proposer stop a draft early; any stopping rule that
looks only at the proposer's own distribution keeps verification exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve_app.engine.proposers.base import ProposeRow
from serve_app.engine.sampling import process_logits, sample


@dataclass(frozen=True)
class Choice:
    """One row's next draft token."""

    token: int
    q: torch.Tensor | None  # [V] float32 for a sampling row; None for a greedy one (one-hot)
    confidence: float  # the proposer's top probability (1.0 when not computed)


def choose_tokens(
    rows: list[ProposeRow], logits: torch.Tensor, need_confidence: bool = False
) -> list[Choice]:
    """The next draft token of every row from the proposer's ``logits`` ``[B, V]`` (float32)."""
    if all(row.generator is None for row in rows):
        if need_confidence:
            top, picked = logits.softmax(dim=-1).max(dim=-1)  # [B], [B]
            return [Choice(t, None, c) for t, c in zip(picked.tolist(), top.tolist(), strict=True)]
        return [Choice(t, None, 1.0) for t in logits.argmax(dim=-1).tolist()]
    device = logits.device
    q = process_logits(
        logits,
        torch.tensor([r.params.temperature for r in rows], device=device),
        torch.tensor([r.params.top_k for r in rows], device=device),
        torch.tensor([r.params.top_p for r in rows], device=device),
    )  # [B, V]
    picked = sample(q, [r.generator for r in rows]).tolist()
    confidence = q.max(dim=-1).values.tolist()  # [B]
    return [
        Choice(t, None if r.generator is None else q[b], confidence[b])
        for b, (t, r) in enumerate(zip(picked, rows, strict=True))
    ]
