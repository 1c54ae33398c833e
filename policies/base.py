"""The decision layer's contracts: what a policy sees of a step, what it decides, what it learns.

Pure Python: nothing here (or anywhere in ``policies``) imports ``serve_app``. The engine builds a
frozen ``StepView`` before each decode step, asks the configured ``Policy`` for one ``Decision``
per running request, runs the step, and feeds back an ``Outcome``.

A decision of depth 0 or proposer None means plain decoding for that request this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Continuation:
    """How far a proposer that may end a draft early (a draft model stopping when unsure) drafts.

    Per position j = 0, 1, ...: ``drafted[j]`` = P(it drafts position j + 1 | it drafted position j
    and the depth allowed j + 1), and ``accepted[j]`` = the same given also that positions 0..j were
    accepted. A draft of depth k then holds 1 + sum_{j=1..k-1} prod_{m<j} drafted[m] tokens on
    average, and emits 1 + sum_{j<k} a_j prod_{m<j} a_m accepted[m] (a the conditional acceptance).
    Missing positions repeat the last; empty means it never stops early (every rate 1).
    """

    drafted: tuple[float, ...] = ()
    accepted: tuple[float, ...] = ()


@dataclass(frozen=True)
class RequestView:
    """One running request as a policy sees it (read-only)."""

    request_id: str
    prompt_len: int  # tokens in the prompt
    generated: int  # tokens generated so far
    tokens_left: int  # max_tokens - generated (a draft deeper than tokens_left - 1 is wasted)
    temperature: float  # 0 = greedy
    workload: str  # workload class: "code" | "json" | "prose" | a user tag
    # Per proposer: estimated probability that draft position j is accepted given that positions
    # < j were (conditional acceptance), j = 0 .. max_depth - 1.
    acceptance: dict[str, tuple[float, ...]] = field(default_factory=dict)
    override_mode: str = "auto"  # the request's own say: "auto" | "off" | a proposer name
    override_max_depth: int | None = None  # the request's cap on depth (None = server's limit)
    # Per proposer that can tell before drafting (a lookup, such as n-gram): how many tokens it
    # would draft for this request now (0: it has nothing to propose). A proposer not here has no
    # such bound. The limits cap each proposer's depth by it (``policies.limits.depth_cap``).
    draftable: dict[str, int] = field(default_factory=dict)
    # Per proposer that may stop a draft before its depth: how far it goes (a proposer not here
    # always drafts its full depth).
    continuation: dict[str, Continuation] = field(default_factory=dict)

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.generated


@runtime_checkable
class CostModel(Protocol):
    """Predicts step times in seconds (see ``policies.cost_model`` for the fitted implementation)."""

    def target_time(self, rows: int, tokens_per_row: int, context: int) -> float:
        """One target forward over ``rows`` rows of ``tokens_per_row`` tokens (padding included)."""

    def draft_time(self, proposer: str, rows: int, context: int) -> float:
        """One draft step of ``proposer`` for ``rows`` rows (one drafted token per row); 0 if free."""


@dataclass(frozen=True)
class StepView:
    """Everything a policy may use to decide one decode step."""

    requests: tuple[RequestView, ...]
    queue_depth: int  # requests waiting for a slot
    proposers: tuple[str, ...]  # proposers loaded on this replica
    max_depth: int  # the server's limit on depth
    cost: CostModel

    @property
    def batch_size(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class Decision:
    """Speculate with ``proposer`` up to ``depth`` tokens for one request; depth 0 = plain.
    ``nodes``: alternatives the draft may add beside its chain, making it a token tree (0 = a
    chain; only a proposer that branches uses them, only for greedy and coupled rows): a policy
    leaves it 0, and the engine's planner grants the request's or the replica's budget.
    ``min_score``: the proposer's probability an alternative must reach to join the tree (the
    planner sets it from the cost model, ``policies.trees``)."""

    proposer: str | None
    depth: int
    nodes: int = 0
    min_score: float = 0.0

    @classmethod
    def plain(cls) -> Decision:
        return cls(None, 0)


@dataclass(frozen=True)
class RequestOutcome:
    """What happened to one request in one step."""

    request_id: str
    workload: str
    proposer: str | None
    depth: int  # depth decided
    drafted: int  # tokens the proposer actually drafted (may be < depth)
    accepted: int  # of which the target accepted
    emitted: int  # tokens emitted (accepted + 1, fewer if the request stopped inside the run)


@dataclass(frozen=True)
class Outcome:
    """One decode step, measured: fed back to the policy (and to the cost model, stats)."""

    requests: tuple[RequestOutcome, ...]
    target_seconds: float  # the target forward (with verification)
    draft_seconds: dict[str, float]  # per proposer, all its draft steps this step
    draft_steps: dict[str, int]  # per proposer, how many batched draft forwards it ran
    tokens_per_row: int  # 1 + the deepest draft in the batch (the padded width of the forward)
    context: int  # mean context length of the batch
    step_seconds: float  # wall time of the whole step


@runtime_checkable
class Policy(Protocol):
    """Decides, per step and per request, whether and how deep to speculate."""

    name: str

    def decide(self, step: StepView) -> list[Decision]:
        """One decision per request of ``step.requests``, in order."""

    def observe(self, outcome: Outcome) -> None:
        """Learn from a finished step (optional: a stateless policy ignores it)."""
