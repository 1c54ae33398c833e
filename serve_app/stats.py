"""Acceptance, cost and load statistics: local to a replica, and shared across replicas through Redis.

One ``SharedStats`` per replica. The engine's loop thread calls ``record``, ``priors`` and
``set_load``: they only touch in-process dictionaries under a lock that is never held across a
network call, so they are O(1) (O(depth)) and never block on Redis. A background thread does all
the network work:

- every ``flush_interval_s`` it writes the batched counts (one MULTI/EXEC pipeline), this
  replica's load (with a TTL) and any new cost-model coefficients;
- every ``refresh_interval_s`` it reads the cluster-wide counts of the rolling window and the other
  replicas' loads into a local cache, which ``priors`` and ``replica_loads`` read.

Keys (all under ``settings.key_prefix``; ``:`` and ``%`` inside a name component are %-escaped):

- ``{prefix}:acc:{model_pair}:{proposer}:{workload}:{bucket}``: HASH of ``d{j}`` / ``a{j}`` (drafts
  that reached position j / were accepted there) and ``steps``, incremented with HINCRBY;
  ``bucket = floor(now / bucket_s)``; each key expires ``window_s + bucket_s`` after its last write,
  so "rolling" means the last ``window_s`` across every replica.
- ``{prefix}:acc:index``: ZSET of the known ``(model_pair, proposer, workload)`` triples (JSON
  members) scored by the last bucket written; refreshing reads the window's buckets of the triples
  scored inside the window and prunes the older ones (no SCAN of the keyspace).
- ``{prefix}:load:{replica_id}``: HASH (running, queued, tokens_per_s, updated) with a TTL of
  ``load_ttl_s``; ``{prefix}:loads``: SET of replica ids (members whose hash expired are pruned).
- ``{prefix}:cost:{hardware}:{model}``: JSON string of cost-model coefficients, no TTL.

Redis unavailable or restarted: the background thread marks the client disconnected, warns at most
once per ``warn_interval_s``, keeps the unsent counts merged by (key, bucket) (buckets that left the
window are dropped, so memory stays O(keys x buckets)), retries with exponential backoff capped at
``max_backoff_s`` and sends the merged counts once Redis answers again. Meanwhile ``priors`` answer
from this replica's own counts. With ``redis_url`` unset the statistics are local only and no thread
runs.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from serve_app.config import StatsSettings

logger = logging.getLogger(__name__)

MAX_POSITIONS = 64  # draft positions tracked per key (deeper positions are ignored)
MAX_KEYS = 4096  # distinct acceptance keys tracked per replica (workloads can be user tags)

_NETWORK_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


@dataclass(frozen=True)
class AcceptanceKey:
    """What acceptance statistics are kept per, e.g. model_pair "qwen2.5-coder-1.5b-instruct|qwen2.5-
    coder-0.5b-instruct" (target|draft), proposer "draft", workload "code"."""

    model_pair: str
    proposer: str
    workload: str


@dataclass(frozen=True)
class AcceptanceCounts:
    """Counts over the rolling window: ``drafted[j]`` drafts reached position j, ``accepted[j]`` of
    them were accepted there; ``steps`` verification steps. ``source``: "cluster" or "local"."""

    drafted: tuple[int, ...]
    accepted: tuple[int, ...]
    steps: int
    source: str = "local"

    def acceptance(self) -> tuple[float, ...]:
        """Conditional acceptance per position: accepted_j / drafted_j, up to the first position
        no draft reached."""
        out: list[float] = []
        for d, a in zip(self.drafted, self.accepted, strict=False):
            if d <= 0:
                break
            out.append(min(1.0, max(0.0, a / d)))
        return tuple(out)


def position_counts(drafted: int, accepted: int) -> tuple[list[int], list[int]]:
    """Per-position counts of ONE draft of ``drafted`` tokens of which the first ``accepted`` were
    accepted: (``[1] * drafted``, ``[1] * accepted + [0] * (drafted - accepted)``)."""
    drafted = max(0, drafted)
    accepted = min(max(0, accepted), drafted)
    return [1] * drafted, [1] * accepted + [0] * (drafted - accepted)


