"""A replica's spans of one request (``RequestSpans``): queue, prefill and decode, fed real
``RequestOutput``s at chosen ``time.perf_counter()`` moments, kept by an in-memory exporter."""

from __future__ import annotations

import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serve_app.config import TelemetrySettings
from serve_app.engine.request import RequestOutput, SpecStats
from serve_app.observability.request_spans import RequestSpans
from serve_app.observability.tracing import get_tracer, inject_context, setup_tracing
from serve_app.wire import GenerateError

MS = 1_000_000  # nanoseconds
SLACK = MS // 10  # converting perf_counter readings to wall time at different moments


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = setup_tracing(TelemetrySettings(), exporter, set_global=False)
    tracer = get_tracer(provider)
    root = tracer.start_span("chat m")
    carrier = inject_context(trace.set_span_in_context(root))
    yield tracer, carrier, root, exporter
    provider.shutdown()


def output(
    tokens: int,
    *,
    finished: bool = False,
    scheduled: float | None = None,
    drafted: int = 0,
    accepted: int = 0,
) -> RequestOutput:
    stats = None
    if finished:
        stats = SpecStats()
        stats.record("draft", 4, 3)
    return RequestOutput(
        request_id="r1",
        new_token_ids=list(range(tokens)),
        new_text="x" * tokens,
        finished=finished,
        finish_reason="length" if finished else None,
        prompt_tokens=11,
        completion_tokens=tokens,
        spec_stats=stats,
        step_proposer="draft" if drafted else None,
        step_drafted=drafted,
        step_accepted=accepted,
        scheduled_time=scheduled,
    )


def _by_name(exporter: InMemorySpanExporter) -> dict:
    finished = exporter.get_finished_spans()
    spans = {span.name: span for span in finished}
    assert len(spans) == len(finished)  # one span of each name
    return spans


def test_queue_prefill_decode_follow_the_request(traced) -> None:
    tracer, carrier, root, exporter = traced
    before = time.perf_counter()
    spans_of = RequestSpans(tracer, carrier, "r1")  # arrives between `before` and `base`
    base = time.perf_counter()
    # 10 ms in the queue, 20 ms of prefill, then two decode steps 10 ms apart.
    spans_of.on_output(output(1, scheduled=base + 0.010), base + 0.030, first=True)
    spans_of.on_output(output(4, drafted=4, accepted=3), base + 0.040, first=False)
    spans_of.on_output(output(2, finished=True, drafted=4, accepted=1), base + 0.050, first=False)
    root.end()
    spans = _by_name(exporter)
    assert set(spans) == {"chat m", "queue", "prefill", "decode"}
    queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
    for span in (queue, prefill, decode):
        assert span.parent.span_id == root.get_span_context().span_id
        assert span.context.trace_id == root.get_span_context().trace_id
        assert span.attributes["gen_ai.response.id"] == "r1"
    assert queue.end_time == prefill.start_time and prefill.end_time == decode.start_time
    waited = queue.end_time - queue.start_time
    assert 10 * MS - SLACK <= waited <= 10 * MS + (base - before) * 1e9 + SLACK
    assert abs(prefill.end_time - prefill.start_time - 20 * MS) <= SLACK
    assert abs(decode.end_time - decode.start_time - 20 * MS) <= SLACK
    assert prefill.attributes["gen_ai.usage.input_tokens"] == 11
    assert "gen_ai.usage.input_tokens" not in queue.attributes
    # decode: the speculation summary (the engine's SpecStats) and its step events
    assert decode.attributes["specserve.decode_steps"] == 2
    assert decode.attributes["specserve.emitted_tokens"] == 6
    assert decode.attributes["specserve.proposer"] == "draft"
    assert decode.attributes["specserve.drafted"] == 4  # SpecStats wins over the steps counted here
    assert decode.attributes["gen_ai.response.finish_reasons"] == ("length",)
    (event,) = decode.events
    assert event.name == "specserve.speculation"
    assert (event.attributes["specserve.drafted"], event.attributes["specserve.accepted"]) == (8, 4)


def test_a_first_output_that_is_the_last(traced) -> None:
    tracer, carrier, _, exporter = traced
    spans_of = RequestSpans(tracer, carrier, "r1")
    base = time.perf_counter()
    spans_of.on_output(output(1, finished=True, scheduled=base + 0.001), base + 0.002, first=True)
    spans_of.close("abort")  # after the final output: nothing more happens
    spans = _by_name(exporter)
    assert set(spans) == {"queue", "prefill", "decode"}
    assert spans["decode"].attributes["specserve.decode_steps"] == 0
    assert spans["decode"].attributes["gen_ai.response.finish_reasons"] == ("length",)


def test_no_slot_time_leaves_the_wait_to_the_queue(traced) -> None:
    tracer, carrier, _, exporter = traced
    spans_of = RequestSpans(tracer, carrier, "r1")
    spans_of.on_output(output(1), time.perf_counter() + 0.005, first=True)
    spans_of.close("abort")
    spans = _by_name(exporter)
    queue, prefill = spans["queue"], spans["prefill"]
    assert queue.end_time - queue.start_time >= 5 * MS - SLACK
    assert prefill.start_time == prefill.end_time == queue.end_time
    assert spans["decode"].attributes["gen_ai.response.finish_reasons"] == ("abort",)


def test_a_slot_time_before_arrival_is_clamped(traced) -> None:
    """Clocks converted at different moments never put the queue's end before its start."""
    tracer, carrier, _, exporter = traced
    spans_of = RequestSpans(tracer, carrier, "r1")
    now = time.perf_counter()
    spans_of.on_output(output(1, scheduled=now - 1.0), now, first=True)
    spans_of.close("abort")
    spans = _by_name(exporter)
    assert spans["queue"].end_time == spans["queue"].start_time == spans["prefill"].start_time


def test_an_error_before_any_output_ends_the_queue_span_only(traced) -> None:
    tracer, carrier, _, exporter = traced
    spans_of = RequestSpans(tracer, carrier, "r1")
    spans_of.close("error", GenerateError("the prompt is too long", status=400))
    (queue,) = exporter.get_finished_spans()
    assert queue.name == "queue"
    assert queue.status.status_code == trace.StatusCode.ERROR
    assert queue.attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert any(event.name == "exception" for event in queue.events)
