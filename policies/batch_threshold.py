"""``batch-threshold``: depth from a batch-size table, plain above its largest bound.

What vLLM's ``num_speculative_tokens_per_batch_size`` / TensorRT-LLM's ``max_concurrency`` do: the
table maps an upper bound on the batch size to a depth, e.g. ``{1: 6, 2: 5, 4: 3, 8: 2}`` means
depth 6 at batch 1, 5 at batch 2, 3 at batch 3-4, 2 at batch 5-8 and 0 (plain) from batch 9 on.
Param ``table`` (keys may be strings, as YAML/JSON settings give them); the proposer is
``default_proposer`` (or the request's forced one, which speculates at depth >= 1).
"""

from __future__ import annotations

from collections.abc import Mapping

from policies.base import Decision, Outcome, StepView
from policies.limits import fixed
from policies.registry import PolicyConfig, register_policy

DEFAULT_TABLE = {1: 6, 2: 5, 4: 3, 8: 2}


def parse_table(table: object) -> tuple[tuple[int, int], ...]:
    """``{bound: depth}`` as ((bound, depth), ...) sorted by bound; ValueError on a bad table."""
    if not isinstance(table, Mapping) or not table:
        raise ValueError(
            f"batch-threshold: table must be a non-empty mapping batch bound -> depth: {table!r}"
        )
    rows = []
    for bound, depth in table.items():
        try:
            row = (int(bound), int(depth))  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise ValueError(f"batch-threshold: table entry {bound!r}: {depth!r} is not int: int") from None
        if row[0] < 1 or row[1] < 0:
            raise ValueError(f"batch-threshold: table entry {row} needs bound >= 1 and depth >= 0")
        rows.append(row)
    return tuple(sorted(rows))


class BatchThresholdPolicy:
    name = "batch-threshold"

    def __init__(self, table: Mapping[object, object], proposer: str | None, max_depth: int) -> None:
        self.table = parse_table(table)
        self.proposer = proposer
        self.max_depth = max_depth

    def depth_for(self, batch_size: int) -> int:
        """The table's depth for ``batch_size`` (0 above the largest bound)."""
        for bound, depth in self.table:
            if batch_size <= bound:
                return depth
        return 0

    def decide(self, step: StepView) -> list[Decision]:
        depth = self.depth_for(step.batch_size)
        return [fixed(r, step, self.proposer, depth, self.max_depth) for r in step.requests]

    def observe(self, outcome: Outcome) -> None:
        pass


@register_policy(
    "batch-threshold", "depth from a batch-size table (params.table), plain above its largest bound"
)
def _build(config: PolicyConfig) -> BatchThresholdPolicy:
    config.check_params("batch-threshold", ("table",))
    table = config.params.get("table", DEFAULT_TABLE)
    return BatchThresholdPolicy(table, config.default_proposer, config.max_depth)  # type: ignore[arg-type]
