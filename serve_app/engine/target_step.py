"""The target half of a speculative step: one forward over every row's last token and draft (a
chain, or a token tree), the target's choices, and what each row keeps.

``drafting`` makes the drafts; this module scores them. Chain rows are decided by ``verify``
(greedy, coupled or rejection sampling); tree rows are walked (``tree.walk_rows``). Either way a
row ends with the forward indices it keeps, ``rows[b]`` (the fed token at 0, then the accepted
nodes), from which the engine moves the KV cache, feeds the heads and reads logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.engine.grammar import constrain
from serve_app.engine.kv_cache import KVCache
from serve_app.engine.model import DecoderModel
from serve_app.engine.penalties import penalize
from serve_app.engine.proposers.base import Draft
from serve_app.engine.request import Request
from serve_app.engine.tree import TokenTree, layout, path_rows, walk_rows
from serve_app.engine.verify import verify


@dataclass(frozen=True)
class TargetStep:
    """What the target kept of one step, per row (flat tensors for the batch, lists per row)."""

    hidden: torch.Tensor  # [B, W, H] the forward's normed hidden states
    logits: torch.Tensor  # [B, W, V] raw target logits
    num_accepted: list[int]  # drafted tokens accepted (the path's length for a tree)
    tokens: list[list[int]]  # accepted tokens + one recovered or bonus token
    rows: list[list[int]]  # forward indices kept, in order: 0, then the accepted nodes' 1 + node
    on_chain: list[int]  # of the accepted, how many were the proposer's chain (its ``commit``)

    def kept_logits(self) -> torch.Tensor:
        """``[B, W', V]``: each row's logits at its kept indices, first (a chain's are already so)."""
        if all(r == list(range(len(r))) for r in self.rows):
            return self.logits
        width = max(len(r) for r in self.rows)
        index = torch.tensor([r + [0] * (width - len(r)) for r in self.rows], device=self.logits.device)
        return self.logits[torch.arange(len(self.rows), device=index.device)[:, None], index]


def score_drafts(model: DecoderModel, cache: KVCache, requests: Sequence[Request],
                 drafts: Sequence[Draft]) -> TargetStep:  # fmt: skip
    """One target forward over ``requests`` with their ``drafts``; accept and emit (module doc)."""
    slots = [r.slot for r in requests]
    chains = [d.tokens for d in drafts]
    trees = [d.tree for d in drafts]
    if any(t is not None for t in trees):
        shaped = [t if t is not None else TokenTree.of_chain(c) for t, c in zip(trees, chains, strict=True)]
        starts = [cache.lengths[s] for s in slots]
        batch = layout([r.output_ids[-1] for r in requests], shaped, starts, model.device)
        hidden = model.forward(batch.tokens, cache, slots, positions=batch.positions,
                               block_mask=batch.block_mask)  # fmt: skip  [B, W, H]
    else:
        width = 1 + max(len(c) for c in chains)
        tokens = torch.zeros(len(requests), width, dtype=torch.long)  # [B, 1 + K], right-padded
        for b, (request, chain) in enumerate(zip(requests, chains, strict=True)):
            row = [request.output_ids[-1], *chain]
            tokens[b, : len(row)] = torch.tensor(row)
        hidden = model.forward(tokens.to(model.device), cache, slots)  # [B, 1 + K, H]
    logits = model.logits(hidden)  # [B, W, V]
    # Tree rows have neither penalties nor a grammar (drafting.tree_row): both pass them through.
    scored = penalize(logits, requests, chains)  # each position after its prefix
    scored = constrain(scored, requests, chains)  # likewise the grammar's mask
    noises = [r.noise_at() for r in requests]
    params = [r.params for r in requests]
    # Tree rows verify an empty chain here (greedy / coupled: no random numbers drawn), then walk.
    result = verify(scored, [[] if t is not None else c for t, c in zip(trees, chains, strict=True)],
                    [None if t is not None else d.probs for t, d in zip(trees, drafts, strict=True)],
                    params, [r.generator for r in requests], noises)  # fmt: skip
    walked = walk_rows(scored, trees, params, noises)
    accepted, emitted, rows, on_chain = [], [], [], []
    for b, (n, toks) in enumerate(zip(result.num_accepted, result.tokens, strict=True)):
        if b in walked:
            path, toks = walked[b]
            n, kept, chain_n = len(path), path_rows(path), trees[b].on_chain(path)  # type: ignore[union-attr]
        else:
            kept, chain_n = list(range(1 + n)), n
        accepted.append(n)
        emitted.append(toks)
        rows.append(kept)
        on_chain.append(chain_n)
    return TargetStep(hidden, logits, accepted, emitted, rows, on_chain)
