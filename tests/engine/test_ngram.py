"""The n-gram / prompt-lookup proposer: what it proposes, and that its incremental index is exact."""

from __future__ import annotations

import random

import pytest

from serve_app.engine.params import SamplingParams
from serve_app.engine.proposers.base import Draft, Proposer, ProposeRow
from serve_app.engine.proposers.ngram import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, NgramProposer

GREEDY = SamplingParams(temperature=0.0)


def row(tokens: list[int], depth: int, slot: int = 0) -> ProposeRow:
    return ProposeRow(slot=slot, token_ids=list(tokens), depth=depth, params=GREEDY, generator=None)


def propose_one(proposer: NgramProposer, tokens: list[int], depth: int, slot: int = 0) -> list[int]:
    (draft,) = proposer.propose([row(tokens, depth, slot)])
    assert draft.probs is None
    return draft.tokens


def reference(tokens: list[int], depth: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Brute force: longest n first; for it, the most recent earlier occurrence of the suffix."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # end < length: never the suffix itself
            if tokens[end - n : end] == suffix:
                return tokens[end : end + depth]
    return []


def test_satisfies_protocol_and_defaults():
    proposer = NgramProposer()
    assert isinstance(proposer, Proposer)
    assert proposer.name == "ngram"
    assert (proposer.max_ngram, proposer.min_ngram) == (DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM) == (4, 2)


def test_repeated_pattern_proposes_continuation():
    assert propose_one(NgramProposer(), [1, 2, 3, 4, 5, 9, 1, 2, 3], depth=2) == [4, 5]


def test_picks_most_recent_match():
    assert propose_one(NgramProposer(), [1, 2, 7, 1, 2, 8, 5, 1, 2], depth=1) == [8]


def test_longer_ngram_preferred_over_shorter():
    tokens = [5, 1, 2, 7, 9, 1, 2, 8, 5, 1, 2]
    # The 3-gram [5, 1, 2] matched at the start beats the more recent 2-gram [1, 2].
    assert propose_one(NgramProposer(max_ngram=3, min_ngram=2), tokens, depth=1) == [7]
    assert propose_one(NgramProposer(max_ngram=2, min_ngram=2), tokens, depth=1) == [8]


def test_no_match_gives_empty_draft():
    proposer = NgramProposer()
    assert propose_one(proposer, [1, 2, 3, 4], depth=3) == []
    assert propose_one(proposer, [], depth=3, slot=1) == []
    assert propose_one(proposer, [7], depth=3, slot=2) == []
    # A unigram match only counts when min_ngram allows it.
    assert propose_one(NgramProposer(min_ngram=2), [1, 2, 3, 1], depth=2) == []
    assert propose_one(NgramProposer(min_ngram=1), [1, 2, 3, 1], depth=2) == [2, 3]


def test_suffix_is_not_its_own_match():
    proposer = NgramProposer(max_ngram=2, min_ngram=1)
    assert propose_one(proposer, [1, 2], depth=2) == []
    assert propose_one(proposer, [4, 4], depth=2, slot=1) == [4]  # the earlier 4 overlaps the suffix
    assert propose_one(proposer, [4, 4, 4], depth=2, slot=2) == [4]


def test_depth_limits_length():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose_one(NgramProposer(), tokens, depth=3) == [3, 4, 5]
    assert propose_one(NgramProposer(), tokens, depth=1) == [3]
    assert propose_one(NgramProposer(), tokens, depth=0) == []


def test_draft_shorter_when_sequence_ends():
    assert propose_one(NgramProposer(), [1, 2, 3, 1, 2], depth=5) == [3, 1, 2]
    assert propose_one(NgramProposer(), [9, 1, 2, 1, 2], depth=5) == [1, 2]


def test_negative_depth_is_an_error():
    with pytest.raises(ValueError, match="depth"):
        NgramProposer().propose([row([1, 2, 1], depth=-1)])


@pytest.mark.parametrize(
    ("max_ngram", "min_ngram", "vocab"),
    [(4, 2, 3), (4, 1, 4), (1, 1, 5), (3, 3, 2), (6, 2, 6)],
)
def test_incremental_index_equals_brute_force(max_ngram, min_ngram, vocab):
    rng = random.Random(1000 * max_ngram + 10 * min_ngram + vocab)
    proposer = NgramProposer(max_ngram=max_ngram, min_ngram=min_ngram)
    sequences: dict[int, list[int]] = {}
    for slot in range(4):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        proposer.admit(slot, prompt)
        sequences[slot] = [*prompt, rng.randrange(vocab)]
    for _step in range(100):
        slots = rng.sample(sorted(sequences), k=rng.randint(1, len(sequences)))
        depths = [rng.randint(0, 6) for _ in slots]
        drafts = proposer.propose([row(sequences[s], d, s) for s, d in zip(slots, depths, strict=True)])
        assert len(drafts) == len(slots)
        for slot, depth, draft in zip(slots, depths, drafts, strict=True):
            assert draft.tokens == reference(sequences[slot], depth, max_ngram, min_ngram)
            assert draft.probs is None
            # Accept some of the draft (or not) plus one token of the target's, as the engine does.
            accepted = rng.randint(0, len(draft.tokens))
            proposer.commit(slot, accepted)
            sequences[slot] += [*draft.tokens[:accepted], rng.randrange(vocab)]


def test_long_sequence_grows_one_token_at_a_time():
    rng = random.Random(7)
    tokens = [rng.randrange(50) for _ in range(3000)]
    proposer = NgramProposer(max_ngram=4, min_ngram=1)
    proposer.admit(0, tokens)
    for _ in range(100):
        draft = propose_one(proposer, tokens, depth=4)
        assert draft == reference(tokens, 4, 4, 1)
        tokens.append(draft[0] if draft and rng.random() < 0.7 else rng.randrange(50))


def test_admit_and_release_isolate_slots():
    proposer = NgramProposer()
    proposer.admit(0, [1, 2, 3, 9])
    proposer.admit(1, [1, 2, 4, 9])
    assert propose_one(proposer, [1, 2, 3, 9, 1, 2], depth=2, slot=0) == [3, 9]
    assert propose_one(proposer, [1, 2, 4, 9, 1, 2], depth=2, slot=1) == [4, 9]

    proposer.release(0)
    proposer.release(0)  # releasing twice (or an unknown slot) is harmless
    proposer.release(42)
    proposer.admit(0, [1, 2, 5])
    assert propose_one(proposer, [1, 2, 5, 1, 2], depth=1, slot=0) == [5]
    assert propose_one(proposer, [1, 2, 4, 9, 1, 2, 4], depth=2, slot=1) == [9, 1]

    # Admitting over a slot without releasing it first also starts from a clean index.
    proposer.admit(1, [7, 8])
    assert propose_one(proposer, [7, 8, 1, 2], depth=2, slot=1) == []


def test_sequence_that_changes_under_the_index_is_rebuilt():
    proposer = NgramProposer(max_ngram=2, min_ngram=1)
    assert propose_one(proposer, [1, 2, 3, 4, 5, 6, 1, 2], depth=2) == [3, 4]
    # Shorter than what was indexed: no stale position may be proposed from.
    assert propose_one(proposer, [6, 2, 6], depth=3) == [2, 6]
    # Longer than what was indexed, but with a different history.
    assert propose_one(proposer, [9, 9, 8, 7, 9], depth=2) == [8, 7]


def test_several_rows_in_one_call():
    proposer = NgramProposer()
    rows = [
        row([1, 2, 3, 1, 2], depth=1, slot=3),
        row([5, 6, 7], depth=4, slot=0),
        row([4, 4, 4, 4, 4], depth=3, slot=1),
    ]
    drafts = proposer.propose(rows)
    assert all(isinstance(d, Draft) and d.probs is None for d in drafts)
    assert [d.tokens for d in drafts] == [[3], [], [4]]
    assert proposer.propose([]) == []


def test_options():
    assert (NgramProposer.from_options({}).max_ngram, NgramProposer.from_options({}).min_ngram) == (4, 2)
    p = NgramProposer.from_options({"max_ngram": 1, "draft_path": "ignored"})
    assert (p.max_ngram, p.min_ngram) == (1, 1)
    p = NgramProposer.from_options({"max_ngram": 6, "min_ngram": 3})
    assert (p.max_ngram, p.min_ngram) == (6, 3)
    for bad in ({"max_ngram": 0}, {"min_ngram": 5}, {"max_ngram": "4"}, {"min_ngram": True}):
        with pytest.raises(ValueError, match="ngram"):
            NgramProposer.from_options(bad)


def test_lookahead_says_what_propose_will_draft():
    rng = random.Random(3)
    proposer, reference_proposer = NgramProposer(3, 1), NgramProposer(3, 1)
    tokens = [rng.randrange(6) for _ in range(5)]
    proposer.admit(0, tokens[:-1])
    reference_proposer.admit(0, tokens[:-1])
    for _ in range(60):
        depth = rng.randrange(0, 6)
        ahead = proposer.lookahead(row(tokens, depth))
        assert (
            ahead
            == len(propose_one(proposer, tokens, depth))
            == len(propose_one(reference_proposer, tokens, depth))
        )
        tokens.append(rng.randrange(6))
