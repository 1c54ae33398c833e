"""FittedCostModel: least-squares fit, online correction, persistence, report, profile plan."""

from __future__ import annotations

import json
import random

import pytest

from policies import CostModel, FittedCostModel, Outcome, RequestOutcome, draft_profile_plan, profile_plan

TRUE = (0.120, 0.006, 0.0015, 2e-6)  # c0, c1, c2, c3
TRUE_KNEE = 12


def true_target(rows: int, tpr: int, ctx: int) -> float:
    c0, c1, c2, c3 = TRUE
    n = rows * tpr
    return c0 + c1 * max(0, n - TRUE_KNEE) + c2 * n + c3 * rows * ctx


def samples(noise: float = 0.01, seed: int = 0, contexts=(128, 1024)) -> list[tuple[int, int, int, float]]:
    rng = random.Random(seed)
    return [
        (rows, tpr, ctx, true_target(rows, tpr, ctx) * (1 + rng.uniform(-noise, noise)))
        for rows, tpr in profile_plan()
        for ctx in contexts
    ]


def test_implements_the_protocol():
    assert isinstance(FittedCostModel(), CostModel)


def test_profile_plan_is_small_and_spans_the_knee():
    plan = profile_plan()
    assert 8 <= len(plan) <= 24
    tokens = sorted({rows * tpr for rows, tpr in plan})
    assert tokens[0] == 1 and tokens[-1] >= 32
    assert {(1, t) for t in range(1, 9)} <= set(plan)  # every width a lone request verifies
    assert {rows for rows, _ in plan} >= {1, 4, 8}
    assert draft_profile_plan()[0] == 1
    # the default model's estimate of profiling one repeat of the plan: a few seconds
    model = FittedCostModel()
    assert sum(model.target_time(rows, tpr, 256) for rows, tpr in plan) < 5.0


def test_fit_recovers_known_coefficients():
    model = FittedCostModel().fit(samples(noise=0.0))
    assert model.knee == TRUE_KNEE
    assert model.target == pytest.approx(TRUE, rel=1e-6, abs=1e-9)


def test_fit_with_noise_predicts_held_out_shapes():
    model = FittedCostModel().fit(samples(noise=0.02, seed=1))
    held_out = [(r, t, c, true_target(r, t, c)) for r, t, c in [(2, 3, 500), (16, 2, 300), (1, 32, 2000)]]
    report = model.fit_report(held_out)
    assert report["n"] == 3 and report["mean_abs_pct_error"] < 3.0
    row = report["samples"][0]
    assert set(row) == {"rows", "tokens_per_row", "context", "measured", "predicted", "abs_pct_error"}


def test_fit_at_a_single_context_and_coefficients_stay_non_negative():
    flat = [(rows, tpr, 256, 0.13 + 0.0001 * rows * tpr) for rows, tpr in profile_plan()]
    model = FittedCostModel().fit(flat)
    assert all(c >= 0 for c in model.target)
    assert model.fit_report(flat)["max_abs_pct_error"] < 1.0


def test_fit_needs_enough_samples():
    with pytest.raises(ValueError, match=">= 4"):
        FittedCostModel().fit(samples()[:3])


def test_draft_fit_and_unknown_proposers():
    model = FittedCostModel()
    assert model.draft_time("ngram", 8, 200) == 0.0  # never fitted nor observed: free
    data = [
        (rows, ctx, 0.030 + 0.006 * rows + 1e-6 * rows * ctx) for rows in (1, 2, 4, 8) for ctx in (128, 1024)
    ]
    model.fit_draft("draft", data)
    assert model.draft["draft"] == pytest.approx((0.030, 0.006, 1e-6), rel=1e-6)
    report = model.fit_report([], {"draft": [(3, 500, 0.030 + 0.018 + 0.0015)]})
    assert report["draft_steps"]["draft"]["mean_abs_pct_error"] < 1e-6
    assert model.draft_prefill_time("draft", 130) == pytest.approx(3 * model.draft_time("draft", 1, 130))


