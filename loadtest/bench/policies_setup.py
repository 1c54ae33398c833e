"""The fixed terms of ``specserve bench --policies``: which policies it compares, the fixed arm
(proposer, depth) the fixed policy runs, how an arm is written, the mixed workload's shape, and
the priors every policy starts from. The simulation (``policies_sim``) and the real runs
(``policies_real``) both read them, so that the two tables compare the same things.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from policies import DEFAULT_POLICY, FIXED_POLICY, PLAIN_POLICY, registered_policies
from serve_app.engine.proposers.registry import DEFAULT_PROPOSER

RECORD_DEPTH = 8  # traces are recorded (and policies capped) at this depth
Priors = dict[tuple[str, str], tuple[float, ...]]  # (proposer, workload) -> conditional acceptance
Arm = tuple[str | None, int]  # (proposer, depth); (None, 0) is plain decoding
# The fixed policy's arm: the default proposer at the depth the benchmarks found best on code+json
# (BENCHMARKS.md).
BEST_STATIC: Arm = (DEFAULT_PROPOSER, 4)
# The mixed workload: interactive code and prose one request at a time, then a burst of every trace
# twice with up to 32 in flight, then interactive again.
MIX_LOW, MIX_BURST, MIX_REPEAT = 1, 32, 2
QUIET_KINDS = ("code", "prose")  # the prompt kinds of the mix's interactive phases
# The real runs: the plain baseline, the fixed arm and the server's default policy.
REAL_POLICIES = (PLAIN_POLICY, FIXED_POLICY, DEFAULT_POLICY)

T = TypeVar("T")


def compared_policies() -> list[str]:
    """Every registered policy; the fixed one runs at ``BEST_STATIC``."""
    return sorted(registered_policies())


def arm_label(arm: Arm) -> str:
    """An arm as the tables write it: ``"<proposer> d<depth>"``, or the plain policy's name."""
    return PLAIN_POLICY if arm[0] is None else f"{arm[0]} d{arm[1]}"


def real_policy(label: str) -> tuple[str, Arm]:
    """A real run's label as (policy, fixed arm): a policy name (the fixed policy at
    ``BEST_STATIC``), or an arm as ``arm_label`` writes it (``"<proposer> d1"``: the fixed policy
    at that proposer and depth)."""
    proposer, _, depth = label.partition(" d")
    if depth.isdigit():
        return FIXED_POLICY, (proposer, int(depth))
    return label, BEST_STATIC


def quiet(items: Sequence[T], kinds: Sequence[str]) -> list[T]:
    """The items whose prompt kind (``kinds``, item by item) runs in the mix's interactive phases."""
    return [item for item, kind in zip(items, kinds, strict=True) if kind in QUIET_KINDS]
