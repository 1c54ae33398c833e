"""The first-minute table (``specserve bench --first-minute``): medians per window, the whole span."""

from __future__ import annotations

from loadtest.bench.first_minute import Phase, Window, report


def phase(name: str, *windows: tuple[int, int, int, int]) -> Phase:
    return Phase(name, 1.0, [Window(t, d, a, s, 1) for t, d, a, s in windows])


def test_the_table_has_medians_per_window_and_the_whole_span() -> None:
    # (tokens, drafted, accepted, speculative steps) per 10 s window
    warm = [
        phase("warm", (300, 80, 60, 20), (320, 80, 64, 20)),
        phase("warm", (340, 80, 68, 20), (300, 0, 0, 0)),
    ]
    cold = [
        phase("cold", (200, 0, 0, 0), (260, 40, 20, 20)),
        phase("cold", (100, 0, 0, 0), (280, 40, 30, 20)),
    ]
    lines = report({"warm": warm, "cold": cold}, 10.0).splitlines()
    assert lines[0].startswith("| window | tok/s warm | tok/s cold |")
    # window 1: warm tok/s median of 30 and 34, acceptance of 75% and 85%; cold drafted nothing
    assert lines[2] == "| 0-10 s | 32.0 | 15.0 | 80% | - | 4.00 | - |"
    # window 2: a repeat that drafted nothing has no acceptance: the median is of the other
    assert lines[3] == "| 10-20 s | 31.0 | 27.0 | 80% | 62% | 4.00 | 2.00 |"
    # whole: 1260 tokens over 2 x 20 s warm; acceptance 192 / 240 warm, 50 / 80 cold
    assert lines[4] == "| **first 20 s** | 31.5 | 21.0 | 80% | 62% | 4.00 | 2.00 |"
