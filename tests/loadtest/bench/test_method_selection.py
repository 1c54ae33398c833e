"""Tests for `specserve bench`'s method selection and arguments (loadtest.bench.method_names, the
CLI), its prompts and machine readings, and the measuring functions on a tiny in-memory model."""

from __future__ import annotations

import pytest
import torch

from loadtest.bench import machine, methods, run, sweeps
from loadtest.bench.method_names import (
    Family,
    MethodName,
    draft_depth,
    engine_proposers,
    parse_method,
    select_methods,
)
from loadtest.catalogue import BENCH, KINDS
from serve_app.config import Settings
from specserve.cli import build_parser

OURS, D2, AS, HF = "specserve-plain", "specserve-draft-d2", "transformers-assisted", "transformers-plain"


def test_method_selection() -> None:
    assert select_methods(None, [4, 2]) == [
        OURS, "specserve-plain-noninvariant", "specserve-auto", D2, "specserve-draft-d4", "specserve-ngram",
        "specserve-self", "specserve-self-default", HF, AS, "transformers-lookup",
        "llama.cpp-plain"]  # fmt: skip
    assert select_methods(None, [2], no_transformers=True) == [
        OURS, "specserve-plain-noninvariant", "specserve-auto", D2, "specserve-ngram", "specserve-self",
        "specserve-self-default", "llama.cpp-plain"]  # fmt: skip
    # Any draft depth may be named; the order is the report's whatever the order asked in.
    assert select_methods([AS, "specserve-draft-d3", OURS], [2]) == [OURS, "specserve-draft-d3", AS]
    assert draft_depth("specserve-draft-d12") == 12 and draft_depth(OURS) is None
    assert draft_depth("specserve-draft-d0") is None
    with pytest.raises(ValueError, match="unknown methods nope"):
        select_methods(["nope"], [2])
    with pytest.raises(ValueError, match="no methods left"):
        select_methods([HF], [2], no_transformers=True)
    with pytest.raises(ValueError, match="--depths"):
        select_methods(None, [0])


def test_bench_arguments() -> None:
    args = build_parser().parse_args(["bench"])
    assert args.depths == [2, 4, 6, 8] and args.methods is None and args.sweep is None and not args.cost_curve
    args = build_parser().parse_args(
        ["bench", "--methods", OURS, D2, "--depths", "3", "--sweep", "1", "2", "--cost-curve", "--draft", "x"]
    )
    assert args.methods == [OURS, D2] and args.depths == [3] and args.sweep == [1, 2] and args.cost_curve
    assert args.draft_model == "x"


@pytest.mark.parametrize(("argv", "match"), [
    (["--kinds", "nope"], "no prompts"),
    (["--methods", "nope"], "unknown methods"),
    (["--sweep", "0", "--no-transformers"], "--sweep"),
])  # fmt: skip
def test_bad_arguments_fail_before_loading(argv: list[str], match: str) -> None:
    args = build_parser().parse_args(["bench", *argv])
    with pytest.raises(ValueError, match=match):
        run.run_bench(args, Settings())


def test_assisted_without_a_draft_fails_before_loading() -> None:
    args = build_parser().parse_args(["bench", "--methods", AS])
    with pytest.raises(ValueError, match="needs a draft model"):
        run.run_bench(args, Settings(model={"draft": None}))


def test_model_drafted_methods_without_their_model_fail_before_loading() -> None:
    args = build_parser().parse_args(["bench", "--methods", OURS, D2, "--no-transformers"])
    with pytest.raises(ValueError, match="'draft' needs a draft model"):
        run.run_bench(args, Settings(model={"draft": None}))


def test_method_names_are_parsed_from_the_registry() -> None:
    assert parse_method(D2) == MethodName(D2, Family.MODEL, "draft", 2)
    assert parse_method("specserve-ngram") == MethodName("specserve-ngram", Family.LOOKUP, "ngram")
    assert parse_method("specserve-self") == MethodName("specserve-self", Family.LAYERS, "self")
    assert parse_method("specserve-self-default").default_plan
    assert parse_method("specserve-self-d3") == MethodName("specserve-self-d3", Family.LAYERS, "self", 3)
    assert parse_method("specserve-ngram-d2") == MethodName("specserve-ngram-d2", Family.LOOKUP, "ngram", 2)
    for wrong in ("specserve-draft", "specserve-ngram-default", "specserve-draft-default", "specserve-nope"):
        assert parse_method(wrong) is None
    # A layer-skipping proposer at a depth of its own, when named, goes beside its other methods.
    asked = ["specserve-self-default", "transformers-lookup", "specserve-self-d3", OURS]
    assert select_methods(asked, [2]) == [
        OURS, "specserve-self-d3", "specserve-self-default", "transformers-lookup"]  # fmt: skip
    # The shared engine loads what the model-based and lookup methods name (self runs on its own).
    assert engine_proposers([OURS, "specserve-auto", D2, "specserve-ngram", "specserve-self", AS]) == [
        "draft", "ngram"]  # fmt: skip


def test_prompts_cover_the_kinds() -> None:
    assert {p.kind for p in BENCH} == set(KINDS)
    assert any(p.chat for p in BENCH) and any(not p.chat for p in BENCH)


