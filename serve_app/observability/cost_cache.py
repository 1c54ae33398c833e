"""Cost-model coefficients per (hardware, model), shared across replicas through Redis.

A replica that profiled a cost model ``put``s it: it is kept in process at once and queued for the
background thread of ``SharedStats``, which writes it in its next flush. A replica that starts
``get``s it: its own if it put one, else Redis's (one short read; None when Redis is down).

Key: ``{prefix}:cost:{hardware}:{model}``, a JSON string, no TTL (``:`` and ``%`` inside a name
component are %-escaped).
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from serve_app.observability.redis_link import RedisLink, escape

if TYPE_CHECKING:
    from redis.client import Pipeline

CostBatch = dict[tuple[str, str], str]  # (hardware, model) -> JSON


class CostModelCache:
    """This replica's cost models, and the ones not yet written to Redis."""

    def __init__(self, link: RedisLink, key_prefix: str) -> None:
        self._link = link
        self._prefix = key_prefix
        self._lock = threading.Lock()  # guards the dicts below; never held across a network call
        self._local: CostBatch = {}
        self._pending: CostBatch = {}

    def put(self, hardware: str, model: str, coefficients: dict[str, Any]) -> None:
        """Remember coefficients and queue them for Redis. Raises TypeError when ``coefficients``
        is not JSON-serialisable."""
        text = json.dumps(coefficients, sort_keys=True)
        with self._lock:
            self._local[(hardware, model)] = text
            if self._link.configured:
                self._pending[(hardware, model)] = text

    def get(self, hardware: str, model: str, timeout_s: float = 0.5) -> dict[str, Any] | None:
        """Coefficients for (hardware, model): this replica's own if it put some, else Redis's
        (waiting at most about ``timeout_s``); None when there are none or Redis is down."""
        with self._lock:
            text = self._local.get((hardware, model))
        if text is None and self._link.configured:
            client = self._link.make_client(timeout_s)
            try:
                text = client.get(self.key(hardware, model))
            except RedisError as exc:
                self._link.warn("stats: could not read the cost model from Redis (%s)", exc)
                return None
            finally:
                client.close()
        if text is None:
            return None
        try:
            value = json.loads(text)
        except ValueError:
            self._link.log.warning("stats: cost model %s/%s in Redis is not JSON; ignored", hardware, model)
            return None
        return value if isinstance(value, dict) else None

    # ---- the background thread's side ------------------------------------------------------------

    def take_pending(self) -> CostBatch:
        """The cost models not yet written (now owned by the caller: write them or ``put_back``)."""
        with self._lock:
            batch, self._pending = self._pending, {}
        return batch

    def queue_writes(self, pipe: Pipeline, batch: CostBatch) -> None:
        """Add the writes of ``batch`` to ``pipe``."""
        for (hardware, model), text in batch.items():
            pipe.set(self.key(hardware, model), text)

    def put_back(self, batch: CostBatch) -> None:
        """A write failed: queue ``batch`` again (a newer put of the same key wins)."""
        with self._lock:
            for cost_key, text in batch.items():
                self._pending.setdefault(cost_key, text)

    def key(self, hardware: str, model: str) -> str:
        return f"{self._prefix}:cost:{escape(hardware)}:{escape(model)}"
