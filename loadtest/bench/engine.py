"""The benchmarks' engine: built as a replica builds it (``serve_app.builder.build_engine``: each
proposer's options and model from the settings), with the proposers a benchmark needs loaded
whatever ``speculation.method`` says, room for its depths and lengths, and the fixed policy with
no default proposer, so that every request names its proposer and depth.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from policies import FIXED_POLICY
from serve_app.builder import build_engine, model_store
from serve_app.config import OFF, Settings
from serve_app.engine.proposers.registry import proposer_spec, proposer_specs


def require_model(settings: Settings, role: str, who: str) -> str:
    """The model ``settings.model.<role>`` names; a ValueError saying ``who`` needs one when none."""
    ref = getattr(settings.model, role, None)
    if not ref:
        raise ValueError(f"{who} needs a {role} model (model.{role} / --{role})")
    return ref


def target_folder(settings: Settings) -> Path:
    """The target's model folder in the store (fetched first, for a pack)."""
    return model_store(settings).resolve(settings.model.target)


def bench_engine(settings: Settings, proposers: Sequence[str], *, max_slots: int, depth: int, n: int,
                 optional: Sequence[str] = ()) -> Any:  # fmt: skip
    """One engine for a benchmark (see the module docstring), torch threads set first from
    ``runtime.threads`` as a replica does: ``proposers`` loaded (a model they draft with must be
    configured, and fit the target: else a ValueError before any model loads), ``optional`` ones
    loaded as a replica would (one whose default model does not fit is left out with a warning);
    ``max_slots`` slots, ``depth`` draft tokens per step, room for requests of ``n`` new tokens."""
    from serve_app.engine.device import set_threads

    required = list(dict.fromkeys(proposers))
    models = {}
    for name in required:
        if (role := proposer_spec(name).model_role) is not None:
            models[role] = require_model(settings, role, f"proposer {name!r}")
    # Named explicitly (fields set), a model that cannot serve the target is an error, not a fallback.
    model = settings.model.model_copy(update=models)
    extra = list(dict.fromkeys([*required, *optional]))
    spec = settings.speculation.model_copy(update={"method": OFF, "extra_proposers": extra})
    set_threads(settings.runtime.threads)
    return build_engine(
        settings.model_copy(update={"model": model, "speculation": spec}),
        max_slots=max_slots,
        spec_method=None,
        spec_depth=depth,
        max_depth=max(spec.max_depth, depth),
        max_seq_len=max(2048, n + 1024),
        policy=FIXED_POLICY,
        policy_params={},
    )


def drop_unfit_defaults(names: list[str], settings: Settings, assisted: str) -> list[str]:
    """The default methods without those whose model is a default that cannot serve the target
    (another tokenizer): left out with a note, as a replica drops such a draft. A model named
    explicitly stays, and fails loudly later if it does not fit."""
    from loadtest.bench.method_names import assistant_role, parse_method

    unfit = set()
    for spec in proposer_specs():
        role = spec.model_role
        ref = getattr(settings.model, role, None) if role else None
        if role is None or role in settings.model.model_fields_set:
            continue
        problem = (
            "no model" if not ref else model_store(settings).tokenizer_mismatch(settings.model.target, ref)
        )
        if problem:
            print(f"[bench] leaving out {spec.name}'s methods: {problem}", file=sys.stderr)
            unfit.add(spec.name)
            if role == assistant_role():
                unfit.add(assisted)
    kept = []
    for name in names:
        parsed = parse_method(name)
        if name in unfit or (parsed is not None and parsed.proposer in unfit):
            continue
        kept.append(name)
    return kept
