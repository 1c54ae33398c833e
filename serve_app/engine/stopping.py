"""Stop conditions for one request: EOS / stop tokens, stop strings, max_tokens.

The engine must call `StopChecker.feed` once per generated token, in order, even when speculation
accepts several tokens in one step. A stop can then fall inside an accepted run and cut exactly
where plain decoding would have stopped; the engine discards the tokens after the one that finished
the request (they are never streamed, counted or cached as output).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from serve_app.engine.params import SamplingParams

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StopResult:
    """What one `feed` call decided: text safe to emit now, and whether the request is done."""

    text: str
    finished: bool
    finish_reason: FinishReason | None


class StopChecker:
    """Tracks one request's output and decides when and why it ends (OpenAI finish reasons).

    - a token in `stop_token_ids` (EOS, user stop tokens) ends it with "stop"; its text is dropped;
    - a stop string ends it with "stop"; output is cut right before the string, which is excluded;
    - the `max_tokens`-th token ends it with "length" (unless it also stopped: "stop" wins).

    Text that could still turn into a stop string is held back, so nothing past a stop string is
    ever emitted; call `flush` once the request is finished to get what is still held.
    """

    def __init__(self, stop: tuple[str, ...], stop_token_ids: Iterable[int], max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.max_tokens = max_tokens
        self.num_tokens = 0  # tokens generated so far, the finishing one included
        self.finished = False
        self.finish_reason: FinishReason | None = None
        self.text = ""  # all text emitted so far
        self._held = ""  # text received but not emitted: it may be the start of a stop string
        self._cut_by_stop_string = False

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Iterable[int]) -> StopChecker:
        """Build from request params: EOS ids count unless `ignore_eos`; user stop ids always do."""
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids.update(eos_token_ids)
        return cls(params.stop, ids, params.max_tokens)

    def feed(self, token_id: int, text: str) -> StopResult:
        """Account for the next generated token and the text it added ("" while bytes are pending)."""
        if self.finished:
            raise RuntimeError("feed() called on a finished request")
        self.num_tokens += 1
        if token_id in self._stop_token_ids:
            # The stop token contributes no text; what was held is final and comes out of flush().
            return self._finish("stop", "")
        emitted = self._absorb(text)
        if self.finished:  # a stop string was found
            return StopResult(emitted, True, "stop")
        if self.num_tokens >= self.max_tokens:
            return self._finish("length", emitted)
        return StopResult(emitted, False, None)

    def flush(self, text: str = "") -> str:
        """At the end of a finished request, return the text still held back.

        `text` is anything the detokenizer still held (its `flush()`); it is checked for stop
        strings too. After a stop string nothing more is ever returned.
        """
        if not self.finished:
            raise RuntimeError("flush() called before the request finished")
        if self._cut_by_stop_string:
            return ""
        buffer = self._held + text
        self._held = ""
        cut = self._find_stop(buffer)
        if cut is not None:
            # The stop string completed in the last held bytes: it still cuts the output.
            buffer = buffer[:cut]
            self._cut_by_stop_string = True
            self.finish_reason = "stop"
        self.text += buffer
        return buffer

    def _finish(self, reason: FinishReason, emitted: str) -> StopResult:
        self.finished = True
        self.finish_reason = reason
        return StopResult(emitted, True, reason)

    def _find_stop(self, buffer: str) -> int | None:
        """Index of the earliest stop string occurrence in `buffer`, or None."""
        hits = [i for i in (buffer.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _absorb(self, text: str) -> str:
        """Add `text`, return the part that is safe to emit now, keep the rest held."""
        buffer = self._held + text
        cut = self._find_stop(buffer)
        if cut is not None:
            # Any stop string ending in the new text starts inside `buffer`, because every suffix
            # of earlier text that is a prefix of a stop string was held back.
            self.finished = True
            self.finish_reason = "stop"
            self._cut_by_stop_string = True
            self._held = ""
            self.text += buffer[:cut]
            return buffer[:cut]
        hold = self._partial_stop_len(buffer)
        safe, self._held = buffer[: len(buffer) - hold], buffer[len(buffer) - hold :]
        self.text += safe
        return safe

    def _partial_stop_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(buffer)), best, -1):
                if buffer.endswith(s[:n]):
                    best = n
                    break
        return best
