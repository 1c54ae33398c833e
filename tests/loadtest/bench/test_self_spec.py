"""Self-speculation in `specserve bench --sweep`: the mode runs beside plain on a tiny engine whose
"self" proposer drafts in the engine's own cache, at its own depth; the label says which."""

from __future__ import annotations

import json

import pytest

from loadtest.bench.methods import auto_method, specserve_method
from loadtest.bench.self_spec import sweep_mode_depths
from loadtest.bench.sweeps import measure_sweep, sweep_markdown
from serve_app.engine.proposers.skip_plan import CALIBRATION_FILE


@pytest.fixture(scope="module")
def self_engine(tiny_tokenizer):
    from tests.conftest import make_tiny_engine, make_tiny_hf_model

    target_hf = make_tiny_hf_model(len(tiny_tokenizer), seed=0, layers=4)
    proposers = {"ngram": {"max_ngram": 3, "min_ngram": 1}, "self": {}}
    return make_tiny_engine(target_hf, tiny_tokenizer, proposers=proposers, self_skip=(1,), depth=3,
                            slots=4, max_seq_len=256)  # fmt: skip


def test_sweep_runs_self_at_its_own_depth(self_engine, tiny_tokenizer) -> None:
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ("def add(a, b):", "The quick brown fox")]
    sweep = measure_sweep(self_engine, prompts, [1, 2], 8, 3, repeats=1, log=lambda _: None,
                                mode_depths={"self": 1})  # fmt: skip
    assert sweep.modes == ["plain", "ngram", "self"]  # default: plain + the loaded proposers
    two = sweep.points[1].runs["self"][0]
    assert two.tokens == 16 and two.differs == 0 and two.drafted > 0
    assert two.drafted <= two.spec_steps  # depth 1: one draft token per request per step
    assert self_engine.cache.num_free == 4
    table = sweep_markdown(sweep)
    assert "self d1 tok/s" in table and "ngram d3 tok/s" in table
    with pytest.raises(ValueError, match="no proposer loaded"):
        measure_sweep(self_engine, prompts, [1], 8, 3, repeats=1, modes=["plain", "draft"])


def test_sweep_depth_of_self_follows_the_resolved_plan(self_engine, tmp_path) -> None:
    assert sweep_mode_depths(self_engine, ["plain", "ngram"], tmp_path) == {}
    assert sweep_mode_depths(self_engine, ["self"], tmp_path) == {}  # default plan: no depth
    stored = {"version": 1, "num_layers": 4, "skip_layers": [2], "depth": 2}
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps(stored))
    assert sweep_mode_depths(self_engine, ["self"], tmp_path) == {"self": 2}
    assert sweep_mode_depths(self_engine, ["self"], tmp_path, skip=[1]) == {}  # explicit set: none


def test_auto_method_gives_self_its_own_cache(self_engine, tiny_tokenizer) -> None:
    """specserve-auto runs on a second engine: its self proposer must draft in THAT engine's cache."""
    from serve_app.config import Settings

    ids = tiny_tokenizer("def add(a, b):")["input_ids"]
    settings = Settings(speculation={"policy": "static", "profile_cost_model": False})
    auto = auto_method(self_engine, settings, 10)
    assert auto.name == "specserve-auto"  # its own name, not that of a proposer it loads
    plain = specserve_method(self_engine, 10, "plain", "off").run(ids)
    run = auto.run(ids)
    assert run.token_ids == plain.token_ids and run.drafted  # static: "auto" = the method, self
    assert self_engine.cache.num_free == 4
