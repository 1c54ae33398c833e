"""One trace per request, across the ingress and the replica: the ingress app of ``create_app`` over
an in-process AsyncEngine (tiny model), spans kept by an in-memory exporter. The root span's GenAI
attributes, and the replica's ``queue`` / ``prefill`` / ``decode`` spans under it.

With Ray the two halves run in different processes; the only link is the W3C carrier in
``GenerateRequest.trace_context``, which is exactly what crosses here too.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from serve_app.api.routes import create_app
from serve_app.async_engine import AsyncEngine
from serve_app.config import ServerSettings, TelemetrySettings
from serve_app.observability.metrics import EngineMetrics
from serve_app.observability.tracing import get_tracer, setup_tracing
from tests.conftest import make_tiny_hf_model
from tests.serve.test_async_engine import make_engine

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
ALIAS = "tiny-alias"  # what clients ask for; the engine's model is "tiny" (gen_ai.response.model)
STOP = "\x00never\x00"  # a stop sequence the tiny model's text cannot contain


@pytest.fixture
def traced(tiny_tokenizer):
    exporter = InMemorySpanExporter()
    provider = setup_tracing(TelemetrySettings(), exporter=exporter, set_global=False)
    tracer = get_tracer(provider)
    target = make_tiny_hf_model(len(tiny_tokenizer), seed=0)
    engine = AsyncEngine(
        make_engine(target, tiny_tokenizer),
        model_name="tiny",
        metrics=EngineMetrics("tiny", backend="memory"),
        tracer=tracer,
    )
    app = create_app(engine, ServerSettings(served_model_name=ALIAS), tracer=tracer)
    with TestClient(app) as client:
        yield client, exporter
    engine.shutdown()
    provider.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_one_trace_from_ingress_to_decode(traced, stream: bool) -> None:
    client, exporter = traced
    body = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 24,
        "temperature": 0,
        "top_k": 40,
        "seed": 7,
        "stop": [STOP],
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}  # the client's own trace
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        speculation = next(e["speculation"] for e in events if e.get("speculation"))
    else:
        speculation = response.json()["speculation"]
    finished = exporter.get_finished_spans()
    spans = {span.name: span for span in finished}
    assert sorted(spans) == sorted(span.name for span in finished)  # one span of each name
    assert set(spans) == {f"chat {ALIAS}", "queue", "prefill", "decode"}, list(spans)
    root, queue, prefill, decode = (spans[name] for name in (f"chat {ALIAS}", "queue", "prefill", "decode"))
    assert root.kind == SpanKind.SERVER
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE  # continues the client's trace
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN
    for child in (queue, prefill, decode):
        assert child.context.trace_id == root.context.trace_id
        assert child.parent.span_id == root.context.span_id
        assert child.attributes["gen_ai.response.id"] == root.attributes["gen_ai.response.id"]
    assert root.start_time <= queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.start_time <= prefill.end_time == decode.start_time <= decode.end_time <= root.end_time
    assert prefill.attributes["gen_ai.usage.input_tokens"] == root.attributes["gen_ai.usage.input_tokens"] > 0
    assert decode.events and {event.name for event in decode.events} == {"specserve.speculation"}
    assert decode.attributes["specserve.drafted"] == speculation["drafted"] > 0
    assert decode.attributes["specserve.accepted"] == speculation["accepted"]
    assert decode.attributes["specserve.emitted_tokens"] == 24 - 1  # the first token is prefill's
    assert root.attributes["specserve.drafted"] == speculation["drafted"]
    assert root.attributes["gen_ai.usage.output_tokens"] == 24

    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "specserve"
    assert attrs["gen_ai.request.model"] == ALIAS
    assert attrs["gen_ai.response.model"] == "tiny"
    assert attrs["gen_ai.response.id"].startswith("chatcmpl-")
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.request.top_k"] == 40.0
    assert attrs["gen_ai.request.stop_sequences"] == (STOP,)
    assert attrs["gen_ai.request.stream"] is stream
    # Time to first token: at least until the replica's first output, at most the whole request.
    ttft_ns = attrs["specserve.time_to_first_token_s"] * 1e9
    assert prefill.end_time - root.start_time - 1e6 <= ttft_ns <= root.end_time - root.start_time
    if stream:
        assert attrs["gen_ai.response.time_to_first_chunk"] == attrs["specserve.time_to_first_token_s"]
    else:
        assert "gen_ai.response.time_to_first_chunk" not in attrs
