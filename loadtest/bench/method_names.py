"""The methods of ``specserve bench``, by name: derived from the proposer registry, parsed generically.

- ``specserve-plain``: our engine, speculation off; the reference for speedups and output identity.
- ``specserve-auto``: our engine as the server runs it: requests say "auto", the configured policy
  picks proposer and depth every step.
- ``specserve-<proposer>-d<k>``: a proposer that drafts with a model of its own (a ``model_role``
  in the registry: the draft model), ``k`` tokens per step, for each k of ``--depths`` (any k >= 1
  when named).
- ``specserve-<proposer>``: a proposer without a model that is not layer-skipping (a lookup: the
  n-gram; a trained head: EAGLE, Medusa), at the settings' depth; ``specserve-<proposer>-d<k>``
  when named: at depth k.
- ``specserve-auto-t<n>``: "auto" with every request's tree budget n (``-t0``: chains only).
- ``...-t<n>`` after a proposer's method (``specserve-draft-d4-t4``, ``specserve-ngram-t4``): the
  same with token trees of up to ``n`` alternatives beside the chain (``engine.tree``), for a
  proposer that branches; only when named.
- ``specserve-<proposer>``, ``specserve-<proposer>-default``: a layer-skipping proposer
  (self-speculation) with the skip set a replica resolves and with the default one, each at its
  calibrated depth (``loadtest.bench.self_spec``); ``specserve-<proposer>-d<k>`` when named: the
  resolved set at depth k.
- ``transformers-plain``, ``transformers-assisted``, ``transformers-lookup``: `generate`
  (``loadtest.bench.transformers_methods``); the assistant is the model of the first proposer that
  drafts with one.

The report lists methods in that order (proposers in registration order).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from serve_app.engine.proposers.registry import proposer_spec, proposer_specs, registered_proposers
from serve_app.engine.weights import WEIGHT_FORMATS

PREFIX = "specserve-"
PLAIN, AUTO = "specserve-plain", "specserve-auto"
# Plain decoding with batch invariance off (runtime.batch_invariant): what exactness costs.
NONINVARIANT = "specserve-plain-noninvariant"
DEFAULT_PLAN = "default"  # the suffix of a layer-skipping proposer's default skip set
ASSISTED = "transformers-assisted"
TRANSFORMERS = ("transformers-plain", ASSISTED, "transformers-lookup")
LLAMA_CPP = "llama.cpp-plain"  # the peer on the pack's own GGUF (loadtest.bench.llama_cpp)
_DEPTH = re.compile(r"d([1-9][0-9]*)")
_TREE = re.compile(r"(.*?)-?t(0|[1-9][0-9]*)")  # a trailing ``-t<n>``: a tree budget


class Family(Enum):
    """What a method runs; the values give the report order."""

    PLAIN = 1  # our engine, speculation off (also without batch invariance: NONINVARIANT)
    AUTO = 2  # our engine, the configured policy decides
    MODEL = 3  # a proposer drafting with a model, at the depth its name gives
    LOOKUP = 4  # a proposer without a model, at the settings' depth
    LAYERS = 5  # a layer-skipping proposer on an engine of its own
    TRANSFORMERS = 6  # `transformers` `generate`
    PEER = 7  # another engine: llama.cpp on the same GGUF


@dataclass(frozen=True)
class MethodName:
    """A method name, parsed."""

    name: str
    family: Family
    proposer: str | None = None
    depth: int | None = None  # the k of ``-d<k>``
    default_plan: bool = False  # ``-default``: a layer-skipping proposer's default skip set
    weight_format: str | None = None  # ``+<format>``: the target's weights in that format
    tree_nodes: int | None = None  # the n of ``-t<n>``: token trees of up to n alternatives


# ------------------------------------------------------------------------------------ the registry
def model_proposers() -> list[str]:
    """Registered proposers that draft with a model of their own (they name a model role)."""
    return [s.name for s in proposer_specs() if s.model_role]


def layer_skipping_proposers() -> list[str]:
    """Registered proposers that draft through the target's own layers (built where
    ``SelfSpecProposer`` lives)."""
    from serve_app.engine.proposers.self_spec import SelfSpecProposer

    return [s.name for s in proposer_specs() if s.module == SelfSpecProposer.__module__]


def lookup_proposers() -> list[str]:
    """Registered proposers without a model that are not layer-skipping (the n-gram lookup)."""
    skipping = set(layer_skipping_proposers())
    return [s.name for s in proposer_specs() if not s.model_role and s.name not in skipping]


def assistant_role() -> str | None:
    """The model role of the first proposer that drafts with a model: transformers' assistant."""
    return next((s.model_role for s in proposer_specs() if s.model_role), None)


