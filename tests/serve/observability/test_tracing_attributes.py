"""Tracing setup, W3C context propagation, GenAI attributes and the bounded decode span."""

from __future__ import annotations

import itertools

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from serve_app.config import TelemetrySettings
from serve_app.observability import tracing as telemetry
from serve_app.observability.request_spans import DecodeSpanRecorder
from serve_app.observability.tracing import (
    SPECULATION_EVENT,
    extract_context,
    gen_ai_request_attributes,
    gen_ai_span_name,
    gen_ai_usage_attributes,
    get_tracer,
    inject_context,
    resolve_otlp_endpoint,
    setup_tracing,
    speculation_attributes,
)


@pytest.fixture
def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = setup_tracing(TelemetrySettings(service_name="specserve-test"), exporter, set_global=False)
    yield provider, exporter
    provider.shutdown()


def _processors(provider: TracerProvider) -> tuple:
    return provider._active_span_processor._span_processors


def test_explicit_exporter_sees_spans_at_once_with_service_name(traced) -> None:
    provider, exporter = traced
    with get_tracer(provider).start_as_current_span("hello"):
        pass
    (span,) = exporter.get_finished_spans()  # SimpleSpanProcessor: no flush needed
    assert span.name == "hello"
    assert span.resource.attributes["service.name"] == "specserve-test"
    assert span.instrumentation_scope.name == "specserve"


def test_parent_and_child_across_inject_extract(traced) -> None:
    """Ingress opens the root span; the carrier crosses to the replica, whose span is its child."""
    provider, exporter = traced
    tracer = get_tracer(provider)
    with tracer.start_as_current_span("chat tiny") as root:
        carrier = inject_context()
    assert set(carrier) >= {"traceparent"}
    assert carrier["traceparent"].startswith("00-")
    # the replica side: nothing current, only the carrier (a plain dict that pickles)
    parent = extract_context(dict(carrier))
    with tracer.start_as_current_span("generate", context=parent):
        recorder = DecodeSpanRecorder(tracer, parent)
        recorder.on_step("draft", 4, 4, 2, 3)
        recorder.finish(None, "stop")
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"chat tiny", "generate", "decode"}
    trace_id = root.get_span_context().trace_id
    assert all(span.context.trace_id == trace_id for span in spans.values())
    assert spans["generate"].parent.span_id == root.get_span_context().span_id
    assert spans["decode"].parent.span_id == root.get_span_context().span_id
    assert spans["generate"].parent.is_remote


def test_inject_given_context_and_empty_carrier(traced) -> None:
    provider, _ = traced
    assert inject_context() == {}  # no span: nothing to propagate
    span = get_tracer(provider).start_span("x")
    carrier = inject_context(trace.set_span_in_context(span))
    span.end()
    assert f"{span.get_span_context().trace_id:032x}" in carrier["traceparent"]
    # a missing or broken carrier starts a new trace instead of failing
    for bad in ({}, {"traceparent": "garbage"}):
        assert not trace.get_current_span(extract_context(bad)).get_span_context().is_valid


def test_gen_ai_request_and_usage_attributes() -> None:
    request = gen_ai_request_attributes("chat", "qwen-tiny", 128, 0.7, 0.95)
    assert request == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "specserve",
        "gen_ai.system": "specserve",
        "gen_ai.request.model": "qwen-tiny",
        "gen_ai.request.max_tokens": 128,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.95,
    }
    # the optional request attributes, when set (top_k 0 is "off": left out, as above)
    optional = gen_ai_request_attributes(
        "text_completion",
        "m",
        8,
        0.0,
        1.0,
        top_k=40,
        seed=7,
        stop_sequences=["\n\n", "END"],
        stream=False,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
    )
    assert {k: v for k, v in optional.items() if k not in request} == {
        "gen_ai.request.top_k": 40.0,
        "gen_ai.request.seed": 7,
        "gen_ai.request.stop_sequences": ("\n\n", "END"),
        "gen_ai.request.stream": False,
        "gen_ai.request.presence_penalty": 0.5,
        "gen_ai.request.frequency_penalty": -1.0,
    }
    assert "gen_ai.request.top_k" not in gen_ai_request_attributes("chat", "m", 8, 1.0, 1.0, top_k=0)
    usage = gen_ai_usage_attributes(12, 34, ["stop", "length"], "chatcmpl-1")
    assert usage == {
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.response.finish_reasons": ("stop", "length"),
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 34,
    }
    assert gen_ai_span_name("chat", "qwen-tiny") == "chat qwen-tiny"