class _Counts:
    """Mutable per-position counts (one key, one bucket)."""

    __slots__ = ("accepted", "drafted", "steps")

    def __init__(self) -> None:
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.steps = 0

    def add(self, drafted: Sequence[int], accepted: Sequence[int], steps: int) -> None:
        n = min(max(len(drafted), len(accepted)), MAX_POSITIONS)
        if len(self.drafted) < n:
            grow = n - len(self.drafted)
            self.drafted.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for j in range(min(len(drafted), n)):
            self.drafted[j] += int(drafted[j])
        for j in range(min(len(accepted), n)):
            self.accepted[j] += int(accepted[j])
        self.steps += int(steps)

    def merge(self, other: _Counts) -> None:
        self.add(other.drafted, other.accepted, other.steps)

    def fields(self) -> dict[str, int]:
        out = {f"d{j}": d for j, d in enumerate(self.drafted) if d}
        out.update({f"a{j}": a for j, a in enumerate(self.accepted) if a})
        if self.steps:
            out["steps"] = self.steps
        return out

    def add_fields(self, fields: dict[str, str]) -> None:
        for name, value in fields.items():
            try:
                count = int(value)
            except ValueError:
                continue
            if name == "steps":
                self.steps += count
                continue
            kind, index = name[:1], name[1:]
            if kind not in ("d", "a") or not index.isdigit() or int(index) >= MAX_POSITIONS:
                continue
            j = int(index)
            if len(self.drafted) <= j:
                grow = j + 1 - len(self.drafted)
                self.drafted.extend([0] * grow)
                self.accepted.extend([0] * grow)
            (self.drafted if kind == "d" else self.accepted)[j] += count

    def frozen(self, source: str) -> AcceptanceCounts:
        return AcceptanceCounts(tuple(self.drafted), tuple(self.accepted), self.steps, source)


def _esc(component: str) -> str:
    return component.replace("%", "%25").replace(":", "%3A")


