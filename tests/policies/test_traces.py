"""Recorded traces: matches per position, the file format, replay, mixes, and the shipped file."""

from __future__ import annotations

from pathlib import Path

import pytest

import policies
from policies import PolicyConfig, create_policy
from policies.cost_model import FittedCostModel
from policies.simulate import Phase, Trace, replay, simulate, simulate_mix
from policies.traces import RecordedTrace, StepRecord, TraceSet, acceptance_priors, matches_from_steps
from tests.policies.helpers import qwen_cpu_cost

SHIPPED = Path(policies.__file__).parent / "traces" / "qwen2.5-coder-1.5b-0.5b-cpu.json"


def test_matches_fill_the_positions_a_step_skipped():
    # step at 0 kept 3 (emitted 4: positions 0..3), step at 4 kept 0, step at 5 kept 8 of 8
    steps = [StepRecord(0, 8, 3), StepRecord(4, 8, 0), StepRecord(5, 8, 8)]
    assert matches_from_steps(steps, 12) == (3, 2, 1, 0, 0, 8, 7, 6, 5, 4, 3, 2)


def test_acceptance_priors_pool_the_conditional_rates_per_proposer_and_workload():
    traces = [
        RecordedTrace("code/a", "code", 5, 4, {"draft": (3, 2, 1, 0), "ngram": (0, 0, 0, 0)}),
        RecordedTrace("code/b", "code", 5, 2, {"draft": (1, 0)}),
        RecordedTrace("prose/c", "prose", 5, 2, {"draft": (0, 0)}),
    ]
    priors = acceptance_priors(traces, 5)
    # code/draft: starts with m = 3, 2, 1, 0, 1, 0 -> a_0 = 4/6; reached 1: m >= 1 (4), accepted m > 1
    # (2) -> a_1 = 2/4; a_2 = 1/2; a_3 = 0/1 (the run of 3 stops there); 4 never reached: repeats a_3
    assert priors[("draft", "code")] == pytest.approx((4 / 6, 2 / 4, 1 / 2, 0.0, 0.0))
    assert priors[("ngram", "code")] == (0.0,) * 5
    assert priors[("draft", "prose")] == (0.0,) * 5
    assert set(priors) == {("draft", "code"), ("ngram", "code"), ("draft", "prose")}


def test_a_lookup_s_priors_count_only_the_drafts_it_could_make():
    # n-gram with draft lengths: no match at positions 1 and 2, a 2-token match at 0 (kept 1)
    trace = RecordedTrace("code/a", "code", 5, 4, {"ngram": (1, 0, 0, 2)}, {"ngram": (2, 0, 0, 3)})
    priors = acceptance_priors([trace], 3)
    # position 0 reached at g = 0 and 3 (accepted both); position 1 at 0 (rejected) and 3 (kept);
    # position 2 only at g = 3 (m = 2 reaches it, d = 3 > 2): rejected
    assert priors[("ngram", "code")] == pytest.approx((1.0, 0.5, 0.0))
    with pytest.raises(ValueError, match="exceed"):
        RecordedTrace.from_dict({"name": "x", "workload": "code", "prompt_len": 1, "output_len": 2,
                                 "matches": {"ngram": [2, 0]}, "draftable": {"ngram": [1, 0]}})  # fmt: skip


def test_the_simulator_gives_the_policy_what_a_lookup_can_draft():
    # n-gram matches everywhere it can draft, but can draft only every other position
    lengths = tuple(4 if g % 2 == 0 else 0 for g in range(40))
    matches = tuple(min(4, d) for d in lengths)
    trace = Trace("code", 10, 40, matches={"ngram": matches, "draft": (2,) * 40},
                  draftable={"ngram": lengths})  # fmt: skip
    cost = qwen_cpu_cost()
    forced = simulate(create_policy("static", PolicyConfig("ngram", 4, 8)), [trace], cost, 1)
    assert forced.drafted["ngram"] == forced.accepted["ngram"] > 0  # never drafted where it could not
    goodput = simulate(create_policy("goodput", PolicyConfig(max_depth=8)), [trace], cost, 1)
    assert goodput.drafted["draft"] > 0 and goodput.drafted["ngram"] > 0


