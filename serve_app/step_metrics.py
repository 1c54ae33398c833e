"""What a replica's loop thread records after each engine step: request timing and ``EngineMetrics``.

``AsyncEngine`` hands every output of a step to :meth:`StepMetrics.output`, which stamps the
request's ``RequestStream`` (KV slot, first and latest output) and records what happened as it
happened: time to first token at the prefill that made it, inter-token latency at every later
output, the step's speculation outcome at :meth:`StepMetrics.end_step`, the per-request latencies
once, at :meth:`StepMetrics.finished`. A metrics failure is logged and never breaks the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from serve_app.observability.metrics import StepOutcome

if TYPE_CHECKING:
    from serve_app.engine.request import RequestOutput
    from serve_app.observability.metrics import EngineMetrics
    from serve_app.request_stream import RequestStream

log = logging.getLogger(__name__)


class StepMetrics:
    """Per-step bookkeeping of one replica's loop thread (not thread-safe: that thread only)."""

    def __init__(self, metrics: EngineMetrics | None) -> None:
        self.metrics = metrics
        self._outcomes: list[StepOutcome] = []

    def _record(self, what: str, call: Callable[[EngineMetrics], None]) -> None:
        if self.metrics is None:
            return
        try:
            call(self.metrics)
        except Exception:  # metrics must never cost a request
            log.exception("metrics: %s failed", what)

    def output(self, stream: RequestStream, output: RequestOutput, now: float) -> bool:
        """One request's output of the step that ended at ``now``; True when it is its first."""
        if stream.scheduled is None:
            stream.scheduled = output.scheduled_time
        tokens = len(output.new_token_ids)
        first = stream.first_output is None
        if first:
            stream.first_output = now
            self._record("first token", lambda m: m.on_first_token(now - stream.arrival, tokens))
        else:
            gap = now - (stream.last_output if stream.last_output is not None else now)
            self._record("tokens", lambda m: m.on_tokens(gap, tokens))
            if self.metrics is not None:
                self._outcomes.append(StepOutcome.of(output))
        stream.last_output = now
        return first

    def end_step(self) -> None:
        """The step's speculation outcome over the requests it decoded (prefills excluded)."""
        outcomes, self._outcomes = self._outcomes, []
        if outcomes:
            self._record("step", lambda m: m.on_step(len(outcomes), outcomes))

    def finished(self, stream: RequestStream, output: RequestOutput | None, reason: str, now: float) -> None:
        """A request ended (``output`` None when it ended without one: abort, error)."""
        completion = output.completion_tokens if output is not None else 0
        prompt = output.prompt_tokens if output is not None else 0
        timings = stream.timings(completion, now)
        self._record("request", lambda m: m.on_request_finished(timings, prompt, completion, reason))

    def refused(self, reason: str) -> None:
        """A request refused with 503 (``metric_names.ENGINE_QUEUE_FULL``)."""
        self._record("refused", lambda m: m.on_refused(reason))

    def load(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self._record("load", lambda m: m.set_load(running, waiting, kv_cache_usage))
