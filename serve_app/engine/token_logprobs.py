"""Log-probabilities of tokens, as data: what the engine hands back when a request asks for them.

Torch-free on purpose: a ``LogprobRun`` crosses the Ray handle inside ``wire.GenerateChunk`` and the
HTTP layer renders it (``api.logprobs_format``) without importing the engine. The engine fills it
(``engine.logprobs``) from the target's logits at the very positions that chose the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# The most alternatives a request may ask for per position (vLLM's default ``max_logprobs``; OpenAI
# allows 20 in chat and 5 in completions: we take 20 in both).
MAX_LOGPROBS = 20

# A token's text and its exact bytes. They differ where a token holds part of a character (byte-level
# BPE): the text then has a replacement character, the bytes are the token's own.
Piece = tuple[str, bytes]


@dataclass(frozen=True)
class LogprobRun:
    """The target's log-probabilities at consecutive positions, one entry per token.

    ``logprobs[i]`` is ``log p(token_ids[i] | every token before it)`` under the target's raw
    distribution (``engine.logprobs``); None where a token has no context (a prompt's first token).
    ``top_ids[i]`` / ``top_logprobs[i]`` are the most likely tokens at that position, most likely
    first (empty when the request asked for none, and for a prompt's first token). ``pieces`` has the
    text and bytes of every id above.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    pieces: dict[int, Piece] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {len(self.token_ids), len(self.logprobs), len(self.top_ids), len(self.top_logprobs)}
        if len(sizes) != 1:
            raise ValueError("a LogprobRun needs one logprob and one top list per token")

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, n: int) -> LogprobRun:
        """The first ``n`` entries (the tokens a stop condition kept)."""
        if n >= len(self):
            return self
        return LogprobRun(
            self.token_ids[:n], self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n], self.pieces
        )

    def piece(self, token_id: int) -> Piece:
        """The text and bytes of ``token_id`` (empty if the engine did not send them)."""
        return self.pieces.get(token_id, ("", b""))

    @staticmethod
    def concat(runs: Iterable[LogprobRun | None]) -> LogprobRun | None:
        """The runs one after the other; None when there is none."""
        present = [r for r in runs if r is not None]
        if len(present) <= 1:
            return present[0] if present else None
        pieces: dict[int, Piece] = {}
        for run in present:
            pieces.update(run.pieces)
        return LogprobRun(
            [t for r in present for t in r.token_ids],
            [x for r in present for x in r.logprobs],
            [t for r in present for t in r.top_ids],
            [t for r in present for t in r.top_logprobs],
            pieces,
        )
