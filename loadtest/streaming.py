"""One streamed chat completion, measured: time to first token, time per output token, tokens, and
the server's ``speculation`` block.

The server streams Server-Sent Events (``data: {...}`` lines, ``data: [DONE]`` last). Content
chunks carry text; the chunk with ``finish_reason`` and, with ``stream_options.include_usage``, a
last chunk with ``usage`` (and no choices) carry the ``speculation`` block
(``serve_app/api/protocol.py``: proposer, steps, drafted, accepted, acceptance rate, ...). Output
tokens are the server's ``usage.completion_tokens``: a chunk may carry several tokens (accepted
drafts arrive together), so counting chunks would undercount.

- TTFT: from sending the request to the first chunk with non-empty text.
- TPOT: (last text chunk - first text chunk) / (output tokens - 1), as vLLM's benchmarks define it.
- latency: from sending the request to the end of the stream.

Works with any ``requests``-like session (Locust patches sockets with gevent; the tests pass fakes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class _Response(Protocol):
    status_code: int

    def iter_lines(self) -> Iterable[bytes | str]: ...

    def close(self) -> None: ...

    @property
    def text(self) -> str: ...


class Session(Protocol):
    def post(self, url: str, *, json: Any, stream: bool, timeout: float) -> _Response: ...


@dataclass
class RequestRecord:
    """What one request did, as the client saw it (one JSON line of the records file)."""

    workload: str
    user: int
    start: float  # wall-clock seconds (time.time()) when the request was sent
    latency_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    status: int = 0
    error: str | None = None
    retry_after_s: float | None = None  # a refusal's Retry-After header (seconds), if it sent one
    proposer: str | None = None
    steps: int = 0
    spec_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    text: str = field(default="", repr=False)  # the answer (for chat history); not written out

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end(self) -> float:
        return self.start + self.latency_s

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("text")
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def _events(lines: Iterable[bytes | str]) -> Iterable[str]:
    """The ``data:`` payloads of an SSE stream (comments, blank lines and other fields skipped)."""
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        if line.startswith("data:"):
            yield line[5:].strip()


def stream_chat(
    session: Session,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    timeout: float = 600.0,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    """Send ``body`` (``"stream": true``) to ``url`` and fill ``record`` from the stream; never raises
    for HTTP or stream errors (they end up in ``record.error``)."""
    record.start = time.time()
    started = clock()
    first = last = None
    text: list[str] = []
    try:
        response = session.post(url, json=body, stream=True, timeout=timeout)
        record.status = response.status_code
        try:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {response.text[:300]}"
                record.retry_after_s = _retry_after(getattr(response, "headers", None) or {})
                return record
            done = False
            for payload in _events(response.iter_lines()):
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk and "choices" not in chunk:
                    error = chunk["error"]
                    record.error = (
                        f"stream error: {error.get('message', error) if isinstance(error, dict) else error}"
                    )
                    break
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if content:
                        now = clock()
                        first = first if first is not None else now
                        last = now
                        text.append(content)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    record.output_tokens = int(usage.get("completion_tokens", 0))
                    record.prompt_tokens = int(usage.get("prompt_tokens", 0))
                _take_speculation(record, chunk.get("speculation"))
            if record.error is None and not done:
                record.error = "stream ended without [DONE]"
        finally:
            response.close()
    except Exception as exc:  # connection refused / reset, time-out, bad JSON
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.latency_s = clock() - started
        record.text = "".join(text)
        if first is not None:
            record.ttft_s = first - started
            if last is not None and record.output_tokens > 1:
                record.tpot_s = (last - first) / (record.output_tokens - 1)
    if record.error is None and record.finish_reason is None:
        record.error = "stream ended without a finish_reason"
    return record


def _retry_after(headers: Any) -> float | None:
    """The ``Retry-After`` header in seconds (the delay form; an HTTP date is not used here)."""
    value = headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _take_speculation(record: RequestRecord, block: dict[str, Any] | None) -> None:
    if not block:
        return
    record.proposer = block.get("proposer")
    record.steps = int(block.get("steps", 0))
    record.spec_steps = int(block.get("spec_steps", 0))
    record.drafted = int(block.get("drafted", 0))
    record.accepted = int(block.get("accepted", 0))
