"""Tests for serve_app.engine.stopping.StopChecker."""

from __future__ import annotations

import pytest

from serve_app.engine.params import SamplingParams
from serve_app.engine.stopping import StopChecker, StopResult

EOS = 2


def _run(checker: StopChecker, pieces: list[str | int]) -> tuple[list[str], str]:
    """Feed text pieces (token id 100 + i) or bare ints (stop tokens, no text) until finished.

    Returns the chunks emitted by feed and what flush added at the end ("" if never finished).
    """
    chunks = []
    for i, piece in enumerate(pieces):
        result = checker.feed(piece, "") if isinstance(piece, int) else checker.feed(100 + i, piece)
        chunks.append(result.text)
        if result.finished:
            return chunks, checker.flush()
    return chunks, ""


def test_stop_string_spanning_several_tokens() -> None:
    checker = StopChecker(("###",), {EOS}, 100)
    chunks, tail = _run(checker, ["Hello", " #", "#", "# world", " more"])
    assert chunks == ["Hello", " ", "", ""]
    assert (checker.finished, checker.finish_reason, checker.num_tokens) == (True, "stop", 4)
    assert checker.text == "Hello " and tail == ""


def test_stop_string_inside_one_token_with_text_after() -> None:
    checker = StopChecker(("STOP",), set(), 100)
    chunks, tail = _run(checker, ["ab", "cdSTOPef", "gh"])
    assert chunks == ["ab", "cd"] and tail == ""
    assert checker.text == "abcd" and checker.finish_reason == "stop" and checker.num_tokens == 2


def test_earliest_of_several_stop_strings_wins() -> None:
    checker = StopChecker(("world", "lo w"), set(), 100)
    chunks, _ = _run(checker, ["hel", "lo world"])
    assert "".join(chunks) == "hel"


def test_held_prefix_released_when_not_a_stop() -> None:
    checker = StopChecker(("</answer>",), set(), 100)
    r1 = checker.feed(1, "x </ans")
    assert r1 == StopResult("x ", False, None)  # "</ans" could start the stop string
    r2 = checker.feed(2, "wer")
    assert r2.text == ""  # "</answer" is still a prefix
    r3 = checker.feed(3, "s!")
    assert r3 == StopResult("</answers!", False, None)
    assert checker.text == "x </answers!"


def test_hold_back_is_only_the_matching_suffix() -> None:
    checker = StopChecker(("abc", "zz"), set(), 100)
    assert checker.feed(1, "xxab").text == "xx"
    assert checker.feed(2, "d z").text == "abd "
    assert checker.feed(3, "y").text == "zy"


def test_eos_ends_with_stop_and_adds_no_text() -> None:
    checker = StopChecker((), {EOS}, 100)
    assert checker.feed(5, "hi").text == "hi"
    result = checker.feed(EOS, "<|im_end|>")
    assert result == StopResult("", True, "stop")
    assert checker.num_tokens == 2 and checker.text == "hi" and checker.flush() == ""


def test_eos_releases_held_text_on_flush() -> None:
    checker = StopChecker(("END",), {EOS}, 100)
    assert checker.feed(5, "the EN").text == "the "
    assert checker.feed(EOS, "").finished
    assert checker.flush() == "EN"
    assert checker.text == "the EN" and checker.finish_reason == "stop"


def test_max_tokens_is_length() -> None:
    checker = StopChecker(("STOP",), {EOS}, 3)
    chunks, tail = _run(checker, ["a", "b", "cST", "OP"])
    assert chunks == ["a", "b", "c"] and tail == "ST"
    assert (checker.finish_reason, checker.num_tokens, checker.text) == ("length", 3, "abcST")


def test_stop_on_last_allowed_token_is_stop() -> None:
    checker = StopChecker(("STOP",), {EOS}, 2)
    _run(checker, ["a", "STOP"])
    assert checker.finish_reason == "stop"
    checker = StopChecker((), {EOS}, 2)
    _run(checker, ["a", EOS])
    assert checker.finish_reason == "stop" and checker.num_tokens == 2


def test_flush_checks_detokenizer_tail_for_stop() -> None:
    checker = StopChecker(("STOP",), set(), 1)
    result = checker.feed(1, "aS")
    assert result == StopResult("a", True, "length")
    assert checker.flush("TOP b") == ""  # "S" + "TOP" completes the stop string
    assert checker.finish_reason == "stop" and checker.text == "a"
    assert checker.finish_reason == "stop" and checker.text == "a"


def test_pending_bytes_empty_text() -> None:
    # While the detokenizer holds bytes it reports "" for a token; the token still counts.
    checker = StopChecker(("😀",), set(), 10)
    assert checker.feed(1, "ok ").text == "ok "
    assert checker.feed(2, "").text == ""
    result = checker.feed(3, "😀!")
    assert result == StopResult("", True, "stop") and checker.num_tokens == 3


def test_ignore_eos_and_stop_token_ids() -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=(7,))
    checker = StopChecker.from_params(params, eos_token_ids=[EOS])
    assert not checker.feed(EOS, "").finished  # EOS ignored: counts as a token, no stop
    assert checker.feed(7, "x").finish_reason == "stop"  # user stop ids still apply
    assert checker.text == "" and checker.num_tokens == 2

    checker = StopChecker.from_params(SamplingParams(max_tokens=2, ignore_eos=True), [EOS])
    _run(checker, [EOS, EOS])
    assert checker.finish_reason == "length"

    checker = StopChecker.from_params(SamplingParams(stop=("\n\n",)), [EOS])
    assert checker.feed(EOS, "").finish_reason == "stop"


def test_feed_after_finish_and_early_flush_raise() -> None:
    checker = StopChecker((), {EOS}, 1)
    with pytest.raises(RuntimeError):
        checker.flush()
    checker.feed(1, "a")
    with pytest.raises(RuntimeError):
        checker.feed(2, "b")


def test_invalid_construction() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        StopChecker((), set(), 0)
    with pytest.raises(ValueError, match="stop"):
        StopChecker(("",), set(), 5)
