"""The self-speculation calibration on tiny float32 models: replayed acceptance is the engine's,
the search finds a layer that does nothing, and the result round-trips through the model folder."""

from __future__ import annotations

import pytest

from loadtest.calibrate.self_spec import SelfSpecCalibrator, calibrate_self_spec, expected_tokens
from serve_app.engine.model import DecoderModel
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.proposers.skip_plan import load_plan, resolve_plan, save_plan
from tests.conftest import make_noop_layer_model, make_tiny_engine
from tests.engine.test_speculative import PROMPTS

LAYERS = 4
NOOP = 2  # this layer's output projections are zero: skipping it changes nothing


@pytest.fixture(scope="module")
def model(tiny_tokenizer) -> DecoderModel:
    return DecoderModel.from_hf_model(make_noop_layer_model(len(tiny_tokenizer), LAYERS, NOOP))


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(p)["input_ids"] for p in PROMPTS[:4]]


def test_replayed_acceptance_matches_the_engine(model, tiny_tokenizer, prompts) -> None:
    """Depth-1 self-speculation in the engine accepts exactly what the calibrator's replay accepts."""
    new_tokens, skip = 12, (1,)
    calibrator = SelfSpecCalibrator(model, prompts, new_tokens, max_depth=1, batch=5)
    accepted, tried = calibrator.acceptance(skip, 1, calibrator.starts)
    engine = make_tiny_engine(model, tiny_tokenizer, proposers=["self"], self_skip=skip, method="self",
                              depth=1, max_depth=1, slots=4)  # fmt: skip
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params, [SpecOverride("self", 1)] * len(prompts))
    for result, sequence, plen in zip(results, calibrator.sequences, calibrator.prompt_lens, strict=True):
        assert result.token_ids == sequence[plen:]  # the calibrator's reference is plain decoding
    # The engine drafts from a subset of the starts (after an accepted token it skips one); the
    # replay covers every start, so compare rates rather than counts.
    engine_rate = sum(r.spec_stats.accepted for r in results) / sum(r.spec_stats.drafted for r in results)
    assert 0 < accepted[0] < tried[0] == len(calibrator.starts)
    assert abs(engine_rate - accepted[0] / tried[0]) < 0.35


def test_replay_of_the_noop_layer_accepts_everything(model, prompts) -> None:
    calibrator = SelfSpecCalibrator(model, prompts, 10, max_depth=3, batch=4)
    accepted, tried = calibrator.acceptance((NOOP,), 3, calibrator.starts)
    assert accepted == tried and tried[0] == len(calibrator.starts)


def test_search_finds_the_noop_layer_and_round_trips(model, prompts, tmp_path) -> None:
    lines: list[str] = []
    result = calibrate_self_spec(model, prompts, new_tokens=10, max_depth=3, budget_s=60, log=lines.append)
    assert result.ranking[0] == (NOOP, 1.0)
    assert NOOP in result.best.skip and result.history
    best = result.best
    assert best.acceptance[0] <= 1.0 and 1 <= best.depth <= 3
    assert best.tokens_per_step == pytest.approx(expected_tokens(best.acceptance, best.depth))
    assert all(c > 0 for c in result.costs.verify) and any("expected speedup" in line for line in lines)
    plan = result.plan("tiny")
    save_plan(tmp_path, plan)
    loaded = load_plan(tmp_path, LAYERS)
    assert loaded is not None and loaded.skip == plan.skip and loaded.depth == plan.depth
    assert loaded.source == "calibrated" and loaded.details["model"] == "tiny"
    assert resolve_plan(LAYERS, folder=tmp_path).skip == plan.skip
