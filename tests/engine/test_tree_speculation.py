"""Tree speculation is exact: a walked token tree emits plain decoding's tokens, token for token.

Tiny float32 models (our float32 attention skips masked keys: trees are exact there by
construction, ``engine.tree``). An oracle drafts trees whose right continuation sits on the chain,
on an alternative (one token, or a whole branch of several) or nowhere, so every kind of walk and
cache move happens; the draft model and the n-gram lookup draft trees of their own. Greedy and
coupled sampling, batches mixing trees, chains, rejection sampling and plain rows.
"""

from __future__ import annotations

import pytest

from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.proposers.base import Draft, ProposeRow
from serve_app.engine.tree import TokenTree
from tests.conftest import make_tiny_engine, make_tiny_hf_model
from tests.engine.test_speculative import NGRAM_3_1, PROMPTS, OracleProposer

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)


class TreeOracle(OracleProposer):
    """Knows each request's plain output; drafts a chain right with probability ``agree`` per token
    and, at the chain's first wrong token, a branch holding the right continuation (up to the node
    budget) with probability ``branch``."""

    branches = True

    def __init__(self, references: list[list[int]], agree: float, branch: float, vocab: int) -> None:
        super().__init__(references, agree, vocab)
        self.branch = branch
        self.committed: list[int] = []
        self.trees = 0

    def commit(self, slot: int, num_accepted: int) -> None:
        self.committed.append(num_accepted)

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        drafts = []
        for row in rows:
            n = len(row.token_ids)
            ref = next(r for r in self.references if r[:n] == row.token_ids)[n : n + row.depth]
            chain = [t if self.rng.random() < self.agree else (t + 1) % self.vocab for t in ref]
            wrong = next((j for j, (a, b) in enumerate(zip(chain, ref, strict=True)) if a != b), None)
            if row.nodes == 0 or wrong is None or self.rng.random() >= self.branch:
                drafts.append(Draft(tokens=chain))
                continue
            tree = TokenTree.of_paths([chain, ref], max_nodes=len(chain) + row.nodes)
            self.trees += 1
            drafts.append(Draft(tokens=chain, tree=tree))
        return drafts


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(target_hf, tiny_tokenizer, prompts):
    """Plain decoding's outputs: greedy, and seeded (coupled sampling) with seed = prompt index."""
    engine = make_tiny_engine(target_hf, tiny_tokenizer, slots=8)
    greedy = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    sampled = [r.token_ids for r in engine.generate(prompts, [seeded(i) for i in range(len(prompts))])]
    return greedy, sampled


@pytest.mark.parametrize(
    ("agree", "branch", "nodes"), [(0.5, 1.0, 1), (0.5, 0.7, 4), (0.0, 1.0, 6), (0.8, 1.0, 2)]
)
def test_oracle_trees_are_exact_greedy(
    target_hf, tiny_tokenizer, prompts, plain, agree, branch, nodes
) -> None:
    references = [p + out for p, out in zip(prompts, plain[0], strict=True)]
    oracle = TreeOracle(references, agree, branch, len(tiny_tokenizer))
    engine = make_tiny_engine(target_hf, tiny_tokenizer, proposers={"oracle": oracle}, method="oracle",
                              depth=4, max_depth=8, slots=3)  # fmt: skip
    assert engine.trees
    results = engine.generate(prompts, GREEDY, SpecOverride(mode="oracle", tree_nodes=nodes))
    assert [r.token_ids for r in results] == plain[0]
    assert oracle.trees > 0
    # The walk left the chain (a commit of fewer chain tokens than accepted) at least once.
    accepted = sum(r.spec_stats.accepted for r in results)
    assert sum(oracle.committed) < accepted
    assert engine.cache.num_free == 3


def test_oracle_trees_are_exact_coupled_sampling(target_hf, tiny_tokenizer, prompts, plain) -> None:
    references = [p + out for p, out in zip(prompts, plain[1], strict=True)]
    oracle = TreeOracle(references, 0.5, 1.0, len(tiny_tokenizer))
    engine = make_tiny_engine(target_hf, tiny_tokenizer, proposers={"oracle": oracle}, method="oracle",
                              depth=4, max_depth=8, slots=4)  # fmt: skip
    params = [seeded(i) for i in range(len(prompts))]
    results = engine.generate(prompts, params, SpecOverride(mode="oracle", tree_nodes=3))
    assert [r.token_ids for r in results] == plain[1]
    assert oracle.trees > 0 and sum(oracle.committed) < sum(r.spec_stats.accepted for r in results)


