"""SharedStats without Redis: local counts, conditional acceptance, rolling buckets, bounded batches."""

from __future__ import annotations

import logging
import socket

import pytest

from serve_app.config import Settings, StatsSettings
from serve_app.observability import shared_stats as stats_module
from serve_app.observability.redis_link import escape, redact
from serve_app.observability.shared_stats import AcceptanceCounts, AcceptanceKey, SharedStats, position_counts

KEY = AcceptanceKey("qwen2.5-coder-1.5b-instruct|qwen2.5-coder-0.5b-instruct", "draft", "code")
OTHER = AcceptanceKey("qwen2.5-coder-1.5b-instruct|qwen2.5-coder-0.5b-instruct", "ngram", "prose")


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def refused_url() -> str:
    """A Redis URL nothing listens on (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_local_mode_record_then_priors() -> None:
    stats = SharedStats(StatsSettings(), "r0")
    stats.start()  # local only: no thread, nothing to connect to
    try:
        assert stats.priors(KEY) is None
        stats.record(KEY, [4, 3, 2], [3, 2, 0], steps=4)
        assert stats.priors(KEY) == pytest.approx((0.75, 2 / 3, 0.0))
        counts = stats.counts(KEY)
        assert counts == AcceptanceCounts((4, 3, 2), (3, 2, 0), 4, "local")
        assert stats.priors(OTHER) is None
        assert not stats.connected
        assert stats.pending_entries == 0  # nothing is batched for a Redis that is not configured
    finally:
        stats.close()


def test_conditional_acceptance_per_position() -> None:
    assert position_counts(3, 1) == ([1, 1, 1], [1, 0, 0])
    assert position_counts(2, 5) == ([1, 1], [1, 1])  # accepted never exceeds drafted
    assert position_counts(0, 0) == ([], [])
    stats = SharedStats(StatsSettings(), "r0")
    # drafts of 3 (1 accepted), 3 (all accepted), 1 (rejected): position j counts drafts reaching j
    for drafted, accepted in [(3, 1), (3, 3), (1, 0)]:
        stats.record(KEY, *position_counts(drafted, accepted), steps=1)
    counts = stats.counts(KEY)
    assert counts is not None
    assert counts.drafted == (3, 2, 2) and counts.accepted == (2, 1, 1) and counts.steps == 3
    assert stats.priors(KEY) == pytest.approx((2 / 3, 1 / 2, 1 / 2))
    # positions no draft reached end the estimate; a key with steps but no drafts has no priors
    stats.record(OTHER, [], [], steps=5)
    assert stats.priors(OTHER) is None
    assert AcceptanceCounts((4, 0, 2), (2, 0, 1), 1).acceptance() == (0.5,)


def test_buckets_roll_out_of_the_window() -> None:
    clock = FakeClock(1000.0)  # bucket 100 with bucket_s 10
    stats = SharedStats(StatsSettings(window_s=60, bucket_s=10), "r0", clock=clock)  # 6 buckets
    stats.record(KEY, [1], [1], steps=1)
    clock.now = 1055.0  # bucket 105: bucket 100 is the oldest still in the window
    assert stats.priors(KEY) == (1.0,)
    stats.record(KEY, [1], [0], steps=1)
    assert stats.priors(KEY) == (0.5,)
    clock.now = 1060.0  # bucket 106: bucket 100 left the window
    assert stats.priors(KEY) == (0.0,)
    assert stats.counts(KEY) == AcceptanceCounts((1,), (0,), 1, "local")
    clock.now = 1200.0
    assert stats.priors(KEY) is None
    # a long run keeps at most one window of buckets per key
    for t in range(0, 1000, 5):
        clock.now = 2000.0 + t
        stats.record(KEY, [2, 1], [1, 1], steps=1)
    assert len(stats._local[KEY]) <= 6
    assert stats.counts(KEY).steps == 12  # 60 s of records, one per 5 s


def test_pending_batch_merges_and_stays_bounded(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(1000.0)
    settings = StatsSettings(
        redis_url=refused_url(), window_s=60, bucket_s=10, warn_interval_s=60, socket_timeout_s=0.2
    )
    stats = SharedStats(settings, "r0", clock=clock)
    try:
        for _ in range(1000):
            stats.record(KEY, [3, 2], [2, 1], steps=1)
        assert stats.pending_entries == 1  # merged by (key, bucket), not one entry per record
        with caplog.at_level(logging.DEBUG, logger="serve_app.observability.shared_stats"):
            assert not stats.flush_now()
            assert not stats.flush_now()
        assert not stats.connected
        assert stats.pending_entries == 1  # a failed flush keeps the batch
        stats.record(KEY, [1], [1], steps=1)
        assert stats.pending_entries == 1
        assert stats._pending[(KEY, 100)].steps == 1001
        assert stats._pending[(KEY, 100)].drafted == [3001, 2000]
        # an outage across many buckets: buckets that left the window are dropped
        for t in range(0, 600, 10):
            clock.now = 1000.0 + t
            stats.record(KEY, [1], [1], steps=1)
            stats.record(OTHER, [1], [0], steps=1)
        assert stats.pending_entries <= 2 * 6  # even before any flush (or without a thread)
        assert not stats.flush_now()
        assert stats.pending_entries <= 2 * 6
        # warnings are rate-limited: one per warn_interval_s, the rest at debug level
        failures = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(failures) >= 2
        assert sum(r.levelno == logging.WARNING for r in failures) == 1
        # priors keep working on local counts meanwhile
        assert stats.priors(KEY) == (1.0,)
        assert stats.priors(OTHER) == (0.0,)
    finally:
        stats.close()


def test_distinct_keys_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats_module, "MAX_KEYS", 2)
    stats = SharedStats(StatsSettings(), "r0")
    for i in range(4):
        stats.record(AcceptanceKey("a|b", "draft", f"tag{i}"), [1], [1], steps=1)
    assert stats.dropped_records == 2
    assert stats.priors(AcceptanceKey("a|b", "draft", "tag1")) == (1.0,)
    assert stats.priors(AcceptanceKey("a|b", "draft", "tag3")) is None


def test_local_cost_model() -> None:
    stats = SharedStats(StatsSettings(), "r0")
    assert stats.get_cost_model("cpu-amx", "m") is None
    stats.put_cost_model("cpu-amx", "m", {"a": 1.5, "b": [1, 2]})
    assert stats.get_cost_model("cpu-amx", "m") == {"a": 1.5, "b": [1, 2]}
    with pytest.raises(TypeError):
        stats.put_cost_model("cpu-amx", "m", {"a": object()})


def test_key_components_are_escaped_and_passwords_redacted() -> None:
    assert escape("a:b%c") == "a%3Ab%25c"
    assert redact("redis://:secret@redis.example:6380/2") == "redis://:***@redis.example:6380/2"
    assert redact("redis://user:secret@redis.example/0") == "redis://user:***@redis.example/0"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_STATS__REDIS_URL", "redis://redis.example:6380/2")
    monkeypatch.setenv("SPECSERVE_STATS__WINDOW_S", "120")
    stats = Settings().stats
    assert stats.redis_url == "redis://redis.example:6380/2"
    assert stats.window_s == 120.0
    monkeypatch.delenv("SPECSERVE_STATS__REDIS_URL")
    assert Settings().stats.redis_url is None
