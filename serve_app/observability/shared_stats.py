"""Acceptance statistics, local to a replica and shared across replicas through Redis.

One ``SharedStats`` per replica. The engine's loop thread calls ``record`` and ``priors``: they
only touch in-process dictionaries under a lock that is never held across a network call, so they
are O(1) (O(depth)) and never block on Redis. A background thread does all the network work:

- every ``flush_interval_s`` it writes the batched counts and any new cost-model coefficients
  (``serve_app.observability.cost_cache``) in one MULTI/EXEC pipeline;
- every ``refresh_interval_s`` it reads the cluster-wide counts of the rolling window into a local
  cache, which ``priors`` reads.

Keys (all under ``settings.key_prefix``; ``:`` and ``%`` inside a name component are %-escaped):

- ``{prefix}:acc:{model_pair}:{proposer}:{workload}:{bucket}``: HASH of ``d{j}`` / ``a{j}`` (drafts
  that reached position j / were accepted there) and ``steps``, incremented with HINCRBY;
  ``bucket = floor(now / bucket_s)``; each key expires ``window_s + bucket_s`` after its last write,
  so "rolling" means the last ``window_s`` across every replica.
- ``{prefix}:acc:index``: ZSET of the known ``(model_pair, proposer, workload)`` triples (JSON
  members) scored by the last bucket written; refreshing reads the window's buckets of the triples
  scored inside the window and prunes the older ones (no SCAN of the keyspace).
- ``{prefix}:cost:{hardware}:{model}``: see ``serve_app.observability.cost_cache``.

Redis unavailable or restarted (``serve_app.observability.redis_link``): the background thread marks
the link disconnected, warns at most once per ``warn_interval_s``, keeps the unsent counts merged by
(key, bucket) (buckets that left the window are dropped, so memory stays O(keys x buckets)), retries
with exponential backoff capped at ``max_backoff_s`` and sends the merged counts once Redis answers
again. Meanwhile ``priors`` answer from this replica's own counts. With ``redis_url`` unset the
statistics are local only and no thread runs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from serve_app.config import StatsSettings
from serve_app.observability.acceptance import AcceptanceCounts, AcceptanceKey, Counts, position_counts
from serve_app.observability.cost_cache import CostModelCache
from serve_app.observability.redis_link import NETWORK_ERRORS, RedisLink, escape

__all__ = [
    "MAX_KEYS",
    "AcceptanceCounts",
    "AcceptanceKey",
    "EngineStatsSink",
    "SharedStats",
    "position_counts",
]

logger = logging.getLogger(__name__)

MAX_KEYS = 4096  # distinct acceptance keys tracked per replica (workloads can be user tags)


class SharedStats:
    """Acceptance counts and cost-model coefficients, for one replica."""

    def __init__(
        self, settings: StatsSettings, replica_id: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.settings = settings
        self.replica_id = replica_id
        self._clock = clock
        self._bucket_s = settings.bucket_s
        self._n_buckets = max(1, math.ceil(settings.window_s / settings.bucket_s - 1e-9))
        self._acc_ttl_ms = max(1, int((settings.window_s + settings.bucket_s) * 1000))
        self._acc_index = f"{settings.key_prefix}:acc:index"
        self._link = RedisLink(settings, logger)
        self._costs = CostModelCache(self._link, settings.key_prefix)

        self._lock = threading.Lock()  # guards the dicts below; never held across a network call
        self._local: dict[AcceptanceKey, dict[int, Counts]] = {}  # this replica's counts by bucket
        self._pending: dict[tuple[AcceptanceKey, int], Counts] = {}  # not yet written to Redis
        self.dropped_records = 0  # records refused because MAX_KEYS distinct keys are tracked

        # Written by the background thread, read by the loop thread (whole-object swaps).
        self._cluster: dict[AcceptanceKey, AcceptanceCounts] = {}
        self._cluster_at: float | None = None  # monotonic time of the last successful refresh

        self._first_look = threading.Event()  # the thread's first exchange with Redis is over
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---- the loop thread's side: in-process only ------------------------------------------------

    def record(
        self,
        key: AcceptanceKey,
        drafted_per_position: Sequence[int],
        accepted_per_position: Sequence[int],
        steps: int,
    ) -> None:
        """Add one outcome (counts per draft position, verification steps) to the local counts and
        to the batch the background thread sends. O(depth); never touches the network."""
        bucket = math.floor(self._clock() / self._bucket_s)
        with self._lock:
            buckets = self._local.get(key)
            if buckets is None:
                if len(self._local) >= MAX_KEYS:
                    self.dropped_records += 1
                    return
                buckets = self._local[key] = {}
            counts = buckets.get(bucket)
            if counts is None:
                counts = buckets[bucket] = Counts()
                oldest = bucket - self._n_buckets + 1
                for old in [b for b in buckets if b < oldest]:
                    del buckets[old]
                    self._pending.pop((key, old), None)  # bounded even if no flush ever runs
            counts.add(drafted_per_position, accepted_per_position, steps)
            if self._link.configured:
                pending = self._pending.get((key, bucket))
                if pending is None:
                    pending = self._pending[(key, bucket)] = Counts()
                pending.add(drafted_per_position, accepted_per_position, steps)

    def counts(self, key: AcceptanceKey) -> AcceptanceCounts | None:
        """Counts over the rolling window: cluster-wide from the cache while Redis is up, else this
        replica's own (or, with none, the last cluster snapshot while it is younger than the
        window); None without data."""
        if self._link.connected:
            cluster = self._cluster.get(key)
            if cluster is not None:
                return cluster
        local = self._local_counts(key)
        if local is not None:
            return local
        at = self._cluster_at
        if at is not None and time.monotonic() - at <= self.settings.window_s:
            return self._cluster.get(key)
        return None

    def priors(self, key: AcceptanceKey) -> tuple[float, ...] | None:
        """Conditional acceptance per draft position over the rolling window (see ``counts``);
        None when nothing was drafted for ``key``."""
        counts = self.counts(key)
        if counts is None:
            return None
        acceptance = counts.acceptance()
        return acceptance or None

    def put_cost_model(self, hardware: str, model: str, coefficients: dict[str, Any]) -> None:
        """Remember cost-model coefficients and publish them (no TTL) from the background thread.
        Raises TypeError when ``coefficients`` is not JSON-serialisable."""
        self._costs.put(hardware, model, coefficients)

    @property
    def connected(self) -> bool:
        """Whether the last exchange with Redis succeeded (always False in local-only mode)."""
        return self._link.connected

    @property
    def pending_entries(self) -> int:
        """(key, bucket) entries waiting to be written to Redis."""
        return len(self._pending)

    # ---- called once at engine start, or by tests: may block briefly -----------------------------

    def get_cost_model(self, hardware: str, model: str, timeout_s: float = 0.5) -> dict[str, Any] | None:
        """Coefficients for (hardware, model): this replica's own if it put some, else Redis's
        (waiting at most about ``timeout_s``); None when there are none or Redis is down."""
        return self._costs.get(hardware, model, timeout_s)

    def wait_for_cluster_view(self, timeout_s: float) -> int | None:
        """Block until the background thread's first exchange with Redis is over (at most
        ``timeout_s``): a new replica calls this before it serves, so that its first step plans
        from the cluster's acceptance, not from a cold guess. The number of acceptance keys the
        cluster had; None when there is no cluster view (local-only, Redis down, or too slow)."""
        if self._link.client is None or self._thread is None:
            return None
        self._first_look.wait(timeout_s)
        return len(self._cluster) if self._cluster_at is not None else None

    def start(self) -> None:
        """Start the background thread (local-only mode: nothing to do). Idempotent."""
        if self._link.client is None or self._thread is not None or self._closed:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"stats-{self.replica_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread, send what is pending (one attempt, short timeouts) and close the
        connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=4 * self.settings.socket_timeout_s + 1.0)
            self._thread = None
        if self._link.client is None:
            return
        self._flush()
        self._link.close()

    def flush_now(self) -> bool:
        """Send the pending batch now (tests, shutdown); True when Redis took it."""
        return self._flush()

    def refresh_now(self) -> bool:
        """Refresh the cluster cache now (tests); True on success."""
        return self._refresh()

    # ---- background thread -----------------------------------------------------------------------

    def _run(self) -> None:
        s, link = self.settings, self._link
        next_flush = next_refresh = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                self._prune()
                if not link.connected and now >= link.next_attempt:
                    # (re)connect: send everything merged meanwhile, then read the cluster's view
                    if self._flush() and self._refresh():
                        next_flush, next_refresh = now + s.flush_interval_s, now + s.refresh_interval_s
                elif link.connected:
                    if now >= next_flush:
                        next_flush = now + s.flush_interval_s
                        self._flush()
                    if link.connected and now >= next_refresh:
                        next_refresh = now + s.refresh_interval_s
                        self._refresh()
            except Exception:  # never let the thread die: the engine would lose shared stats silently
                logger.exception("stats: unexpected error in the background thread")
            self._first_look.set()  # connected and read, or failed: either way, waiting is over
            wake = min(next_flush, next_refresh) if link.connected else link.next_attempt
            self._stop.wait(min(max(wake - time.monotonic(), 0.005), 1.0))

    def _oldest_bucket(self) -> int:
        """The oldest bucket still inside the rolling window."""
        return math.floor(self._clock() / self._bucket_s) - self._n_buckets + 1

    def _prune(self) -> None:
        """Drop buckets that left the window (local and pending): memory stays O(keys x buckets)."""
        oldest = self._oldest_bucket()
        with self._lock:
            for key in list(self._local):
                buckets = self._local[key]
                for b in [b for b in buckets if b < oldest]:
                    del buckets[b]
                if not buckets:
                    del self._local[key]
            for entry in [e for e in self._pending if e[1] < oldest]:
                del self._pending[entry]

    def _flush(self) -> bool:
        client = self._link.client
        if client is None:
            return False
        oldest = self._oldest_bucket()
        with self._lock:
            batch, self._pending = self._pending, {}
        costs = self._costs.take_pending()
        batch = {e: c for e, c in batch.items() if e[1] >= oldest}  # older buckets left the window
        pipe = client.pipeline(transaction=True)
        newest: dict[AcceptanceKey, int] = {}
        for (key, bucket), counts in batch.items():
            fields = counts.fields()
            if not fields:
                continue
            name = self._acc_key(key, bucket)
            for field, value in fields.items():
                pipe.hincrby(name, field, value)
            pipe.pexpire(name, self._acc_ttl_ms)
            newest[key] = max(bucket, newest.get(key, bucket))
        if newest:
            pipe.zadd(self._acc_index, {k.member(): b for k, b in newest.items()}, gt=True)
            pipe.pexpire(self._acc_index, self._acc_ttl_ms)
        self._costs.queue_writes(pipe, costs)
        try:
            if len(pipe):
                pipe.execute()
            else:
                client.ping()
        except NETWORK_ERRORS as exc:
            with self._lock:  # put the batch back, merged with what was recorded meanwhile
                for entry, counts in batch.items():
                    merged = self._pending.get(entry)
                    if merged is None:
                        self._pending[entry] = counts
                    else:
                        merged.merge(counts)
            self._costs.put_back(costs)
            self._link.failed(exc)
            return False
        except RedisError as exc:  # a refused command, not an outage: retrying would not help
            self._link.warn("stats: Redis refused a batch of statistics, dropped (%s)", exc)
            return False
        finally:
            pipe.reset()
        self._link.succeeded()
        return True

    def _refresh(self) -> bool:
        client = self._link.client
        if client is None:
            return False
        now_bucket = math.floor(self._clock() / self._bucket_s)
        oldest = now_bucket - self._n_buckets + 1
        try:
            members = client.zrangebyscore(self._acc_index, oldest, "+inf")
            keys = [k for k in (AcceptanceKey.from_member(m) for m in members) if k is not None]
            pipe = client.pipeline(transaction=False)
            for key in keys:
                for bucket in range(oldest, now_bucket + 1):
                    pipe.hgetall(self._acc_key(key, bucket))
            pipe.zremrangebyscore(self._acc_index, "-inf", f"({oldest}")
            results = pipe.execute()
        except NETWORK_ERRORS as exc:
            self._link.failed(exc)
            return False
        except RedisError as exc:
            self._link.warn("stats: Redis refused to refresh the statistics (%s)", exc)
            return False

        cluster: dict[AcceptanceKey, AcceptanceCounts] = {}
        per_key = now_bucket - oldest + 1
        for i, key in enumerate(keys):
            counts = Counts()
            for fields in results[i * per_key : (i + 1) * per_key]:
                counts.add_fields(fields)
            if counts.drafted or counts.steps:
                cluster[key] = counts.frozen("cluster")
        self._cluster, self._cluster_at = cluster, time.monotonic()
        self._link.succeeded()
        return True

    # ---- helpers ---------------------------------------------------------------------------------

    def _local_counts(self, key: AcceptanceKey) -> AcceptanceCounts | None:
        oldest = self._oldest_bucket()
        total = Counts()
        with self._lock:
            buckets = self._local.get(key)
            if not buckets:
                return None
            for bucket, counts in buckets.items():
                if bucket >= oldest:
                    total.merge(counts)
        if not total.drafted and not total.steps:
            return None
        return total.frozen("local")

    def _acc_key(self, key: AcceptanceKey, bucket: int) -> str:
        return (
            f"{self.settings.key_prefix}:acc:{escape(key.model_pair)}:{escape(key.proposer)}:"
            f"{escape(key.workload)}:{bucket}"
        )


class EngineStatsSink:
    """The engine's view of ``SharedStats`` (``serve_app.engine.planner.StatsSink``): tuple keys,
    one draft at a time; every call is O(depth) and never touches the network."""

    def __init__(self, stats: SharedStats) -> None:
        self.stats = stats

    def record(self, key: tuple[str, str, str], drafted: int, accepted: int) -> None:
        drafted_pp, accepted_pp = position_counts(drafted, accepted)
        self.stats.record(AcceptanceKey(*key), drafted_pp, accepted_pp, 1)

    def priors(self, key: tuple[str, str, str]) -> tuple[float, ...] | None:
        return self.stats.priors(AcceptanceKey(*key))
