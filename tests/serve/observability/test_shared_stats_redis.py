"""SharedStats against a real Redis: two replicas share acceptance, a closing replica sends what
is pending, cost models round-trip, the window rolls, and a Redis outage (hung, killed, restarted)
never stalls serving.

The Redis URL comes from the config (``SPECSERVE_STATS__REDIS_URL``); unset, the CI default
``redis://127.0.0.1:6379/0`` (a server that keeps nothing on disk). Every test writes under its own
key prefix and deletes its keys afterwards. The outage test runs its own ``redis-server`` on a free
port. Without a reachable Redis (or ``redis-server`` binary) the tests skip, and fail under CI.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from serve_app.config import Settings, StatsSettings
from serve_app.observability.shared_stats import AcceptanceCounts, AcceptanceKey, SharedStats, position_counts
from tests.serve.redis_server import RedisServer, free_port, own_redis_server, unavailable, wait_for

CI_REDIS_URL = "redis://127.0.0.1:6379/0"
PAIR = "qwen2.5-coder-1.5b-instruct|qwen2.5-coder-0.5b-instruct"
KEY = AcceptanceKey(PAIR, "draft", "code")


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_url() -> str:
    url = Settings().stats.redis_url or CI_REDIS_URL
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        unavailable(f"no Redis at {url} ({exc}); set SPECSERVE_STATS__REDIS_URL")
    finally:
        client.close()
    return url


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards."""
    prefix = f"specserve-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=2, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def replicas(redis_url: str, prefix: str) -> Iterator[Callable[..., SharedStats]]:
    """Factory of SharedStats replicas on the test's prefix; all closed at teardown."""
    made: list[SharedStats] = []

    def make(replica_id: str, clock: Callable[[], float] = time.time, **overrides: Any) -> SharedStats:
        settings = StatsSettings(**{"redis_url": redis_url, "key_prefix": prefix, **overrides})
        stats = SharedStats(settings, replica_id, clock=clock)
        made.append(stats)
        return stats

    yield make
    for stats in made:
        stats.close()


def test_two_replicas_see_each_others_acceptance(replicas, raw: redis.Redis, prefix: str) -> None:
    clock = FakeClock(1_000_000.0)  # bucket 16666 with bucket_s 60
    a = replicas("a", clock)
    b = replicas("b", clock)
    a.record(KEY, [4, 3, 2], [3, 2, 1], steps=4)
    a.record(KEY, [1], [0], steps=1)
    assert b.priors(KEY) is None
    assert a.flush_now() and b.refresh_now()
    assert a.connected and b.connected
    assert b.counts(KEY) == AcceptanceCounts((5, 3, 2), (3, 2, 1), 5, "cluster")
    assert b.priors(KEY) == pytest.approx((0.6, 2 / 3, 0.5))

    # the key layout: one HASH per (pair, proposer, workload, bucket) with a TTL; an index ZSET
    name = f"{prefix}:acc:{PAIR}:draft:code:16666"
    expected = {"d0": "5", "d1": "3", "d2": "2", "a0": "3", "a1": "2", "a2": "1", "steps": "5"}
    assert raw.hgetall(name) == expected
    assert 0 < raw.pttl(name) <= (600 + 60) * 1000
    assert raw.zscore(f"{prefix}:acc:index", f'["{PAIR}", "draft", "code"]') == 16666

    # both directions, summed cluster-wide; the other replica's local-only counts are not visible
    for drafted, accepted in [(2, 2)] * 5:
        b.record(KEY, *position_counts(drafted, accepted), steps=1)
    assert b.flush_now() and a.refresh_now() and b.refresh_now()
    for stats in (a, b):
        assert stats.counts(KEY) == AcceptanceCounts((10, 8, 2), (8, 7, 1), 10, "cluster")
    other = AcceptanceKey(PAIR, "ngram", "prose")
    a.record(other, [1], [1], steps=1)
    assert b.priors(other) is None and a.priors(other) == (1.0,)


