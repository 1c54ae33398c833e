"""`specserve bench`'s own methods: our engine, one request at a time, each request choosing its
proposer and depth through its speculation override (names: ``loadtest.bench.method_names``).

All share one engine (``loadtest.bench.engine``), built as ``specserve serve`` builds it (each
proposer's options from the settings), except two: a layer-skipping proposer drafts in its own
engine's KV cache (``loadtest.bench.self_spec``), and ``specserve-auto`` runs on a second engine
over the same weights under the configured policy (``auto_method``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from loadtest.bench.method_names import AUTO, NONINVARIANT, Family, parse_method
from loadtest.bench.results import Method, Run
from loadtest.bench.self_spec import self_spec_engine
from serve_app.config import OFF, Settings
from serve_app.engine.proposers.registry import proposer_spec


def specserve_method(engine: Any, n: int, name: str, mode: str = OFF, depth: int | None = None,
                     description: str = "", tree_nodes: int | None = None) -> Method:  # fmt: skip
    """Our engine, one request at a time, with this speculation override (mode ``OFF`` = plain)."""
    from serve_app.engine.params import SamplingParams, SpecOverride

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    speculation = SpecOverride(mode, max_depth=depth, tree_nodes=tree_nodes)

    def run(ids: list[int]) -> Run:
        with timed_proposers(engine.proposers) as drafting:
            start = time.perf_counter()
            done = engine.generate([ids], params, [speculation])[0]
            seconds = time.perf_counter() - start
        ttft, stats = done.time_to_first_token, done.spec_stats
        spec = mode != OFF and stats is not None
        counts = (stats.drafted, stats.accepted, stats.spec_steps) if spec else (None,) * 3
        at = (tuple(stats.drafted_per_position), tuple(stats.accepted_per_position)) if spec else ((), ())
        cost = (drafting[0], int(drafting[1])) if spec else (None, None)
        decode = None if ttft is None else done.duration - ttft
        return Run(done.token_ids, seconds, decode, *counts, *at, *cost)

    return Method(name, run, description=description)


@contextmanager
def timed_proposers(proposers: Mapping[str, Any]) -> Iterator[list[float]]:
    """While inside: every proposer's ``propose`` timed; yields ``[seconds, calls]``, summed over all
    of them (one request at a time: its step's draft, whichever proposer made it)."""
    spent = [0.0, 0.0]
    wrapped = []
    for proposer in proposers.values():
        own = vars(proposer).get("propose")  # already an instance attribute (a test's watcher)
        inner = proposer.propose

        def timed(rows: Any, inner: Callable[[Any], Any] = inner) -> Any:
            start = time.perf_counter()
            try:
                return inner(rows)
            finally:
                spent[0] += time.perf_counter() - start
                spent[1] += 1

        proposer.propose = timed
        wrapped.append((proposer, own))
    try:
        yield spent
    finally:
        for proposer, own in wrapped:
            if own is None:
                del proposer.propose
            else:
                proposer.propose = own


def without_invariance(method: Method, engine: Any) -> Method:
    """``method`` run with the engine's row plans and key padding suspended (what invariance costs)."""
    from serve_app.engine.exactness import suspended

    def run(ids: list[int]) -> Run:
        with suspended(engine.model):
            return method.run(ids)

    return Method(method.name, run, description=method.description)


def proposer_note(settings: Settings, proposer: str, engine: Any = None) -> str:
    """The proposer as configured: its model (if it drafts with one) and its options; given the
    ``engine``, the weight format its model was loaded in (an option of "target" resolves per host)."""
    role = proposer_spec(proposer).model_role
    model = f" {getattr(settings.model, role)}" if role else ""
    options = getattr(settings.speculation.proposers, proposer).model_dump()
    listed = ", ".join(f"{k}={v}" for k, v in options.items())
    loaded = getattr(getattr(engine, "proposers", {}).get(proposer), "model", None)
    if loaded is not None:
        listed += f"{', ' if listed else ''}loaded as {loaded.weight_format}"
    return f"{proposer}{model}" + (f" ({listed})" if listed else "")


def our_methods(
    names: list[str], engine_for: Callable[[str | None], Any], settings: Settings, n: int
) -> list[Method]:
    """Our methods among ``names``, on the shared engine of their weight format (``engine_for``:
    format or None for the settings' -> engine; see the module docstring)."""
    from loadtest.bench.engine import target_folder

    spec = settings.speculation
    methods = []
    for name in names:
        method = parse_method(name)
        if method is None or method.family in (Family.TRANSFORMERS, Family.PEER):
            continue
        engine = engine_for(method.weight_format)
        weights = f" ({method.weight_format} weights)" if method.weight_format else ""
        if method.family is Family.AUTO:
            methods.append(auto_method(engine, settings, n, name, method.tree_nodes))
        elif name.partition("+")[0] == NONINVARIANT:
            note = "our engine, plain decoding, batch invariance off (runtime.batch_invariant false)"
            plain = specserve_method(engine, n, name, OFF, description=note)
            methods.append(without_invariance(plain, engine))
        elif method.family is Family.PLAIN:
            methods.append(
                specserve_method(engine, n, name, OFF, description=f"our engine, plain decoding{weights}")
            )
        elif method.family is Family.LAYERS:
            own, depth, note = self_spec_engine(engine, method.proposer, target_folder(settings), spec.depth,
                                                method.default_plan, method.depth)  # fmt: skip
            methods.append(specserve_method(own, n, name, method.proposer, depth, note))
        else:  # a model-based proposer at the method's depth, a lookup at the settings'
            depth = method.depth or spec.depth
            nodes = method.tree_nodes or 0  # chains unless the name says -t<n>
            tree = f", trees of up to {nodes} alternatives" if nodes else ""
            if nodes and spec.profile_cost_model and not engine.planner.cost.shape:
                # a tree's floor comes from the cost model (policies.trees): this machine's, as a replica's
                engine.profile_cost_model()
            configured = proposer_note(settings, method.proposer, engine)
            note = f"our engine{weights}, {configured}, depth {depth}{tree}"
            methods.append(specserve_method(engine, n, name, method.proposer, depth, note, nodes))
    return methods


def auto_method(engine: Any, settings: Settings, n: int, name: str = AUTO,
                tree_nodes: int | None = None) -> Method:  # fmt: skip
    """Requests that leave speculation to the server ("auto") on ``auto_engine``, one at a time.
    ``tree_nodes``: the requests' tree budget (``specserve-auto-t0``: chains only); None leaves it
    to the replica's setting."""
    auto = auto_engine(engine, settings)
    spec = settings.speculation
    note = f'our engine, speculation "auto": policy {spec.policy} over {", ".join(auto.proposers)}'
    trees = spec.tree_nodes if tree_nodes is None else tree_nodes
    note += f", trees of up to {trees} alternatives" if trees else ", chains only"
    return specserve_method(auto, n, name, "auto", None, note, tree_nodes)


def auto_engine(engine: Any, settings: Settings) -> Any:
    """An engine under the configured policy with its cost model profiled on these models, as a
    replica starts: a second engine over ``engine``'s weights and proposers (its own KV cache, in
    which a layer-skipping proposer drafts). Its default proposer is a replica's: the configured
    method when loaded, else the first loaded proposer that drafts with a model, else the first
    loaded."""
    from dataclasses import replace

    from serve_app.engine.engine import SpecEngine
    from serve_app.engine.proposers.base import ModelDrafter
    from serve_app.engine.proposers.self_spec import SelfSpecProposer

    spec = settings.speculation
    loaded = list(engine.proposers)
    drafters = [p for p in loaded if isinstance(engine.proposers[p], ModelDrafter)]
    method = next(iter([spec.method] if spec.method in loaded else [*drafters, *loaded]), None)
    config = replace(
        engine.config, spec_method=method, policy=spec.policy, policy_params=dict(spec.policy_params)
    )
    proposers, cache = dict(engine.proposers), None
    for proposer_name, proposer in engine.proposers.items():
        if isinstance(proposer, SelfSpecProposer):  # it drafts in its engine's cache: the new one's
            cache = cache or engine.model.new_cache(config.max_slots, config.max_seq_len)
            proposers[proposer_name] = SelfSpecProposer(
                engine.model, cache, proposer.skip, proposer.min_confidence
            )
    auto = SpecEngine(engine.model, engine.tokenizer, config, engine.eos_ids, proposers, cache=cache)
    if spec.profile_cost_model:
        auto.profile_cost_model()
    return auto