def test_copy_bandwidth_is_positive() -> None:
    assert machine.measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, repeats=2) > 0


# ------------------------------------------------------------------------------------ tiny model
@pytest.fixture(scope="module")
def tiny_engine(tiny_tokenizer):
    from tests.conftest import make_tiny_engine, make_tiny_hf_model

    hf = make_tiny_hf_model(len(tiny_tokenizer), seed=0)
    # The target as its own draft: everything accepted.
    proposers = {"draft": {}, "ngram": {"max_ngram": 3, "min_ngram": 1}}
    return make_tiny_engine(hf, tiny_tokenizer, proposers=proposers, depth=4, slots=4, max_seq_len=256)


def test_our_methods_report_speculation(tiny_engine, tiny_tokenizer) -> None:
    ids = tiny_tokenizer("def add(a, b):")["input_ids"]
    plain = methods.specserve_method(tiny_engine, 12, OURS, "off").run(ids)
    drafted = methods.specserve_method(tiny_engine, 12, D2, "draft", 2).run(ids)
    assert len(plain.token_ids) == 12 and plain.drafted is None
    assert drafted.token_ids == plain.token_ids
    assert drafted.drafted == drafted.accepted > 0  # a self-draft is always right
    assert drafted.drafted <= 2 * drafted.spec_steps  # depth 2 per step
    # the draft's cost: every step that drafted called propose once, and took time there
    assert drafted.draft_calls >= drafted.spec_steps and drafted.draft_seconds > 0
    assert plain.draft_calls is None
    assert "propose" not in vars(tiny_engine.proposers["draft"])  # the timers are gone


def test_proposer_timers_leave_a_watcher_in_place() -> None:
    class Proposer:
        def propose(self, rows):
            return ["class"]

    proposer = Proposer()
    proposer.propose = lambda rows: ["watcher"]  # a test's own wrapper, as an instance attribute
    with methods.timed_proposers({"p": proposer}) as spent:
        assert proposer.propose([]) == ["watcher"] and spent[1] == 1
    assert proposer.propose([]) == ["watcher"] and spent[1] == 1


def test_measure_sweep_and_cost_curve_on_a_tiny_model(tiny_engine, tiny_tokenizer) -> None:
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ("def add(a, b):", "The quick brown fox")]
    sweep = sweeps.measure_sweep(tiny_engine, prompts, [1, 3], 8, 2, repeats=1, log=lambda _: None)
    assert [p.concurrency for p in sweep.points] == [1, 3]
    three = sweep.points[1].runs
    assert three["plain"][0].tokens == 24 and three["plain"][0].drafted == 0
    assert three["draft"][0].accepted == three["draft"][0].drafted > 0 and three["draft"][0].differs == 0
    assert tiny_engine.cache.num_free == 4  # every request finished and freed its slot
    with pytest.raises(ValueError, match="slots"):
        sweeps.measure_sweep(tiny_engine, prompts, [5], 8, 2, repeats=1)
    draft = tiny_engine.proposers["draft"].model
    curve = sweeps.measure_cost_curve(tiny_engine.model, draft, context=20, tokens=(1, 4), batches=(1, 2),
                                     repeats=2, log=lambda _: None)  # fmt: skip
    assert set(curve.target) == {1, 2} and set(curve.target[2]) == {1, 4}
    assert all(len(v) == 2 and min(v) > 0 for row in curve.target.values() for v in row.values())
    assert set(curve.draft) == {1, 2}


def test_the_sweep_runs_auto_on_an_engine_under_the_policy(tiny_engine, tiny_tokenizer) -> None:
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ("def add(a, b):", "The quick brown fox")]
    modes = ["plain", "auto"]
    with pytest.raises(ValueError, match="auto_engine"):
        sweeps.measure_sweep(tiny_engine, prompts, [2], 8, 2, repeats=1, modes=modes)
    policy = methods.auto_engine(tiny_engine, Settings())
    sweep = sweeps.measure_sweep(tiny_engine, prompts, [1, 2], 8, 2, repeats=1, modes=modes,
                                 log=lambda _: None, auto_engine=policy)  # fmt: skip
    for point in sweep.points:
        auto = point.runs["auto"][0]
        assert auto.differs == 0 and auto.tokens == 8 * point.concurrency
        assert sum(auto.by_proposer.values()) == auto.spec_steps > 0  # a self-draft: the policy drafts
        assert set(auto.by_proposer) <= set(tiny_engine.proposers)
    assert policy.cache.num_free == policy.config.max_slots


def test_a_method_may_name_a_weight_format() -> None:
    from loadtest.bench.method_names import Family, parse_method

    parsed = parse_method("specserve-draft-d4+q8")
    assert (parsed.family, parsed.proposer, parsed.depth, parsed.weight_format) == (
        Family.MODEL,
        "draft",
        4,
        "q8",
    )
    assert parse_method("specserve-plain+q8").family is Family.PLAIN
    assert parse_method("transformers-plain+q8") is None and parse_method("specserve-plain+int3") is None
    assert select_methods(["specserve-plain+q8", OURS], [2]) == [OURS, "specserve-plain+q8"]