# ------------------------------------------------------------------------------------ names
def parse_method(name: str) -> MethodName | None:
    """``name`` parsed (see the module docstring), None when it names no method. Any of our methods
    may end in ``+<weight format>`` (e.g. ``specserve-plain+q8``): the same on the target in that
    format (``runtime.weight_format``)."""
    base, plus, weights = name.partition("+")
    if plus:
        parsed = parse_method(base)
        ours = parsed is not None and parsed.family not in (Family.TRANSFORMERS, Family.PEER)
        return (
            replace(parsed, name=name, weight_format=weights) if ours and weights in WEIGHT_FORMATS else None
        )
    if name in (PLAIN, NONINVARIANT):
        return MethodName(name, Family.PLAIN)
    if name == AUTO:
        return MethodName(name, Family.AUTO)
    if name.startswith(AUTO + "-") and (tree := _TREE.fullmatch(name.removeprefix(AUTO + "-"))):
        return MethodName(name, Family.AUTO, tree_nodes=int(tree.group(2))) if not tree.group(1) else None
    if name in TRANSFORMERS:
        return MethodName(name, Family.TRANSFORMERS)
    if name == LLAMA_CPP:
        return MethodName(name, Family.PEER)
    if not name.startswith(PREFIX):
        return None
    rest = name.removeprefix(PREFIX)
    models, skipping = set(model_proposers()), set(layer_skipping_proposers())
    for proposer in sorted(registered_proposers(), key=len, reverse=True):
        family = Family.MODEL if proposer in models else Family.LOOKUP
        family = Family.LAYERS if proposer in skipping else family
        if rest == proposer:
            return None if family is Family.MODEL else MethodName(name, family, proposer)
        suffix = rest.removeprefix(proposer + "-")
        if suffix == rest:
            continue
        nodes = None
        if (tree := _TREE.fullmatch(suffix)) and family is not Family.LAYERS and _branches(proposer):
            suffix, nodes = tree.group(1), int(tree.group(2))
            if not suffix and family is Family.LOOKUP:
                return MethodName(name, family, proposer, tree_nodes=nodes)
        if match := _DEPTH.fullmatch(suffix):
            return MethodName(name, family, proposer, int(match.group(1)), tree_nodes=nodes)
        if suffix == DEFAULT_PLAN and family is Family.LAYERS:
            return MethodName(name, family, proposer, default_plan=True)
    return None


def _branches(proposer: str) -> bool:
    """Whether the proposer's class drafts token trees (``proposers.base.branches``)."""
    import importlib

    from serve_app.engine.proposers.base import branches

    module = importlib.import_module(proposer_spec(proposer).module)
    classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
    return any(branches(c) for c in classes)


def draft_depth(method: str) -> int | None:
    """k of ``specserve-<proposer>-d{k}``, else None."""
    parsed = parse_method(method)
    return parsed.depth if parsed else None


def _order(method: MethodName) -> tuple[int, int, bool, int, int, int, int]:
    registry = list(registered_proposers())
    rank = registry.index(method.proposer) if method.proposer else 0
    theirs = TRANSFORMERS.index(method.name) if method.family is Family.TRANSFORMERS else 0
    weights = WEIGHT_FORMATS.index(method.weight_format) + 1 if method.weight_format else 0
    depth, nodes = method.depth or 0, method.tree_nodes or 0
    return method.family.value, rank, method.default_plan, depth, nodes, theirs, weights


def in_report_order(names: Iterable[str]) -> list[str]:
    """Method names (each parseable), without repeats, in report order."""
    parsed = {name: parse_method(name) for name in names}
    return [m.name for m in sorted((m for m in parsed.values() if m), key=_order)]


def method_names(depths: Sequence[int]) -> list[str]:
    """Every method, in report order, for these depths of the model-based proposers."""
    names = [PLAIN, NONINVARIANT, AUTO, *TRANSFORMERS, LLAMA_CPP]
    names += [f"{PREFIX}{p}-d{k}" for p in model_proposers() for k in set(depths)]
    trained = {s.name for s in proposer_specs() if s.trained}  # heads: only where asked (--methods)
    names += [f"{PREFIX}{p}" for p in lookup_proposers() if p not in trained]
    names += [f"{PREFIX}{p}{s}" for p in layer_skipping_proposers() for s in ("", f"-{DEFAULT_PLAN}")]
    return in_report_order(names)


def select_methods(
    requested: Sequence[str] | None, depths: Sequence[int], no_transformers: bool = False
) -> list[str]:
    """The methods to run, in report order: all (for ``depths``) or the requested ones, which may
    name a depth of their own (``specserve-<proposer>-d3``); ``no_transformers`` drops theirs."""
    if any(k < 1 for k in depths):
        raise ValueError(f"--depths must be >= 1, got {list(depths)}")
    chosen = method_names(depths)
    if requested:
        unknown = [m for m in requested if parse_method(m) is None]
        if unknown:
            any_depth = ", ".join(f"{PREFIX}{p}-d<k>" for p in registered_proposers())
            raise ValueError(f"unknown methods {', '.join(unknown)}; known: {', '.join(chosen)} "
                             f"(and {any_depth} for any depth k >= 1)")  # fmt: skip
        chosen = in_report_order(requested)
    if no_transformers:
        chosen = [m for m in chosen if m not in TRANSFORMERS]
    if not chosen:
        raise ValueError("no methods left to run (--no-transformers with only transformers methods?)")
    return chosen


def engine_proposers(names: Iterable[str]) -> list[str]:
    """The proposers the shared engine must load for these methods (a layer-skipping method runs
    on an engine of its own, the auto method on what the settings load)."""
    parsed = [parse_method(n) for n in names]
    found = [m.proposer for m in parsed if m and m.proposer and m.family in (Family.MODEL, Family.LOOKUP)]
    return list(dict.fromkeys(found))
