"""One registry of proposers, by name.

A proposer module registers a factory with ``@register_proposer(name, description)``; the engine
builds one with ``create_proposer(name, context)``. Nothing else in the code base switches on
proposer types: adding a proposer is one new module plus one import in ``proposers/__init__.py``.

    @register_proposer("ngram", "prompt lookup: copy what followed the last match of the suffix")
    def _build(context: ProposerContext) -> Proposer:
        return NgramProposer.from_options(context.options)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from serve_app.engine.proposers.base import Proposer


@dataclass(frozen=True)
class ProposerContext:
    """What a factory may use to build a proposer."""

    target: object  # the target model (serve_app.engine.model.DecoderModel)
    tokenizer: object  # the target's tokenizer
    max_slots: int  # KV slots of the target cache (a stateful proposer sizes its own to match)
    max_seq_len: int  # the longest sequence a slot holds
    # Proposer-specific settings (e.g. {"draft_path": ...} or {"max_ngram": 4}); read-only.
    options: Mapping[str, object] = field(default_factory=dict)
    # The target's KV cache (serve_app.engine.kv_cache.KVCache), for a proposer that drafts inside it
    # (self-speculation); None where the caller has none to share.
    target_cache: object | None = None
    target_path: Path | None = None  # the target's model folder (a proposer's stored calibration)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


ProposerFactory = Callable[[ProposerContext], Proposer]


@dataclass(frozen=True)
class _Entry:
    factory: ProposerFactory
    description: str
    cold_acceptance: tuple[float, ...] | None


# The registry itself; mutated only by ``register_proposer``.
_REGISTRY: dict[str, _Entry] = {}


def register_proposer(
    name: str, description: str, cold_acceptance: Sequence[float] | None = None
) -> Callable[[ProposerFactory], ProposerFactory]:
    """Decorator: register ``factory`` under ``name``. A name can be registered once (ValueError).

    ``cold_acceptance``: the conditional acceptance per draft position (the last repeats) that a
    policy assumes for this proposer before any statistics exist (a fresh cluster, a workload never
    seen); None leaves it to the acceptance estimator's generic default. A proposer whose drafts
    differ in kind from a model's (an n-gram lookup mostly finds nothing) says what it knows here.
    """
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"proposer name must be a non-empty string without surrounding spaces: {name!r}")
    if not isinstance(description, str) or not description.strip():
        raise ValueError(f"proposer {name!r} needs a one-line description")
    cold = None if cold_acceptance is None else tuple(float(r) for r in cold_acceptance)
    if cold is not None and (not cold or any(not 0.0 <= r <= 1.0 for r in cold)):
        raise ValueError(f"proposer {name!r}: cold_acceptance must be rates in [0, 1]: {cold_acceptance!r}")

    def decorator(factory: ProposerFactory) -> ProposerFactory:
        if name in _REGISTRY:
            raise ValueError(f"proposer {name!r} is already registered")
        if not callable(factory):
            raise TypeError(f"proposer {name!r}: factory must be callable, got {factory!r}")
        _REGISTRY[name] = _Entry(factory, " ".join(description.split()), cold)
        return factory

    return decorator


def create_proposer(name: str, context: ProposerContext) -> Proposer:
    """Build the proposer registered as ``name``; an unknown name is a ValueError listing the known."""
    entry = _REGISTRY.get(name)
    if entry is None:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise ValueError(f"unknown proposer {name!r}; registered proposers: {known}")
    proposer = entry.factory(context)
    if not isinstance(proposer, Proposer):
        raise TypeError(
            f"the factory for proposer {name!r} returned {type(proposer).__name__}, not a Proposer"
        )
    return proposer


def registered_proposers() -> dict[str, str]:
    """Name -> one-line description of every registered proposer (a copy, sorted by name)."""
    return {name: _REGISTRY[name].description for name in sorted(_REGISTRY)}


def cold_acceptance(names: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """Name -> the rates it registered as ``cold_acceptance``, for those of ``names`` that did."""
    return {n: e.cold_acceptance for n in names if (e := _REGISTRY.get(n)) and e.cold_acceptance is not None}
