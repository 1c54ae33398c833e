"""Over the fake engine: a client that goes away closes the engine stream (which aborts the request),
and every request has its root span carrying the caller's trace context."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from serve_app.api import create_app
from serve_app.config import ServerSettings
from tests.serve.fake_engine import (
    CHAT,
    COMPLETION,
    MODEL,
    FakeEngine,
    engine,
    http,
)

__all__ = ["engine", "http"]  # fixtures used below


# --- client disconnects: the engine stream is closed (which aborts the request) -------------------------


async def drive(
    engine: FakeEngine, body: dict, asgi_version: str, disconnect_after: int
) -> tuple[list, list]:
    """Run one request against the ASGI app; the client goes away after ``disconnect_after`` body sends."""
    app = create_app(engine, ServerSettings())
    sent: list[dict] = []
    gone = asyncio.Event()
    payload = json.dumps(body).encode()
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set() and asgi_version == "2.4":
            raise OSError("connection lost")  # an ASGI 2.4 server's word for a vanished client
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= disconnect_after:
            gone.set()

    path = "/v1/chat/completions"
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": asgi_version}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    if disconnect_after == 0:
        gone.set()
    async with asyncio.timeout(5):
        await app(scope, receive, send)
    # Checked before the event loop gets a chance to finalize abandoned generators by itself.
    return sent, list(engine.aborted)


@pytest.mark.parametrize("asgi_version", ["2.3", "2.4"])
def test_stream_disconnect_closes_the_engine_stream(engine: FakeEngine, asgi_version: str) -> None:
    engine.hang_after = 2  # the client leaves while the engine is still generating
    sent, aborted = asyncio.run(drive(engine, {**CHAT, "stream": True}, asgi_version, disconnect_after=2))
    assert sent[0]["status"] == 200
    assert aborted == [engine.requests[0].request_id]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_any_output_closes_the_engine_stream(engine: FakeEngine, stream: bool) -> None:
    engine.hang_after = 0  # e.g. queued in the engine when the client gives up
    _, aborted = asyncio.run(drive(engine, {**CHAT, "stream": stream}, "2.3", disconnect_after=0))
    assert aborted == [engine.requests[0].request_id]


def test_testclient_stream_closed_early(http: TestClient, engine: FakeEngine) -> None:
    engine.hang_after = 3
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    deadline = time.monotonic() + 5
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.aborted == [engine.requests[0].request_id]


# --- tracing -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_root_span_and_trace_context(engine: FakeEngine, stream: bool) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    http = TestClient(create_app(engine, ServerSettings(), tracer=provider.get_tracer("test")))
    r = http.post(
        "/v1/chat/completions", json={**CHAT, "stream": stream, "max_tokens": 7, "temperature": 0.5}
    )
    assert r.status_code == 200
    _ = r.text
    (span,) = exporter.get_finished_spans()
    a = span.attributes
    assert span.name == f"chat {MODEL}" and span.parent is None
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"], a["gen_ai.request.max_tokens"]) == (
        "chat",
        MODEL,
        7,
    )
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (0.5, 1.0)
    assert a["gen_ai.response.id"] == engine.requests[0].request_id
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (5, 3)
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
    assert (a["specserve.proposer"], a["specserve.drafted"], a["specserve.accepted"]) == ("draft", 8, 6)
    assert (a["specserve.acceptance_rate"], a["specserve.mean_accepted_length"]) == (0.75, 4.0)
    traceparent = engine.requests[0].trace_context["traceparent"]
    assert traceparent.split("-")[1:3] == [f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"]
    exporter.clear()
    assert http.post("/v1/completions", json={**COMPLETION, "model": "nope"}).status_code == 404
    (span,) = exporter.get_finished_spans()
    assert span.name == "text_completion nope" and span.status.status_code is StatusCode.ERROR