def test_draft_model_and_ngram_trees_in_a_mixed_batch(target_hf, tiny_tokenizer, prompts, plain) -> None:
    """Tree rows (draft, n-gram), chain rows, plain rows, greedy and coupled, in one batch, with
    requests joining as others finish; then the draft model with rejection sampling beside them."""
    other = make_tiny_hf_model(len(tiny_tokenizer), seed=7)
    engine = make_tiny_engine(target_hf, tiny_tokenizer, proposers={"draft": {}, "ngram": NGRAM_3_1},
                              draft_hf=other, method="draft", depth=4, max_depth=8, slots=5)  # fmt: skip
    drafted = engine.proposers["draft"].propose
    trees = []

    def watch(rows):
        drafts = drafted(rows)
        trees.extend(d.tree for d in drafts if d.tree is not None)
        return drafts

    engine.proposers["draft"].propose = watch
    modes = ["draft", "ngram", "off", "draft", "ngram", "draft", "auto", "draft"]
    overrides = [SpecOverride(mode=m, max_depth=2 + i % 4, tree_nodes=0 if i == 3 else 1 + i % 4)
                 for i, m in enumerate(modes)]  # fmt: skip
    params = [GREEDY if i % 2 == 0 else seeded(i) for i in range(len(prompts))]
    results = engine.generate(prompts, params, overrides)
    expected = [plain[0][i] if i % 2 == 0 else plain[1][i] for i in range(len(prompts))]
    assert [r.token_ids for r in results] == expected
    assert trees and max(len(t) - t.chain for t in trees) > 0
    assert engine.cache.num_free == 5 and engine.proposers["draft"].cache.num_free == 5


def test_ngram_trees_offer_every_continuation(tiny_tokenizer) -> None:
    from serve_app.engine.proposers.ngram import NgramProposer

    ngram = NgramProposer(max_ngram=2, min_ngram=1)
    tokens = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 5, 7, 1, 2]
    ngram.admit(0, tokens[:-1])
    row = ProposeRow(0, tokens, depth=2, params=GREEDY, generator=None, nodes=4)
    (draft,) = ngram.propose([row])
    assert draft.tokens == [5, 7]  # the most recent match is the chain
    assert draft.tree is not None and set(draft.tree.tokens) >= {5, 7, 4, 3}
    assert ngram.lookahead(row) == 2
    (chain,) = ngram.propose([ProposeRow(0, tokens, depth=2, params=GREEDY, generator=None)])
    assert chain.tokens == [5, 7] and chain.tree is None


def test_logprobs_of_a_walked_tree_are_plain_decodings(target_hf, tiny_tokenizer, prompts, plain) -> None:
    """A tree row's logprobs come from the rows of its accepted path (``TargetStep.kept_logits``)."""
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1, ignore_eos=True, logprobs=0)]
    rows = prompts[:2]
    reference = make_tiny_engine(target_hf, tiny_tokenizer, slots=2).generate(rows, params)
    references = [p + r.token_ids for p, r in zip(rows, reference, strict=True)]
    oracle = TreeOracle(references, 0.4, 1.0, len(tiny_tokenizer))
    engine = make_tiny_engine(target_hf, tiny_tokenizer, proposers={"oracle": oracle}, method="oracle",
                              depth=4, max_depth=8, slots=2)  # fmt: skip
    results = engine.generate(rows, params, SpecOverride(mode="oracle", tree_nodes=3))
    assert oracle.trees > 0
    for got, want in zip(results, reference, strict=True):
        assert got.token_ids == want.token_ids
        assert got.logprobs.token_ids == want.logprobs.token_ids
        assert got.logprobs.logprobs == want.logprobs.logprobs
        assert got.logprobs.top_ids == want.logprobs.top_ids
