"""One trace per request, across the ingress and the replica: the ingress app of ``create_app`` over
an in-process AsyncEngine (tiny model), spans kept by an in-memory exporter.

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
    app = create_app(engine, ServerSettings(), tracer=tracer)
    with TestClient(app) as client:
        yield client, exporter
    engine.shutdown()
    provider.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_one_trace_from_ingress_to_decode(traced, stream: bool) -> None:
    client, exporter = traced
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_tokens": 24,
        "temperature": 0,
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
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert {"chat tiny", "queue", "decode"} <= set(spans), list(spans)
    root, queue, decode = spans["chat tiny"], spans["queue"], spans["decode"]
    assert root.kind == SpanKind.SERVER
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE  # continues the client's trace
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN
    for child in (queue, decode):
        assert child.context.trace_id == root.context.trace_id
        assert child.parent.span_id == root.context.span_id
    assert root.start_time <= queue.start_time <= queue.end_time <= decode.start_time <= decode.end_time
    assert decode.end_time <= root.end_time
    assert decode.attributes["specserve.drafted"] == speculation["drafted"] > 0
    assert decode.attributes["specserve.accepted"] == speculation["accepted"]
    assert decode.attributes["specserve.emitted_tokens"] == 24 - 1  # the first token is prefill's
    assert root.attributes["specserve.drafted"] == speculation["drafted"]
    assert root.attributes["gen_ai.usage.output_tokens"] == 24
