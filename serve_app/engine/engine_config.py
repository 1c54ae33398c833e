"""``EngineConfig``: what a ``SpecEngine`` needs to know (``serve_app.builder`` makes it from the
settings)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policies import FIXED_POLICY
from serve_app.engine.block_file import AUTO
from serve_app.engine.weights import WEIGHT_FORMATS

COUPLED, REJECTION = "coupled", "rejection"  # the sampling schemes (EngineConfig.sampling)
SAMPLING_SCHEMES = (COUPLED, REJECTION)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to know; built from ``serve_app.config.Settings`` by the caller."""

    max_slots: int = 8
    max_seq_len: int = 4096
    max_waiting: int = 256
    spec_method: str | None = None  # proposer used when a request says "auto"; None = plain decoding
    spec_depth: int = 4  # draft tokens per step
    max_depth: int = 16  # the most a request may ask for
    tree_nodes: int = 0  # alternatives a tree may add beside its chain where the policy picks one
    proposer_options: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    policy: str = FIXED_POLICY  # a registered policy name (`specserve policies`)
    policy_params: Mapping[str, object] = field(default_factory=dict)
    # "coupled": a sampled token is the exponential race of p under noise fixed by (seed, position)
    # (sampling.PositionNoise), so seeded output is the same with speculation on or off;
    # "rejection": classic speculative sampling (accept with min(1, p/q)) on a per-request stream.
    sampling: str = COUPLED
    # Probe every product kind at start and run each on a row count whose rows agree with any other
    # (engine.invariance); off only to measure what it costs.
    batch_invariant: bool = True
    # the target's matrices: one of weights.WEIGHT_FORMATS, or "auto" (block_file.resolve_weight_format,
    # resolved when the engine loads its model folder)
    weight_format: str = "dense"

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING_SCHEMES:
            raise ValueError(f"sampling must be one of {SAMPLING_SCHEMES}, got {self.sampling!r}")
        if self.weight_format not in (*WEIGHT_FORMATS, AUTO):
            raise ValueError(
                f"weight_format must be one of {(*WEIGHT_FORMATS, AUTO)}, got {self.weight_format!r}"
            )
