"""The chaos cell's pieces: the injector's timing, the figures read from request records, the report
table, and the restart-redis recovery check against a ``redis-server`` of the test's own."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis

from loadtest.analysis import CellResult, ServerCounters, cell_result
from loadtest.chaos import (
    KILL_REPLICA,
    RESTART_REDIS,
    ChaosEvent,
    ChaosInjector,
    chaos_figures,
    chaos_survived,
    clean_failure,
    injector_for,
    redis_has_stats,
)
from loadtest.report import write_report
from loadtest.streaming import RequestRecord
from tests.serve.redis_server import own_redis_server


def record(start: float, latency: float, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        "code", 0, start, latency_s=latency, output_tokens=8, error=error, finish_reason="length"
    )


def test_the_fault_comes_after_its_delay_and_recovery_is_timed() -> None:
    healthy = threading.Event()
    with ChaosInjector("test", 0.2, lambda: "broke it", healthy.is_set, poll_s=0.01) as injector:
        started = time.time()
        time.sleep(0.4)
        assert injector.event.at >= started + 0.15 and injector.event.detail == "broke it"
        assert injector.event.recovered_at is None  # not healthy yet
        healthy.set()
        time.sleep(0.1)
    event = injector.event
    assert event.recovered_at is not None and event.recovered_at - event.at >= 0.2
    assert event.error is None


def test_a_cell_that_ends_first_or_a_fault_that_fails_is_reported_not_raised() -> None:
    with ChaosInjector("late", 30.0, lambda: "never", lambda: True) as late:
        pass
    assert late.event.error == "the cell ended before the fault was due" and late.event.at == 0.0

    def broken() -> str:
        raise RuntimeError("no replica to kill")

    with ChaosInjector("broken", 0.0, broken, lambda: True) as failing:
        time.sleep(0.1)
    assert failing.event.error == "RuntimeError: no replica to kill"
    assert failing.event.recovered_at is None


def test_figures_split_requests_at_the_fault() -> None:
    event = ChaosEvent(KILL_REPLICA, at=110.0, detail="killed r1", recovered_at=114.5)
    records = [
        record(100.0, 5.0),  # done before the fault
        record(105.0, 10.0, "stream error: the engine replica is unavailable"),  # in flight, clean
        record(108.0, 10.0),  # in flight, survived (another replica)
        record(109.0, 4.0, "ChunkedEncodingError: connection broken"),  # in flight, cut: unclean
        record(111.0, 2.0, "HTTP 503: overloaded"),  # after, clean
        record(112.0, 3.0),
    ]
    figures = chaos_figures(event, records)
    assert figures["at_s"] == pytest.approx(10.0) and figures["recovered_after_s"] == pytest.approx(4.5)
    assert (figures["in_flight"], figures["failed_in_flight"]) == (3, 2)
    assert (figures["started_after"], figures["failed_after"]) == (2, 1)
    assert figures["unclean_failures"] == 1
    assert not chaos_survived(figures)  # a cut stream
    assert chaos_survived({**figures, "unclean_failures": 0})
    assert not chaos_survived({**figures, "unclean_failures": 0, "recovered_after_s": None})
    assert clean_failure(records[1]) and clean_failure(records[4]) and not clean_failure(records[3])
    assert not clean_failure(records[0])  # no failure at all


def test_figures_of_a_fault_that_never_came_say_so() -> None:
    event = ChaosEvent(RESTART_REDIS, error="the cell ended before the fault was due")
    figures = chaos_figures(event, [record(1.0, 1.0)])
    assert figures["error"] == event.error and "in_flight" not in figures


def test_the_report_has_a_chaos_table(tmp_path: Path) -> None:
    event = ChaosEvent(KILL_REPLICA, at=110.0, detail="killed r1 (one of 2 running)", recovered_at=120.0)
    records = [record(100.0, 20.0, "stream error: gone"), record(101.0, 5.0)]
    result = cell_result("goodput", 4, "mixed", records, ServerCounters(), 60.0, 0.15)
    result.chaos = chaos_figures(event, records)
    plain = CellResult("plain", 4, "mixed")
    meta = {"chaos": "kill-replica at 0.5 of the run time"}
    text = write_report(tmp_path, [result, plain], {}, meta).read_text()
    assert "- chaos: kill-replica at 0.5 of the run time" in text
    row = next(line for line in text.splitlines() if "killed r1" in line)
    expected = "| goodput | 4 | killed r1 (one of 2 running) | 10.0 | 10.0 | 1: 1 | 0: 0 | 0 | stream error"
    assert expected in row
    assert CellResult.from_dict(result.to_dict()).chaos == result.chaos


def test_unknown_faults_and_a_redis_fault_without_redis_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown chaos 'flood'"):
        injector_for("flood", 1.0, "app")
    with pytest.raises(ValueError, match="own redis-server"):
        injector_for(RESTART_REDIS, 1.0, "app")


def test_restart_redis_is_recovered_once_statistics_are_back() -> None:
    with own_redis_server() as server:
        client = redis.Redis.from_url(server.url)
        client.set("chaos-test:acc:index", "1")
        assert redis_has_stats(server.url, "chaos-test")
        injector = injector_for(RESTART_REDIS, 0.0, "app", server, "chaos-test", outage_s=0.3)
        with injector:
            time.sleep(0.2)
            assert not redis_has_stats(server.url, "chaos-test")  # down
            time.sleep(1.0)  # restarted empty: no statistics yet
            assert injector.event.recovered_at is None and not redis_has_stats(server.url, "chaos-test")
            client = redis.Redis.from_url(server.url)
            client.set("chaos-test:acc:index", "1")  # what a replica's flush writes
            deadline = time.monotonic() + 5
            while injector.event.recovered_at is None and time.monotonic() < deadline:
                time.sleep(0.05)
        client.close()
    event = injector.event
    assert event.recovered_at is not None and event.recovered_at - event.at >= 0.3
    assert "restarted empty 0.3 s later" in event.detail
