"""Which layers the self-speculative draft skips: the calibrated set stored with the model, a set
shipped with specserve for the known packs, or a default.

A calibration (``loadtest.calibrate.self_spec``, run by ``specserve calibrate self-spec``) writes
``specserve-self-spec.json`` into the model's folder in the store, so every replica that loads the
model finds it. ``resolve_plan`` picks, in order:

1. ``skip_layers`` given explicitly (settings ``speculation.self_spec_skip``, tests);
2. the calibration file in the model's folder (written by ``specserve calibrate self-spec``);
3. the calibration shipped in ``SHIPPED`` for the model's pack (measured on this project's
   machines with the same search), so a fresh store starts calibrated;
4. ``default_skip``: every other layer of the lower middle of the stack, about a quarter of them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CALIBRATION_FILE = "specserve-self-spec.json"
PACK_FILE = "specserve-pack.json"
FORMAT_VERSION = 1

# Calibrations measured with ``specserve calibrate self-spec`` (bf16, 2 threads, this project's CPU
# machines), by pack name. Only ``skip_layers`` and ``depth`` are used; the rest documents the
# measurement (expected_speedup: expected tokens/s vs plain decoding at batch 1; on these machines
# self-speculation is about break-even for Qwen2.5-Coder-1.5B and does not pay for SmolLM2-135M,
# whose draft steps cost too much of a plain step for the acceptance they get).
SHIPPED: dict[str, dict[str, Any]] = {
    "qwen2.5-coder-1.5b-instruct": {
        "version": 1,
        "num_layers": 28,
        "skip_layers": [2, 3, 4, 5, 6, 8, 10, 11, 12, 17],
        "depth": 1,
        "expected_speedup": 1.0145,
        "tokens_per_step": 1.8299,
        "acceptance": [0.8299, 0.7854, 0.7797, 0.8134, 0.7642, 0.7564],
        "draft_cost": 0.6918,
        "plain_step_s": 0.13433,
        "calibrated_at": "2026-11-30T16:07:49+0000",
    },
    "smollm2-135m-instruct": {
        "version": 1,
        "num_layers": 30,
        "skip_layers": [3, 4, 5, 14],
        "depth": 1,
        "expected_speedup": 0.9278,
        "tokens_per_step": 1.8681,
        "acceptance": [0.8681, 0.8408, 0.8382, 0.8284, 0.8478, 0.8246],
        "draft_cost": 0.8856,
        "plain_step_s": 0.02499,
        "calibrated_at": "2026-11-30T16:02:01+0000",
    },
}


@dataclass(frozen=True)
class SkipPlan:
    """The layers the draft skips, where the choice came from, and what the calibration measured."""

    skip: tuple[int, ...]
    num_layers: int
    source: str = "default"  # explicit | calibrated | shipped | default
    depth: int | None = None  # the calibration's best draft depth (informative; the policy decides)
    details: Mapping[str, Any] = field(default_factory=dict)  # measured acceptance, costs, search

    def __post_init__(self) -> None:
        skip = tuple(sorted({int(i) for i in self.skip}))
        object.__setattr__(self, "skip", skip)
        check_skip(skip, self.num_layers)

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers the draft runs, in order."""
        return tuple(i for i in range(self.num_layers) if i not in set(self.skip))

    def to_json(self) -> dict[str, Any]:
        return {"version": FORMAT_VERSION, "num_layers": self.num_layers, "skip_layers": list(self.skip),
                "depth": self.depth, **dict(self.details)}  # fmt: skip


def check_skip(skip: Sequence[int], num_layers: int) -> None:
    """A skip set must name existing layers and leave at least one layer to run, and skip one."""
    bad = [i for i in skip if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"skip layers {bad} outside 0..{num_layers - 1}")
    if not skip:
        raise ValueError("a self-speculative draft must skip at least one layer")
    if len(set(skip)) >= num_layers:
        raise ValueError(f"a self-speculative draft must run at least one of the {num_layers} layers")


def default_skip(num_layers: int) -> tuple[int, ...]:
    """Every other layer from a tenth of the way up to three fifths (about a quarter of the layers).

    What the calibrations of Qwen2.5-Coder-1.5B and SmolLM2-135M agree on: skipping any one of the
    lower-middle layers barely changes the output, while the first layer or two (they map tokens
    into the residual stream) and the top third (they shape the output distribution) matter most.
    Skipping alternate layers rather than a block keeps each skipped layer's neighbours running.
    """
    if num_layers < 2:
        raise ValueError("self-speculation needs a model with at least 2 layers")
    start, stop = max(1, num_layers // 10), (3 * num_layers) // 5
    return tuple(range(start, stop, 2)) or (num_layers // 2,)


def load_plan(folder: Path, num_layers: int) -> SkipPlan | None:
    """The calibration stored in ``folder``, or None (missing, unreadable or for another shape)."""
    path = Path(folder) / CALIBRATION_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return plan_from_json(data, num_layers, "calibrated")
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring self-speculation calibration %s: %s", path, exc)
        return None


def plan_from_json(data: Mapping[str, Any], num_layers: int, source: str) -> SkipPlan:
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"unsupported calibration version {data.get('version')!r}")
    if int(data["num_layers"]) != num_layers:
        raise ValueError(f"calibrated for {data['num_layers']} layers, the model has {num_layers}")
    details = {k: v for k, v in data.items() if k not in ("version", "num_layers", "skip_layers", "depth")}
    depth = data.get("depth")
    return SkipPlan(tuple(data["skip_layers"]), num_layers, source, None if depth is None else int(depth),
                    details)  # fmt: skip


def save_plan(folder: Path, plan: SkipPlan) -> Path:
    """Write ``plan`` as the folder's calibration (atomically: a reader never sees half a file)."""
    path = Path(folder) / CALIBRATION_FILE
    tmp = path.with_suffix(f".tmp{time.time_ns()}")
    tmp.write_text(json.dumps(plan.to_json(), indent=1) + "\n")
    tmp.replace(path)
    return path


def pack_name(folder: Path | None) -> str | None:
    """The pack a store folder was converted from (``specserve-pack.json``), else None."""
    if folder is None or not (Path(folder) / PACK_FILE).exists():
        return None
    try:
        return str(json.loads((Path(folder) / PACK_FILE).read_text())["pack"])
    except (ValueError, KeyError, TypeError):
        return None


def resolve_plan(num_layers: int, skip_layers: Sequence[int] | None = None,
                 folder: Path | None = None) -> SkipPlan:  # fmt: skip
    """The skip plan for a model of ``num_layers`` layers (see the module docstring for the order)."""
    if skip_layers:
        return SkipPlan(tuple(skip_layers), num_layers, "explicit")
    if folder is not None and (plan := load_plan(Path(folder), num_layers)) is not None:
        return plan
    shipped = SHIPPED.get(pack_name(folder) or "")
    if shipped is not None:
        try:
            return plan_from_json(shipped, num_layers, "shipped")
        except (ValueError, KeyError) as exc:
            log.warning("ignoring the shipped self-speculation calibration: %s", exc)
    return SkipPlan(default_skip(num_layers), num_layers, "default")