def test_rolling_window_across_replicas(replicas, raw: redis.Redis, prefix: str) -> None:
    clock = FakeClock(1000.0)
    a = replicas("a", clock, window_s=30, bucket_s=10)  # 3 buckets
    b = replicas("b", clock, window_s=30, bucket_s=10)
    a.record(KEY, [1], [1], steps=1)  # bucket 100
    assert a.flush_now()
    clock.now = 1025.0  # bucket 102
    a.record(KEY, [1], [0], steps=1)
    assert a.flush_now() and b.refresh_now()
    assert b.priors(KEY) == (0.5,)
    clock.now = 1030.0  # bucket 103: bucket 100 left the window
    assert b.refresh_now()
    assert b.counts(KEY) == AcceptanceCounts((1,), (0,), 1, "cluster")
    clock.now = 1060.0  # everything left the window: the index is pruned too
    assert b.refresh_now()
    assert b.priors(KEY) is None
    assert raw.zcard(f"{prefix}:acc:index") == 0


def test_bucket_keys_expire_in_redis(replicas, raw: redis.Redis, prefix: str) -> None:
    a = replicas("a", window_s=0.6, bucket_s=0.3)  # real clock, TTL 0.9 s
    a.record(KEY, [1], [1], steps=1)
    assert a.flush_now()
    names = raw.keys(f"{prefix}:acc:*:*:*:*")
    assert len(names) == 1
    assert 0 < raw.pttl(names[0]) <= 900
    assert wait_for(lambda: not raw.exists(names[0]), timeout=3.0)


def test_close_sends_what_is_pending(replicas) -> None:
    a = replicas("a")
    b = replicas("b")
    a.record(KEY, [2, 1], [2, 0], steps=1)
    a.close()  # no flush before: closing sends the pending counts
    assert not a.connected
    assert b.refresh_now()
    assert b.counts(KEY) == AcceptanceCounts((2, 1), (2, 0), 1, "cluster")


def test_cost_model_round_trip(replicas, raw: redis.Redis, prefix: str) -> None:
    a = replicas("a")
    b = replicas("b")
    coefficients = {"target": {"base": 0.012, "per_token": 0.0004}, "draft": {"draft": 0.003}}
    a.put_cost_model("cpu-amx-2c", "qwen2.5-coder-1.5b-instruct", coefficients)
    assert b.get_cost_model("cpu-amx-2c", "qwen2.5-coder-1.5b-instruct") is None
    assert a.flush_now()
    assert b.get_cost_model("cpu-amx-2c", "qwen2.5-coder-1.5b-instruct") == coefficients
    assert b.get_cost_model("cpu-amx-2c", "other") is None
    assert raw.ttl(f"{prefix}:cost:cpu-amx-2c:qwen2.5-coder-1.5b-instruct") == -1  # no expiry


def test_background_thread_shares_without_explicit_calls(replicas) -> None:
    fast = {"flush_interval_s": 0.05, "refresh_interval_s": 0.05}
    a = replicas("a", **fast)
    b = replicas("b", **fast)
    a.start()
    b.start()
    a.record(KEY, [2, 1], [1, 1], steps=1)
    assert wait_for(lambda: b.counts(KEY) is not None and b.counts(KEY).source == "cluster")
    assert b.priors(KEY) == (0.5, 1.0)
    assert a.connected and b.connected


