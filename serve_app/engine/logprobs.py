"""The target's log-probabilities of tokens, for the requests that ask (OpenAI's ``logprobs``).

What the values are: ``log_softmax`` in float32 of the target's raw logits over the whole
vocabulary, before temperature, top-k and top-p (vLLM's default "raw" logprobs): the model's own
distribution, whatever the request samples with. For a greedy request the chosen token is the most
likely one; for a sampled one it may not be.

Where they come from: the forward that chose the tokens. The first generated token (and the
prompt's tokens, for ``prompt_logprobs``) from the prefill, every other token from the step's
verify forward, at the position that verified it. That forward is row-invariant (``exactness``):
the logits of a verified position are bit for bit the logits plain decoding computes there, and
``log_softmax`` and ``topk`` work on each row alone, so a request gets the same values with
speculation on or off, at any depth, in any batch.

Only requests that ask pay: the engine passes their rows alone, and a step where none asks costs a
list comprehension.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from serve_app.engine.token_logprobs import LogprobRun, Piece

# Prompt logits are made this many positions at a time: a long prompt never holds a whole
# [prompt, vocabulary] float32 block (512 x 152k would be 300 MB).
PROMPT_CHUNK = 128

_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet reversed: the character that stands for each byte -> the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for byte in range(256):
        if byte not in chars:
            chars[byte], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()


class TokenPieces:
    """Each token id's text and exact bytes (cached: each id is worked out once per engine)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, Piece] = {}

    def __call__(self, ids: Iterable[int]) -> dict[int, Piece]:
        """The pieces of ``ids``, by id."""
        return {i: self.piece(i) for i in ids}

    def piece(self, token_id: int) -> Piece:
        found = self._cache.get(token_id)
        if found is None:
            # The text is what vLLM shows (the token decoded alone); the bytes are the token's own,
            # which a client joins to rebuild characters split across tokens (OpenAI's `bytes`).
            text = self.tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            raw = self._raw_bytes(token_id)
            found = self._cache[token_id] = (text, raw if raw is not None else text.encode("utf-8"))
        return found

    def _raw_bytes(self, token_id: int) -> bytes | None:
        """The token's bytes where its vocabulary entry spells them: byte-level BPE (GPT-2, Llama 3,
        Qwen, SmolLM) or a SentencePiece byte-fallback token (``<0x0A>``); else None."""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):
            return None
        if self._byte_level and all(c in _BYTE_LEVEL for c in token):
            return bytes(_BYTE_LEVEL[c] for c in token)
        match = _SENTENCEPIECE_BYTE.fullmatch(token)
        return bytes([int(match.group(1), 16)]) if match else None


def _score(
    logits: torch.Tensor,  # [N, V] raw target logits, one row per position
    chosen: Sequence[int],  # [N] the token at each position
    tops: Sequence[int],  # [N] how many alternatives each position wants (0..MAX_LOGPROBS)
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """log p(chosen) per row, and each row's ``tops`` most likely tokens with their logprobs."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V] float32, each row on its own
    index = torch.tensor(list(chosen), dtype=torch.long, device=logp.device)  # [N]
    values = logp.gather(1, index.unsqueeze(1)).squeeze(1).tolist()  # [N]
    top_ids: list[list[int]] = [[] for _ in chosen]
    top_logprobs: list[list[float]] = [[] for _ in chosen]
    # One topk per distinct k: topk(k) is a function of the row and k alone, so a request's
    # alternatives (their order among ties included) never depend on what other requests ask.
    for k in sorted(set(tops) - {0}):
        members = [i for i, t in enumerate(tops) if t == k]
        best, ids = torch.topk(logp[members], min(k, logp.shape[1]), dim=-1)  # [M, k] each, sorted
        for i, row_values, row_ids in zip(members, best.tolist(), ids.tolist(), strict=True):
            top_ids[i], top_logprobs[i] = row_ids, row_values
    return values, top_ids, top_logprobs


def _run(
    ids: list[int], values: list[float | None], top_ids: list[list[int]], top_lps: list[list[float]],
    pieces: TokenPieces,
) -> LogprobRun:  # fmt: skip
    everything = {*ids, *(t for row in top_ids for t in row)}
    return LogprobRun(ids, values, top_ids, top_lps, pieces(everything))


def emitted_logprobs(
    logits: torch.Tensor,  # [B, T, V] the step's target logits (position j scored token j of a row)
    tokens: Sequence[list[int]],  # [B] the tokens each row emitted (accepted drafts + one of its own)
    tops: Sequence[int | None],  # [B] each request's ``logprobs`` (None: it asked for none)
    pieces: TokenPieces,
) -> list[LogprobRun | None]:  # [B]
    """The logprobs of every emitted token of the rows that asked; None for the others."""
    rows = [b for b, k in enumerate(tops) if k is not None and tokens[b]]
    out: list[LogprobRun | None] = [None] * len(tops)
    if not rows:
        return out
    device = logits.device
    row_idx = torch.tensor([b for b in rows for _ in tokens[b]], dtype=torch.long, device=device)  # [N]
    pos_idx = torch.tensor([j for b in rows for j in range(len(tokens[b]))], dtype=torch.long, device=device)
    chosen = [t for b in rows for t in tokens[b]]  # [N]
    wanted = [int(tops[b] or 0) for b in rows for _ in tokens[b]]  # [N]
    values, top_ids, top_lps = _score(logits[row_idx, pos_idx], chosen, wanted)  # [N, V] rows in
    start = 0
    for b in rows:
        end = start + len(tokens[b])
        out[b] = _run(
            chosen[start:end], list(values[start:end]), top_ids[start:end], top_lps[start:end], pieces
        )
        start = end
    return out


def prompt_logprobs(
    model: Any,  # DecoderModel: its output head (``logits``)
    hidden: torch.Tensor,  # [1, P, H] the prefill's final hidden states
    prompt_ids: Sequence[int],  # [P]
    top: int,
    pieces: TokenPieces,
) -> LogprobRun:
    """Each prompt token's logprob given the tokens before it (None for the first, which has no
    context, as OpenAI and vLLM answer), with ``top`` alternatives."""
    ids = list(prompt_ids)
    values: list[float | None] = [None]
    top_ids: list[list[int]] = [[]]
    top_lps: list[list[float]] = [[]]
    for start in range(0, len(ids) - 1, PROMPT_CHUNK):  # position i scores prompt token i + 1
        end = min(start + PROMPT_CHUNK, len(ids) - 1)
        logits = model.logits(hidden[:, start:end])[0]  # [n, V]
        chunk_values, chunk_ids, chunk_lps = _score(logits, ids[start + 1 : end + 1], [top] * (end - start))
        values.extend(chunk_values)
        top_ids.extend(chunk_ids)
        top_lps.extend(chunk_lps)
    return _run(ids, values, top_ids, top_lps, pieces)
