"""Structured output: a request's grammar masks the target's tokens (llguidance).

Per request a ``Grammar`` (an ``llguidance.LLMatcher``) follows the tokens the request has EMITTED
(``catch_up`` reads ``output_ids``, which hold only plain-decoded and accepted tokens: a rejected
draft token never reaches the grammar). Each step:

1. ``trim_drafts``: a draft is cut before its first token the grammar refuses. The target's masked
   distribution gives such a token probability 0, so greedy and coupled verification (acceptance by
   equality with the target's choice) and a deterministic proposal could never accept it: the cut
   changes no output and makes the verify forward narrower. Rejection-sampling rows with a draft
   distribution q keep their draft whole: their recovered token comes from ``max(0, p - q)``, and
   cutting there would change that distribution.
2. ``constrain``: position j of a row (the row's last token, then its draft's) is scored after the
   emitted tokens plus the draft's first j; its logits outside the grammar's mask at that prefix
   become -inf (the grammar steps through the draft, then rolls back). That is exactly plain
   decoding's mask at that position, on plain decoding's logits row (``exactness``), so
   ``verify`` (and ``sampling.process_logits``) emit exactly plain decoding's tokens.

EOS (every id of the engine's) is allowed only where the grammar accepts; once the grammar is
complete, only EOS is. Logprobs stay the raw logits' (``engine.logprobs``), as for penalties.

Requests without ``params.structured`` have no ``Grammar``; a step where no row has one returns
the logits untouched and the drafts as they are (no copy, no work).

The library (llguidance: compile in about a millisecond, masks in tens of microseconds on a 150k
vocabulary, JSON strings without raw control characters) was chosen by measurement:
``loadtest/bench/grammar_libs.py``, BENCHMARKS.md "Structured output: choosing the grammar library".
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from serve_app.engine.proposers.base import Draft
from serve_app.engine.structured import LARK, StructuredOutput

log = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)  # bit j of a mask word is token 32 * word + j


class GrammarCompiler:
    """One engine's grammars: the tokenizer as llguidance sees it (built on the first structured
    request, about a second for a 150k vocabulary, then kept) and ``compile``."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(i for i in set(eos_ids) if 0 <= i < vocab_size)
        self._lltokenizer: Any = None
        self._lock = threading.Lock()

    def lltokenizer(self) -> Any:
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                if not self.eos_ids:
                    raise ValueError("structured output needs the model's end-of-text token, and it has none")
                self._lltokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_ids)
                )
            return self._lltokenizer

    def compile(self, spec: StructuredOutput) -> Grammar:
        """A fresh grammar state for ``spec``; raises ValueError when the schema cannot be compiled
        (invalid, or a feature llguidance does not support), naming why."""
        import llguidance

        matcher = llguidance.LLMatcher(self.lltokenizer(), spec.grammar(), log_level=0)
        if matcher.is_error():
            what = "grammar" if spec.kind == LARK else "JSON schema"
            raise ValueError(f"invalid {what}: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size, self.eos_ids)


class Grammar:
    """One request's grammar state, advanced by its emitted tokens only."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.words = (vocab_size + 31) // 32
        self.consumed = 0  # output tokens the matcher has taken
        self.failed = False  # the matcher refused an emitted token (ignore_eos past the end): EOS only

    def catch_up(self, output_ids: Sequence[int]) -> None:
        """Feed the tokens emitted since the last call."""
        new = list(output_ids[self.consumed :])
        self.consumed = len(output_ids)
        if new and not self.failed and not self.matcher.consume_tokens(new):
            # Only reachable past the grammar's end (ignore_eos keeps a finished grammar going).
            log.debug("grammar refused emitted tokens %s: %s", new, self.matcher.get_error())
            self.failed = True

    def accepted_prefix(self, draft: Sequence[int]) -> int:
        """How many of ``draft``'s first tokens the grammar allows, in order."""
        return 0 if self.failed or not draft else int(self.matcher.validate_tokens(list(draft)))

    def bitmasks(self, draft: Sequence[int]) -> torch.Tensor:  # [len(draft) + 1, words] int32
        """The allowed tokens at each position of a row: after the emitted tokens, then after each
        draft prefix (``draft`` must be allowed, ``accepted_prefix``); the state is put back."""
        masks = torch.zeros(len(draft) + 1, self.words, dtype=torch.int32)
        if self.failed:
            return self._eos_only(masks)
        fed = 0
        for j in range(len(draft) + 1):
            row = masks[j]
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
            if j < len(draft):
                if not self.matcher.consume_token(draft[j]):
                    raise AssertionError(f"draft token {draft[j]} was not allowed (trim_drafts first)")
                fed += 1
        if fed:
            self.matcher.rollback(fed)
        empty = ~masks.bool().any(dim=1)  # [T]: no token allowed (cannot happen; never a NaN row)
        if bool(empty.any()):
            masks[empty] = self._eos_only(masks[empty])
        return masks

    def _eos_only(self, masks: torch.Tensor) -> torch.Tensor:
        masks.zero_()
        for token in self.eos_ids:
            masks[:, token // 32] |= _bit(token % 32)
        return masks


def _bit(j: int) -> int:
    """Bit j of an int32 mask word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [T, V] bool
    """Unpack ``[T, words]`` int32 bitmasks into one boolean per token."""
    bits = (masks.unsqueeze(-1) >> _BITS) & 1  # [T, words, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


class Constrained(Protocol):
    """What this module reads of a request (``request.Request``)."""

    grammar: Grammar | None
    output_ids: list[int]
    generator: torch.Generator | None


def trim_drafts(requests: Sequence[Constrained], drafts: list[Draft]) -> list[Draft]:
    """Each draft cut before its first token the grammar refuses (module docstring, step 1)."""
    if all(r.grammar is None for r in requests):
        return drafts
    out = []
    for request, draft in zip(requests, drafts, strict=True):
        grammar = request.grammar
        # Rejection sampling against a draft distribution keeps its draft whole (module docstring).
        if grammar is None or not draft.tokens or (draft.probs is not None and request.generator is not None):
            out.append(draft)
            continue
        grammar.catch_up(request.output_ids)
        n = grammar.accepted_prefix(draft.tokens)
        if n < len(draft.tokens):
            draft = Draft(draft.tokens[:n], None if draft.probs is None else draft.probs[:n])
        out.append(draft)
    return out


def constrain(
    logits: torch.Tensor,  # [B, T, V] the step's target logits (penalized, if any request asked)
    requests: Sequence[Constrained],
    drafts: Sequence[list[int]],  # [B] the drafted tokens each row verifies (after trim_drafts)
) -> torch.Tensor:  # [B, T, V]: rows with a grammar masked; ``logits`` itself when no row has one
    """Logits outside each structured request's grammar set to -inf (module docstring, step 2)."""
    rows = [b for b, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return logits
    out = logits.clone()
    for b in rows:
        grammar = requests[b].grammar
        assert grammar is not None
        grammar.catch_up(requests[b].output_ids)
        draft = drafts[b]
        # A rejection-sampling row's untrimmed draft: positions past its first refused token are
        # never used (that token is rejected), so they are left unmasked.
        n = grammar.accepted_prefix(draft)
        allowed = allowed_tokens(grammar.bitmasks(draft[:n]), logits.shape[-1]).to(logits.device)  # [n+1, V]
        out[b, : n + 1].masked_fill_(~allowed, -math.inf)
    return out
