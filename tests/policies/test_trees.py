"""The floor under a tree's alternatives (``policies.trees``): E * dt / T from the cost model."""

from __future__ import annotations

import pytest

from policies import FittedCostModel
from policies.trees import alternative_floor


def cost(flat_to: int, per_token: float) -> FittedCostModel:
    """A 100 ms forward, flat up to ``flat_to`` tokens, then ``per_token`` seconds a token."""
    return FittedCostModel(target=(0.100, per_token, 0.0, 0.0), knee=flat_to, draft={})


def test_a_flat_verify_lets_every_alternative_in() -> None:
    assert alternative_floor(cost(16, 0.02), rows=1, width=5, context=100, tokens=3.0) == 0.0


def test_a_dear_verify_row_asks_for_a_likely_alternative() -> None:
    # dt = 20 ms, T = 100 + 4 * 20 ms at width 5, E = 2 tokens: an alternative must pass 2 * 20 / 180.
    floor = alternative_floor(cost(1, 0.02), rows=1, width=5, context=100, tokens=2.0)
    assert floor == pytest.approx(2 * 0.02 / 0.18)
    # The draft's own time counts in T: a dearer step makes a row relatively cheaper.
    assert alternative_floor(cost(1, 0.02), 1, 5, 100, 2.0, draft_seconds=0.1) < floor
    # More expected tokens make a row dearer to add (it delays them all); capped at 1.
    assert alternative_floor(cost(1, 0.02), 1, 5, 100, 4.0) == pytest.approx(2 * floor)
    assert alternative_floor(cost(1, 1.0), 1, 5, 100, 8.0) == 1.0
