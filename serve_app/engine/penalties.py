"""Penalties and logit biases on the target's logits, at every position a step scores.

What a request's logits become before sampling (vLLM's order and definitions; OpenAI's ranges):

1. ``logit_bias``: each named token's logit gets its bias added (-100..100).
2. ``repetition_penalty`` r (HF / vLLM, > 0, 1 = off): a token that occurs in the prompt OR the
   output so far has its logit divided by r when positive, multiplied by r otherwise.
3. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI, -2..2): ``logit -= f * count`` and
   ``logit -= p * (count > 0)``, where ``count`` is how often the token occurs in the OUTPUT so far
   (the prompt does not count, as in vLLM).

Then ``sampling.process_logits`` (temperature, top-k, top-p) or the greedy argmax, unchanged.
Logprobs are NOT penalized: they stay the raw distribution (``engine.logprobs``, vLLM's default).

Why speculation stays exact: the verify forward scores position j of a row after the request's
output so far plus the draft's first j tokens. Position j is penalized with exactly those tokens
counted (the output's counts plus the draft prefix's), which is what plain decoding counts there
when the drafts before j are accepted; positions after a rejection are never used. Every operation
is elementwise on one (row, position) and its counts are exact integers in float32, so the
penalized row is bit for bit plain decoding's, and ``verify`` accepts exactly plain decoding's
tokens. A proposer drafts from its own unpenalized distribution: that costs acceptance, never
exactness.

Requests without penalties or biases have no ``PenaltyState``; a step where no row has one returns
the logits untouched (no copy, no work).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from serve_app.engine.params import SamplingParams


@dataclass
class PenaltyState:
    """A penalized request's standing data: its biases, its prompt's tokens, its output's counts."""

    params: SamplingParams
    bias_ids: torch.Tensor  # [M] long: the tokens logit_bias names
    bias_values: torch.Tensor  # [M] float32: their biases
    prompt_seen: torch.Tensor  # [V] bool: tokens of the prompt (all False without repetition_penalty)
    counts: torch.Tensor  # [V] float32: each token's count in output_ids[:counted]
    counted: int = field(default=0)

    @classmethod
    def for_request(
        cls, params: SamplingParams, prompt_ids: Sequence[int], vocab: int, device: torch.device | str
    ) -> PenaltyState | None:
        """The state of a request, or None when it has no penalty or bias (it then costs nothing).
        Raises ValueError for a ``logit_bias`` token outside the vocabulary."""
        if not params.penalized:
            return None
        ids = [t for t, _ in params.logit_bias]
        if ids and max(ids) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {max(ids)}")
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        if params.repetition_penalty != 1.0:
            seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=device)] = True
        return cls(
            params=params,
            bias_ids=torch.tensor(ids, dtype=torch.long, device=device),
            bias_values=torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device),
            prompt_seen=seen,
            counts=torch.zeros(vocab, dtype=torch.float32, device=device),
        )

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Count the output tokens emitted since the last call (emitted tokens are final)."""
        new = output_ids[self.counted :]
        if new:
            index = torch.tensor(list(new), dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, index, torch.ones(len(new), device=self.counts.device))
            self.counted = len(output_ids)


class Penalized(Protocol):
    """What ``penalize`` reads of a request (``request.Request``, which imports this module)."""

    penalties: PenaltyState | None
    output_ids: list[int]


def penalize(
    logits: torch.Tensor,  # [B, T, V] raw target logits: row b scores its last token and its draft
    requests: Sequence[Penalized],  # len B
    drafts: Sequence[Sequence[int]],  # per row, the drafted tokens (len depth_b <= T - 1)
) -> torch.Tensor:  # [B, T, V]: the logits itself, or a float32 copy with penalized rows changed
    """The logits plain decoding samples from at every used (row, position) (module docstring).

    Position j of row b is scored after ``output_ids + drafts[b][:j]``; padding positions (j >
    depth_b) are left as they are (verify ignores them). Vectorised over rows, positions and the
    vocabulary; the only Python loops are over rows and the few (position, earlier draft) pairs.
    """
    rows = [b for b, r in enumerate(requests) if r.penalties is not None]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)  # never change the raw logits (logprobs read them)
    device = out.device
    states: list[PenaltyState] = [requests[b].penalties for b in rows]  # type: ignore[misc]
    local, positions, bias_n, bias_tok, bias_val, inc_n, inc_tok = [], [], [], [], [], [], []
    for i, (b, state) in enumerate(zip(rows, states, strict=True)):
        state.catch_up(requests[b].output_ids)
        draft = list(drafts[b])
        for j in range(len(draft) + 1):
            n = len(positions)  # this (row, position)'s index in the flat block
            local.append(i)
            positions.append((b, j))
            bias_n.append(torch.full_like(state.bias_ids, n))
            bias_tok.append(state.bias_ids)
            bias_val.append(state.bias_values)
            inc_n.extend([n] * j)  # the draft tokens before position j count there
            inc_tok.extend(draft[:j])
    row_t = torch.tensor([b for b, _ in positions], dtype=torch.long, device=device)  # [N]
    pos_t = torch.tensor([j for _, j in positions], dtype=torch.long, device=device)  # [N]
    x = out[row_t, pos_t]  # [N, V]
    bias_index = (torch.cat(bias_n), torch.cat(bias_tok))
    x.index_put_(bias_index, torch.cat(bias_val), accumulate=True)  # one bias per (n, token): exact
    if any(s.params.counts_tokens for s in states):
        x = _count_penalties(x, states, local, inc_n, inc_tok)
    out[row_t, pos_t] = x
    return out


def _count_penalties(
    x: torch.Tensor,  # [N, V] float32 logits (biased)
    states: list[PenaltyState],
    local: list[int],  # len N: each flat row's state index
    inc_n: list[int],  # flat rows that count a draft token ...
    inc_tok: list[int],  # ... and the token
) -> torch.Tensor:  # [N, V]
    """Repetition, then frequency and presence penalties, with each position's own counts."""
    device = x.device
    index = torch.tensor(local, dtype=torch.long, device=device)  # [N]
    counts = torch.stack([s.counts for s in states])[index]  # [N, V] the output's counts
    if inc_n:  # plus the draft prefix's: exact integer sums, so the order does not matter
        ones = torch.ones(len(inc_n), dtype=torch.float32, device=device)
        inc_index = (torch.tensor(inc_n, device=device), torch.tensor(inc_tok, device=device))
        counts.index_put_(inc_index, ones, accumulate=True)
    in_output = counts > 0  # [N, V]

    def per_row(name: str) -> torch.Tensor:  # [N, 1] float32
        values = [float(getattr(s.params, name)) for s in states]
        return torch.tensor(values, dtype=torch.float32, device=device)[index].unsqueeze(1)

    seen = in_output | torch.stack([s.prompt_seen for s in states])[index]  # [N, V]
    penalty = torch.where(seen, per_row("repetition_penalty"), 1.0)  # [N, V]; r = 1: x / 1 == x
    x = torch.where(x > 0, x / penalty, x * penalty)
    x = x - per_row("frequency_penalty") * counts  # 0 * count == 0: rows without it are unchanged
    return x - per_row("presence_penalty") * in_output.float()
