"""The skip curve (``specserve calibrate self-spec --curve``) on a tiny float32 model whose layer 2
does nothing: it is ranked first, its set accepts everything, the figures follow the formula."""

from __future__ import annotations

import pytest

from loadtest.calibrate.self_spec import SelfSpecCalibrator, expected_tokens
from loadtest.calibrate.skip_curve import measure_skip_curve, skip_curve_markdown
from serve_app.engine.model import DecoderModel
from specserve.cli import build_parser
from tests.conftest import make_noop_layer_model
from tests.engine.test_speculative import PROMPTS

LAYERS = 4
NOOP = 2


@pytest.fixture(scope="module")
def calibrator(tiny_tokenizer) -> SelfSpecCalibrator:
    model = DecoderModel.from_hf_model(make_noop_layer_model(len(tiny_tokenizer), LAYERS, NOOP))
    prompts = [tiny_tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    return SelfSpecCalibrator(model, prompts, new_tokens=8, max_depth=2, batch=4)


def test_curve_rows_follow_the_ranking_and_the_formula(calibrator: SelfSpecCalibrator) -> None:
    lines: list[str] = []
    curve = measure_skip_curve(calibrator, [0, 1, 2], {"default": (1,)}, rank_starts=8, log=lines.append)
    assert curve.ranking[0] == (NOOP, 1.0) and len(curve.ranking) == LAYERS
    assert [r.label for r in curve.rows] == ["0 layers", "1 layers", "2 layers", "default"]
    none, one, two, named = curve.rows
    assert none.skip == () and none.acceptance == (1.0, 1.0) and none.draft_fraction == 1.0
    assert none.weight_fraction == 1.0
    assert one.skip == (NOOP,) and one.acceptance == (1.0, 1.0)
    assert len(two.skip) == 2 and NOOP in two.skip and named.skip == (1,)
    verify = curve.costs.verify
    for row in curve.rows:
        assert 0.0 < row.draft_fraction <= 1.0 and 0.0 < row.weight_fraction <= 1.0
        assert len(row.acceptance) == len(row.speedup) == 2
        for k, speedup in enumerate(row.speedup, 1):
            cost = k * row.draft_fraction + verify[k] / verify[0]
            assert speedup == pytest.approx(expected_tokens(row.acceptance, k) / cost)
    assert one.weight_fraction < none.weight_fraction and two.weight_fraction < one.weight_fraction
    assert curve.as_dict()["rows"][1]["skip_layers"] == [NOOP]
    table = skip_curve_markdown(curve, "tiny")
    assert table.startswith("### tiny") and "| 1 | [2] | 1.00 | 1.00 |" in table and "default: [1]" in table
    assert any("acceptance" in line for line in lines)
    with pytest.raises(ValueError, match="skip counts"):
        measure_skip_curve(calibrator, [LAYERS])


def test_cli_accepts_curve() -> None:
    args = build_parser().parse_args(["calibrate", "self-spec", "--curve", "0", "2", "--rank-starts", "16"])
    assert (args.curve, args.rank_starts) == ([0, 2], 16)
    assert build_parser().parse_args(["calibrate", "self-spec"]).curve is None
