"""The limits every policy obeys, in one place.

For each request the policy's choice is bounded by

- the request's ``override_mode``: "off" means plain decoding; a proposer name means that proposer
  only (and, except under the ``plain`` policy, speculation with it: depth at least 1 where the
  limits below allow one); "auto" leaves the choice to the policy. A proposer the replica did not
  load is never used (an override naming one decodes plain);
- the depth cap: min(step.max_depth, the request's override_max_depth, the policy's own max_depth,
  tokens_left - 1), since the target adds one token of its own to every accepted run, a deeper
  draft is wasted work. (The engine still caps by the KV cache, which a policy cannot see.)
  Per proposer, also what it said it can draft (``RequestView.draftable``): an n-gram lookup that
  finds no match has nothing to propose, so choosing it would only buy a plain step.

``clamp`` is the last line of every policy's ``decide``: whatever the policy computed, what leaves
it is within these limits, and depth 0 and proposer None always come together.
"""

from __future__ import annotations

from policies.base import Decision, RequestView, StepView

AUTO = "auto"
OFF = "off"


def forced_proposer(request: RequestView) -> str | None:
    """The proposer the request insists on, or None ("auto" or "off")."""
    mode = request.override_mode
    return None if mode in (AUTO, OFF) else mode


def allowed_proposers(request: RequestView, step: StepView) -> tuple[str, ...]:
    """Proposers the policy may use for ``request`` this step (in the replica's order)."""
    mode = request.override_mode
    if mode == OFF:
        return ()
    if mode == AUTO:
        return tuple(step.proposers)
    return (mode,) if mode in step.proposers else ()


def depth_cap(
    request: RequestView, step: StepView, limit: int | None = None, proposer: str | None = None
) -> int:
    """The deepest draft allowed for ``request`` this step (0: plain only); with ``proposer``, the
    deepest that proposer may draft (also capped by what it can draft, ``RequestView.draftable``)."""
    cap = min(step.max_depth, request.tokens_left - 1)
    if request.override_max_depth is not None:
        cap = min(cap, request.override_max_depth)
    if limit is not None:
        cap = min(cap, limit)
    if proposer is not None and proposer in request.draftable:
        cap = min(cap, request.draftable[proposer])
    return max(0, cap)


def pick_proposer(request: RequestView, step: StepView, preferred: str | None) -> str | None:
    """The proposer of a fixed-proposer policy: the forced one, else ``preferred``, else the first.

    ``preferred`` None means "the first proposer the replica loaded"; a preferred proposer the
    replica did not load means plain (never a silent switch to another proposer).
    """
    allowed = allowed_proposers(request, step)
    if not allowed:
        return None
    if forced_proposer(request) is not None:
        return allowed[0]
    if preferred is None:
        return allowed[0]
    return preferred if preferred in allowed else None


def clamp(decision: Decision, request: RequestView, step: StepView, limit: int | None = None) -> Decision:
    """``decision`` within the request's limits (see the module docstring)."""
    if decision.proposer is None or decision.proposer not in allowed_proposers(request, step):
        return Decision.plain()
    depth = min(decision.depth, depth_cap(request, step, limit, decision.proposer))
    return Decision(decision.proposer, depth) if depth > 0 else Decision.plain()


def fixed(
    request: RequestView, step: StepView, proposer: str | None, depth: int, limit: int | None
) -> Decision:
    """A fixed-proposer policy's decision: ``proposer`` (or the forced one) at ``depth``.

    A forced proposer speculates at depth >= 1 even where the policy chose 0.
    """
    name = pick_proposer(request, step, proposer)
    if name is None:
        return Decision.plain()
    if forced_proposer(request) is not None:
        depth = max(depth, 1)
    return clamp(Decision(name, depth), request, step, limit)
