"""The policy registry: one place that maps names to factories; PolicyConfig validation."""

from __future__ import annotations

import pytest

from policies import DEFAULT_POLICY, Policy, PolicyConfig, create_policy, register_policy, registered_policies
from policies import registry as registry_module
from policies.plain import PlainPolicy

BUILTIN = {"plain", "static", "batch-threshold", "heuristic", "goodput", "bandit"}


@pytest.fixture
def scratch_registry(monkeypatch):
    """Register test policies in a copy, so the real registry stays as the package built it."""
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))


def test_builtin_policies_are_registered_with_one_line_descriptions():
    names = registered_policies()
    assert set(names) == BUILTIN
    assert all(text and "\n" not in text for text in names.values())
    assert list(names) == sorted(names)
    assert DEFAULT_POLICY == "goodput"


def test_registered_policies_is_a_copy():
    registered_policies().clear()
    assert set(registered_policies()) == BUILTIN


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_builtin_builds_from_the_default_config(name):
    policy = create_policy(name, PolicyConfig(default_proposer="draft"))
    assert isinstance(policy, Policy)
    assert policy.name == name
    assert create_policy(name).name == name  # config optional


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown policy 'nope'") as info:
        create_policy("nope", PolicyConfig())
    for name in BUILTIN:
        assert name in str(info.value)


def test_duplicate_name_is_an_error(scratch_registry):
    with pytest.raises(ValueError, match="already registered"):
        register_policy("plain", "again")(lambda config: PlainPolicy())


def test_register_and_create_a_new_policy(scratch_registry):
    seen = []

    @register_policy("mine", "a test policy")
    def build(config: PolicyConfig) -> Policy:
        seen.append(config)
        return PlainPolicy()

    assert registered_policies()["mine"] == "a test policy"
    config = PolicyConfig(default_depth=3, params={"x": 1})
    assert isinstance(create_policy("mine", config), PlainPolicy)
    assert seen == [config]


@pytest.mark.parametrize(("name", "description"), [("", "d"), (" x", "d"), ("x", ""), (None, "d")])
def test_bad_names_and_descriptions(scratch_registry, name, description):
    with pytest.raises(ValueError):
        register_policy(name, description)


def test_factory_must_return_a_policy(scratch_registry):
    register_policy("broken", "returns a string")(lambda config: "not a policy")
    with pytest.raises(TypeError, match="not a Policy"):
        create_policy("broken", PolicyConfig())


def test_config_is_validated_and_read_only():
    with pytest.raises(ValueError, match="default_depth"):
        PolicyConfig(default_depth=-1)
    with pytest.raises(ValueError, match="max_depth"):
        PolicyConfig(max_depth=True)
    with pytest.raises(ValueError, match="default_proposer"):
        PolicyConfig(default_proposer=" ")
    config = PolicyConfig(default_depth=12, max_depth=6, params={"table": {1: 2}})
    assert config.depth == 6
    with pytest.raises(TypeError):
        config.params["table"] = {}  # type: ignore[index]


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_unknown_params_are_an_error_naming_them(name):
    with pytest.raises(ValueError, match="tabel"):
        create_policy(name, PolicyConfig(params={"tabel": {1: 4}}))
