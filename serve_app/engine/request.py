"""A request's state inside the engine, and what the engine hands back after each step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from serve_app.engine.detokenizer import IncrementalDetokenizer
from serve_app.engine.grammar import Grammar
from serve_app.engine.params import SamplingParams, SpecOverride
from serve_app.engine.penalties import PenaltyState
from serve_app.engine.sampling import PositionNoise
from serve_app.engine.stopping import StopChecker
from serve_app.engine.token_logprobs import LogprobRun


@dataclass
class SpecStats:
    """What speculation did for one request."""

    steps: int = 0  # decode steps (each emits >= 1 token)
    spec_steps: int = 0  # decode steps that verified a non-empty draft
    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # draft tokens the target kept
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts accepted at depth j+1
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: drafts verified at depth j+1
    proposer: str | None = None  # the proposer of the most recent speculative step
    steps_all_accepted: int = 0  # speculative steps whose whole draft was kept (+ a bonus token)
    steps_none_accepted: int = 0  # speculative steps whose first draft token was rejected
    tree_steps: int = 0  # speculative steps that verified a token tree (engine.tree)
    steps_by_proposer: dict[str, int] = field(default_factory=dict)  # speculative steps of each proposer

    def record(self, proposer: str | None, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One step: ``drafted`` tokens verified (a tree's nodes), ``accepted`` kept; ``depth``: a
        tree's longest path (its positions; default: the chain, ``drafted``)."""
        tree = depth is not None
        depth = drafted if depth is None else depth
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.spec_steps += 1
            self.tree_steps += tree
            if proposer is not None:
                self.steps_by_proposer[proposer] = self.steps_by_proposer.get(proposer, 0) + 1
            self.steps_all_accepted += accepted == depth
            self.steps_none_accepted += accepted == 0
        if proposer is not None:
            self.proposer = proposer
        for counts, n in ((self.drafted_per_position, depth), (self.accepted_per_position, accepted)):
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculative step (accepted drafts + the target's own token)."""
        return (self.accepted + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "proposer": self.proposer,
            "steps": self.steps,
            "spec_steps": self.spec_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "tree_steps": self.tree_steps,
            "steps_by_proposer": dict(self.steps_by_proposer),
        }


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV slot yet
    RUNNING = "running"  # owns a slot; prefilled
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request.

    Invariant while running: the slot's cache holds ``prompt_ids + output_ids[:-1]``; the last
    generated token has been sampled but not yet fed through the model (the next step feeds it).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # rejection sampling's stream; None for greedy and coupled
    detokenizer: IncrementalDetokenizer
    stopper: StopChecker
    speculation: SpecOverride = field(default_factory=SpecOverride)
    spec_stats: SpecStats = field(default_factory=SpecStats)
    proposers_admitted: set[str] = field(default_factory=set)  # proposers holding state for it
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # when it got its KV slot (the end of its queueing)
    first_token_time: float | None = None
    finish_time: float | None = None
    aborted: bool = False
    noise: PositionNoise | None = None  # coupled sampling (sampling.PositionNoise); None otherwise
    penalties: PenaltyState | None = None  # penalties / logit_bias (engine.penalties); None: none
    grammar: Grammar | None = None  # structured output (engine.grammar); None: free text

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def finish_reason(self) -> str | None:
        if self.aborted:
            return "abort"
        return self.stopper.finish_reason

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def tokens_left(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def noise_at(self) -> tuple[PositionNoise, int] | None:
        """(noise, output index of the next token) for a coupled request, else None."""
        return None if self.noise is None else (self.noise, len(self.output_ids))


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: new tokens and the text that is now final."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    spec_stats: SpecStats | None = None  # set on the final output
    step_proposer: str | None = None  # this step's speculation for the request (None = plain)
    step_drafted: int = 0  # draft tokens verified this step
    step_accepted: int = 0  # of which accepted
    step_alternatives: int = 0  # of the verified, a token tree's alternatives beside its chain
    scheduled_time: float | None = None  # time.perf_counter() when the request got its KV slot
    logprobs: LogprobRun | None = None  # of new_token_ids, when the request asked (params.logprobs)
    prompt_logprobs: LogprobRun | None = None  # of the prompt, on the first output (params.prompt_logprobs)


@dataclass(frozen=True)
class Completion:
    """A whole finished request (the non-streaming result)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    time_to_first_token: float | None
    duration: float
    spec_stats: SpecStats | None = None
    logprobs: LogprobRun | None = None  # of token_ids, when the request asked (params.logprobs)
    prompt_logprobs: LogprobRun | None = None  # of prompt_ids (params.prompt_logprobs)
