"""A ramp of users over one load-test cell (``specserve loadtest --ramp``), for watching autoscaling.

Over a cell of ``duration`` seconds with a peak of ``peak`` users the number of users is (fractions
of the duration; the Locust shape in ``loadtest/locustfile.py`` asks :func:`users_at` every second):

- 0 - 0.1: 1 user (the replicas the cell starts with, at a light load);
- 0.1 - 0.4: climbing linearly from 1 to ``peak`` (the autoscaler sees the load grow);
- 0.4 - 0.6: ``peak`` (the scaled-up replicas at work);
- 0.6 - 0.7: falling linearly back to 1;
- 0.7 - 1.0: 1 user (the autoscaler removes the replicas no longer needed).

The runner passes the ramp to the Locust process in the environment (``RAMP_ENV``: ``peak,duration``),
since Locust takes a shape class from the locustfile at import, before its options are parsed.
"""

from __future__ import annotations

import os

RAMP_ENV = "LOADTEST_RAMP"
# (fraction of the duration where a stage ends, users at that point as a fraction of the peak span)
_STAGES = ((0.1, 0.0), (0.4, 1.0), (0.6, 1.0), (0.7, 0.0), (1.0, 0.0))


def users_at(elapsed_s: float, peak: int, duration_s: float) -> int | None:
    """Users wanted ``elapsed_s`` into the cell (None once the cell is over: Locust stops)."""
    if peak < 1 or duration_s <= 0:
        raise ValueError(f"a ramp needs peak >= 1 and a positive duration, got {peak} and {duration_s}")
    if elapsed_s >= duration_s:
        return None
    x = max(0.0, elapsed_s / duration_s)
    start_x, start_level = 0.0, 0.0
    for end_x, end_level in _STAGES:
        if x < end_x:
            level = start_level + (end_level - start_level) * (x - start_x) / (end_x - start_x)
            return 1 + round(level * (peak - 1))
        start_x, start_level = end_x, end_level
    return 1


def ramp_from_environment() -> tuple[int, float] | None:
    """(peak, duration) when the runner asked for a ramp, else None (a ValueError names a bad value)."""
    text = os.environ.get(RAMP_ENV, "").strip()
    if not text:
        return None
    try:
        peak, duration = text.split(",")
        return int(peak), float(duration)
    except ValueError as exc:
        raise ValueError(f"{RAMP_ENV}={text!r}: expected 'peak,duration', e.g. '8,240'") from exc


def ramp_environment(peak: int, duration_s: float) -> dict[str, str]:
    """The environment entry that gives the Locust process this ramp."""
    users_at(0.0, peak, duration_s)  # validates
    return {RAMP_ENV: f"{peak},{duration_s:g}"}