def test_online_correction_moves_predictions_towards_new_measurements():
    model = FittedCostModel().fit(samples(noise=0.0))
    before = model.target_time(4, 4, 500)
    slower = true_target(4, 4, 500) * 1.5
    errors = []
    for _ in range(60):
        model.observe_target(4, 4, 500, slower)
        errors.append(abs(model.target_time(4, 4, 500) - slower))
    assert abs(before - slower) > 0.3 * slower
    assert errors[0] < abs(before - slower) and max(errors[5:]) < 0.5 * errors[0]
    assert max(errors[-10:]) < 0.02 * slower
    # the global factor also moves shapes not measured lately, most of the way
    assert model.target_time(1, 1, 100) > true_target(1, 1, 100) * 1.3


def test_one_outlier_moves_a_prediction_by_a_bounded_amount():
    model = FittedCostModel().fit(samples(noise=0.0))
    before = model.target_time(1, 1, 200)
    model.observe_target(1, 1, 200, 100.0)  # a 100 s "forward": a pause, not the model
    assert before < model.target_time(1, 1, 200) < before * 2 ** (2 * 0.1) * 1.0001
    model.observe_target(1, 1, 200, float("nan"))
    model.observe_target(1, 1, 200, -1.0)
    assert model.target_time(1, 1, 200) > 0


def test_draft_correction_and_learning_an_unprofiled_proposer():
    model = FittedCostModel(draft={"draft": (0.03, 0.006, 0.0)})
    for _ in range(80):
        model.observe_draft("draft", 2, 200, 0.021)  # int8 draft got faster
    assert model.draft_time("draft", 2, 200) == pytest.approx(0.021, rel=0.03)
    model.observe_draft("eagle", 4, 200, 0.01)
    assert model.draft_time("eagle", 4, 200) == pytest.approx(0.01)


def test_observe_outcome_feeds_both_models():
    model = FittedCostModel(draft={"draft": (0.03, 0.006, 0.0)})
    rows = (
        RequestOutcome("a", "code", "draft", 4, 4, 2, 3),
        RequestOutcome("b", "code", "draft", 2, 2, 2, 3),
        RequestOutcome("c", "code", None, 0, 0, 0, 1),
    )
    outcome = Outcome(rows, 0.4, {"draft": 4 * 0.08}, {"draft": 4}, 5, 300, 0.8)
    before_target, before_draft = model.target_time(3, 5, 300), model.draft_time("draft", 2, 300)
    for _ in range(50):
        model.observe(outcome)
    assert model.target_time(3, 5, 300) > before_target * 1.5
    assert model.draft_time("draft", 2, 300) == pytest.approx(0.08, rel=0.05)
    assert before_draft < 0.05


def test_round_trip_through_json():
    model = FittedCostModel(draft={"draft": (0.03, 0.006, 1e-6)}).fit(samples())
    for _ in range(5):
        model.observe_target(8, 2, 300, 0.5)
        model.observe_draft("draft", 3, 300, 0.05)
    copy = FittedCostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    for shape in [(1, 1, 100), (8, 2, 300), (32, 2, 900)]:
        assert copy.target_time(*shape) == model.target_time(*shape)
    assert copy.draft_time("draft", 3, 300) == model.draft_time("draft", 3, 300)
    with pytest.raises(ValueError, match="version"):
        FittedCostModel.from_dict({"version": 99})


# Measured here (module docstring of policies.cost_model): one row's forward by width is not
# monotone; two tokens cost more than one, four to six less.
BUMPS = {1: 1.0, 2: 1.15, 3: 1.0, 4: 0.92, 5: 0.88, 6: 0.88, 7: 1.0, 8: 1.05}


