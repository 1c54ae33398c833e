"""The proposer registry: one place that maps names to factories."""

from __future__ import annotations

import pytest

from serve_app.engine.proposers import registry as registry_module
from serve_app.engine.proposers.base import Draft, Proposer
from serve_app.engine.proposers.ngram import NgramProposer
from serve_app.engine.proposers.options import NgramOptions
from serve_app.engine.proposers.registry import (
    ProposerContext,
    create_proposer,
    fallback_proposer,
    proposer_spec,
    proposer_specs,
    register_proposer,
    registered_proposers,
)

NGRAM_COLD = proposer_spec("ngram").cold_acceptance


def context(**options) -> ProposerContext:
    return ProposerContext(target=None, tokenizer=None, max_slots=4, max_seq_len=512, options=options)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Register test proposers in a copy, so the real registry stays as the package built it."""
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))


class _Echo:
    name = "echo"

    def __init__(self, ctx: ProposerContext) -> None:
        self.ctx = ctx

    def admit(self, slot, prompt_ids):
        pass

    def propose(self, rows):
        return [Draft(tokens=[]) for _ in rows]

    def commit(self, slot, num_accepted):
        pass

    def release(self, slot):
        pass


def test_builtin_names_include_ngram():
    names = registered_proposers()
    assert "ngram" in names
    assert names["ngram"] and "\n" not in names["ngram"]


def test_registered_proposers_is_a_copy():
    registered_proposers().clear()
    assert "ngram" in registered_proposers()


def test_create_ngram_from_context_options():
    proposer = create_proposer("ngram", context(max_ngram=3, min_ngram=1))
    assert isinstance(proposer, NgramProposer)
    assert isinstance(proposer, Proposer)
    assert (proposer.max_ngram, proposer.min_ngram) == (3, 1)
    default = create_proposer("ngram", context())
    assert (default.max_ngram, default.min_ngram) == (4, 2)


def test_unknown_name_lists_registered_names():
    with pytest.raises(ValueError, match="nope") as info:
        create_proposer("nope", context())
    assert "ngram" in str(info.value)


def test_duplicate_registration_raises(scratch_registry):
    register_proposer("echo", "test proposer")(_Echo)
    with pytest.raises(ValueError, match="already registered"):
        register_proposer("echo", "again")(_Echo)
    with pytest.raises(ValueError, match="already registered"):
        register_proposer("ngram", "shadowing a built-in")(_Echo)


def test_registered_factory_receives_the_context(scratch_registry):
    register_proposer("echo", "test proposer")(_Echo)
    assert registered_proposers()["echo"] == "test proposer"
    ctx = context(answer=42)
    proposer = create_proposer("echo", ctx)
    assert isinstance(proposer, _Echo) and proposer.ctx is ctx


def test_factory_must_return_a_proposer(scratch_registry):
    register_proposer("broken", "returns the wrong thing")(lambda ctx: object())
    with pytest.raises(TypeError, match="broken"):
        create_proposer("broken", context())


def test_bad_names_and_descriptions(scratch_registry):
    for name in ("", " ngram2", None):
        with pytest.raises(ValueError):
            register_proposer(name, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="description"):
        register_proposer("nodesc", "  ")


def test_context_options_are_read_only():
    ctx = context(max_ngram=4)
    with pytest.raises(TypeError):
        ctx.options["max_ngram"] = 5  # type: ignore[index]


def test_cold_acceptance_is_what_a_proposer_registered():
    from serve_app.engine.proposers.registry import cold_acceptance

    # ngram declares its own (its acceptance given a match, pooled over the shipped traces); the
    # draft model and unknown names leave it to the estimator's default.
    assert NGRAM_COLD is not None
    assert cold_acceptance(["draft", "ngram", "no-such"]) == {"ngram": NGRAM_COLD}


def test_ngram_cold_acceptance_is_the_shipped_traces_pooled_acceptance_given_a_match():
    from dataclasses import replace
    from pathlib import Path

    import policies
    from policies.traces import TraceSet, acceptance_priors

    shipped = Path(policies.__file__).parent / "traces" / "qwen2.5-coder-1.5b-0.5b-cpu.json"
    traces = TraceSet.load(shipped).traces
    assert all("ngram" in t.draftable for t in traces)  # recorded with its lookahead
    pooled = acceptance_priors([replace(t, workload="*") for t in traces], len(NGRAM_COLD))
    assert pooled[("ngram", "*")] == pytest.approx(NGRAM_COLD, abs=0.006)


@pytest.mark.parametrize("rates", [(), (0.5, 1.5), (-0.1,)])
def test_cold_acceptance_must_be_rates(scratch_registry, rates):
    with pytest.raises(ValueError, match="cold_acceptance"):
        register_proposer("odd", "a proposer with impossible rates", cold_acceptance=rates)(_Echo)
    assert "odd" not in registered_proposers()


def test_each_builtin_says_its_options_model_and_module():
    specs = {spec.name: spec for spec in proposer_specs()}
    assert specs["ngram"].options is NgramOptions and specs["ngram"].always_load
    assert specs["draft"].model_role == "draft"  # the model.draft setting names its model
    assert specs["self"].model_role is None
    assert specs["ngram"].module == "serve_app.engine.proposers.ngram"


def test_fallback_is_the_first_proposer_without_a_model():
    assert fallback_proposer() == "ngram"


def test_unknown_name_lists_the_registered():
    with pytest.raises(ValueError, match="registered proposers: draft, eagle, medusa, ngram, self"):
        proposer_spec("nope")


def test_options_are_validated():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramOptions(max_ngram=2, min_ngram=3)
    with pytest.raises(TypeError, match="pydantic model"):
        register_proposer("bad-options", "x", options=dict)  # type: ignore[arg-type]
