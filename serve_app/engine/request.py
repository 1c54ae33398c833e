"""A request's state inside the engine, and what the engine hands back after each step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from serve_app.engine.detokenizer import IncrementalDetokenizer
from serve_app.engine.sampling import SamplingParams
from serve_app.engine.stopping import StopChecker


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
    generator: torch.Generator | None  # None for greedy
    detokenizer: IncrementalDetokenizer
    stopper: StopChecker
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    aborted: bool = False

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
