"""The spans of one request inside a replica: ``queue``, ``prefill`` and ``decode``.

``RequestSpans`` is what the replica's loop feeds; ``DecodeSpanRecorder`` makes the one ``decode``
span per request, with the speculation outcome of its steps aggregated into a bounded number of
span events. Both are no-ops unless a tracer provider exports spans.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from serve_app.observability.tracing import (
    SPECULATION_EVENT,
    AttributeValue,
    clean_attributes,
    extract_context,
    speculation_attributes,
)


@dataclass
class _StepCounts:
    """Decode steps summed over a range of steps (a whole request, or one event's window)."""

    first_step: int = 1  # 1-based index of the first step counted
    steps: int = 0
    spec_steps: int = 0  # steps that verified a non-empty draft
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    depth_max: int = 0
    proposers: set[str] = field(default_factory=set)
    last_proposer: str | None = None  # of the most recent step that had one (as SpecStats.proposer)

    def add(self, proposer: str | None, depth: int, drafted: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.spec_steps += drafted > 0
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.depth_max = max(self.depth_max, depth)
        if proposer is not None:
            self.proposers.add(proposer)
            self.last_proposer = proposer

    @property
    def acceptance_rate(self) -> float:
        return round(self.accepted / self.drafted, 4) if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculative step, as ``SpecStats`` defines it."""
        return round((self.accepted + self.spec_steps) / self.spec_steps, 4) if self.spec_steps else 0.0


class DecodeSpanRecorder:
    """One request's decoding as ONE ``decode`` span with at most ``max_events`` span events.

    The replica makes one per request, parented on the context extracted from the request's
    carrier, calls :meth:`on_step` after every engine step that decoded for the request and
    :meth:`finish` once at the end. Steps are aggregated: every ``event_every`` steps a
    ``specserve.speculation`` event records the counts since the previous event (steps, speculative
    steps, drafted, accepted, emitted, deepest depth, proposers used, and the window's step range).
    Once ``max_events - 1`` events are out, periodic events stop and :meth:`finish` writes the
    remainder as the last event, so a 1,000-token answer makes 1 span and at most ``max_events``
    events whatever its length.

    The span is never made current (one engine loop interleaves many requests); use
    :attr:`context` to parent further spans on it. As a context manager it finishes on exit,
    recording the exception if one escaped.
    """

    def __init__(
        self,
        tracer: Tracer,
        parent: Context | None = None,
        *,
        name: str = "decode",
        attributes: Mapping[str, object] | None = None,
        event_every: int = 16,
        max_events: int = 64,
        start_time: int | None = None,
    ) -> None:
        if event_every < 1:
            raise ValueError(f"event_every must be >= 1, got {event_every}")
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self._span: Span = tracer.start_span(
            name,
            context=parent,
            kind=trace.SpanKind.INTERNAL,
            attributes=clean_attributes(attributes or {}),
            start_time=start_time,
        )
        self._event_every = event_every
        self._max_events = max_events
        self._events = 0
        self._finished = False
        self._total = _StepCounts()
        self._window = _StepCounts()

    @property
    def span(self) -> Span:
        return self._span

    @property
    def context(self) -> Context:
        """A context holding the decode span, to parent child spans on."""
        return trace.set_span_in_context(self._span)

    @property
    def steps(self) -> int:
        return self._total.steps

    @property
    def events_emitted(self) -> int:
        return self._events

    @property
    def finished(self) -> bool:
        return self._finished

    def on_step(self, proposer: str | None, depth: int, drafted: int, accepted: int, emitted: int) -> None:
        """Record one engine step of this request (``depth`` 0 / ``proposer`` None: plain decoding)."""
        if self._finished:
            return
        self._total.add(proposer, depth, drafted, accepted, emitted)
        self._window.add(proposer, depth, drafted, accepted, emitted)
        if self._window.steps >= self._event_every and self._events < self._max_events - 1:
            self._flush()

    def _flush(self) -> None:
        window = self._window
        if not window.steps:
            return
        attributes: dict[str, AttributeValue] = {
            "specserve.step.first": window.first_step,
            "specserve.step.last": window.first_step + window.steps - 1,
            "specserve.steps": window.steps,
            "specserve.spec_steps": window.spec_steps,
            "specserve.drafted": window.drafted,
            "specserve.accepted": window.accepted,
            "specserve.emitted": window.emitted,
            "specserve.depth.max": window.depth_max,
        }
        if window.drafted:
            attributes["specserve.acceptance_rate"] = window.acceptance_rate
        if window.proposers:
            attributes["specserve.proposers"] = tuple(sorted(window.proposers))
        self._span.add_event(SPECULATION_EVENT, attributes)
        self._events += 1
        self._window = _StepCounts(first_step=self._total.steps + 1)

    def finish(
        self,
        stats: Mapping[str, object] | None = None,
        finish_reason: str | None = None,
        *,
        error: BaseException | None = None,
        end_time: int | None = None,
    ) -> None:
        """Write the last event and the summary attributes, and end the span (once; later calls no-op).

        ``stats`` is ``SpecStats.as_dict()``; without it the summary comes from the steps recorded
        here. ``error`` marks the span as failed and records the exception.
        """
        if self._finished:
            return
        self._finished = True
        self._flush()
        total = self._total
        summary: dict[str, object] = {
            "specserve.decode_steps": total.steps,
            "specserve.emitted_tokens": total.emitted,
            "specserve.span_events": self._events,
        }
        if stats is None:
            stats = {
                "proposer": total.last_proposer,
                "spec_steps": total.spec_steps,
                "drafted": total.drafted,
                "accepted": total.accepted,
                "acceptance_rate": total.acceptance_rate,
                "mean_accepted_length": total.mean_accepted_length,
            }
        summary.update(speculation_attributes(stats))
        if finish_reason is not None:
            summary["gen_ai.response.finish_reasons"] = (finish_reason,)
        self._span.set_attributes(clean_attributes(summary))
        if error is not None:
            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self._span.end(end_time=end_time)

    def __enter__(self) -> DecodeSpanRecorder:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.finish(error=exc)


def _wall_ns(perf_time: float) -> int:
    """A ``time.perf_counter()`` reading as wall-clock nanoseconds (what spans are stamped with)."""
    return time.time_ns() - int((time.perf_counter() - perf_time) * 1e9)


class RequestSpans:
    """The spans of one request in this replica (no-ops unless a tracer provider exports them).

    Three siblings, children of the ingress's root span, one after the other:

    - ``queue``: arrival at the replica to the moment the request got its KV slot
      (``RequestOutput.scheduled_time``);
    - ``prefill``: from the KV slot to the first output (the prompt's forward pass and the first
      token), with the prompt's token count;
    - ``decode`` (a ``DecodeSpanRecorder``): from the first output to the end, with the speculation
      outcome of every step aggregated into span events.

    Each carries ``gen_ai.response.id``. A request that ends before its first output has only its
    ``queue`` span, which then records the reason (and the error, if any).
    """

    def __init__(self, tracer: Any, carrier: dict[str, str], request_id: str) -> None:
        self._tracer = tracer
        self._parent = extract_context(carrier or {})
        self._ids = {"gen_ai.response.id": request_id}
        self._arrival_ns = time.time_ns()
        self._queue_span = tracer.start_span(
            "queue", context=self._parent, attributes=self._ids, start_time=self._arrival_ns
        )
        self._recorder: Any = None
        self._done = False

    def on_output(self, output: Any, at_perf: float, first: bool) -> None:
        """A ``RequestOutput`` made by the step that ended at ``at_perf`` (``time.perf_counter()``);
        ``first``: the request's first output (its prefill)."""
        if first:
            self._end_prefill(output, at_perf)
        elif self._recorder is not None:
            drafted = output.step_drafted
            self._recorder.on_step(
                output.step_proposer, drafted, drafted, output.step_accepted, len(output.new_token_ids)
            )
        if output.finished:
            stats = output.spec_stats.as_dict() if output.spec_stats is not None else None
            self._finish(stats, output.finish_reason, None, _wall_ns(at_perf))

    def _end_prefill(self, output: Any, at_perf: float) -> None:
        """Close ``queue`` at the KV slot, make ``prefill`` from there to now, and open ``decode``."""
        # An output without a slot time (an engine that does not stamp it) leaves the whole wait
        # to the queue span and an empty prefill at its end.
        scheduled = output.scheduled_time
        at = _wall_ns(at_perf)
        # Clamped into [arrival, first output]: the two clocks are converted at different moments.
        slot_ns = _wall_ns(scheduled) if scheduled is not None else at
        slot_ns = min(max(slot_ns, self._arrival_ns), at)
        self._queue_span.end(end_time=slot_ns)
        attributes = {**self._ids, "gen_ai.usage.input_tokens": output.prompt_tokens}
        prefill = self._tracer.start_span(
            "prefill", context=self._parent, attributes=attributes, start_time=slot_ns
        )
        prefill.end(end_time=at)
        self._recorder = DecodeSpanRecorder(self._tracer, self._parent, attributes=self._ids, start_time=at)

    def close(self, reason: str, error: Any = None) -> None:
        """The request ended without a final output: an error (a ``GenerateError``), an abort or a
        time-out."""
        exc = RuntimeError(f"{error.status} {error.type}: {error.message}") if error is not None else None
        self._finish(None, reason, exc, None)

    def _finish(
        self, stats: dict[str, Any] | None, reason: str | None, error: Exception | None, end_ns: int | None
    ) -> None:
        if self._done:
            return
        self._done = True
        if self._recorder is None:  # never got an output: the queue span is all there is
            if reason is not None:
                self._queue_span.set_attribute("gen_ai.response.finish_reasons", (reason,))
            if error is not None:
                self._queue_span.record_exception(error)
                self._queue_span.set_status(Status(StatusCode.ERROR, str(error)))
            self._queue_span.end(end_time=end_ns)
        else:
            self._recorder.finish(stats, reason, error=error, end_time=end_ns)
