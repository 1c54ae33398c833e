"""One streamed request, measured from a scripted SSE stream (a fake session, a fake clock)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from loadtest.streaming import RequestRecord, stream_chat


class FakeResponse:
    def __init__(
        self, status: int, lines: list[str], text: str = "", headers: dict[str, str] | None = None
    ) -> None:
        self.status_code = status
        self._lines = lines
        self.text = text
        self.headers = headers or {}
        self.closed = False

    def iter_lines(self) -> Iterable[bytes]:
        for line in self._lines:
            yield line.encode()

    def close(self) -> None:
        self.closed = True


class FakeSession:
    def __init__(self, response: FakeResponse | Exception) -> None:
        self.response = response
        self.sent: dict[str, Any] = {}

    def post(self, url: str, *, json: Any, stream: bool, timeout: float) -> FakeResponse:
        self.sent = {"url": url, "json": json, "stream": stream}
        if isinstance(self.response, Exception):
            raise self.response
        return self.response


def ticks(*values: float) -> Iterator[float]:
    yield from values


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}"


SPEC = {"proposer": "draft", "steps": 3, "spec_steps": 3, "drafted": 9, "accepted": 6}


def chat_stream() -> list[str]:
    delta = lambda text: sse({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})  # noqa: E731
    return [
        sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        "",
        delta("Hello"),
        ": a comment line",
        delta(" big"),
        delta(" world"),
        sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "speculation": SPEC}),
        sse({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 9}, "speculation": SPEC}),
        "data: [DONE]",
    ]


def test_a_stream_is_measured() -> None:
    session = FakeSession(FakeResponse(200, chat_stream()))
    # clock: start, first text, second, third text, end
    clock = ticks(10.0, 10.5, 10.9, 11.3, 11.4)
    record = stream_chat(
        session,
        "http://x/v1/chat/completions",
        {"stream": True},
        RequestRecord("chat", 0, 0),
        clock=lambda: next(clock),
    )
    assert record.ok and record.finish_reason == "length"
    assert record.text == "Hello big world"
    assert record.output_tokens == 9 and record.prompt_tokens == 12  # the server's count, not chunks
    assert record.ttft_s == 0.5
    assert abs(record.tpot_s - (11.3 - 10.5) / 8) < 1e-9
    assert abs(record.latency_s - 1.4) < 1e-9
    assert (record.proposer, record.drafted, record.accepted, record.spec_steps) == ("draft", 9, 6, 3)
    assert session.sent["stream"] is True and session.response.closed
    assert "text" not in json.loads(record.to_json())
    assert RequestRecord.from_dict(json.loads(record.to_json())).output_tokens == 9


def test_errors_are_recorded_not_raised() -> None:
    refused = stream_chat(
        FakeSession(FakeResponse(503, [], text='{"error": "busy"}')), "u", {}, RequestRecord("x", 0, 0)
    )
    assert not refused.ok and refused.status == 503 and "503" in refused.error
    assert refused.retry_after_s is None  # no header sent
    asked = FakeResponse(503, [], text="{}", headers={"Retry-After": "2"})
    assert stream_chat(FakeSession(asked), "u", {}, RequestRecord("x", 0, 0)).retry_after_s == 2.0
    dated = FakeResponse(429, [], headers={"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"})
    assert stream_chat(FakeSession(dated), "u", {}, RequestRecord("x", 0, 0)).retry_after_s is None
    broken = stream_chat(FakeSession(ConnectionError("refused")), "u", {}, RequestRecord("x", 0, 0))
    assert not broken.ok and "ConnectionError" in broken.error
    error_event = [
        sse({"choices": [{"delta": {"content": "a"}}]}),
        sse({"error": {"message": "timed out"}}),
        "data: [DONE]",
    ]
    failed = stream_chat(FakeSession(FakeResponse(200, error_event)), "u", {}, RequestRecord("x", 0, 0))
    assert failed.error == "stream error: timed out"
    cut = stream_chat(FakeSession(FakeResponse(200, chat_stream()[:5])), "u", {}, RequestRecord("x", 0, 0))
    assert not cut.ok and "[DONE]" in cut.error
