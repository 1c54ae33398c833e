"""Verification of drafts: greedy is the argmax chain, rejection sampling is distributed as p."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from serve_app.engine.params import SamplingParams
from serve_app.engine.sampling import make_generator, process_logits, sample
from serve_app.engine.verify import VerifyOutput, acceptance_probability, residual_distribution, verify

GREEDY = SamplingParams(temperature=0.0)
TRIALS = 20_000


def chain_logits(chains: list[list[int]], vocab: int = 10, seed: int = 0) -> torch.Tensor:
    """Random logits [B, T, V] whose argmax at position j of row b is chains[b][j]."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(chains), len(chains[0]), vocab, generator=gen)  # [B, T, V]
    for b, chain in enumerate(chains):
        for j, tok in enumerate(chain):
            logits[b, j, tok] += 20.0
    return logits


def probs_of(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p for one position: logits [V] -> [V] float32, as plain decoding builds it."""
    return process_logits(
        logits[None],
        torch.tensor([params.temperature]),
        torch.tensor([params.top_k]),
        torch.tensor([params.top_p]),
    )[0]


def assert_distributed_as(counts: torch.Tensor, p: torch.Tensor, tv_bound: float = 0.02) -> None:
    """counts [V] of samples look drawn from p [V]: nothing outside the support, chi-square, TV."""
    counts, p = counts.double(), p.double()
    n = float(counts.sum())
    support = p > 0
    assert counts[~support].sum() == 0, f"samples outside p's support: {counts.tolist()} vs {p.tolist()}"
    expected = p[support] / p[support].sum() * n
    result = chisquare(counts[support].numpy(), expected.numpy())
    tv = 0.5 * float((counts / n - p).abs().sum())
    assert result.pvalue > 1e-3, f"chi-square p={result.pvalue:.2e}, counts {counts.tolist()}, p {p.tolist()}"
    assert tv < tv_bound, f"total variation {tv:.4f}"


# --- greedy -------------------------------------------------------------------------------------------------


def test_greedy_full_partial_immediate_and_depth0_in_one_call() -> None:
    chain = [3, 1, 4, 1]  # argmax at positions 0..3 (K = 3)
    logits = chain_logits([chain] * 5)
    drafts = [[3, 1, 4], [3, 2, 4], [0, 1, 4], [], [3, 1]]
    out = verify(logits, drafts, [None] * 5, [GREEDY] * 5, [None] * 5)
    assert isinstance(out, VerifyOutput)
    assert out.num_accepted == [3, 1, 0, 0, 2]
    assert out.tokens == [[3, 1, 4, 1], [3, 1], [3], [3], [3, 1, 4]]


def test_greedy_ignores_q_ties_lowest_index_and_consumes_no_randomness() -> None:
    logits = torch.zeros(2, 3, 6)  # [B, K + 1, V]
    logits[:, 0, 2] = logits[:, 0, 4] = 5.0  # tie -> 2
    logits[:, 1, 5] = 5.0
    q = torch.full((2, 6), 1 / 6)  # [depth, V] a sampling draft's q does not matter to greedy
    gen = make_generator(7)
    state = gen.get_state()
    out = verify(logits, [[2, 5], [4, 5]], [q, None], [GREEDY, GREEDY], [gen, None])
    assert out.num_accepted == [2, 0]
    assert out.tokens == [[2, 5, 0], [2]]
    assert torch.equal(gen.get_state(), state)


def test_greedy_equals_argmax_chain_on_random_cases() -> None:
    gen = torch.Generator().manual_seed(1)
    bsz, k, vocab = 64, 5, 4  # small vocab so drafts often match
    logits = torch.randn(bsz, k + 1, vocab, generator=gen)  # [B, K + 1, V]
    best = logits.argmax(-1)  # [B, K + 1]
    drafts = []
    for b in range(bsz):
        depth = int(torch.randint(0, k + 1, (1,), generator=gen))
        noise = torch.randint(0, vocab, (depth,), generator=gen)  # [depth]
        keep = torch.rand(depth, generator=gen) < 0.7  # [depth]
        drafts.append(torch.where(keep, best[b, :depth], noise).tolist())
    out = verify(logits, drafts, [None] * bsz, [GREEDY] * bsz, [None] * bsz)
    for b, draft in enumerate(drafts):
        expected = []
        for j in range(len(draft) + 1):
            expected.append(int(best[b, j]))
            if j == len(draft) or draft[j] != expected[-1]:
                break
        assert out.tokens[b] == expected
        assert out.num_accepted[b] == len(expected) - 1


# --- sampling: building blocks and contracts ----------------------------------------------------------------


def test_helpers() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])  # [V]
    q = torch.tensor([0.25, 0.6, 0.1, 0.05])  # [V]
    assert acceptance_probability(p, q).tolist() == pytest.approx([1.0, 0.5, 1.0, 0.0])
    assert residual_distribution(p, q, 1).tolist() == pytest.approx([0.25 / 0.35, 0, 0.1 / 0.35, 0])
    assert residual_distribution(p, None, 0).tolist() == pytest.approx([0, 0.6, 0.4, 0])
    assert torch.equal(residual_distribution(p, p, 0), p)  # p == q: fall back to p


def test_zero_q_for_a_proposed_token_raises() -> None:
    logits = torch.randn(2, 3, 5)
    q = torch.full((2, 5), 0.25)
    q[1, 3] = 0.0
    params = [SamplingParams(temperature=1.0)] * 2
    gens = [make_generator(0), make_generator(1)]
    with pytest.raises(ValueError, match=r"row 1, position 1"):
        verify(logits, [[1, 2], [0, 3]], [q, q], params, gens)


def test_bad_inputs_raise() -> None:
    logits = torch.randn(1, 2, 5)
    params, gens = [SamplingParams()], [make_generator(0)]
    with pytest.raises(ValueError, match="positions"):
        verify(logits, [[1, 2]], [None], params, gens)
    with pytest.raises(ValueError, match="out of range"):
        verify(logits, [[5]], [None], params, gens)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(logits, [[1]], [torch.ones(2, 5) / 5], params, gens)
    with pytest.raises(ValueError, match="generator"):
        verify(logits, [[1]], [None], params, [None])


def test_depth0_sampling_row_consumes_generator_like_sample() -> None:
    vocab = 32
    logits = torch.randn(4, 3, vocab, generator=torch.Generator().manual_seed(3))  # [B, K + 1, V]
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        GREEDY,
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0),
    ]
    drafts = [[], [1, 2], [], []]
    for seed in range(20):
        gens = [make_generator(seed + 100 * b) if not p.greedy else None for b, p in enumerate(params)]
        out = verify(logits, drafts, [None] * 4, params, gens)
        for b in (0, 2, 3):  # the depth-0 sampling rows (row 3 alone would take the fast path)
            ref_gen = make_generator(seed + 100 * b)
            p = params[b]
            probs = process_logits(
                logits[b, :1], torch.tensor([p.temperature]), torch.tensor([p.top_k]), torch.tensor([p.top_p])
            )  # [1, V]
            assert out.tokens[b] == sample(probs, [ref_gen]).tolist()
            assert torch.equal(gens[b].get_state(), ref_gen.get_state())


def test_batch_composition_does_not_change_a_row() -> None:
    vocab = 16
    logits = torch.randn(3, 4, vocab, generator=torch.Generator().manual_seed(4))  # [B, K + 1, V]
    q = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)), -1)  # [3, V]
    params = [SamplingParams(temperature=0.9, top_k=8), SamplingParams(temperature=1.0), GREEDY]
    drafts = [[1, 2, 3], [4, 5], [6]]
    for seed in range(10):
        gens = [make_generator(seed), make_generator(9), None]
        full = verify(logits, drafts, [q, q[:2], None], params, gens)
        alone = verify(logits[:1], drafts[:1], [q], params[:1], [make_generator(seed)])
        assert full.tokens[0] == alone.tokens[0]
        assert full.num_accepted[0] == alone.num_accepted[0]


# --- sampling: the output is distributed exactly as p ------------------------------------------------------

VOCAB = 8
STAT_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.85),
    SamplingParams(temperature=0.6, top_k=6, top_p=0.9),
]


def run_depth1(
    p_logits: torch.Tensor,  # [V] target logits at position 0
    params: SamplingParams,
    drafts: torch.Tensor,  # [N] one draft token per trial
    q: torch.Tensor | None,  # [V] the draft distribution, or None = deterministic proposal
    seed: int,
) -> VerifyOutput:
    n = drafts.shape[0]
    logits = torch.stack([p_logits, torch.zeros(VOCAB)]).expand(n, 2, VOCAB)  # [N, 2, V]
    q_rows = [None] * n if q is None else [q[None]] * n  # each [1, V]
    gen = make_generator(seed)  # shared by all rows: rows are processed in order
    return verify(logits, [[t] for t in drafts.tolist()], q_rows, [params] * n, [gen] * n)


def first_token_counts(out: VerifyOutput) -> torch.Tensor:
    return torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=VOCAB)  # [V]


@pytest.mark.parametrize("case", range(len(STAT_PARAMS)))
def test_sampled_q_first_token_is_distributed_as_p(case: int) -> None:
    gen = torch.Generator().manual_seed(10 + case)
    p_logits = torch.randn(VOCAB, generator=gen) * 1.5  # [V]
    q = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, -1)  # [V] a different distribution
    drafts = torch.multinomial(q, TRIALS, replacement=True, generator=gen)  # [N] x ~ q
    out = run_depth1(p_logits, STAT_PARAMS[case], drafts, q, seed=case)
    accepted = sum(out.num_accepted)
    assert 0 < accepted < TRIALS  # both branches exercised
    assert_distributed_as(first_token_counts(out), probs_of(p_logits, STAT_PARAMS[case]))


@pytest.mark.parametrize("rank", [0, 2, VOCAB - 1])  # most likely, middle, outside top-k / top-p
def test_deterministic_q_first_token_is_distributed_as_p(rank: int) -> None:
    params = STAT_PARAMS[3]
    p_logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(20)) * 1.5  # [V]
    p = probs_of(p_logits, params)  # [V]
    draft_token = int(torch.argsort(p_logits, descending=True)[rank])
    out = run_depth1(p_logits, params, torch.full((TRIALS,), draft_token), None, seed=rank)
    if p[draft_token] == 0:
        assert sum(out.num_accepted) == 0  # a token outside p's support is never accepted
    else:
        assert 0 < sum(out.num_accepted) < TRIALS
    assert_distributed_as(first_token_counts(out), p)


def test_q_equal_to_p_accepts_everything() -> None:
    params = STAT_PARAMS[1]
    gen = torch.Generator().manual_seed(30)
    p_logits = torch.randn(VOCAB, generator=gen) * 1.5  # [V]
    p = probs_of(p_logits, params)  # [V]
    drafts = torch.multinomial(p, TRIALS, replacement=True, generator=gen)  # [N]
    out = run_depth1(p_logits, params, drafts, p, seed=30)
    assert out.num_accepted == [1] * TRIALS
    assert_distributed_as(first_token_counts(out), p)


def test_q_disjoint_from_top_k_rejects_everything() -> None:
    params = SamplingParams(temperature=1.0, top_k=3)
    gen = torch.Generator().manual_seed(40)
    p_logits = torch.randn(VOCAB, generator=gen)  # [V]
    p = probs_of(p_logits, params)  # [V] support: the top 3
    q = torch.softmax(torch.randn(VOCAB, generator=gen), -1).masked_fill(p > 0, 0.0)  # [V]
    q = q / q.sum()
    drafts = torch.multinomial(q, TRIALS, replacement=True, generator=gen)  # [N]
    out = run_depth1(p_logits, params, drafts, q, seed=40)
    assert sum(out.num_accepted) == 0
    assert_distributed_as(first_token_counts(out), p)


def test_depth3_first_two_tokens_are_jointly_distributed_as_p0_times_p1() -> None:
    vocab, depth = 6, 3
    gen = torch.Generator().manual_seed(50)
    params = SamplingParams(temperature=0.9, top_k=4)
    # The target's distribution at each position does not depend on earlier tokens.
    pos_logits = torch.randn(depth + 1, vocab, generator=gen) * 1.5  # [K + 1, V]
    q = torch.softmax(torch.randn(depth, vocab, generator=gen), -1)  # [K, V]
    drafts = torch.stack(
        [torch.multinomial(q[j], TRIALS, replacement=True, generator=gen) for j in range(depth)], dim=1
    )  # [N, K], x_j ~ q_j
    logits = pos_logits.expand(TRIALS, depth + 1, vocab)  # [N, K + 1, V]
    shared = make_generator(51)
    out = verify(logits, drafts.tolist(), [q] * TRIALS, [params] * TRIALS, [shared] * TRIALS)
    assert set(out.num_accepted) == {0, 1, 2, 3}

    # A row that stopped after one token continues with a plain step, whose target is p_1 again.
    short = [b for b, toks in enumerate(out.tokens) if len(toks) == 1]
    m = len(short)
    nxt = verify(pos_logits[1:2].expand(m, 1, vocab), [[]] * m, [None] * m, [params] * m, [shared] * m)
    second = {b: toks[1] for b, toks in enumerate(out.tokens) if len(toks) > 1}
    second.update({b: toks[0] for b, toks in zip(short, nxt.tokens, strict=True)})

    pairs = torch.tensor([out.tokens[b][0] * vocab + second[b] for b in range(TRIALS)])  # [N]
    counts = torch.bincount(pairs, minlength=vocab * vocab)  # [V * V]
    p0, p1 = probs_of(pos_logits[0], params), probs_of(pos_logits[1], params)  # [V] each
    assert_distributed_as(counts, torch.outer(p0, p1).flatten())
