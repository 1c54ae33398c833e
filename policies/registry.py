"""One registry of policies, by name.

A policy module registers a factory with ``@register_policy(name, description)``; the engine builds
the configured one with ``create_policy(name, config)``. Adding a policy is one new module plus one
import in ``policies/__init__.py``; nothing else switches on policy names.

    @register_policy("plain", "never speculate")
    def _build(config: PolicyConfig) -> Policy:
        return PlainPolicy()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from policies.base import Policy

# The roles tools and the engine ask for by role, never by name (the names live here and in the
# policies' own modules only).
DEFAULT_POLICY = "goodput"  # the server's default: decides from the cost model and acceptance
PLAIN_POLICY = "plain"  # never speculates: the baseline of every comparison
FIXED_POLICY = "static"  # a fixed proposer at a fixed depth: what a benchmark of one method runs


@dataclass(frozen=True)
class PolicyConfig:
    """What a factory may use to build a policy (the server's settings for it)."""

    default_proposer: str | None = None  # None: the first proposer the replica loaded
    default_depth: int = 4  # the depth of fixed-depth policies, the start of adaptive ones
    max_depth: int = 8  # the policy's own cap (the step's max_depth and the request's also apply)
    # Policy-specific knobs (e.g. {"table": {1: 6, 8: 2}} for batch-threshold); read-only.
    params: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("default_depth", "max_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PolicyConfig.{name} must be an int >= 0, got {value!r}")
        if self.default_proposer is not None and (
            not isinstance(self.default_proposer, str) or not self.default_proposer.strip()
        ):
            raise ValueError(
                f"PolicyConfig.default_proposer must be a name or None: {self.default_proposer!r}"
            )
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def depth(self) -> int:
        """The default depth within the policy's own cap."""
        return min(self.default_depth, self.max_depth)

    def check_params(self, policy: str, known: Iterable[str]) -> None:
        """ValueError naming the unknown keys of ``params`` (a typo must not pass silently)."""
        known = set(known)
        unknown = sorted(str(key) for key in self.params if key not in known)
        if unknown:
            allowed = ", ".join(sorted(known)) or "(none)"
            raise ValueError(f"policy {policy!r}: unknown params {unknown}; known params: {allowed}")


PolicyFactory = Callable[[PolicyConfig], Policy]


@dataclass(frozen=True)
class _Entry:
    factory: PolicyFactory
    description: str
    uses_cost_model: bool


# The registry itself; mutated only by ``register_policy``.
_REGISTRY: dict[str, _Entry] = {}


def register_policy(
    name: str, description: str, *, uses_cost_model: bool = False
) -> Callable[[PolicyFactory], PolicyFactory]:
    """Decorator: register ``factory`` under ``name``. A name can be registered once (ValueError).

    ``uses_cost_model``: the policy reads ``StepView.cost``, so a replica profiles (or fetches) the
    cost model before serving with it."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"policy name must be a non-empty string without surrounding spaces: {name!r}")
    if not isinstance(description, str) or not description.strip():
        raise ValueError(f"policy {name!r} needs a one-line description")

    def decorator(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} is already registered")
        if not callable(factory):
            raise TypeError(f"policy {name!r}: factory must be callable, got {factory!r}")
        _REGISTRY[name] = _Entry(factory, " ".join(description.split()), uses_cost_model)
        return factory

    return decorator


def create_policy(name: str, config: PolicyConfig | None = None) -> Policy:
    """Build the policy registered as ``name``; an unknown name is a ValueError listing the known."""
    entry = _REGISTRY.get(name)
    if entry is None:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise ValueError(f"unknown policy {name!r}; registered policies: {known}")
    policy = entry.factory(config if config is not None else PolicyConfig())
    if not isinstance(policy, Policy):
        raise TypeError(f"the factory for policy {name!r} returned {type(policy).__name__}, not a Policy")
    return policy


def registered_policies() -> dict[str, str]:
    """Name -> one-line description of every registered policy (a copy, sorted by name)."""
    return {name: _REGISTRY[name].description for name in sorted(_REGISTRY)}


def policy_uses_cost_model(name: str) -> bool:
    """Whether the policy registered as ``name`` reads the cost model (unknown: ValueError)."""
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise ValueError(f"unknown policy {name!r}; registered policies: {known}")
    return _REGISTRY[name].uses_cost_model


def policy_modules() -> dict[str, str]:
    """Name -> the module that registered it (the house test: names are spelled nowhere else)."""
    return {name: entry.factory.__module__ for name, entry in _REGISTRY.items()}
