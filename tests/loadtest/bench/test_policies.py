"""`specserve bench --policies` on tiny in-memory models: recording, exact matches, the tables."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from loadtest.bench.policies import DEFAULT_TRACES, cold_priors, cost_comparison, estimator_options
from loadtest.bench.policies_real import (
    RealRun,
    closed_loop,
    median_run,
    paired_ratio,
    policy_engine,
    real_markdown,
    rotated,
    run_real,
)
from loadtest.bench.policies_setup import real_policy
from loadtest.bench.policies_sim import run_simulation, simulation_markdown
from loadtest.bench.policies_traces import record_traces, teacher_forced_matches
from loadtest.catalogue import Prompt
from policies import FittedCostModel
from policies.traces import TraceSet
from serve_app.engine.engine import SpecEngine
from tests.conftest import make_tiny_engine, make_tiny_hf_model

PROMPTS = [
    Prompt("code", "add", "def add(a, b):", False),
    Prompt("prose", "fox", "The quick brown fox", False),
]


@pytest.fixture(scope="module")
def engine(tiny_tokenizer) -> SpecEngine:
    target_hf = make_tiny_hf_model(len(tiny_tokenizer), seed=0)
    draft_hf = make_tiny_hf_model(len(tiny_tokenizer), seed=0)
    with torch.no_grad():  # a draft that mostly, not always, agrees with the target
        gen = torch.Generator().manual_seed(1)
        for p in draft_hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.15 * p.std())
    return make_tiny_engine(target_hf, tiny_tokenizer, proposers=["draft", "ngram"], draft_hf=draft_hf,
                            method="draft", depth=4, max_depth=8, slots=4)  # fmt: skip


def test_teacher_forced_matches_agree_with_what_drafting_really_kept(engine) -> None:
    traces = record_traces(engine, PROMPTS, 24, depth=8, log=lambda _: None)
    assert [t.name for t in traces] == ["code/add", "prose/fox"]
    draft = engine.proposers["draft"].model
    for prompt, trace in zip(PROMPTS, traces, strict=True):
        assert set(trace.matches) == {"draft", "ngram"} and trace.output_len == 23
        ids = engine.encode_prompt(prompt.text)
        # a real run at the engine's depth keeps what the matches say it keeps
        depth = engine.config.spec_depth
        out = engine.generate([ids], _greedy(24), [_override("draft", depth)])[0]
        exact = teacher_forced_matches(draft, ids, out.token_ids)
        assert exact == trace.matches["draft"]
        g, kept_total = 0, 0
        while g < trace.output_len:
            kept = min(exact[g], depth, trace.output_len - g - 1)  # the engine's tokens-left cap
            g, kept_total = g + kept + 1, kept_total + kept
        assert out.spec_stats.accepted == kept_total
    values = [m for t in traces for m in t.matches["draft"]]
    assert 0 in values and any(m > 1 for m in values)  # the draft agrees sometimes, not always


def test_lookup_traces_replay_what_the_ngram_really_drafts_and_keeps(engine) -> None:
    traces = record_traces(engine, PROMPTS, 24, depth=8, log=lambda _: None)
    for prompt, trace in zip(PROMPTS, traces, strict=True):
        ids = engine.encode_prompt(prompt.text)
        matches, lengths = trace.matches["ngram"], trace.draftable["ngram"]
        assert len(lengths) == len(matches) == trace.output_len and "draft" not in trace.draftable
        # forced n-gram at depth 8 drafts exactly where the trace says it can and keeps its matches
        out = engine.generate([ids], _greedy(24), [_override("ngram", 8)])[0]
        g, kept_total, drafted_total = 0, 0, 0
        while g < trace.output_len:
            depth = min(lengths[g], 8, trace.output_len - g - 1)
            kept = min(matches[g], depth)
            g, kept_total, drafted_total = g + kept + 1, kept_total + kept, drafted_total + depth
        assert (out.spec_stats.drafted, out.spec_stats.accepted) == (drafted_total, kept_total)
    assert any(d == 0 for t in traces for d in t.draftable["ngram"])  # a lookup often finds nothing
    assert not engine.proposers["ngram"]._slots  # the replay released its slot


def _greedy(n: int):
    from serve_app.engine.params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _override(mode: str, depth: int):
    from serve_app.engine.params import SpecOverride

    return SpecOverride(mode, max_depth=depth)


def test_simulation_tables_cover_every_policy_and_the_mix(engine) -> None:
    traces = TraceSet("tiny+tiny", tuple(record_traces(engine, PROMPTS, 16, log=lambda _: None)))
    cost = FittedCostModel(draft={"draft": (0.03, 0.005, 0.0)})
    table = run_simulation(traces.traces, cost, [1, 4])
    assert {"plain", "static", "goodput", "bandit", "heuristic", "batch-threshold"} <= set(table.policies)
    assert all(table.rate[p][load] > 0 for p in table.policies for load in (1, 4))
    assert table.oracle[1][1] >= max(table.rate["plain"][1], table.rate["static"][1]) - 1e-9
    text = simulation_markdown(table, traces)
    assert "| 4 |" in text and "Mixed workload" in text and "oracle best single static" in text


def test_closed_loop_keeps_the_load_and_counts_every_token(engine) -> None:
    cost = FittedCostModel(draft={"draft": (0.03, 0.005, 0.0)})
    ids = [engine.encode_prompt(p.text) for p in PROMPTS] * 2
    for policy in ("plain", "static", "goodput"):
        run = closed_loop(policy_engine(engine, policy, cost), ids, 2, 10)
        assert run.tokens == 4 * 10 and run.seconds > 0
        assert (run.drafted == 0) == (policy == "plain") or policy == "goodput"  # goodput may stay plain
    assert engine.cache.num_free == engine.cache.num_slots  # every slot given back


def test_real_runs_interleave_the_policies_round_by_round(engine) -> None:
    order: list[str] = []
    results, mix = run_real(engine, PROMPTS, FittedCostModel(draft={"draft": (0.03, 0.005, 0.0)}), [1], 4,
                            ["plain", "static", "goodput"], 2, log=order.append)  # fmt: skip
    load_runs = [line.split(":")[0] for line in order if line.startswith("[real] load")]
    assert load_runs == [
        "[real] load 1 round 1 plain", "[real] load 1 round 1 static", "[real] load 1 round 1 goodput",
        "[real] load 1 round 2 static", "[real] load 1 round 2 goodput", "[real] load 1 round 2 plain",
    ]  # fmt: skip
    assert sum(line.startswith("[real] mix round") for line in order) == 6
    for runs in (*(r[1] for r in results.values()), *mix.values()):
        assert len(runs.rounds) == 2 and runs.rate in runs.rounds
    text = real_markdown(results, mix, 4, 2)
    assert "| 1 |" in text and "| mix |" in text and "paired" in text
    assert engine.cache.num_free == engine.cache.num_slots


def test_medians_and_paired_ratios_over_rounds() -> None:
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    runs = [RealRun("goodput", 1, tokens, 1.0, 0, 0) for tokens in (30, 10, 20)]
    middle = median_run(runs)
    assert middle.rate == 20 and middle.rounds == (30.0, 10.0, 20.0)
    # Round by round the other runs 10% slower in rounds 1 and 3, 50% faster in round 2 (a slow
    # spell hit goodput's turn): the paired ratio is the median of 1.1, 0.667, 1.1.
    other = replace(middle, policy="static", rounds=(30 / 1.1, 15.0, 20 / 1.1))
    assert paired_ratio(middle, other) == pytest.approx(1.1)
    assert paired_ratio(replace(middle, rounds=()), other) is None


def test_real_run_labels_name_a_policy_or_a_static_arm(engine) -> None:
    assert real_policy("goodput") == ("goodput", ("draft", 4))
    assert real_policy("static") == ("static", ("draft", 4))
    assert real_policy("draft d1") == ("static", ("draft", 1))
    arm = policy_engine(engine, "ngram d2", FittedCostModel())
    assert (arm.config.policy, arm.config.spec_method, arm.config.spec_depth) == ("static", "ngram", 2)


def test_estimator_options_parse_names_and_numbers() -> None:
    parsed = estimator_options(["pool_alpha=0.05", "prior_weight=4"])
    assert parsed == {"pool_alpha": 0.05, "prior_weight": 4.0}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        estimator_options(["pool_alpha"])
    with pytest.raises(ValueError, match="one of"):
        estimator_options(["speed=3"])
    with pytest.raises(ValueError, match="not a number"):
        estimator_options(["alpha=fast"])


def test_cost_comparison_sets_this_machine_beside_the_traces() -> None:
    traces = FittedCostModel((0.05, 0.001, 0.0, 0.0), knee=16, draft={"draft": (0.015, 0.001, 0.0)})
    here = FittedCostModel((0.10, 0.002, 0.0, 0.0), knee=16, draft={"draft": (0.030, 0.002, 0.0)})
    line = cost_comparison(traces, here, ["draft", "ngram"])
    assert "target 1 row(s) x 1 token(s)" in line and "draft step" in line
    assert "ngram" not in line  # free: no draft cost on either side
    here_ms = float(line.split("target 1 row(s) x 1 token(s) ")[1].split(" ms")[0])
    theirs_ms = float(line.split("(traces: ")[1].split(")")[0])
    assert here_ms == pytest.approx(2 * theirs_ms, rel=0.05)


def test_a_cold_simulation_starts_where_a_fresh_engine_does() -> None:
    """``--no-priors``: the traced proposers' registered cold acceptance, as SpecEngine seeds it."""
    from serve_app.engine.proposers.registry import proposer_spec

    traces = TraceSet.load(DEFAULT_TRACES).traces
    assert cold_priors(traces) == {("ngram", "*"): proposer_spec("ngram").cold_acceptance}
