"""N-gram / prompt-lookup proposer: no model, no forward pass.

For each row the proposer takes the last ``n`` tokens of the sequence (prompt + output so far) and
looks for an EARLIER occurrence of them, trying ``n = max_ngram`` first and going down to
``min_ngram`` (a longer match is better evidence). On a match it proposes the up to ``depth``
tokens that followed the MOST RECENT earlier occurrence; if the sequence ends sooner, the draft is
shorter (it is never extended by copying the draft itself). No match gives an empty draft. The
draft is deterministic (``probs=None``), so verification treats q as one-hot and stays lossless.
This is vLLM's ``prompt_lookup_max`` / ``prompt_lookup_min``; the defaults here are 4 and 2
(unigram matches are frequent and rarely right, and every drafted token costs target compute).

Cost. ``propose`` runs every step for every row on sequences of thousands of tokens, so each slot
keeps an index ``n-gram tuple -> end positions of its most recent occurrences`` for every ``n`` in
range, covering the n-grams that end before the last token (the suffix itself is never its own
match). Given a node budget (``ProposeRow.nodes``), the continuations of older occurrences and of
shorter matches join the draft as alternatives: the trie of them all, the most recent longest
match its chain (``engine.tree``). Each call indexes only the tokens appended since the previous
one: O(new tokens x number of n) work plus O(number of n) lookups, independent of the sequence
length. ``admit`` indexes the prompt, ``release`` drops the index, ``commit`` does nothing: the
state follows ``token_ids``, which is the verified sequence and only grows (rejected drafts never
enter it). Should a row's
sequence ever shrink or change under the index (not expected in this engine) the slot's index is
rebuilt from scratch, so a stale position is never proposed from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from serve_app.engine.proposers.base import Draft, ProposeRow
from serve_app.engine.proposers.registry import ProposerContext
from serve_app.engine.tree import TokenTree

DEFAULT_MAX_NGRAM = 4
DEFAULT_MIN_NGRAM = 2
RECENT_ENDS = 4  # earlier occurrences of an n-gram remembered, for a tree's alternatives
# What an alternative continuation is credited with against a tree's floor (ProposeRow.min_score,
# policies.trees): a lookup has no probabilities, and older matches were rarely right where measured
# (no extra accepted token over the bench's six prompts, BENCHMARKS.md, twenty-fifth session), so
# they join only where a verify row is nearly free.
ALTERNATIVE_SCORE = 0.05


@dataclass
class _SlotIndex:
    """N-grams of one slot's sequence ending at positions ``<= indexed_end`` (exclusive ends)."""

    # n-gram -> its most recent ends, newest first (up to ``RECENT_ENDS``: a tree's alternatives)
    ends: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)
    indexed_end: int = 0  # every n-gram ending at e <= indexed_end is in ``ends``
    last_token: int | None = None  # token_ids[indexed_end - 1] when indexed: a cheap consistency check


class NgramProposer:
    """Prompt lookup: copy what followed the most recent earlier match of the sequence's suffix."""

    name = "ngram"
    branches = True  # given a node budget, what followed earlier occurrences joins as alternatives

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM) -> None:
        for label, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ngram proposer: {label} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"ngram proposer: min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._slots: dict[int, _SlotIndex] = {}

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> NgramProposer:
        """Build from settings options; reads ``max_ngram`` and ``min_ngram``, ignores other keys."""
        max_ngram = options.get("max_ngram", DEFAULT_MAX_NGRAM)
        # With only max_ngram set below the default minimum (e.g. 1), the minimum follows it down.
        default_min = min(DEFAULT_MIN_NGRAM, max_ngram) if _is_int(max_ngram) else DEFAULT_MIN_NGRAM
        min_ngram = options.get("min_ngram", default_min)
        return cls(max_ngram=max_ngram, min_ngram=min_ngram)  # type: ignore[arg-type]

    # -- Proposer protocol ---------------------------------------------------------------------

    def admit(self, slot: int, prompt_ids: list[int]) -> None:
        state = _SlotIndex()
        self._extend(state, prompt_ids)
        self._slots[slot] = state

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        drafts = []
        for row in rows:
            # alternatives only where they could pass the tree's floor: else the first match alone
            branching = row.nodes > 0 and row.min_score < ALTERNATIVE_SCORE
            paths = self._continuations(row, first_only=not branching)
            chain = paths[0] if paths else []
            tree = None
            if branching and len(paths) > 1:
                tree = TokenTree.of_paths(paths, max_nodes=len(chain) + row.nodes)
                tree = tree if len(tree) > len(chain) else None
            drafts.append(Draft(tokens=chain, tree=tree))
        return drafts

    def lookahead(self, row: ProposeRow) -> int:
        """How many tokens ``propose`` would draft for ``row`` (0: no match); the same lookup
        (it extends the slot's index as ``propose`` would, which ``propose`` then reuses)."""
        paths = self._continuations(row, first_only=True)
        return len(paths[0]) if paths else 0

    def commit(self, slot: int, num_accepted: int) -> None:
        """Nothing to do: the index follows ``token_ids``, which holds only verified tokens."""

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    # -- internals -----------------------------------------------------------------------------

    def _continuations(self, row: ProposeRow, first_only: bool = False) -> list[list[int]]:
        """What followed the suffix's earlier occurrences, most recent first, from the longest n
        that matches (the chain: the first); unless ``first_only``, also the older occurrences and
        the shorter n-grams' (a tree's alternatives)."""
        if row.depth < 0:
            raise ValueError(f"ngram proposer: depth must be >= 0, got {row.depth}")
        tokens = row.token_ids
        state = self._slots.get(row.slot)
        if state is None or not self._consistent(state, tokens):
            state = _SlotIndex()  # never admitted, or the sequence changed under us: rebuild
            self._slots[row.slot] = state
        self._extend(state, tokens)
        if row.depth == 0:
            return []
        length = len(tokens)
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            for end in state.ends.get(tuple(tokens[length - n :]), ()):
                # end <= length - 1: at least one token follows the match
                found.append(list(tokens[end : end + row.depth]))
                if first_only:
                    return found
        return found

    @staticmethod
    def _consistent(state: _SlotIndex, tokens: list[int]) -> bool:
        """The index may be extended to ``tokens``: it covers no position beyond them."""
        if state.indexed_end == 0:
            return True
        return len(tokens) > state.indexed_end and tokens[state.indexed_end - 1] == state.last_token

    def _extend(self, state: _SlotIndex, tokens: list[int]) -> None:
        """Index the n-grams ending at ``indexed_end + 1 .. len(tokens) - 1`` (not the suffix)."""
        target_end = len(tokens) - 1
        if target_end <= state.indexed_end:
            return
        ends = state.ends
        lo, hi = self.min_ngram, self.max_ngram
        for end in range(state.indexed_end + 1, target_end + 1):
            for n in range(lo, min(hi, end) + 1):
                key = tuple(tokens[end - n : end])
                ends[key] = (end, *ends.get(key, ())[: RECENT_ENDS - 1])
        state.indexed_end = target_end
        state.last_token = tokens[target_end - 1]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def build_ngram_proposer(context: ProposerContext) -> NgramProposer:
    """The registry's factory: options ``max_ngram`` and ``min_ngram``."""
    return NgramProposer.from_options(context.options)
