"""Verification of drafted tokens: greedy acceptance and lossless rejection sampling.

A proposer drafts ``d_1 .. d_k`` for a row; the target scores the last token and every draft in one
forward, which gives its distributions ``p_1 .. p_{k+1}`` (``p_j`` conditioned on the prefix up to
``d_{j-1}``; position index ``j - 1`` in ``target_logits``). Per row this module returns:

- the **accepted** tokens: the longest prefix of drafts the target keeps. Draft ``x = d_j``, drawn
  from ``q_j``, is kept with probability ``min(1, p_j(x) / q_j(x))``;
- then exactly one token of the target's own: the **recovered** token at the first rejection,
  sampled from ``normalize(max(0, p_j - q_j))``, or the **bonus** token sampled from ``p_{k+1}``
  when all ``k`` drafts were accepted.

This is the speculative sampling of Leviathan, Kalman, Matias 2022, "Fast Inference from
Transformers via Speculative Decoding", and Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling".

Why it is lossless: at one position the token emitted is ``x`` with probability
``q(x) min(1, p(x)/q(x)) + P(reject) r(x) = min(p(x), q(x)) + (p(x) - min(p(x), q(x))) = p(x)``,
because ``P(reject) = 1 - sum_y min(p(y), q(y)) = sum_y max(0, p(y) - q(y))`` is exactly the
normaliser of ``r``. After an acceptance the next position is scored on exactly the prefix emitted
so far, so by induction every emitted token is drawn from the target's conditional given the tokens
before it: the output is distributed exactly as plain sampling from ``p`` (``p`` built by
``process_logits``, the very function plain decoding samples from). A deterministic proposal is a
one-hot ``q``: accept with probability ``p(x)``, recover from ``p`` with ``x`` zeroed.

Under greedy decoding (temperature 0) ``p`` is one-hot at the argmax ``a``: ``p(x)/q(x)`` is 0 or
>= 1, so a draft is kept iff it equals ``a``, and ``max(0, p - q)`` is concentrated on ``a``. So it
reduces to "accept while the target's argmax equals the draft; emit the target's argmax", which
needs no random numbers and is token-identical to plain greedy decoding.

**Coupled sampling** (a row with a ``PositionNoise``, ``sampling.PositionNoise``): the target's
token at output position ``i`` is its exponential-race choice ``c_i = argmax p_i / E_i``, with the
noise ``E_i`` fixed by the request's seed and ``i`` alone. A draft token is **accepted** iff it
equals ``c_i``; the first mismatch emits ``c_i`` (the **recovered** token), a full acceptance emits
``c_{k+1}`` (the **bonus** token). That is the greedy rule with the race in place of the argmax:
every token emitted is the very token plain decoding with the same seed emits at that position,
each an exact draw from ``p``, whatever the proposer, depth or batch. It needs no ``q``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.engine.params import SamplingParams
from serve_app.engine.sampling import PositionNoise, process_logits


@dataclass(frozen=True)
class VerifyOutput:
    """What the target kept, one entry per row."""

    num_accepted: list[int]  # per row: how many drafted tokens were accepted (0..depth_b)
    tokens: list[list[int]]  # per row: the accepted drafts + one recovered or bonus token


def acceptance_probability(
    p_x: torch.Tensor,  # [M] target probability p_j(x_j) of each drafted token
    q_x: torch.Tensor,  # [M] draft probability q_j(x_j) > 0 (1 for a deterministic proposal)
) -> torch.Tensor:  # [M] min(1, p_j(x_j) / q_j(x_j))
    """Probability that each drafted token is accepted."""
    return torch.clamp(p_x / q_x, max=1.0)  # [M]


def residual_distribution(
    p: torch.Tensor,  # [V] target distribution at the rejected position
    q: torch.Tensor | None,  # [V] draft distribution there, or None = one-hot at `token`
    token: int,  # the rejected draft token
) -> torch.Tensor:  # [V] float32, normalize(max(0, p - q)); p itself if that is all zero
    """The distribution the recovered token is drawn from after rejecting `token`."""
    if q is None:
        r = p.clone()  # [V]
        r[token] = 0.0
    else:
        r = torch.clamp(p - q, min=0.0)  # [V]
    total = r.sum()
    if not bool(total > 0):  # only when p == q (numerically); then any rejection is noise
        return p
    return r / total  # [V]


def verify(
    target_logits: torch.Tensor,  # [B, K + 1, V] raw target logits at (last token, d_1 .. d_K)
    draft_tokens: Sequence[list[int]],  # per row, the drafted tokens (len depth_b <= K, may be 0)
    draft_probs: Sequence[torch.Tensor | None],  # per row, q: [depth_b, V] float32, None = one-hot
    params: Sequence[SamplingParams],  # per row
    generators: Sequence[torch.Generator | None],  # per row; None for greedy and coupled rows
    noises: Sequence[tuple[PositionNoise, int] | None] | None = None,  # per row: (noise, first index)
) -> VerifyOutput:
    """Accept drafted tokens against the target and emit one more token per row.

    Row ``b`` uses its first ``depth_b + 1`` positions; the rest of its positions are ignored.
    Greedy rows (``params.greedy``) are decided by argmax, vectorised, consuming no random numbers.
    Coupled rows (a ``noises`` entry: the noise and the output index of the row's first position)
    by the exponential race (module docstring). Other sampling rows draw ``torch.rand(1)`` per
    examined draft and one ``torch.multinomial`` for the recovered / bonus token from the row's own
    generator, so a row's result never depends on the other rows; a depth-0 row consumes its
    generator exactly like ``sampling.sample``.
    """
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, K + 1, V], got shape {tuple(target_logits.shape)}")
    bsz, positions, vocab = target_logits.shape  # B, K + 1, V
    lengths = {"draft_tokens": len(draft_tokens), "draft_probs": len(draft_probs), "params": len(params)}
    lengths["generators"] = len(generators)
    noises = list(noises) if noises is not None else [None] * bsz
    lengths["noises"] = len(noises)
    for name, n in lengths.items():
        if n != bsz:
            raise ValueError(f"{name} has {n} entries for {bsz} rows")
    for b in range(bsz):
        depth, q = len(draft_tokens[b]), draft_probs[b]
        if depth + 1 > positions:
            raise ValueError(f"row {b}: {depth} drafts need {depth + 1} positions, logits have {positions}")
        if any(not 0 <= t < vocab for t in draft_tokens[b]):
            raise ValueError(f"row {b}: draft token out of range [0, {vocab}): {draft_tokens[b]}")
        if q is not None and tuple(q.shape) != (depth, vocab):
            raise ValueError(f"row {b}: draft_probs must be [{depth}, {vocab}], got {tuple(q.shape)}")
        if not params[b].greedy and generators[b] is None and noises[b] is None:
            raise ValueError(f"row {b}: a sampling row needs a generator or a noise")

    num_accepted = [0] * bsz
    tokens: list[list[int]] = [[] for _ in range(bsz)]
    greedy_rows = [b for b in range(bsz) if params[b].greedy]
    coupled_rows = [b for b in range(bsz) if not params[b].greedy and noises[b] is not None]
    sampling_rows = [b for b in range(bsz) if not params[b].greedy and noises[b] is None]

    if greedy_rows:
        argmax = target_logits.argmax(dim=-1)[greedy_rows]  # [G, K + 1]; ties -> lowest index
        counts, emitted = _verify_greedy(argmax, [draft_tokens[b] for b in greedy_rows])
        for b, n, toks in zip(greedy_rows, counts, emitted, strict=True):
            num_accepted[b], tokens[b] = n, toks

    if coupled_rows:
        probs = _target_probs(target_logits, coupled_rows, draft_tokens, params)  # [N, V]
        start = 0
        for b in coupled_rows:
            depth = len(draft_tokens[b])
            noise, first = noises[b]  # type: ignore[misc]
            num_accepted[b], tokens[b] = _verify_coupled_row(probs[start : start + depth + 1],
                                                             draft_tokens[b], noise, first)  # fmt: skip
            start += depth + 1

    if sampling_rows:
        device = target_logits.device
        row_idx = [b for b in sampling_rows for _ in range(len(draft_tokens[b]) + 1)]
        pos_idx = [j for b in sampling_rows for j in range(len(draft_tokens[b]) + 1)]
        # One process_logits call for every used (row, position): N = sum over rows of depth_b + 1.
        rows_t = torch.tensor(row_idx, dtype=torch.long, device=device)  # [N]
        pos_t = torch.tensor(pos_idx, dtype=torch.long, device=device)  # [N]
        flat = target_logits[rows_t, pos_t]  # [N, V]
        temperature = torch.tensor([params[b].temperature for b in row_idx], device=device)  # [N]
        top_k = torch.tensor([params[b].top_k for b in row_idx], device=device)  # [N]
        top_p = torch.tensor([params[b].top_p for b in row_idx], device=device)  # [N]
        probs = process_logits(flat, temperature, top_k, top_p)  # [N, V]

        # p_j(x_j) and q_j(x_j) for every draft of every sampling row at once (M drafts in all),
        # checked before any random number is drawn.
        starts, draft_pos, draft_tok, owner, q_parts, q_mask = [], [], [], [], [], []
        q_rows: dict[int, torch.Tensor | None] = {}
        start = 0
        for b in sampling_rows:
            depth, q = len(draft_tokens[b]), draft_probs[b]
            q_rows[b] = None if q is None else q.to(device=device, dtype=torch.float32)  # [depth, V]
            starts.append(start)
            draft_pos.extend(range(start, start + depth))
            draft_tok.extend(draft_tokens[b])
            owner.extend((b, j) for j in range(depth))
            q_mask.extend([q is not None] * depth)
            if q is not None and depth:
                q_parts.append(q_rows[b])
            start += depth + 1
        accept: list[float] = []
        if draft_tok:
            tok_t = torch.tensor(draft_tok, dtype=torch.long, device=device)  # [M]
            p_x = probs[torch.tensor(draft_pos, dtype=torch.long, device=device), tok_t]  # [M]
            q_x = torch.ones_like(p_x)  # [M]; deterministic proposals: q_j(x_j) = 1
            if q_parts:
                mask = torch.tensor(q_mask, device=device)  # [M]
                q_cat = torch.cat(q_parts)  # [Mq, V]
                q_x[mask] = q_cat[torch.arange(q_cat.shape[0], device=device), tok_t[mask]]  # [Mq]
            bad = (~(q_x > 0)).nonzero().flatten().tolist()
            if bad:
                m = bad[0]
                raise ValueError(
                    f"row {owner[m][0]}, position {owner[m][1]}: draft token {draft_tok[m]} has draft "
                    f"probability q = {float(q_x[m])}; a proposer must never propose a token it gave "
                    "zero probability"
                )
            accept = acceptance_probability(p_x, q_x).tolist()  # [M]

        m = 0
        for b, start in zip(sampling_rows, starts, strict=True):
            depth = len(draft_tokens[b])
            p = probs[start : start + depth + 1]  # [depth + 1, V]
            num_accepted[b], tokens[b] = _verify_sampling_row(
                p, q_rows[b], draft_tokens[b], accept[m : m + depth], generators[b]
            )
            m += depth

    return VerifyOutput(num_accepted=num_accepted, tokens=tokens)


def _verify_greedy(
    argmax: torch.Tensor,  # [G, K + 1] long, argmax of the raw logits of the greedy rows
    drafts: list[list[int]],  # per greedy row, len depth_g <= K
) -> tuple[list[int], list[list[int]]]:
    """Accept while draft == argmax; then emit the argmax (recovered or bonus)."""
    rows, k = argmax.shape[0], argmax.shape[1] - 1
    padded = torch.tensor([d + [-1] * (k - len(d)) for d in drafts], dtype=torch.long)  # [G, K]
    padded = padded.reshape(rows, k).to(argmax.device)  # [G, K]; -1 padding never matches
    match = padded == argmax[:, :k]  # [G, K]
    accepted = match.long().cumprod(dim=1).sum(dim=1).tolist()  # [G] length of the matching prefix
    best = argmax.tolist()  # [G][K + 1]
    emitted = [[*d[:n], best[i][n]] for i, (d, n) in enumerate(zip(drafts, accepted, strict=True))]
    return accepted, emitted


def _verify_sampling_row(
    p: torch.Tensor,  # [depth + 1, V] target distributions (process_logits)
    q: torch.Tensor | None,  # [depth, V] draft distributions, or None = deterministic proposal
    draft: list[int],  # len depth
    accept: list[float],  # len depth, min(1, p_j(x_j) / q_j(x_j))
    gen: torch.Generator | None,
) -> tuple[int, list[int]]:
    """Rejection-sample one row: accepted drafts, then one recovered or bonus token."""
    assert gen is not None  # checked by verify
    for j, x in enumerate(draft):
        u = float(torch.rand(1, generator=gen, device=gen.device)[0])
        if u < accept[j]:  # P(u < a) = a for u ~ U[0, 1)
            continue
        residual = residual_distribution(p[j], None if q is None else q[j], x)  # [V]
        recovered = int(torch.multinomial(residual, 1, generator=gen)[0])
        return j, [*draft[:j], recovered]
    depth = len(draft)
    # Bonus (or, at depth 0, the plain decoding draw: one multinomial, exactly like `sample`).
    bonus = int(torch.multinomial(p[depth], 1, generator=gen)[0])
    return depth, [*draft, bonus]


def _target_probs(
    target_logits: torch.Tensor,  # [B, K + 1, V]
    rows: list[int],
    draft_tokens: Sequence[list[int]],
    params: Sequence[SamplingParams],
) -> torch.Tensor:  # [N, V]: each row's first depth_b + 1 positions, rows in order
    """One ``process_logits`` call for every used (row, position)."""
    device = target_logits.device
    row_idx = [b for b in rows for _ in range(len(draft_tokens[b]) + 1)]
    pos_idx = [j for b in rows for j in range(len(draft_tokens[b]) + 1)]
    flat = target_logits[torch.tensor(row_idx, device=device), torch.tensor(pos_idx, device=device)]  # [N, V]
    return process_logits(
        flat,
        torch.tensor([params[b].temperature for b in row_idx], device=device),
        torch.tensor([params[b].top_k for b in row_idx], device=device),
        torch.tensor([params[b].top_p for b in row_idx], device=device),
    )


def _verify_coupled_row(
    p: torch.Tensor,  # [depth + 1, V] target distributions
    draft: list[int],  # len depth
    noise: PositionNoise,
    first: int,  # output index of position 0
) -> tuple[int, list[int]]:
    """Accept while the draft equals the target's race choice; then emit the choice."""
    for j, x in enumerate(draft):
        choice = noise.choose(p[j], first + j)
        if choice != x:
            return j, [*draft[:j], choice]
    depth = len(draft)
    return depth, [*draft, noise.choose(p[depth], first + depth)]
