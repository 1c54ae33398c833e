"""Settings -> engine objects: which proposers a replica loads, with which options and models."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from serve_app.builder import engine_config, model_pair, models_needed, proposer_options
from serve_app.config import Settings, build_settings
from serve_app.packs.store import ModelStore


class NoFetchStore(ModelStore):
    """The real pack catalogue; ``resolve`` answers a fake folder instead of fetching a pack."""

    def __init__(self) -> None:
        super().__init__(Path("/nonexistent-store"))
        self.resolved: list[str] = []

    def resolve(self, ref: str, fetch_missing: bool = True) -> Path:
        self.resolved.append(ref)
        return Path("/models") / ref


def test_method_self_with_no_draft_model() -> None:
    settings = Settings(model={"target": "t", "draft": None}, speculation={"method": "self"})
    options, method = proposer_options(settings, NoFetchStore())  # resolves no draft model
    assert method == "self"
    assert options["self"] == {"skip_layers": None, "min_confidence": 0.0}
    assert "draft" not in options and "ngram" in options  # n-gram: every replica loads it
    assert engine_config(settings, options, method).spec_method == "self"


def test_extra_proposers_and_their_options() -> None:
    settings = Settings(
        model={"draft": None},
        speculation={
            "method": "ngram",
            "extra_proposers": ["self"],
            "proposers": {"self": {"skip_layers": [3, 5]}},
        },
    )
    options, method = proposer_options(settings, NoFetchStore())
    assert method == "ngram" and options["self"]["skip_layers"] == [3, 5]
    plain_ngram, _ = proposer_options(Settings(speculation={"method": "ngram"}), NoFetchStore())
    assert "self" not in plain_ngram
    with pytest.raises(ValueError, match=r"needs a model: set model\.draft"):
        proposer_options(Settings(model={"draft": None}, speculation={"method": "draft"}), NoFetchStore())


def test_off_loads_the_free_proposers_but_decodes_plainly() -> None:
    options, method = proposer_options(Settings(speculation={"method": "off"}), NoFetchStore())
    assert method is None and list(options) == ["ngram"]


def test_draft_model_options_carry_its_folder_and_names() -> None:
    store = NoFetchStore()
    options, method = proposer_options(Settings(), store)
    assert method == "draft"
    draft = options["draft"]
    assert draft["model_path"] == "/models/qwen2.5-coder-0.5b-instruct"
    assert (draft["model_name"], draft["target_name"]) == (
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    )
    assert (draft["int8"], draft["head_tokens"]) == (True, 32768)
    assert store.resolved == ["qwen2.5-coder-0.5b-instruct"]


def test_a_default_draft_of_another_family_falls_back_with_one_warning(caplog) -> None:
    store = NoFetchStore()
    settings = build_settings({"model.target": "smollm2-135m-instruct"})
    with caplog.at_level(logging.WARNING, logger="serve_app.builder"):
        options, method = proposer_options(settings, store)
    assert method == "ngram" and "draft" not in options
    assert store.resolved == []  # decided from the pack catalogue: nothing downloaded
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "does not share the tokenizer" in warnings[0]
    assert model_pair(settings, method) == "smollm2-135m-instruct|-"


def test_an_explicit_draft_of_another_family_is_an_error_naming_both() -> None:
    settings = build_settings(
        {"model.target": "smollm2-135m-instruct", "model.draft": "qwen2.5-coder-0.5b-instruct"}
    )
    with pytest.raises(
        ValueError, match=r"qwen2\.5-coder-0\.5b-instruct does not share the tokenizer of target smollm2"
    ):
        proposer_options(settings, NoFetchStore())


def test_models_needed_follow_the_loaded_proposers() -> None:
    assert models_needed(Settings()) == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    assert models_needed(Settings(speculation={"method": "ngram"})) == ["qwen2.5-coder-1.5b-instruct"]
    extra = Settings(speculation={"method": "off", "extra_proposers": ["draft"]})
    assert models_needed(extra) == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    assert model_pair(Settings(), "draft") == "qwen2.5-coder-1.5b-instruct|qwen2.5-coder-0.5b-instruct"
