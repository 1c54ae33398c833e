"""Sampling: the target distribution and seeded draws (the parameters are in ``params``).

`process_logits` is the single definition of "the distribution plain decoding samples from". The
plain decoding path samples from it and the speculative verifier uses the same function to get the
target probabilities p for every verified position, which is what makes speculation lossless. Any
change here changes both paths at once; never build p another way.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.engine.params import GREEDY_TEMPERATURE


def process_logits(
    logits: torch.Tensor,  # [N, V] any float dtype
    temperature: torch.Tensor,  # [N] float
    top_k: torch.Tensor,  # [N] long, 0 = off
    top_p: torch.Tensor,  # [N] float in (0, 1], 1 = off
) -> torch.Tensor:  # [N, V] float32 probabilities, rows sum to 1
    """Turn logits into the probabilities plain decoding samples from, one row per position.

    All arithmetic is float32 whatever the logits' dtype. Per row, in this order:

    1. temperature < `GREEDY_TEMPERATURE`: one-hot at `argmax(logits)` (ties: lowest index, as
       `torch.argmax`); the remaining steps don't apply.
    2. divide by the temperature;
    3. top-k (k > 0): keep every token whose scaled logit is >= the k-th largest one, so tokens tied
       with the k-th are all kept;
    4. top-p (p < 1): on the softmax of what top-k kept, sorted descending (stable: equal
       probabilities keep ascending token order), keep the shortest prefix whose cumulative
       probability reaches p; the most likely token is always kept;
    5. softmax over the kept tokens (the others get probability exactly 0).

    Rows are independent and may have different parameters; any N works, so the verifier flattens
    [B, T, V] to [B*T, V] and repeats each request's parameters T times.
    """
    raw = logits.float()  # [N, V]
    v = raw.shape[1]
    temperature = temperature.to(device=raw.device, dtype=torch.float32)  # [N]
    top_k = top_k.to(device=raw.device, dtype=torch.long)  # [N]
    top_p = top_p.to(device=raw.device, dtype=torch.float32)  # [N]

    greedy = temperature < GREEDY_TEMPERATURE  # [N]
    # Greedy rows divide by 1 so no inf/NaN appears; their result is replaced at the end.
    x = raw / torch.where(greedy, 1.0, temperature).unsqueeze(1)  # [N, V]
    one_hot = torch.nn.functional.one_hot(raw.argmax(dim=-1), v).to(torch.float32)  # [N, V]

    filtered = ((top_k > 0) & (top_k < v)) | (top_p < 1.0)  # [N]
    if not bool(filtered.any()):
        # Fast path (no sort over a 100k+ vocabulary): bit-identical to the full path, whose
        # masks keep every finite logit when no row filters.
        return torch.where(greedy.unsqueeze(1), one_hot, torch.softmax(x, dim=-1))  # [N, V]

    # One stable sort serves both filters; stable so that ties are ordered by token index and the
    # result is a deterministic function of the logits.
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [N, V] each

    # top-k: threshold at the k-th largest value; k = 0 or k >= V means keep everything.
    k = torch.where((top_k <= 0) | (top_k > v), v, top_k)  # [N]
    kth = sorted_x.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
    sorted_x = sorted_x.masked_fill(sorted_x < kth, -math.inf)  # [N, V] still sorted

    # top-p on the top-k-filtered distribution. A token is kept when the probability mass strictly
    # before it (exclusive cumsum) is < p; position 0 has mass 0 so it is always kept.
    sorted_probs = torch.softmax(sorted_x, dim=-1)  # [N, V]
    cum = torch.cumsum(sorted_probs, dim=-1)  # [N, V]
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # [N, V]
    # Rows with p >= 1 skip the filter: float32 cumsum can reach 1.0 before the tail and would
    # otherwise drop tiny-probability tokens that "top_p = 1" promises to keep.
    keep_sorted = (mass_before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)  # [N, V]
    keep_sorted &= sorted_x > -math.inf  # respect top-k (and -inf logits)
    keep_sorted[:, 0] = True  # the most likely token always survives

    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)  # [N, V] token order
    probs = torch.softmax(x.masked_fill(~keep, -math.inf), dim=-1)  # [N, V]
    return torch.where(greedy.unsqueeze(1), one_hot, probs)  # [N, V]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request random generator on `device`, seeded with `seed` (or fresh OS entropy).

    One generator per request, never shared, so a request's draws do not depend on which other
    requests are in the batch.
    """
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(
    probs: torch.Tensor,  # [N, V] float probabilities (e.g. from process_logits)
    generators: Sequence[torch.Generator | None],  # len N; None = greedy row
) -> torch.Tensor:  # [N] long token ids
    """Draw one token per row: argmax where the generator is None, else a seeded multinomial draw."""
    if len(generators) != probs.shape[0]:
        raise ValueError(f"got {len(generators)} generators for {probs.shape[0]} rows")
    tokens = probs.argmax(dim=-1)  # [N]
    # One multinomial per row: each request draws from its own generator, so batching one request
    # with others never changes its random stream.
    for i, gen in enumerate(generators):
        if gen is not None:
            tokens[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
    return tokens


_MASK64 = (1 << 64) - 1


def _position_seed(seed: int, index: int) -> int:
    """A 63-bit seed for output position ``index`` of a request seeded ``seed`` (splitmix64 of the
    pair): the same in every process, independent enough across positions for the race below."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class PositionNoise:
    """Coupled sampling: a request's token at output position ``i`` is ``argmax_v p(v) / E_i(v)``.

    ``E_i(v)`` are i.i.d. Exp(1), drawn on the CPU from a generator seeded by ``(seed, i)`` alone.
    The smallest of ``E(v) / p(v)`` falls on ``v`` with probability ``p(v)`` (an exponential race,
    equivalent to the Gumbel-max trick), so every token is an exact draw from ``p``, and positions
    are independent. Because the noise depends on nothing but the seed and the position, plain
    decoding, any speculative step (which checks a draft token by equality with this choice), any
    batch and any replica pick the same token: seeded sampling is reproducible with speculation on
    or off. A proposer that drafts under the same noise (``argmax q / E``) agrees with the target
    whenever both races have the same winner.
    """

    seed: int

    def exponentials(self, index: int, vocab: int) -> torch.Tensor:  # [V] float32 on the CPU
        generator = torch.Generator(device="cpu").manual_seed(_position_seed(self.seed, index))
        return torch.empty(vocab, dtype=torch.float32).exponential_(generator=generator)

    def choose(self, probs: torch.Tensor, index: int) -> int:
        """The token at output position ``index`` for the distribution ``probs`` ``[V]``."""
        race = probs.float().cpu() / self.exponentials(index, probs.shape[-1])  # [V]
        return int(race.argmax())


def new_seed() -> int:
    """A fresh 63-bit seed from the OS (what an unseeded request samples with)."""
    return int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
