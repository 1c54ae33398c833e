"""Token trees on real weights: tree output IS plain output, token for token, greedy and seeded.

SmolLM2 in float32 (our float32 attention, as a quantized target on a CPU runs: trees are exact
there, ``engine.tree``). The draft is SmolLM2 itself in 4-bit weights (re-quantized to Q4_K, against
the target's dense float32), so it is right most of the time and wrong sometimes: the walk leaves
the chain for an alternative now and then. The cost model is flat (every budgeted alternative joins).
In bf16 trees are off (``attention.tree_exact``): the engine says so and verifies chains.
"""

from __future__ import annotations

import pytest
import torch

from policies import FittedCostModel
from serve_app.engine import engine as engine_module
from serve_app.engine.engine import SpecEngine
from serve_app.engine.engine_config import EngineConfig
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.target_step import score_drafts

PROMPTS = [  # not in the repository's prompt catalogues
    "def flatten(nested):",
    "The lighthouse keeper wrote in his log that",
]
CHAT = ["Give three tips for naming variables."]


def params(seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2(smollm2_path) -> SpecEngine:
    proposers = {"draft": {"model_path": smollm2_path, "weight_format": "q4k"}, "ngram": {"max_ngram": 3}}
    config = EngineConfig(max_slots=6, max_seq_len=256, spec_method="draft", spec_depth=4, max_depth=8,
                          proposer_options=proposers, max_waiting=16)  # fmt: skip
    engine = SpecEngine.from_path(smollm2_path, config, "float32", "cpu")
    # A forward that costs the same at every width: the floor is 0, every budgeted alternative joins.
    engine.use_cost_model(FittedCostModel(target=(0.05, 0.0, 0.0, 0.0), knee=64))
    return engine


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return [smollm2.encode_prompt(p) for p in PROMPTS] + [smollm2.encode_prompt(p, chat=True) for p in CHAT]


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_trees_equal_plain_on_real_weights(smollm2, prompts, seed, monkeypatch) -> None:
    assert smollm2.exact and smollm2.trees
    rows = [params(None if seed is None else seed + i) for i in range(len(prompts))]
    plain = [r.token_ids for r in smollm2.generate(prompts, rows, SpecOverride("off"))]
    off_chain = 0  # rows whose accepted path left the proposer's chain for an alternative

    def counted(*args):
        nonlocal off_chain
        step = score_drafts(*args)
        off_chain += sum(c < n for c, n in zip(step.on_chain, step.num_accepted, strict=True))
        return step

    monkeypatch.setattr(engine_module, "score_drafts", counted)
    for mode, depth, nodes in (("draft", 4, 4), ("ngram", 4, 4)):
        spec = smollm2.generate(prompts, rows, SpecOverride(mode, depth, tree_nodes=nodes))
        assert [r.token_ids for r in spec] == plain, (mode, depth, nodes)
    assert off_chain > 0
    mixed = [SpecOverride("draft", 4, tree_nodes=3), SpecOverride("ngram", 3, tree_nodes=2),
             SpecOverride("off")]  # fmt: skip
    assert [r.token_ids for r in smollm2.generate(prompts, rows, mixed)] == plain


def test_bf16_verifies_chains_and_stays_exact(smollm2_path) -> None:
    config = EngineConfig(max_slots=2, max_seq_len=128, spec_method="ngram", spec_depth=4, max_depth=4,
                          proposer_options={"ngram": {}}, max_waiting=4)  # fmt: skip
    engine = SpecEngine.from_path(smollm2_path, config, "bfloat16", "cpu")
    assert engine.model.dtype == torch.bfloat16 and not engine.trees
    prompt = [engine.encode_prompt("a, b, c, a, b, c, a, b,")]
    plain = engine.generate(prompt, params(None), SpecOverride("off"))[0].token_ids
    assert engine.generate(prompt, params(None), SpecOverride("ngram", 4, tree_nodes=4))[0].token_ids == plain