def test_priors_reach_the_simulated_policy():
    # A cold estimator (default 0.7, decaying) drafts shallower than one told the class accepts all.
    trace = [Trace("code", 100, 96, {"draft": (1.0,)})] * 2
    cold = simulate(create_policy("goodput", PolicyConfig(max_depth=8)), trace, qwen_cpu_cost(), 1)
    warm = simulate(create_policy("goodput", PolicyConfig(max_depth=8)), trace, qwen_cpu_cost(), 1,
                    priors={("draft", "code"): (1.0,) * 8})  # fmt: skip
    assert warm.mean_draft_depth > cold.mean_draft_depth
    assert warm.tokens_per_second > cold.tokens_per_second


def test_trace_set_round_trips(tmp_path):
    traces = (RecordedTrace("code/a", "code", 12, 5, {"draft": (2, 1, 0, 4, 3), "ngram": (0, 1, 0, 0, 0)},
                            {"ngram": (0, 3, 1, 0, 2)}),)  # fmt: skip
    original = TraceSet("t+d", traces, {"target": [0.1, 0, 0, 0], "knee": 4, "draft": {}}, "notes")
    original.save(tmp_path / "t.json")
    assert TraceSet.load(tmp_path / "t.json") == original
    (tmp_path / "bad.json").write_text('{"format": 99, "model_pair": "x", "traces": []}')
    with pytest.raises(ValueError, match="format"):
        TraceSet.load(tmp_path / "bad.json")


def test_replay_keeps_min_of_match_and_depth_exactly():
    # matches as a depth-8 recording would give them; a depth-2 policy keeps min(match, 2)
    trace = Trace("code", 10, 12, matches={"draft": (3, 2, 1, 0, 0, 8, 7, 6, 5, 4, 3, 2)})
    policy = create_policy("static", PolicyConfig(default_proposer="draft", default_depth=2))
    result = simulate(policy, [trace], qwen_cpu_cost(), 1, include_prefill=False)
    # g=0: keep 2 (emit 3) -> g=3: match 0, emit 1 -> g=4: 0, emit 1 -> g=5: keep 2 -> g=8: keep 2
    # -> g=11: one token left, so no draft (limits): plain
    assert result.accepted["draft"] == 2 + 0 + 0 + 2 + 2
    assert result.tokens == 12 and result.steps == 6


def test_a_mix_carries_one_policy_through_its_phases():
    traces = [Trace("code", 50, 20, matches={"draft": (4,) * 20}) for _ in range(4)]
    cost = qwen_cpu_cost()
    policy = create_policy("plain")
    phases = [Phase(traces[:2], 1), Phase(traces, 4)]
    mixed = simulate_mix(policy, phases, cost, proposers=("draft",))
    parts = [
        simulate(create_policy("plain"), p.traces, cost, p.concurrency, proposers=("draft",)) for p in phases
    ]
    assert mixed.tokens == sum(p.tokens for p in parts) == 120
    assert mixed.seconds == pytest.approx(sum(p.seconds for p in parts))


def test_the_shipped_qwen_traces_cover_every_kind_and_proposer():
    traces = TraceSet.load(SHIPPED)
    kinds = {t.name.split("/")[0] for t in traces.traces}
    assert kinds == {"code", "json", "chat", "prose"}
    assert all({"draft", "ngram"} <= set(t.matches) for t in traces.traces)
    assert all(len(m) == t.output_len for t in traces.traces for m in t.matches.values())
    assert traces.cost_model["target"][0] > 0 and "draft" in traces.cost_model["draft_steps"]
    # the recorded cost model is in this version's layout (`specserve bench --policies` replays it)
    assert FittedCostModel.from_dict(traces.cost_model).draft_time("draft", 1, 100) > 0

    # the draft model agrees with the target far more on code than on prose
    def mean_match(kind: str) -> float:
        values = [x for t in traces.traces if t.name.startswith(kind) for x in t.matches["draft"]]
        return sum(values) / len(values)

    assert mean_match("code") > mean_match("prose")
    assert len(replay(traces.traces)) == len(traces.traces)
