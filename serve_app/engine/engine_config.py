"""``EngineConfig``: what a ``SpecEngine`` needs to know (``serve_app.builder`` makes it from the
settings)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from policies import FIXED_POLICY


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to know; built from ``serve_app.config.Settings`` by the caller."""

    max_slots: int = 8
    max_seq_len: int = 4096
    max_waiting: int = 256
    spec_method: str | None = None  # proposer used when a request says "auto"; None = plain decoding
    spec_depth: int = 4  # draft tokens per step
    max_depth: int = 16  # the most a request may ask for
    proposer_options: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    policy: str = FIXED_POLICY  # a registered policy name (`specserve policies`)
    policy_params: Mapping[str, object] = field(default_factory=dict)
