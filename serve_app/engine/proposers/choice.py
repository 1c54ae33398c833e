"""How a model-based proposer picks its next draft token for each row, and what q it records.

A greedy request drafts the argmax (q is one-hot, so no q is recorded). A coupled sampling request
(``sampling.PositionNoise``) drafts the winner of the exponential race of its own distribution q
under the target's noise for that output position, ``argmax q / E``: verification accepts it iff
the target's race has the same winner, so no q is recorded either. Any other sampling request
draws from q (the proposer's distribution after the request's temperature / top-k / top-p,
``sampling.process_logits``) with the request's generator, and records q, so that verification
accepts with min(1, p/q) and the output stays distributed as the target's.
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
    rows: list[ProposeRow],
    logits: torch.Tensor,
    need_confidence: bool = False,
    drafted: list[int] | None = None,
) -> list[Choice]:
    """The next draft token of every row from the proposer's ``logits`` ``[B, V]`` (float32);
    ``drafted[b]``: how many tokens row ``b`` has drafted this step (its output position offset)."""
    if all(row.generator is None and (row.noise is None or row.params.greedy) for row in rows):
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
    offsets = drafted or [0] * len(rows)
    for b, row in enumerate(rows):
        if row.noise is not None and not row.params.greedy:
            picked[b] = row.noise.choose(q[b], row.first_index + offsets[b])
    confidence = q.max(dim=-1).values.tolist()  # [B]
    return [
        Choice(t, None if r.generator is None else q[b], confidence[b])
        for b, (t, r) in enumerate(zip(picked, rows, strict=True))
    ]


def take_choices(
    active: list[int],
    chosen: list[Choice],
    rows: list[ProposeRow],
    tokens: list[list[int]],
    probs: list[list[torch.Tensor]],
    min_confidence: float,
    keep_unsure: bool = True,
) -> list[int]:
    """Append each active row's choice (and its q) to its draft; the rows that draft on: not yet
    at their depth, and not unsure (top probability at least ``min_confidence``). An unsure choice
    ends the draft after itself, or, with ``keep_unsure`` False, before: a proposer that is often
    wrong when unsure (a trained head) spares the target verifying it."""
    still = []
    for i, choice in zip(active, chosen, strict=True):
        if not keep_unsure and choice.confidence < min_confidence:
            continue
        tokens[i].append(choice.token)
        if choice.q is not None:
            probs[i].append(choice.q)
        if len(tokens[i]) < rows[i].depth and choice.confidence >= min_confidence:
            still.append(i)
    return still
