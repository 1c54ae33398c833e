"""The users of ``specserve loadtest --ramp`` over a cell, and how the Locust process gets them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadtest.ramp import RAMP_ENV, ramp_environment, ramp_from_environment, users_at


def test_the_ramp_climbs_holds_falls_and_stays_low_for_scaling_down() -> None:
    users = [users_at(t, 9, 100.0) for t in range(0, 100)]
    assert users[:10] == [1] * 10  # light load first
    assert users[10:40] == sorted(users[10:40]) and users[25] == 5  # climbing (halfway at 25 s)
    assert users[40:60] == [9] * 20  # the peak
    assert users[60:70] == sorted(users[60:70], reverse=True) and users[65] == 5
    assert users[70:] == [1] * 30  # low again, long enough for the autoscaler to scale down
    assert users_at(100.0, 9, 100.0) is None  # the cell is over
    assert {users_at(t, 1, 60.0) for t in range(60)} == {1}


@pytest.mark.parametrize("bad", [(0, 60.0), (4, 0.0)])
def test_a_bad_ramp_is_refused_naming_it(bad: tuple[int, float]) -> None:
    with pytest.raises(ValueError, match="peak >= 1"):
        ramp_environment(*bad)


def test_the_environment_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RAMP_ENV, raising=False)
    assert ramp_from_environment() is None
    monkeypatch.setenv(RAMP_ENV, ramp_environment(8, 240.0)[RAMP_ENV])
    assert ramp_from_environment() == (8, 240.0)
    monkeypatch.setenv(RAMP_ENV, "eight")
    with pytest.raises(ValueError, match="peak,duration"):
        ramp_from_environment()


def test_the_locustfile_has_a_shape_only_when_a_ramp_is_asked_for() -> None:
    # locust first, as the locust command does (gevent must patch ssl before requests imports it)
    probe = "import locust; import loadtest.locustfile as f; print(hasattr(f, 'RampShape'))"
    for env, expected in (({}, "False"), (ramp_environment(4, 30.0), "True")):
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env={**_base_env(), **env},
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip().splitlines()[-1] == expected, out.stderr


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != RAMP_ENV}
