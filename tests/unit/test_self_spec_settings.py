"""Settings and command line of self-speculation: a replica with no draft model still speculates."""

from __future__ import annotations

import pytest

from serve_app.cli import _serve_settings, build_parser, engine_config
from serve_app.config import Settings


def test_method_self_with_no_draft_model() -> None:
    settings = Settings(model={"target": "t", "draft": None}, speculation={"method": "self"})
    config = engine_config(settings)  # resolves no draft model
    assert config.spec_method == "self"
    assert config.proposer_options["self"] == {"skip_layers": []}
    assert "draft" not in config.proposer_options


def test_self_spec_beside_another_method_and_explicit_skip() -> None:
    settings = Settings(model={"draft": None}, speculation={"method": "ngram", "self_spec": True,
                                                            "self_spec_skip": [3, 5]})  # fmt: skip
    config = engine_config(settings)
    assert config.spec_method == "ngram" and config.proposer_options["self"] == {"skip_layers": [3, 5]}
    assert "self" not in engine_config(Settings(speculation={"method": "ngram"})).proposer_options
    with pytest.raises(ValueError, match="needs a draft model"):
        engine_config(Settings(model={"draft": None}, speculation={"method": "draft"}))


def test_serve_and_generate_accept_method_self() -> None:
    args = build_parser().parse_args(["serve", "--method", "self", "--model", "t"])
    assert _serve_settings(args).speculation.method == "self"
    assert build_parser().parse_args(["generate", "--prompt", "x", "--method", "self"]).method == "self"
    args = build_parser().parse_args(["calibrate", "self-spec", "--model", "m", "--budget-s", "30"])
    assert (args.proposer, args.model, args.budget_s, args.max_depth) == ("self-spec", "m", 30.0, 6)
