"""End to end on a 16-token vocabulary: speculative sampling is distributed exactly as plain sampling.

The exact distribution of the first three sampled tokens is computed from the target's logits
(with the same temperature / top-k / top-p processing); thousands of seeded requests through the
engine, with a sampling draft model and with the deterministic n-gram proposer, must match it
(chi-square on the marginals of tokens 2 and 3, which come from verification steps); likewise
with the target drafting for itself through its first layer (self-speculation). Both sampling
schemes: coupled (the default: the race under per-position noise) and rejection (min(1, p/q)).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from serve_app.engine.engine import SpecEngine
from serve_app.engine.engine_config import EngineConfig
from serve_app.engine.model import DecoderModel
from serve_app.engine.params import SamplingParams
from serve_app.engine.proposers.draft_model import DraftModelProposer
from serve_app.engine.proposers.ngram import NgramProposer
from serve_app.engine.proposers.self_spec import SelfSpecProposer
from serve_app.engine.sampling import process_logits
from tests.conftest import make_tiny_hf_model

VOCAB = 16
PROMPT = [3, 5, 3, 5, 3]
SAMPLES = 3000


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1")


@pytest.fixture(scope="module")
def target_hf():
    model = make_tiny_hf_model(VOCAB, seed=3)
    with torch.no_grad():  # milder logits: many tokens with real probability
        model.lm_head.weight.mul_(0.25)
    return model


def exact_marginals(target_hf, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """P(token 2) and P(token 3) under plain sampling, from the target's processed logits."""

    def probs(rows: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = target_hf(torch.tensor(rows)).logits[:, -1].float()  # [N, V]
        n = logits.shape[0]
        return process_logits(
            logits,
            torch.full((n,), params.temperature),
            torch.full((n,), params.top_k, dtype=torch.long),
            torch.full((n,), params.top_p),
        )

    p1 = probs([PROMPT])[0]  # [V]
    p2 = probs([[*PROMPT, a] for a in range(VOCAB)])  # [V(t1), V(t2)]
    pairs = list(itertools.product(range(VOCAB), range(VOCAB)))
    p3 = probs([[*PROMPT, a, b] for a, b in pairs]).view(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    joint12 = p1[:, None] * p2  # [t1, t2]
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def sample_tokens(engine: SpecEngine, params: SamplingParams) -> torch.Tensor:
    results = engine.generate([PROMPT] * SAMPLES, [
        SamplingParams(max_tokens=3, temperature=params.temperature, top_k=params.top_k,
                       top_p=params.top_p, seed=seed, ignore_eos=True)
        for seed in range(SAMPLES)
    ])  # fmt: skip
    return torch.tensor([r.token_ids for r in results])  # [N, 3]


def assert_distributed_as(samples: torch.Tensor, expected: torch.Tensor) -> None:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    keep = expected * SAMPLES >= 5  # chi-square needs expected counts >= 5; pool the rest
    observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    wanted = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)]).double() * SAMPLES
    if wanted[-1] == 0:
        assert observed[-1] == 0
        observed, wanted = observed[:-1], wanted[:-1]
    assert (
        chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue
        > 1e-3
    )
    tv = 0.5 * (counts / SAMPLES - expected.double()).abs().sum().item()
    assert tv < 0.05


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)],
    ids=["t1", "t0.7-k6-p0.9"],
)
@pytest.mark.parametrize(
    ("method", "scheme"),
    [(m, "coupled") for m in ("plain", "draft", "ngram", "self")]
    + [("draft", "rejection"), ("self", "rejection")],
)
def test_first_tokens_distributed_as_plain_sampling(target_hf, params, method, scheme) -> None:
    tokenizer = word_tokenizer()
    model = DecoderModel.from_hf_model(target_hf)
    cache = model.new_cache(8, 32)
    proposers = {}
    if method == "draft":
        draft = DecoderModel.from_hf_model(make_tiny_hf_model(VOCAB, seed=11))
        proposers["draft"] = DraftModelProposer(draft, VOCAB, 8, 32)
    elif method == "ngram":
        proposers["ngram"] = NgramProposer(2, 1)
    elif method == "self":  # the target's first layer drafts (samples from q, records it)
        proposers["self"] = SelfSpecProposer(model, cache, (1,))
    config = EngineConfig(max_slots=8, max_seq_len=32, spec_method=None if method == "plain" else method,
                          spec_depth=2, max_waiting=SAMPLES, sampling=scheme)  # fmt: skip
    engine = SpecEngine(model, tokenizer, config, proposers=proposers, cache=cache)
    samples = sample_tokens(engine, params)
    p2, p3 = exact_marginals(target_hf, params)
    assert_distributed_as(samples[:, 1], p2)
    assert_distributed_as(samples[:, 2], p3)


@pytest.mark.parametrize("scheme", ["coupled", "rejection"])
def test_fixed_seed_reproduces_speculative_sampling(target_hf, scheme) -> None:
    tokenizer = word_tokenizer()
    outputs = []
    for _ in range(2):
        draft = DecoderModel.from_hf_model(make_tiny_hf_model(VOCAB, seed=11))
        config = EngineConfig(max_slots=4, max_seq_len=64, spec_method="draft", spec_depth=3, sampling=scheme)
        engine = SpecEngine(DecoderModel.from_hf_model(target_hf), tokenizer, config,
                            proposers={"draft": DraftModelProposer(draft, VOCAB, 4, 64)})  # fmt: skip
        params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
        results = engine.generate([PROMPT] * 4, params)
        outputs.append([r.token_ids for r in results])
        assert sum(r.spec_stats.accepted for r in results) > 0
        assert sum(r.spec_stats.steps_none_accepted for r in results) > 0
    assert outputs[0] == outputs[1]
    assert len({tuple(o) for o in outputs[0]}) > 1  # different seeds, different samples


@pytest.mark.parametrize("method", ["draft", "ngram", "self"])
def test_coupled_seeded_output_is_the_same_with_speculation_on_or_off(target_hf, method) -> None:
    """The same seed gives the same tokens whatever the proposer and depth (rejection sampling
    cannot promise that: it spends its random stream differently when it speculates)."""
    from serve_app.engine.params import SpecOverride

    tokenizer = word_tokenizer()
    model = DecoderModel.from_hf_model(target_hf)
    cache = model.new_cache(4, 64)
    proposers = {
        "draft": lambda: DraftModelProposer(
            DecoderModel.from_hf_model(make_tiny_hf_model(VOCAB, seed=11)), VOCAB, 4, 64
        ),
        "ngram": lambda: NgramProposer(2, 1),
        "self": lambda: SelfSpecProposer(model, cache, (1,)),
    }
    config = EngineConfig(max_slots=4, max_seq_len=64, spec_method=method, spec_depth=3, max_depth=8)
    engine = SpecEngine(model, tokenizer, config, proposers={method: proposers[method]()}, cache=cache)
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=0.9, seed=s, ignore_eos=True)
              for s, t in enumerate((1.0, 0.7, 1.3, 0.9))]  # fmt: skip
    plain = [r.token_ids for r in engine.generate([PROMPT] * 4, params, SpecOverride("off"))]
    accepted = 0
    for depth in (1, 2, 5, 8):
        results = engine.generate([PROMPT] * 4, params, SpecOverride(method, depth))
        assert [r.token_ids for r in results] == plain, depth
        accepted += sum(r.spec_stats.accepted for r in results)
    assert accepted > 0