def bumpy_samples() -> list[tuple[int, int, int, float]]:
    return [
        (rows, tpr, 128, true_target(rows, tpr, 128) * (BUMPS.get(rows * tpr, 1.0) if rows == 1 else 1.0))
        for rows, tpr in profile_plan()
    ]


def test_fit_keeps_the_measured_shape_of_each_profiled_width():
    data = bumpy_samples()
    model = FittedCostModel().fit(data)
    for rows, tpr, ctx, seconds in data:
        if rows == 1 and tpr in (2, 3, 5, 6, 7):  # n measured at one row only: reproduced exactly
            assert model.target_time(rows, tpr, ctx) == pytest.approx(seconds, rel=1e-9)
    assert model.target_time(1, 2, 128) > model.target_time(1, 1, 128) > model.target_time(1, 5, 128)
    # the fitted curve alone would miss the bumps by their size
    assert model.fitted_target_time(1, 2, 128) < 0.95 * model.target_time(1, 2, 128)
    model.reset_corrections()  # the shape is part of the fit, not a correction
    assert model.target_time(1, 2, 128) == pytest.approx(data[1][3], rel=1e-9)
    copy = FittedCostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert copy.target_time(1, 5, 128) == model.target_time(1, 5, 128)


def test_online_correction_learns_each_small_width_on_its_own():
    model = FittedCostModel().fit(samples(noise=0.0))
    three, five = model.target_time(1, 3, 200), model.target_time(1, 5, 200)
    for _ in range(80):
        model.observe_target(1, 2, 200, true_target(1, 2, 200) * 1.25)
        model.observe_target(1, 3, 200, true_target(1, 3, 200))
    assert model.target_time(1, 2, 200) == pytest.approx(true_target(1, 2, 200) * 1.25, rel=0.02)
    assert model.target_time(1, 3, 200) == pytest.approx(three, rel=0.02)  # its own bucket
    # widths not run moved only by the global factor, which both measurements share
    assert model.target_time(1, 5, 200) / five == pytest.approx(model.target_factor[0], rel=1e-9)


def test_a_measured_draft_prefill_prices_admission_and_catching_up():
    model = FittedCostModel(draft={"draft": (0.008, 0.0, 0.0)}).fit(samples())
    # unmeasured: one draft step per 64 tokens (85 tokens: 2 steps)
    assert model.draft_prefill_time("draft", 85) == pytest.approx(0.016)
    model.set_draft_prefill("draft", 128, 0.256)  # 2 ms a token, what the profile timed
    assert model.draft_prefill_time("draft", 85) == pytest.approx(0.170)
    assert model.draft_prefill_time("draft", 2) == pytest.approx(0.008)  # never below one draft step
    for _ in range(50):  # real steps cost twice the profile's: that moves the steps, not the prefill
        model.observe_draft("draft", 1, 100, 0.016)
    assert model.draft_time("draft", 1, 100) == pytest.approx(0.016, rel=0.05)
    assert model.draft_prefill_time("draft", 85) == pytest.approx(0.170)
    assert model.draft_prefill_time("draft", 2) == pytest.approx(model.draft_time("draft", 1, 2))
    copy = FittedCostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert copy.draft_prefill_time("draft", 85) == model.draft_prefill_time("draft", 85)
    model.mark_no_prefill("draft")
    assert model.draft_prefill_time("draft", 85) == 0.0


def test_an_older_version_is_refused_so_a_replica_profiles_again():
    target = [0.13, 0.005, 0.0, 1e-6]
    old = {"version": 3, "knee": 4, "target": target, "draft_steps": {"d": [0.03, 0.0, 0.0]}}
    with pytest.raises(ValueError, match="version 3"):
        FittedCostModel.from_dict(old)
    old = {"version": 2, "knee": 4, "target": [0.13, 0.005, 0.0, 1e-6], "draft": {"d": [0.03, 0.0, 0.0]}}
    with pytest.raises(ValueError, match="version 2"):
        FittedCostModel.from_dict(old)
