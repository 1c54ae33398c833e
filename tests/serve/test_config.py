"""Settings: one builder for every shape of overrides; choices come from the registries."""

from __future__ import annotations

import pytest

from serve_app.config import Settings, build_settings


def test_build_settings_takes_nested_dotted_underscored_and_bare_keys() -> None:
    settings = build_settings(
        {"model": {"target": "x"}, "cache.max_slots": "4", "server__port": 9000, "max_seq_len": 256}
    )
    assert settings.model.target == "x" and settings.model.draft == Settings().model.draft
    assert (settings.cache.max_slots, settings.cache.max_seq_len, settings.server.port) == (4, 256, 9000)
    deep = build_settings({"speculation.proposers.ngram.max_ngram": 6})
    assert deep.speculation.proposers.ngram.max_ngram == 6


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"cache": {"max_slots": 0}}, r"cache\.max_slots"),
        ({"model": {"bogus": 1}}, "bogus"),
        ({"nonsense": 1}, "nonsense"),
        ({"speculation.method": "telepathy"}, "unknown method 'telepathy'"),
        ({"speculation.policy": "oracle"}, "unknown policy 'oracle'"),
        ({"speculation.extra_proposers": ["nope"]}, "unknown proposers"),
        ({"speculation.proposers.ngram.max_ngrams": 3}, "max_ngrams"),
        ({"speculation.proposers.ngram": {"max_ngram": 2, "min_ngram": 3}}, "min_ngram"),
    ],
)
def test_bad_settings_are_value_errors_naming_the_field(overrides, named) -> None:
    with pytest.raises(ValueError, match=named):
        build_settings(overrides)


def test_environment_applies_unless_asked_not_to(monkeypatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE__MAX_SLOTS", "3")
    monkeypatch.setenv("SPECSERVE_SPECULATION__PROPOSERS__DRAFT__INT8", "false")
    settings = build_settings()
    assert settings.cache.max_slots == 3 and settings.speculation.proposers.draft.int8 is False
    assert (
        build_settings(environment=False).cache.max_slots
        == Settings.model_fields["cache"].default_factory().max_slots
    )


def test_loaded_proposers_are_method_extras_then_the_always_loaded() -> None:
    spec = Settings(speculation={"method": "self", "extra_proposers": ["draft"]}).speculation
    assert spec.loaded_proposers() == ["self", "draft", "ngram"]
    assert Settings(speculation={"method": "off"}).speculation.loaded_proposers() == ["ngram"]
