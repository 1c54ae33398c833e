"""Incremental detokenization: stream text out token by token, never half a character.

Decoding one token at a time does not work: a byte-level BPE token may hold only part of a UTF-8
character (an emoji is often 2-4 tokens), and SentencePiece-style decoders drop the leading space
of whatever comes first in the decoded list. Decoding everything generated so far at every step is
correct but quadratic. Instead we decode a short window: a few tokens that are already emitted
(the "prefix", there only for context) plus the tokens not yet emitted, and emit the difference
between the window's text and the prefix's text. The window then slides forward.

Known limit: with SentencePiece byte fallback, an *invalid* UTF-8 run of byte tokens is decoded as
one U+FFFD per byte, including bytes that were valid on their own (ASCII or a complete character)
and already streamed; text already sent cannot be taken back, so only for such garbage byte runs
can the stream differ from a full decode. Byte-level BPE replaces invalid bytes locally: no limit.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# How many already-emitted prompt tokens give context when continuing the prompt.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text chunks that are final when returned.

    By default the concatenation of everything `push` and `flush` return equals
    `tokenizer.decode(generated_ids, skip_special_tokens=True)` (space clean-up off, as transformers
    5 does for every BPE tokenizer). With `continue_prompt=True` the
    text is instead decoded as the continuation of the prompt's last few tokens; this differs only
    for SentencePiece-style tokenizers, where a word-initial first token then keeps its leading
    space (what a /v1/completions client appending the completion to its prompt expects). For
    byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, SmolLM) both modes give the same text.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int] = (),
        *,
        continue_prompt: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # The token list starts with the prompt context (possibly empty); generated ids follow.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) if continue_prompt else []
        # ids[prefix:read] were emitted and give context; ids[read:] are not emitted yet.
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        # Space clean-up (" ," -> ",") rewrites text across token boundaries, which would break
        # "window minus prefix"; transformers 5 never applies it to BPE tokenizers anyway.
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated tokens; return the text that became final ("" if none yet).

        Text is held back while the window's decoded text ends in U+FFFD, i.e. the last token(s)
        end inside a multi-byte character that later tokens will complete.
        """
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        # A shorter window text means the new tokens decoded to nothing yet (special tokens, or
        # bytes that only combine with what follows); an U+FFFD tail means an unfinished character.
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        new_text = window_text[len(prefix_text) :]
        # Slide: the tokens just emitted become the next window's context. They end on a character
        # boundary (the tail was not U+FFFD), so the next window never starts inside a character.
        self._prefix, self._read = self._read, len(self._ids)
        return new_text

    def flush(self) -> str:
        """Return whatever is still held back (at the end of the request), U+FFFD included."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        self._prefix, self._read = self._read, len(self._ids)
        return window_text[len(prefix_text) :]
