"""Continuous batching: who waits, who runs, and who gets a KV slot at the next step.

The scheduler owns the queues and the slot bookkeeping; it runs no model. Each engine step asks it
for a ``StepPlan``: requests admitted this step (to prefill) and requests already running (to
decode). Admission is first-come first-served while slots are free; the waiting queue is bounded
so that overload is refused at once rather than answered by a time-out.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from serve_app.engine.kv_cache import KVCache
from serve_app.engine.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429/503)."""


@dataclass(frozen=True)
class StepPlan:
    prefill: list[Request]  # admitted this step: allocate done, prompt not yet in the cache
    decode: list[Request]  # running, with one sampled token not yet fed


class Scheduler:
    """FIFO admission into a fixed number of KV slots."""

    def __init__(self, cache: KVCache, max_waiting: int) -> None:
        # The target's cache decides admission; proposers with caches of their own take the same
        # slot index when the engine admits the request to them.
        self.cache = cache
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
        self.waiting.append(request)

    def plan(self) -> StepPlan:
        """Admit what fits, then return this step's work."""
        decode = list(self.running)
        prefill: list[Request] = []
        while self.waiting and self.cache.num_free > 0:
            request = self.waiting.popleft()
            request.slot = self.cache.allocate()
            request.status = RequestStatus.RUNNING
            request.scheduled_time = time.perf_counter()
            prefill.append(request)
            self.running.append(request)
        return StepPlan(prefill=prefill, decode=decode)

    def finish(self, request: Request) -> None:
        """Release a request's slot (called once, when it finishes or aborts)."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.cache.free(request.slot)
            request.slot = None
        request.status = RequestStatus.FINISHED