def test_speculation_attributes_prefix_and_drop_none() -> None:
    stats = {
        "proposer": "draft",
        "steps": 10,
        "spec_steps": 8,
        "drafted": 40,
        "accepted": 30,
        "acceptance_rate": 0.75,
        "mean_accepted_length": 4.75,
        "accepted_per_position": [8, 8, 7, 7],
    }
    attrs = speculation_attributes(stats)
    assert attrs["specserve.proposer"] == "draft"
    assert attrs["specserve.drafted"] == 40
    assert attrs["specserve.accepted"] == 30
    assert attrs["specserve.acceptance_rate"] == 0.75
    assert attrs["specserve.mean_accepted_length"] == 4.75
    assert attrs["specserve.spec_steps"] == 8
    assert attrs["specserve.accepted_per_position"] == (8, 8, 7, 7)
    plain = speculation_attributes({"proposer": None, "drafted": 0, "nested": {"a": 1, "deeper": {"b": 2}}})
    # None and non-attribute values dropped; one level of mapping flattened
    assert plain == {"specserve.drafted": 0, "specserve.nested.a": 1}


def test_attributes_are_accepted_by_a_span(traced) -> None:
    provider, exporter = traced
    with get_tracer(provider).start_as_current_span("chat m") as span:
        span.set_attributes(gen_ai_request_attributes("chat", "m", 8, 1.0, 1.0))
        span.set_attributes(gen_ai_usage_attributes(3, 8, ["length"], "r1"))
        span.set_attributes(speculation_attributes({"proposer": None, "drafted": 5, "accepted": 2}))
    (finished,) = exporter.get_finished_spans()
    assert finished.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert finished.attributes["specserve.drafted"] == 5
    assert "specserve.proposer" not in finished.attributes


def test_decode_span_bounded_events_for_1000_steps(traced) -> None:
    provider, exporter = traced
    recorder = DecodeSpanRecorder(get_tracer(provider), attributes={"gen_ai.request.model": "m"})
    for i in range(1000):
        plain = i % 10 == 0
        recorder.on_step(
            None if plain else "draft",
            0 if plain else 4,
            0 if plain else 4,
            0 if plain else 3,
            1 if plain else 4,
        )
    recorder.finish(
        {"proposer": "draft", "spec_steps": 900, "drafted": 3600, "accepted": 2700, "acceptance_rate": 0.75},
        "length",
    )
    (span,) = exporter.get_finished_spans()
    assert span.name == "decode"
    events = [e for e in span.events if e.name == SPECULATION_EVENT]
    assert 1 <= len(events) <= 64
    assert len(events) == len(span.events) == recorder.events_emitted
    # the events partition the steps and their counts add up to the totals
    assert events[0].attributes["specserve.step.first"] == 1
    assert events[-1].attributes["specserve.step.last"] == 1000
    for before, after in itertools.pairwise(events):
        assert after.attributes["specserve.step.first"] == before.attributes["specserve.step.last"] + 1
    assert sum(e.attributes["specserve.steps"] for e in events) == 1000
    assert sum(e.attributes["specserve.spec_steps"] for e in events) == 900
    assert sum(e.attributes["specserve.drafted"] for e in events) == 3600
    assert sum(e.attributes["specserve.accepted"] for e in events) == 2700
    assert sum(e.attributes["specserve.emitted"] for e in events) == 100 + 900 * 4
    assert events[0].attributes["specserve.proposers"] == ("draft",)
    assert events[0].attributes["specserve.depth.max"] == 4
    attrs = span.attributes
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["specserve.proposer"] == "draft"
    assert attrs["specserve.acceptance_rate"] == 0.75
    assert attrs["specserve.decode_steps"] == 1000
    assert attrs["specserve.emitted_tokens"] == 100 + 900 * 4
    assert attrs["specserve.span_events"] == len(events)


