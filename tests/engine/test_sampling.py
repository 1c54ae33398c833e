"""Tests for serve_app.engine.sampling: params validation, the target distribution, seeded draws."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from serve_app.engine.params import SamplingParams
from serve_app.engine.sampling import make_generator, process_logits, sample


def _process(logits: list[list[float]], temperature, top_k, top_p) -> torch.Tensor:
    n = len(logits)

    def per_row(x, dtype):
        return torch.tensor(x if isinstance(x, list) else [x] * n, dtype=dtype)

    return process_logits(
        torch.tensor(logits),
        per_row(temperature, torch.float32),
        per_row(top_k, torch.long),
        per_row(top_p, torch.float32),
    )


# ---------------------------------------------------------------------------------------------- params


def test_params_defaults_and_greedy() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (256, 1.0, 0, 1.0, None)
    assert not p.greedy
    assert SamplingParams(temperature=0.0).greedy


def test_params_lists_become_tuples() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[3])  # type: ignore[arg-type]
    assert p.stop == ("a", "b") and p.stop_token_ids == (3,)
    hash(p)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": tuple(str(i) for i in range(17))}, "stop"),
        ({"stop": ("ok", "")}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_params_invalid_raise_naming_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------------------------------- process_logits


def test_plain_softmax_with_temperature() -> None:
    logits = [[1.0, 2.0, 3.0, 0.5]]
    for t in (1.0, 0.5, 2.0):
        got = _process(logits, t, 0, 1.0)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.softmax(torch.tensor(logits) / t, dim=-1))


def test_temperature_zero_is_one_hot_lowest_index_on_ties() -> None:
    got = _process([[1.0, 5.0, 5.0, 2.0], [9.0, 0.0, 0.0, 0.0]], 0.0, 2, 0.5)
    assert got.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_top_k_keeps_k_largest() -> None:
    logits = [[1.0, 4.0, 3.0, 2.0, 0.0]]
    got = _process(logits, 1.0, 2, 1.0)
    want = torch.softmax(torch.tensor([[-math.inf, 4.0, 3.0, -math.inf, -math.inf]]), dim=-1)
    torch.testing.assert_close(got, want)
    # k = 0 and k >= V switch the filter off.
    full = torch.softmax(torch.tensor(logits), dim=-1)
    torch.testing.assert_close(_process(logits, 1.0, 0, 1.0), full)
    torch.testing.assert_close(_process(logits, 1.0, 99, 1.0), full)


def test_top_k_keeps_ties_at_boundary() -> None:
    got = _process([[3.0, 2.0, 2.0, 1.0]], 1.0, 2, 1.0)
    assert (got[0] > 0).tolist() == [True, True, True, False]


def test_top_p_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.15]])
    logits = probs.log().tolist()
    # Sorted: 0.5, 0.25, 0.15, 0.1 -> cumulative 0.5, 0.75, 0.9, 1.0.
    for p, kept in [
        (0.3, [1]),
        (0.5, [1]),
        (0.6, [1, 2]),
        (0.75, [1, 2]),
        (0.8, [1, 2, 3]),
        (0.95, [0, 1, 2, 3]),
    ]:
        got = _process(logits, 1.0, 0, p)[0]
        assert (got > 0).nonzero().flatten().tolist() == kept, p
        want = torch.zeros(4)
        want[kept] = probs[0, kept] / probs[0, kept].sum()
        torch.testing.assert_close(got, want)


def test_top_p_always_keeps_top_token() -> None:
    got = _process([[0.0, 1.0, 0.5]], 1.0, 0, 1e-9)
    assert got.tolist() == [[0.0, 1.0, 0.0]]


def test_top_p_one_keeps_tiny_tail() -> None:
    # float32 cumsum reaches 1.0 before the tail here; top_p = 1 must still keep every token that
    # top-k keeps (top_k = 4 forces the sorting path).
    got = _process([[30.0, 0.0, 0.0, 0.0, -1.0]], 1.0, 4, 1.0)
    assert (got[0] > 0).tolist() == [True, True, True, True, False]


def test_top_k_then_top_p_on_renormalised() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top-k 2 leaves 0.4/0.7 = 0.571 and 0.3/0.7; top-p 0.5 on that keeps only the first.
    got = _process(probs.log().tolist(), 1.0, 2, 0.5)
    torch.testing.assert_close(got, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    # top-p 0.6 on the renormalised pair needs both (on the raw probs it would need 0.4 + 0.3 too).
    got = _process(probs.log().tolist(), 1.0, 2, 0.6)
    torch.testing.assert_close(got, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_rows_with_different_params_match_rows_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen) * 3
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 2.0])
    top_k = torch.tensor([0, 0, 5, 10, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8, 0.3])
    together = process_logits(logits, temperature, top_k, top_p)
    for i in range(5):
        alone = process_logits(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=0)
    torch.testing.assert_close(together.sum(-1), torch.ones(5))
    assert together[0].max() == 1.0 and together[0].argmax() == logits[0].argmax()
    assert (together[2] > 0).sum() == 5
    assert (together[3] > 0).sum() <= 10


def test_unfiltered_rows_identical_with_or_without_filtered_neighbours() -> None:
    # A request's distribution must not depend on what else is in the batch (fast path vs sort).
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(7)) * 4
    logits[0, 5] = -math.inf
    temperature = torch.tensor([0.9, 1.0])
    alone = process_logits(logits[:1], temperature[:1], torch.tensor([0]), torch.tensor([1.0]))
    mixed = process_logits(logits, temperature, torch.tensor([0, 3]), torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(mixed[:1], alone, rtol=0, atol=0)
    assert alone[0, 5] == 0


def test_half_precision_logits_computed_in_float32() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    params = (torch.full((3,), 0.8), torch.zeros(3, dtype=torch.long), torch.ones(3))
    got = process_logits(logits, *params)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, process_logits(logits.float(), *params), rtol=0, atol=0)


def test_flattened_positions() -> None:
    # The verifier flattens [B, T, V] and repeats each row's params T times.
    b, t, v = 2, 3, 16
    logits = torch.randn(b, t, v, generator=torch.Generator().manual_seed(2))
    temperature = torch.tensor([0.5, 1.0]).repeat_interleave(t)
    top_k = torch.tensor([4, 0]).repeat_interleave(t)
    top_p = torch.tensor([1.0, 0.9]).repeat_interleave(t)
    got = process_logits(logits.reshape(b * t, v), temperature, top_k, top_p).reshape(b, t, v)
    assert ((got[0] > 0).sum(-1) == 4).all()
    torch.testing.assert_close(got.sum(-1), torch.ones(b, t))


# -------------------------------------------------------------------------------------- sample / seeds


def test_sample_greedy_rows_are_argmax() -> None:
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])
    assert sample(probs, [None, None]).tolist() == [1, 0]


def test_seeded_generator_reproducible() -> None:
    probs = torch.softmax(torch.randn(4, 100, generator=torch.Generator().manual_seed(3)), dim=-1)

    def draws(seed: int) -> list[int]:
        gens = [make_generator(seed + i) for i in range(4)]
        return [t for _ in range(20) for t in sample(probs, gens).tolist()]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    # Unseeded generators still work and differ (with overwhelming probability).
    a, b = make_generator(None), make_generator(None)
    assert a.initial_seed() != b.initial_seed()


def test_row_stream_independent_of_batch() -> None:
    probs = torch.softmax(torch.randn(3, 30, generator=torch.Generator().manual_seed(4)), dim=-1)
    g_alone, g_batched, other = make_generator(5), make_generator(5), make_generator(1)
    alone = [sample(probs[1:2], [g_alone]).item() for _ in range(30)]
    batched = [sample(probs, [other, g_batched, None])[1].item() for _ in range(30)]
    assert alone == batched


def test_sample_matches_distribution_chisquare() -> None:
    target = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.22, 0.28])
    n = 20_000
    gen = make_generator(1234)
    counts = torch.zeros(6)
    # Several rows per call, all sharing one generator, so the loop exercises sample() itself.
    rows = 50
    for _ in range(n // rows):
        tokens = sample(target.expand(rows, 6), [gen] * rows)
        counts += torch.bincount(tokens, minlength=6)
    result = chisquare(counts.numpy(), (target * n).numpy())
    assert result.pvalue > 1e-3, (counts, result)


def test_sample_never_draws_masked_tokens() -> None:
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(6)).expand(200, 40)
    probs = process_logits(logits, torch.ones(200), torch.full((200,), 3), torch.ones(200))
    gen = make_generator(9)
    tokens = sample(probs, [gen] * 200)
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) <= allowed


def test_sample_rejects_wrong_generator_count() -> None:
    with pytest.raises(ValueError):
        sample(torch.ones(2, 3) / 3, [None])
