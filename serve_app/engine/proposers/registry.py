"""One registry of proposers, by name: the only place outside a proposer's own module that names it.

Each entry says what the rest of the code base needs to know about a proposer without importing
torch: its description, its options (a pydantic model: ``speculation.proposers.<name>`` in the
settings), the model it drafts with (the ``model.<role>`` setting, resolved by the store; None for
no model), what a policy assumes before any statistics exist (``cold_acceptance``), whether every
engine loads it (``always_load``: it costs nothing to keep) and the factory that builds it from a
:class:`ProposerContext`. Built-in factories are named by import path and imported when first
built, so that settings, the CLI and the HTTP layer can list proposers without loading torch.
Config choices, CLI choices, the k8s model list and the benchmark's methods all derive from here.

    register_proposer("echo", "repeats the last token", options=EchoOptions)(build_echo)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from pydantic import BaseModel

from serve_app.engine.proposers.options import (
    DraftModelOptions,
    HeadOptions,
    NgramOptions,
    NoOptions,
    SelfSpecOptions,
)

if TYPE_CHECKING:
    from serve_app.engine.proposers.base import Proposer


@dataclass(frozen=True)
class ProposerContext:
    """What a factory may use to build a proposer."""

    target: object  # the target model (serve_app.engine.model.DecoderModel)
    tokenizer: object  # the target's tokenizer
    max_slots: int  # KV slots of the target cache (a stateful proposer sizes its own to match)
    max_seq_len: int  # the longest sequence a slot holds
    # The proposer's options (its options model, dumped) plus, for a proposer with a model role,
    # ``model_path`` / ``model_name`` / ``target_name`` (for messages); read-only.
    options: Mapping[str, object] = field(default_factory=dict)
    # The target's KV cache (serve_app.engine.kv_cache.KVCache), for a proposer that drafts inside it
    # (self-speculation); None where the caller has none to share.
    target_cache: object | None = None
    target_path: Path | None = None  # the target's model folder (a proposer's stored calibration)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


ProposerFactory = Callable[[ProposerContext], "Proposer"]


class _Lazy:
    """A factory named ``"module:function"``, imported when first called."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.module = path.partition(":")[0]

    def __call__(self, context: ProposerContext) -> Proposer:
        module, _, attr = self.path.partition(":")
        return getattr(importlib.import_module(module), attr)(context)


@dataclass(frozen=True)
class ProposerSpec:
    """Everything known about a registered proposer (see the module docstring)."""

    name: str
    description: str
    factory: ProposerFactory
    options: type[BaseModel] = NoOptions
    model_role: str | None = None
    cold_acceptance: tuple[float, ...] | None = None
    always_load: bool = False
    # Drafts with heads trained on the target (a file `specserve train-heads` writes beside it):
    # tools run it only where asked, since a machine has it only after training.
    trained: bool = False

    @property
    def module(self) -> str:
        """The module that implements it."""
        return self.factory.module if isinstance(self.factory, _Lazy) else self.factory.__module__


# The registry itself; mutated only by ``register_proposer``.
_REGISTRY: dict[str, ProposerSpec] = {}


def register_proposer(
    name: str,
    description: str,
    *,
    options: type[BaseModel] = NoOptions,
    model_role: str | None = None,
    cold_acceptance: Sequence[float] | None = None,
    always_load: bool = False,
    trained: bool = False,
) -> Callable[[ProposerFactory | str], ProposerFactory | str]:
    """Decorator: register ``factory`` (a callable or ``"module:function"``) under ``name``.

    A name can be registered once (ValueError). ``cold_acceptance``: the conditional acceptance per
    draft position (the last repeats) a policy assumes before any statistics exist; None leaves it
    to the acceptance estimator's generic default.
    """
    if not isinstance(name, str) or not name.strip() or name != name.strip() or name in ("off", "auto"):
        raise ValueError(f"proposer name must be a non-empty string other than off/auto: {name!r}")
    if not isinstance(description, str) or not description.strip():
        raise ValueError(f"proposer {name!r} needs a one-line description")
    cold = None if cold_acceptance is None else tuple(float(r) for r in cold_acceptance)
    if cold is not None and (not cold or any(not 0.0 <= r <= 1.0 for r in cold)):
        raise ValueError(f"proposer {name!r}: cold_acceptance must be rates in [0, 1]: {cold_acceptance!r}")
    if not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise TypeError(f"proposer {name!r}: options must be a pydantic model class, got {options!r}")

    def decorator(factory: ProposerFactory | str) -> ProposerFactory | str:
        if name in _REGISTRY:
            raise ValueError(f"proposer {name!r} is already registered")
        built = _Lazy(factory) if isinstance(factory, str) else factory
        if not callable(built):
            raise TypeError(f"proposer {name!r}: factory must be callable, got {factory!r}")
        desc = " ".join(description.split())
        _REGISTRY[name] = ProposerSpec(name, desc, built, options, model_role, cold, always_load, trained)
        return factory

    return decorator


