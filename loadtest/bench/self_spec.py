"""`specserve bench` for self-speculation: a layer-skipping proposer, the target drafting through
its own layers (``method_names.layer_skipping_proposers``; ``p`` below).

- ``specserve-<p>``: the skip set a replica would use (``skip_plan.resolve_plan``: the
  calibration stored with the model, else the shipped one, else the default), at the calibration's
  best depth (settings' depth when the plan has none);
- ``specserve-<p>-default``: the default skip set (``skip_plan.default_skip``), at the depth the
  calibration found best for it (when it scored this set), else the calibrated set's depth, else
  settings' depth;
- ``specserve-<p>-d<k>`` (when named): the skip set a replica would use, at depth k.

Each method runs on an engine of its own over the shared target weights (its own KV cache, in
which its proposer drafts), under the fixed policy, one request at a time, like the other fixed
methods (``self_spec_engine`` builds it; ``loadtest.bench.methods`` times it). In the batch sweep
(``--sweep``) a layer-skipping proposer runs at the depth of the plan a replica resolves
(``sweep_mode_depths``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from policies import FIXED_POLICY
from serve_app.engine.proposers.self_spec import SelfSpecProposer
from serve_app.engine.proposers.skip_plan import SkipPlan, default_skip, resolve_plan


def configured_skip(settings: Any, proposer: str) -> list[int] | None:
    """The skip set the settings give ``proposer`` (its ``skip_layers`` option), None when none."""
    options = getattr(settings.speculation.proposers, proposer).model_dump()
    return list(options.get("skip_layers") or []) or None


def self_spec_engine(
    engine: Any,
    proposer: str,
    folder: Path | None,
    depth: int,
    default_plan: bool = False,
    fixed_depth: int | None = None,
) -> tuple[Any, int, str]:
    """(an engine over ``engine``'s model drafting with the layer-skipping ``proposer`` alone, the
    depth to run it at, a note for the report): the resolved skip set, or the default one when
    ``default_plan``; at ``fixed_depth`` when given, else as the module docstring says."""
    from serve_app.engine.engine import SpecEngine

    model = engine.model
    layers = model.cfg.num_layers
    plan = resolve_plan(layers, folder=folder)
    calibrated_depth = plan.depth
    if default_plan:
        scored = dict(plan.details.get("default") or {})
        stored_depth = (
            scored.get("depth") if tuple(scored.get("skip_layers", ())) == default_skip(layers) else None
        )
        plan = SkipPlan(default_skip(layers), layers, "default", stored_depth)
    depth = fixed_depth or plan.depth or calibrated_depth or depth
    cache = model.new_cache(engine.config.max_slots, engine.config.max_seq_len)
    drafter = SelfSpecProposer(model, cache, plan.skip)
    config = replace(
        engine.config, spec_method=None, policy=FIXED_POLICY, max_depth=max(engine.config.max_depth, depth)
    )
    own = SpecEngine(model, engine.tokenizer, config, engine.eos_ids, {proposer: drafter}, cache=cache)
    note = (f"our engine, self-speculation skipping {len(plan.skip)} of {layers} layers "
            f"({plan.source}: {list(plan.skip)}), depth {depth}")  # fmt: skip
    return own, depth, note


def sweep_mode_depths(
    engine: Any, modes: Sequence[str], folder: Path | None, skip: Sequence[int] | None = None
) -> dict[str, int]:
    """The sweep's per-mode depths: a layer-skipping proposer at the depth its resolved plan was
    calibrated for (none for an explicit ``skip`` set or the default one: the sweep's depth applies)."""
    depths = {}
    for mode in modes:
        if isinstance(engine.proposers.get(mode), SelfSpecProposer):
            plan = resolve_plan(engine.model.cfg.num_layers, list(skip) if skip else None, folder)
            if plan.depth is not None:
                depths[mode] = plan.depth
    return depths


def sweep_depths(engine: Any, modes: Sequence[str], folder: Path | None, settings: Any) -> dict[str, int]:
    """``sweep_mode_depths`` with each layer-skipping proposer's skip set from the settings."""
    depths = {}
    for mode in modes:
        if isinstance(engine.proposers.get(mode), SelfSpecProposer):
            depths |= sweep_mode_depths(engine, [mode], folder, configured_skip(settings, mode))
    return depths