def _redact(url: str) -> str:
    """The URL without its password (for log lines)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{parts.username or ''}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class SharedStats:
    """Acceptance counts, cost-model coefficients and replica load, for one replica."""

    def __init__(
        self, settings: StatsSettings, replica_id: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.settings = settings
        self.replica_id = replica_id
        self._clock = clock
        self._bucket_s = settings.bucket_s
        self._n_buckets = max(1, math.ceil(settings.window_s / settings.bucket_s - 1e-9))
        self._acc_ttl_ms = max(1, int((settings.window_s + settings.bucket_s) * 1000))
        self._load_ttl_ms = max(1, int(settings.load_ttl_s * 1000))
        p = settings.key_prefix
        self._acc_index = f"{p}:acc:index"
        self._loads_index = f"{p}:loads"
        self._load_key = f"{p}:load:{_esc(replica_id)}"

        self._lock = threading.Lock()  # guards the dicts below; never held across a network call
        self._local: dict[AcceptanceKey, dict[int, _Counts]] = {}  # this replica's counts by bucket
        self._pending: dict[tuple[AcceptanceKey, int], _Counts] = {}  # not yet written to Redis
        self._load: dict[str, Any] | None = None
        self._cost_local: dict[tuple[str, str], str] = {}  # (hardware, model) -> JSON
        self._cost_pending: dict[tuple[str, str], str] = {}
        self.dropped_records = 0  # records refused because MAX_KEYS distinct keys are tracked

        # Written by the background thread, read by the loop thread (whole-object swaps).
        self._cluster: dict[AcceptanceKey, AcceptanceCounts] = {}
        self._cluster_at: float | None = None  # monotonic time of the last successful refresh
        self._loads: dict[str, dict[str, Any]] = {}
        self._loads_at: float | None = None  # monotonic time of the last successful refresh

        self._connected = False
        self._ever_connected = False
        self._backoff = min(settings.flush_interval_s, 1.0)
        self._next_attempt = 0.0
        self._last_warn: float | None = None
        self._suppressed = 0
        self._state_lock = threading.Lock()  # connection state and warning rate limit

        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._client: redis.Redis | None = None
        if settings.redis_url is not None:
            self._client = self._make_client(settings.socket_timeout_s)

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
                counts = buckets[bucket] = _Counts()
                oldest = bucket - self._n_buckets + 1
                for old in [b for b in buckets if b < oldest]:
                    del buckets[old]
                    self._pending.pop((key, old), None)  # bounded even if no flush ever runs
            counts.add(drafted_per_position, accepted_per_position, steps)
            if self._client is not None:
                pending = self._pending.get((key, bucket))
                if pending is None:
                    pending = self._pending[(key, bucket)] = _Counts()
                pending.add(drafted_per_position, accepted_per_position, steps)

    def counts(self, key: AcceptanceKey) -> AcceptanceCounts | None:
        """Counts over the rolling window: cluster-wide from the cache while Redis is up, else this
        replica's own (or, with none, the last cluster snapshot while it is younger than the
        window); None without data."""
        if self._connected:
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

    def set_load(self, running: int, queued: int, tokens_per_s: float) -> None:
        """This replica's load, published (with a TTL) by the background thread. O(1)."""
        self._load = {
            "running": int(running),
            "queued": int(queued),
            "tokens_per_s": float(tokens_per_s),
            "updated": self._clock(),
        }

    def replica_loads(self, include_self: bool = False) -> dict[str, dict[str, Any]]:
        """The other replicas' loads from the cache (published less than ``load_ttl_s`` ago)."""
        at = self._loads_at
        if at is None or time.monotonic() - at > self.settings.load_ttl_s:
            loads: dict[str, dict[str, Any]] = {}
        else:
            loads = {r: dict(v) for r, v in self._loads.items() if include_self or r != self.replica_id}
        if include_self and self._load is not None:
            loads[self.replica_id] = dict(self._load)
        return loads

    def put_cost_model(self, hardware: str, model: str, coefficients: dict[str, Any]) -> None:
        """Remember cost-model coefficients and publish them (no TTL) from the background thread.
        Raises TypeError when ``coefficients`` is not JSON-serialisable."""
        text = json.dumps(coefficients, sort_keys=True)
        with self._lock:
            self._cost_local[(hardware, model)] = text
            if self._client is not None:
                self._cost_pending[(hardware, model)] = text

    @property
    def connected(self) -> bool:
        """Whether the last exchange with Redis succeeded (always False in local-only mode)."""
        return self._connected

    @property
    def pending_entries(self) -> int:
        """(key, bucket) entries waiting to be written to Redis."""
        return len(self._pending)

    # ---- called once at engine start, or by tests: may block briefly -----------------------------

    def get_cost_model(self, hardware: str, model: str, timeout_s: float = 0.5) -> dict[str, Any] | None:
        """Coefficients for (hardware, model): this replica's own if it put some, else Redis's
        (waiting at most about ``timeout_s``); None when there are none or Redis is down."""
        with self._lock:
            text = self._cost_local.get((hardware, model))
        if text is None and self.settings.redis_url is not None:
            client = self._make_client(timeout_s)
            try:
                text = client.get(self._cost_key(hardware, model))
            except RedisError as exc:
                self._warn("stats: could not read the cost model from Redis (%s)", exc)
                return None
            finally:
                client.close()
        if text is None:
            return None
        try:
            value = json.loads(text)
        except ValueError:
            logger.warning("stats: cost model %s/%s in Redis is not JSON; ignored", hardware, model)
            return None
        return value if isinstance(value, dict) else None

    def start(self) -> None:
        """Start the background thread (local-only mode: nothing to do). Idempotent."""
        if self._client is None or self._thread is not None or self._closed:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"stats-{self.replica_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread, send what is pending (one attempt, short timeouts), withdraw this
        replica's load, and close the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=4 * self.settings.socket_timeout_s + 1.0)
            self._thread = None
        if self._client is None:
            return
        if self._flush(final=True):
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.delete(self._load_key)
                pipe.srem(self._loads_index, self.replica_id)
                pipe.execute()
            except RedisError as exc:
                logger.debug("stats: could not withdraw the load of %s: %s", self.replica_id, exc)
        self._client.close()
        self._connected = False

    def flush_now(self) -> bool:
        """Send the pending batch now (tests, shutdown); True when Redis took it."""
        return self._flush()

    def refresh_now(self) -> bool:
        """Refresh the cluster cache now (tests); True on success."""
        return self._refresh()

    # ---- background thread -----------------------------------------------------------------------

    def _run(self) -> None:
        s = self.settings
        next_flush = next_refresh = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                self._prune()
                if not self._connected and now >= self._next_attempt:
                    # (re)connect: send everything merged meanwhile, then read the cluster's view
                    if self._flush() and self._refresh():
                        next_flush, next_refresh = now + s.flush_interval_s, now + s.refresh_interval_s
                elif self._connected:
                    if now >= next_flush:
                        next_flush = now + s.flush_interval_s
                        self._flush()
                    if self._connected and now >= next_refresh:
                        next_refresh = now + s.refresh_interval_s
                        self._refresh()
            except Exception:  # never let the thread die: the engine would lose shared stats silently
                logger.exception("stats: unexpected error in the background thread")
            wake = min(next_flush, next_refresh) if self._connected else self._next_attempt
            self._stop.wait(min(max(wake - time.monotonic(), 0.005), 1.0))

    def _prune(self) -> None:
        """Drop buckets that left the window (local and pending): memory stays O(keys x buckets)."""
        oldest = math.floor(self._clock() / self._bucket_s) - self._n_buckets + 1
        with self._lock:
            for key in list(self._local):
                buckets = self._local[key]
                for b in [b for b in buckets if b < oldest]:
                    del buckets[b]
                if not buckets:
                    del self._local[key]
            for entry in [e for e in self._pending if e[1] < oldest]:
                del self._pending[entry]

    def _flush(self, final: bool = False) -> bool:
        client = self._client
        if client is None:
            return False
        oldest = math.floor(self._clock() / self._bucket_s) - self._n_buckets + 1
        with self._lock:
            batch, self._pending = self._pending, {}
            costs, self._cost_pending = self._cost_pending, {}
        batch = {e: c for e, c in batch.items() if e[1] >= oldest}  # older buckets left the window
        load = self._load
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
            pipe.zadd(self._acc_index, {self._member(k): b for k, b in newest.items()}, gt=True)
            pipe.pexpire(self._acc_index, self._acc_ttl_ms)
        if load is not None and not final:
            pipe.hset(self._load_key, mapping={**load, "replica": self.replica_id})
            pipe.pexpire(self._load_key, self._load_ttl_ms)
            pipe.sadd(self._loads_index, self.replica_id)
            pipe.pexpire(self._loads_index, max(self._load_ttl_ms * 4, 3_600_000))
        for (hardware, model), text in costs.items():
            pipe.set(self._cost_key(hardware, model), text)
        try:
            if len(pipe):
                pipe.execute()
            else:
                client.ping()
        except _NETWORK_ERRORS as exc:
            with self._lock:  # put the batch back, merged with what was recorded meanwhile
                for entry, counts in batch.items():
                    merged = self._pending.get(entry)
                    if merged is None:
                        self._pending[entry] = counts
                    else:
                        merged.merge(counts)
                for cost_key, text in costs.items():
                    self._cost_pending.setdefault(cost_key, text)
            self._failed(exc)
            return False
        except RedisError as exc:  # a refused command, not an outage: retrying would not help
            self._warn("stats: Redis refused a batch of statistics, dropped (%s)", exc)
            return False
        finally:
            pipe.reset()
        self._succeeded()
        return True

    def _refresh(self) -> bool:
        client = self._client
        if client is None:
            return False
        now_bucket = math.floor(self._clock() / self._bucket_s)
        oldest = now_bucket - self._n_buckets + 1
        try:
            members = client.zrangebyscore(self._acc_index, oldest, "+inf")
            keys = [k for k in (self._parse_member(m) for m in members) if k is not None]
            pipe = client.pipeline(transaction=False)
            for key in keys:
                for bucket in range(oldest, now_bucket + 1):
                    pipe.hgetall(self._acc_key(key, bucket))
            pipe.zremrangebyscore(self._acc_index, "-inf", f"({oldest}")
            pipe.smembers(self._loads_index)
            results = pipe.execute()
            replicas = sorted(results[-1])
            pipe = client.pipeline(transaction=False)
            for replica in replicas:
                pipe.hgetall(f"{self.settings.key_prefix}:load:{_esc(replica)}")
            load_results = pipe.execute() if replicas else []
            gone = [r for r, h in zip(replicas, load_results, strict=True) if not h]
            if gone:
                client.srem(self._loads_index, *gone)
        except _NETWORK_ERRORS as exc:
            self._failed(exc)
            return False
        except RedisError as exc:
            self._warn("stats: Redis refused to refresh the statistics (%s)", exc)
            return False

        cluster: dict[AcceptanceKey, AcceptanceCounts] = {}
        per_key = now_bucket - oldest + 1
        for i, key in enumerate(keys):
            counts = _Counts()
            for fields in results[i * per_key : (i + 1) * per_key]:
                counts.add_fields(fields)
            if counts.drafted or counts.steps:
                cluster[key] = counts.frozen("cluster")
        loads: dict[str, dict[str, Any]] = {}
        for replica, fields in zip(replicas, load_results, strict=True):
            if fields:
                loads[replica] = self._parse_load(fields)
        self._cluster, self._cluster_at = cluster, time.monotonic()
        self._loads, self._loads_at = loads, time.monotonic()
        self._succeeded()
        return True

    # ---- connection state ------------------------------------------------------------------------

    def _succeeded(self) -> None:
        with self._state_lock:
            if self._connected:
                return
            self._connected = True
            self._backoff = min(self.settings.flush_interval_s, 1.0)
            again = self._ever_connected
            self._ever_connected = True
        url = _redact(self.settings.redis_url or "")
        if again:
            logger.info("stats: Redis at %s is back; shared statistics resumed", url)
        else:
            logger.info("stats: connected to Redis at %s", url)

    def _failed(self, exc: BaseException) -> None:
        with self._state_lock:
            self._connected = False
            self._next_attempt = time.monotonic() + self._backoff
            delay = self._backoff
            self._backoff = min(self._backoff * 2, self.settings.max_backoff_s)
        self._warn(
            "stats: Redis at %s unavailable (%s: %s); serving on local statistics, retrying in %.1f s",
            _redact(self.settings.redis_url or ""),
            type(exc).__name__,
            exc,
            delay,
        )

    def _warn(self, message: str, *args: Any) -> None:
        """``logger.warning`` at most once per ``warn_interval_s``; debug otherwise."""
        now = time.monotonic()
        with self._state_lock:
            due = self._last_warn is None or now - self._last_warn >= self.settings.warn_interval_s
            if due:
                self._last_warn, suppressed, self._suppressed = now, self._suppressed, 0
            else:
                self._suppressed += 1
        if due:
            if suppressed:
                message += f" ({suppressed} similar messages suppressed)"
            logger.warning(message, *args)
        else:
            logger.debug(message, *args)

    # ---- helpers ---------------------------------------------------------------------------------

    def _make_client(self, timeout_s: float) -> redis.Redis:
        assert self.settings.redis_url is not None
        return redis.Redis.from_url(
            self.settings.redis_url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # our own backoff; never retry inside a call
            decode_responses=True,
        )

    def _local_counts(self, key: AcceptanceKey) -> AcceptanceCounts | None:
        oldest = math.floor(self._clock() / self._bucket_s) - self._n_buckets + 1
        total = _Counts()
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
            f"{self.settings.key_prefix}:acc:{_esc(key.model_pair)}:{_esc(key.proposer)}:"
            f"{_esc(key.workload)}:{bucket}"
        )

    def _cost_key(self, hardware: str, model: str) -> str:
        return f"{self.settings.key_prefix}:cost:{_esc(hardware)}:{_esc(model)}"

    @staticmethod
    def _member(key: AcceptanceKey) -> str:
        return json.dumps([key.model_pair, key.proposer, key.workload])

    @staticmethod
    def _parse_member(member: str) -> AcceptanceKey | None:
        try:
            pair, proposer, workload = json.loads(member)
        except (ValueError, TypeError):
            return None
        if not all(isinstance(x, str) for x in (pair, proposer, workload)):
            return None
        return AcceptanceKey(pair, proposer, workload)

    @staticmethod
    def _parse_load(fields: dict[str, str]) -> dict[str, Any]:
        def number(name: str, kind: Callable[[str], Any]) -> Any:
            try:
                return kind(fields.get(name, "0"))
            except ValueError:
                return kind("0")

        return {
            "running": number("running", lambda v: int(float(v))),
            "queued": number("queued", lambda v: int(float(v))),
            "tokens_per_s": number("tokens_per_s", float),
            "updated": number("updated", float),
        }


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
