"""`specserve bench` methods for self-speculation: the target drafting through its own layers.

- ``specserve-self``: the skip set a replica would use (``skip_plan.resolve_plan``: the
  calibration stored with the model, else the shipped one, else the default), at the calibration's
  best depth (settings' depth when the plan has none);
- ``specserve-self-default``: the default skip set (``skip_plan.default_skip``), at the depth the
  calibration found best for it (when it scored this set), else the calibrated set's depth, else
  settings' depth.

Each method runs on an engine of its own over the shared target weights (its own KV cache, in
which its proposer drafts), under the static policy, one request at a time, like the other fixed
methods. In the batch sweep (``--sweep``, mode ``self``) the self proposer runs at the depth of
the plan a replica resolves (``sweep_mode_depths``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

SELF, SELF_DEFAULT = "specserve-self", "specserve-self-default"
SELF_METHODS = (SELF, SELF_DEFAULT)


def self_spec_method(engine: Any, name: str, folder: Path | None, depth: int, n: int) -> Any:
    """The method ``name`` (one of ``SELF_METHODS``) over ``engine``'s model (see the docstring)."""
    from serve_app.bench import specserve_method
    from serve_app.engine.engine import SpecEngine
    from serve_app.engine.proposers.self_spec import SelfSpecProposer
    from serve_app.engine.proposers.skip_plan import SkipPlan, default_skip, resolve_plan

    model = engine.model
    layers = model.cfg.num_layers
    plan = resolve_plan(layers, folder=folder)
    calibrated_depth = plan.depth
    if name == SELF_DEFAULT:
        scored = dict(plan.details.get("default") or {})
        stored_depth = (
            scored.get("depth") if tuple(scored.get("skip_layers", ())) == default_skip(layers) else None
        )
        plan = SkipPlan(default_skip(layers), layers, "default", stored_depth)
    depth = plan.depth or calibrated_depth or depth
    cache = model.new_cache(engine.config.max_slots, engine.config.max_seq_len)
    proposer = SelfSpecProposer(model, cache, plan.skip)
    config = replace(
        engine.config, spec_method=None, policy="static", max_depth=max(engine.config.max_depth, depth)
    )
    own = SpecEngine(model, engine.tokenizer, config, engine.eos_ids, {"self": proposer}, cache=cache)
    note = (f"our engine, self-speculation skipping {len(plan.skip)} of {layers} layers "
            f"({plan.source}: {list(plan.skip)}), depth {depth}")  # fmt: skip
    return specserve_method(own, n, name, "self", depth, note)


def sweep_mode_depths(
    engine: Any, modes: Sequence[str], folder: Path | None, skip: Sequence[int] | None = None
) -> dict[str, int]:
    """The sweep's per-mode depths: ``self`` at the depth its resolved plan was calibrated for
    (none for an explicit or default skip set: the sweep's depth applies)."""
    from serve_app.engine.proposers.skip_plan import resolve_plan

    if "self" not in modes:
        return {}
    plan = resolve_plan(engine.model.cfg.num_layers, list(skip) if skip else None, folder)
    return {} if plan.depth is None else {"self": plan.depth}
