"""When an alternative earns its verify row: the floor under a tree's alternatives, from the cost model.

An alternative ``x`` beside the chain's token at position j is a leaf: if the target's choice there
is ``x``, plain verification of the chain would have emitted ``x`` anyway (as the recovered token);
the tree adds what comes after it, the bonus token. So a leaf the target picks with probability s
gains s tokens, and it costs one more row in the verify forward, dt = t(W + 1) - t(W) at the row's
width W. A step that emits E tokens in T seconds gains from it iff

    (E + s) / (T + dt) > E / T   <=>   s > E * dt / T.

The proposer does not know s, but its own probability of reaching ``x`` (the product of the chosen
tokens' probabilities before j, times q(x)) is the estimate SpecInfer and EAGLE-2 grow trees by;
``alternative_floor`` is the E * dt / T it must exceed. In a batch of B rows each with an
alternative, one more column costs dt for all of them and gains B s: the same rule with E the
tokens per row. On a CPU whose wide verifies are nearly free
(AMX: 16 tokens cost about one) the floor is ~0 and every budgeted alternative joins; where each
verify row costs a fifth of a step (an AVX-512 EPYC here, BENCHMARKS.md) only sure alternatives do.
"""

from __future__ import annotations

from policies.base import CostModel


def alternative_floor(
    cost: CostModel,
    rows: int,
    width: int,
    context: int,
    tokens: float,
    draft_seconds: float = 0.0,
) -> float:
    """E * dt / T (module docstring) for a ``rows``-row step whose forward is ``width`` tokens
    wide, expected to emit ``tokens`` per row, its drafts taking ``draft_seconds``; in [0, 1]."""
    base = cost.target_time(rows, width, context)
    extra = cost.target_time(rows, width + 1, context) - base
    if extra <= 0.0:
        return 0.0  # a wider forward that costs no more (or less: the shape residual) is free
    return min(1.0, tokens * extra / (base + draft_seconds))