def test_decode_span_cap_holds_for_any_length(traced) -> None:
    provider, exporter = traced
    recorder = DecodeSpanRecorder(get_tracer(provider), event_every=1, max_events=8)
    for _ in range(100):
        recorder.on_step("ngram", 3, 3, 1, 2)
    recorder.finish(None, "stop")
    recorder.finish(None, "stop")  # a second finish is a no-op
    recorder.on_step("ngram", 3, 3, 1, 2)  # and so is a step after it
    (span,) = exporter.get_finished_spans()
    assert len(span.events) == 8
    assert span.events[-1].attributes["specserve.steps"] == 93  # the remainder, in the last event
    assert sum(e.attributes["specserve.steps"] for e in span.events) == 100
    # without stats, the summary comes from the recorded steps
    assert span.attributes["specserve.drafted"] == 300
    assert span.attributes["specserve.accepted"] == 100
    assert span.attributes["specserve.spec_steps"] == 100
    assert span.attributes["specserve.proposer"] == "ngram"
    assert span.attributes["specserve.mean_accepted_length"] == 2.0


def test_decode_span_records_errors(traced) -> None:
    provider, exporter = traced
    with pytest.raises(RuntimeError), DecodeSpanRecorder(get_tracer(provider)) as recorder:
        recorder.on_step(None, 0, 0, 0, 1)
        raise RuntimeError("boom")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" for e in span.events)
    with pytest.raises(ValueError):
        DecodeSpanRecorder(get_tracer(provider), event_every=0)


@pytest.mark.parametrize("exporter", ["none", "console"])
def test_none_and_console_exporters_construct(exporter: str) -> None:
    provider = setup_tracing(TelemetrySettings(exporter=exporter), set_global=False)
    try:
        processors = _processors(provider)
        if exporter == "none":
            assert processors == ()
        else:
            (processor,) = processors
            assert isinstance(processor, BatchSpanProcessor)
            assert isinstance(processor._batch_processor._exporter, ConsoleSpanExporter)
        with get_tracer(provider).start_as_current_span("s") as span:
            assert span.get_span_context().is_valid  # trace ids exist even with no exporter
    finally:
        provider.shutdown()


@pytest.mark.parametrize(
    ("protocol", "endpoint", "module"),
    [
        ("grpc", "http://127.0.0.1:9", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
        ("http", "http://127.0.0.1:9", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
    ],
)
def test_otlp_exporter_constructs_without_a_collector(protocol: str, endpoint: str, module: str) -> None:
    settings = TelemetrySettings(exporter="otlp", otlp_protocol=protocol, otlp_endpoint=endpoint)
    provider = setup_tracing(settings, set_global=False)
    (processor,) = _processors(provider)
    exporter = processor._batch_processor._exporter
    assert type(exporter).__module__ == module
    assert type(exporter).__name__ == "OTLPSpanExporter"
    # no span was made: shutdown exports nothing, so no connection is ever attempted
    provider.shutdown()


def test_resolve_otlp_endpoint() -> None:
    assert resolve_otlp_endpoint("http://c:4318", "http") == "http://c:4318/v1/traces"
    assert resolve_otlp_endpoint("http://c:4318/", "http") == "http://c:4318/v1/traces"
    assert resolve_otlp_endpoint("http://c:4318/v1/traces", "http") == "http://c:4318/v1/traces"
    assert resolve_otlp_endpoint("http://c:4317", "grpc") == "http://c:4317"
    assert resolve_otlp_endpoint(None, "http") is None


def test_global_provider_is_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    installed: list[TracerProvider] = []
    monkeypatch.setattr(
        telemetry.trace,
        "get_tracer_provider",
        lambda: installed[-1] if installed else trace.ProxyTracerProvider(),
    )
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", installed.append)
    first = setup_tracing(TelemetrySettings())
    second = setup_tracing(TelemetrySettings())  # refused gracefully: a warning, no exception
    assert installed == [first]
    assert isinstance(second, TracerProvider) and second is not first
    setup_tracing(TelemetrySettings(), set_global=False)
    assert installed == [first]


def test_speculation_attributes_of_real_spec_stats() -> None:
    from serve_app.engine.request import SpecStats

    stats = SpecStats()
    stats.record("draft", 4, 3)
    stats.record(None, 0, 0)
    attrs = speculation_attributes(stats.as_dict())
    assert attrs["specserve.proposer"] == "draft"
    assert attrs["specserve.spec_steps"] == 1
    assert attrs["specserve.mean_accepted_length"] == 4.0
    assert attrs["specserve.accepted_per_position"] == (1, 1, 1)
    assert attrs["specserve.steps_by_proposer.draft"] == 1 and "specserve.steps_by_proposer" not in attrs
    assert speculation_attributes(SpecStats().as_dict()).get("specserve.proposer") is None