def test_get_cost_model_when_redis_is_down() -> None:
    stats = SharedStats(StatsSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0"), "a")
    started = time.monotonic()
    assert stats.get_cost_model("cpu", "m", timeout_s=0.3) is None
    assert time.monotonic() - started < 5.0  # bounded by the timeout, not a hang
    stats.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with own_redis_server() as server:
        yield server


class ServingLoop(threading.Thread):
    """Stands for the engine's decode loop: record / priors every ~2 ms, timed."""

    def __init__(self, stats: SharedStats) -> None:
        super().__init__(name="fake-decode-loop", daemon=True)
        self.stats = stats
        self.phase = "before"
        self.recorded: dict[str, int] = {}
        self.durations: list[float] = []
        self.priors_missing = 0
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                phase = self.phase
                key = AcceptanceKey(PAIR, "draft", phase)
                started = time.perf_counter()
                self.stats.record(key, [1, 1, 1], [1, 1, 0], steps=1)
                if self.stats.priors(key) is None:
                    self.priors_missing += 1
                self.durations.append(time.perf_counter() - started)
                self.recorded[phase] = self.recorded.get(phase, 0) + 1
                time.sleep(0.002)
        except BaseException as exc:
            self.error = exc


def test_outage_serving_goes_on_and_stats_resume(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = StatsSettings(
        redis_url=own_redis.url,
        key_prefix="outage",
        flush_interval_s=0.05,
        refresh_interval_s=0.1,
        socket_timeout_s=0.25,
        max_backoff_s=0.3,
        warn_interval_s=60,
    )
    caplog.set_level(logging.DEBUG, logger="serve_app.observability.shared_stats")
    stats = SharedStats(settings, "replica-0")
    loop = ServingLoop(stats)
    try:
        stats.start()
        assert wait_for(lambda: stats.connected)
        loop.start()
        assert wait_for(lambda: loop.recorded.get("before", 0) > 20)
        before = AcceptanceKey(PAIR, "draft", "before")
        assert wait_for(lambda: (c := stats.counts(before)) is not None and c.source == "cluster")

        # 1. Redis hangs (accepts, never answers): the background thread times out, not the loop
        own_redis.hang()
        assert wait_for(lambda: not stats.connected, timeout=5.0)
        loop.phase = "outage"  # from here on, every count must wait for Redis to come back
        time.sleep(0.5)
        # 2. Redis dies: connections are refused; 3. a new, empty Redis starts on the same port
        own_redis.kill()
        time.sleep(0.5)
        outage = AcceptanceKey(PAIR, "draft", "outage")
        assert stats.priors(outage) == (1.0, 1.0, 0.0) and stats.counts(outage).source == "local"
        loop.phase = "after"
        assert wait_for(lambda: loop.recorded.get("after", 0) > 0)  # the last "outage" record is counted
        outage_total = loop.recorded["outage"]
        assert outage_total > 20
        own_redis.start()
        assert wait_for(lambda: stats.connected, timeout=5.0)

        # the counts recorded during the outage arrived; counts go on arriving afterwards
        reader = SharedStats(settings, "reader")
        try:
            after = AcceptanceKey(PAIR, "draft", "after")

            def arrived() -> bool:
                reader.refresh_now()
                got_outage, got_after = reader.counts(outage), reader.counts(after)
                return (
                    got_outage is not None
                    and got_outage.steps == outage_total
                    and got_after is not None
                    and got_after.source == "cluster"
                    and got_after.steps > 0
                )

            assert wait_for(arrived, timeout=5.0), (reader.counts(outage), outage_total)
            got = reader.counts(outage)
            assert got.drafted == (outage_total,) * 3 and got.accepted == (outage_total, outage_total, 0)
        finally:
            reader.close()
    finally:
        loop.halt.set()
        loop.join(timeout=5)
        stats.close()

    assert loop.error is None
    assert loop.priors_missing == 0  # priors always answered (local counts during the outage)
    # the loop never waited on the network: every call took well under the socket timeout
    slowest, median = max(loop.durations), statistics.median(loop.durations)
    print(
        f"\nserving loop: {len(loop.durations)} iterations, median {median * 1e6:.0f} us, "
        f"max {slowest * 1e3:.2f} ms"
    )
    assert slowest < 0.05, f"a stats call took {slowest * 1e3:.1f} ms"
    # one warning for the whole outage despite many failed attempts; one note when it came back
    failures = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(failures) >= 2
    assert sum(r.levelno >= logging.WARNING for r in failures) == 1
    assert sum("is back" in r.getMessage() for r in caplog.records) == 1


def test_a_new_replica_waits_for_its_first_view_of_the_cluster(replicas, own_redis: RedisServer) -> None:
    a = replicas("a")
    a.record(KEY, [3, 2], [2, 1], steps=3)
    assert a.flush_now()
    b = replicas("b")
    b.start()
    assert b.wait_for_cluster_view(timeout_s=5.0) == 1  # the one key a wrote, read before serving
    assert b.counts(KEY).source == "cluster" and b.priors(KEY) == (2 / 3, 1 / 2)

    assert SharedStats(StatsSettings(), "local").wait_for_cluster_view(timeout_s=5.0) is None  # no Redis
    # A Redis that accepts connections but never answers: the wait ends with the first timeout.
    own_redis.hang()
    hung = SharedStats(StatsSettings(redis_url=own_redis.url, socket_timeout_s=0.2), "hung")
    try:
        hung.start()
        started = time.monotonic()
        assert hung.wait_for_cluster_view(timeout_s=10.0) is None
        assert time.monotonic() - started < 5.0  # not the 10 s: the failed exchange ended it
    finally:
        hung.close()