def create_proposer(name: str, context: ProposerContext) -> Proposer:
    """Build the proposer registered as ``name``; an unknown name is a ValueError listing the known."""
    from serve_app.engine.proposers.base import Proposer

    proposer = proposer_spec(name).factory(context)
    if not isinstance(proposer, Proposer):
        raise TypeError(
            f"the factory for proposer {name!r} returned {type(proposer).__name__}, not a Proposer"
        )
    return proposer


def proposer_spec(name: str) -> ProposerSpec:
    """The entry of ``name``; an unknown name is a ValueError listing the registered ones."""
    spec = _REGISTRY.get(name)
    if spec is None:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise ValueError(f"unknown proposer {name!r}; registered proposers: {known}")
    return spec


def registered_proposers() -> dict[str, str]:
    """Name -> one-line description of every registered proposer (a copy, in registration order)."""
    return {name: spec.description for name, spec in _REGISTRY.items()}


def proposer_specs() -> list[ProposerSpec]:
    """Every entry, in registration order (the built-ins first)."""
    return list(_REGISTRY.values())


def proposer_modules() -> dict[str, str]:
    """Name -> the module implementing it (the house test: names are spelled nowhere else)."""
    return {name: spec.module for name, spec in _REGISTRY.items()}


def cold_acceptance(names: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """Name -> the rates it registered as ``cold_acceptance``, for those of ``names`` that did."""
    return {n: e.cold_acceptance for n in names if (e := _REGISTRY.get(n)) and e.cold_acceptance is not None}


def fallback_proposer() -> str:
    """The first proposer that needs no model: what a replica drafts with when its default draft
    model cannot serve the target (another tokenizer)."""
    return next(spec.name for spec in _REGISTRY.values() if spec.model_role is None)


# ----------------------------------------------------------------------------- the built-ins

DEFAULT_PROPOSER = "draft"  # what `speculation.method` defaults to

register_proposer(
    "draft",
    "a smaller model of the same family drafts tokens autoregressively",
    options=DraftModelOptions,
    model_role="draft",
)("serve_app.engine.proposers.draft_model:build_draft_proposer")

register_proposer(
    "ngram",
    "prompt lookup: copy what followed the latest earlier match of the last n tokens",
    options=NgramOptions,
    # The conditional acceptance per draft position GIVEN A MATCH, pooled over every request of
    # the shipped Qwen traces (policies/traces, all workloads; tests/engine/test_registry.py checks
    # it). A lookup without a match is never asked to draft (lookahead), so this is what the
    # estimator learns; the generic default of 0.7 from position 0 is too high for a copied token.
    cold_acceptance=(0.63, 0.73, 0.78, 0.80, 0.80, 0.81, 0.82),
    always_load=True,
)("serve_app.engine.proposers.ngram:build_ngram_proposer")

register_proposer(
    "self",
    "the target drafts for itself through a subset of its layers (no second model)",
    options=SelfSpecOptions,
)("serve_app.engine.proposers.self_spec:build_self_spec_proposer")

register_proposer(
    "eagle",
    "a one-layer head trained on the target drafts from the target's own features (train-heads)",
    options=HeadOptions,
    # Measured on the 1.5B Qwen target's heads trained here on its own answers, drafts stopping
    # before an unsure token (BENCHMARKS.md, twenty-third session, the bench's six prompts, greedy).
    cold_acceptance=(0.71, 0.57, 0.5),
    trained=True,
)("serve_app.engine.proposers.eagle:build_eagle_proposer")

register_proposer(
    "medusa",
    "heads trained on the target read several tokens ahead off its last feature (train-heads)",
    options=HeadOptions,
    cold_acceptance=(0.47, 0.18, 0.03),  # measured as eagle's
    trained=True,
)("serve_app.engine.proposers.medusa:build_medusa_proposer")
